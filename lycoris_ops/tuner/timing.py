"""Timing a shortlist: each candidate's first call (compile + warm-up, output checked
against the eager output), then rounds of device time with CUDA events.

Every fused candidate's output is checked against the eager output (``SENTINEL_EAGER``'s,
or the caller's reference) and a mismatch disqualifies it. On the parallel path the fused
candidates' first calls run on worker threads (after the caller's ``prepare`` hook, e.g.
the Triton backend's forked precompile, has had them); on the sequential path, past the
warm-up budget only the planner's first two fused candidates (and eager) are still tried.
Then ``ROUNDS`` rounds, each the median of a few calls timed alone after an L2 flush; a
candidate more than ``DROP_FACTOR`` slower than the leader after round one is dropped; the
score is the best round; timings within ``TIE_MARGIN`` go to the planner's earlier pick.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lycoris_ops.tuner.keys import Candidate, is_eager

__all__ = ["Timer", "Timing", "cuda_timer", "time_candidates", "mismatch", "in_worker", "worker", "failure"]

Timer = Callable[[Callable[[], Any], Candidate], float]

#: timing rounds per candidate (best round wins)
ROUNDS = 3
#: target duration of one timed round (s): reps = this / one call, within [1, MAX_REPS]
ROUND_S = 1e-3
MAX_REPS = 32
#: after round one, candidates slower than this factor of the leader are dropped
DROP_FACTOR = 2.0
#: timings within this factor of the fastest count as a tie, won by the planner's earlier candidate
#: (the fixed default, placed first or second): re-measurements of one config differ by up to
#: 10%, so a noise-sized lead does not displace it
TIE_MARGIN = 1.03
#: agreement with the eager output required of a fused candidate (relative Frobenius)
CHECK_TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float64: 1e-6}
#: output bytes the concurrent first calls of one cold key may hold at once (fewer
#: threads for bigger outputs; one: the sequential path)
PARALLEL_SCRATCH_BYTES = 1 << 30

_worker = threading.local()


def in_worker() -> bool:
    """True on a tuner worker thread (or inside ``worker()``): a nested selection there takes
    the planner's first pick (neither timed nor stored) instead of waiting for the lock the
    tuning thread holds."""
    return getattr(_worker, "active", False)


@contextlib.contextmanager
def worker():
    """Run the block as a tuner worker (``in_worker()`` true), restoring the previous state."""
    was = in_worker()
    _worker.active = True
    try:
        yield
    finally:
        _worker.active = was


# --------------------------------------------------------------------------- the timer

#: GPU cycles spun before a process's first timing on a device (~50 ms at 2 GHz)
SPIN_CYCLES = 100_000_000
_clocked: set = set()
#: GPU clock cycles per microsecond assumed when sizing ``torch.cuda._sleep`` (about 2 GHz
#: parts; a slower clock only sleeps longer)
SLEEP_CYCLES_PER_US = 2000
#: longest sleep before a timed block (s)
MAX_SLEEP_S = 0.02
#: host time of the flush and the two event records around each timed call (s)
FLUSH_HOST_S = 15e-6
#: the L2 flush buffer is this many times the device's L2 (bounded scratch: one per device,
#: dropped when the key's timing ends)
FLUSH_L2_FACTOR = 2
FLUSH_MAX_BYTES = 256 << 20
_flush: Dict[int, torch.Tensor] = {}


def _hold(host_s: float, calls: int) -> None:
    """Keep the GPU busy while the host enqueues ``calls`` calls of ``host_s`` each, so the
    timed kernels then run back to back: device time, not the host's launch path."""
    us = min(1.5 * calls * host_s * 1e6 + 20.0, MAX_SLEEP_S * 1e6)
    torch.cuda._sleep(int(us * SLEEP_CYCLES_PER_US))


def _flush_buffer(dev: int) -> torch.Tensor:
    buf = _flush.get(dev)
    if buf is None:
        l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (32 << 20))
        n = min(max(FLUSH_L2_FACTOR * l2, 8 << 20), FLUSH_MAX_BYTES)
        buf = _flush[dev] = torch.ones(n // 4, dtype=torch.int32, device=torch.device("cuda", dev))
    return buf


def drop_flush_buffers() -> None:
    """Free the L2 flush buffers (they live while a key is timed only, not in the model's peak
    memory)."""
    _flush.clear()


def _evict_l2(buf: torch.Tensor) -> None:
    # a read evicts L2 and leaves it clean: a write (memset) would leave dirty lines whose
    # write-back is charged to the next timed call
    torch.sum(buf, dtype=torch.int32)


def cuda_timer(fn: Callable[[], Any], candidate: Candidate = None) -> float:
    """One timing round: the median device seconds of a few calls of ``fn``, each after an
    L2 flush (a read of twice the L2) and timed alone with CUDA events on the current
    stream (reps sized to about ``ROUND_S``): an op's operands come from DRAM in a model
    (the layers between two calls evict them), and a hot L2 favours the candidates that
    re-read their inputs (the benchmark flushes too). The GPU is held busy
    (``torch.cuda._sleep``, sized from one untimed call's host enqueue time) while the
    calls are enqueued, so host launch gaps are not charged either: without it a call whose
    launch path (Python launcher, several kernels) takes longer than its kernels measured
    the host, the same for every tile."""
    dev = torch.cuda.current_device()
    if dev not in _clocked:  # an idle GPU runs its first milliseconds at low clocks: spin it up once
        _clocked.add(dev)
        torch.cuda._sleep(SPIN_CYCLES)
    flush = _flush_buffer(dev)
    t0 = time.perf_counter()
    fn()  # untimed: the host's enqueue time of one call
    host = time.perf_counter() - t0 + FLUSH_HOST_S

    def timed(reps: int) -> List[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        _hold(host, reps)
        for start, end in events:
            _evict_l2(flush)
            start.record()
            fn()
            end.record()
        events[-1][1].synchronize()
        return sorted(max(s.elapsed_time(e) * 1e-3, 1e-7) for s, e in events)

    one = timed(1)[0]
    reps = max(1, min(MAX_REPS, int(ROUND_S / one), int(2 * ROUND_S / max(host, 1e-7))))
    if reps == 1:
        return one
    times = timed(reps)
    return min(one, times[len(times) // 2])


# --------------------------------------------------------------------------- output check

def _outputs(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def mismatch(got, want) -> Optional[str]:
    """None when every output of ``got`` agrees with ``want`` (shape, dtype, relative
    Frobenius distance within CHECK_TOL of the output dtype)."""
    g, w = _outputs(got), _outputs(want)
    if len(g) != len(w):
        return f"{len(g)} outputs, eager gives {len(w)}"
    for i, (a, b) in enumerate(zip(g, w)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {tuple(a.shape)} {a.dtype}, eager {tuple(b.shape)} {b.dtype}"
        if b.numel() == 0:
            continue
        num, den, a_bad, b_bad = _diff_norms(a.detach().reshape(-1), b.detach().reshape(-1))
        if a_bad and not b_bad:
            return f"output {i} is not finite"
        err = num / max(den, 1e-30)
        tol = CHECK_TOL.get(b.dtype, 1e-2)
        if err > tol and den > 0:
            return f"output {i}: relative error {err:.2e} > {tol:.0e}"
    return None


#: elements per chunk of the output comparison (bounded fp64 scratch: 32 MiB per temporary)
CHECK_CHUNK = 1 << 22


def _diff_norms(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, float, bool, bool]:
    """(‖a − b‖, ‖b‖, a has a non-finite value, b has one), in fp64, chunk by chunk."""
    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    a_bad = torch.zeros((), dtype=torch.bool, device=b.device)
    b_bad = torch.zeros((), dtype=torch.bool, device=b.device)
    for s in range(0, b.numel(), CHECK_CHUNK):
        x = a[s:s + CHECK_CHUNK].double()
        y = b[s:s + CHECK_CHUNK].double()
        a_bad |= ~torch.isfinite(x).all()
        b_bad |= ~torch.isfinite(y).all()
        x, y = torch.nan_to_num(x), torch.nan_to_num(y)
        num += (x - y).square().sum()
        den += y.square().sum()
    return float(num.sqrt()), float(den.sqrt()), bool(a_bad), bool(b_bad)


def failure(exc: Exception) -> Tuple[bool, str]:
    """(whether it ran out of memory, the row's failure text) for a candidate that raised."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True, f"out of memory: {exc}"
    return False, f"{type(exc).__name__}: {str(exc)[:300]}"


# --------------------------------------------------------------------------- a shortlist

@dataclass
class Timing:
    """What ``time_candidates`` found: the winner's index (-1: none ran), the best seconds
    and the failure of each index, whether one ran out of memory, the indices skipped for
    the warm-up budget, the timer calls made."""

    winner: int = -1
    best: Dict[int, float] = field(default_factory=dict)
    errors: Dict[int, str] = field(default_factory=dict)
    oom: bool = False
    skipped: List[int] = field(default_factory=list)
    timer_calls: int = 0


def _warm_parallel(cands, idx, run, ref, threads, errors) -> bool:
    """First call (compile + warm-up, output checked against ``ref``) of the candidates
    ``idx`` on worker threads, on the calling thread's device and stream; failures go to
    ``errors``. Returns whether one ran out of memory."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    dev = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream(dev) if cuda else None

    def first_call(i):
        _worker.active = True
        try:
            if cuda:
                torch.cuda.set_device(dev)  # this thread's device and CUDA context (cuBLAS warns without one)
            with torch.no_grad(), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                out = run(cands[i])
                return mismatch(out, ref) if ref is not None else None
        finally:
            _worker.active = False

    oom = False
    with ThreadPoolExecutor(max_workers=min(threads, len(idx)), thread_name_prefix="lycoris-tune") as pool:
        futures = {i: pool.submit(first_call, i) for i in idx}
        try:
            for i, fut in futures.items():
                try:
                    bad = fut.result()
                    if bad is not None:
                        errors[i] = f"disagrees with eager: {bad}"
                except Exception as exc:
                    was_oom, errors[i] = failure(exc)
                    oom = oom or was_oom
        except BaseException:  # a Ctrl-C: the first calls not started are dropped, not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if cuda:
        stream.synchronize()  # the workers' launches are done before anything is timed
    return oom


def time_candidates(cands: Sequence[Candidate], run: Callable[[Candidate], Any], timer: Timer, check: bool,
                    reference: Optional[Callable[[], Any]] = None, budget: Optional[float] = None,
                    threads: int = 0, prepare: Optional[Callable[[List[Callable[[], Any]]], Any]] = None) -> Timing:
    """Warm up, check and time ``cands`` (``run(c)`` runs one); ``threads`` > 1: the fused
    first calls on worker threads, after ``prepare(runs)`` (one no-argument call per fused
    candidate, e.g. a compile ahead in child processes)."""
    res = Timing()
    errors, skipped = res.errors, res.skipped
    oom = False
    ref = None
    t_start = time.perf_counter()
    eager_at = next((i for i, c in enumerate(cands) if is_eager(c)), None)
    if check and (eager_at is not None or reference is not None):
        try:
            ref = run(cands[eager_at]) if eager_at is not None else reference()
        except torch.OutOfMemoryError as exc:
            oom = True
            if eager_at is not None:
                errors[eager_at] = f"out of memory: {exc}"
        except Exception as exc:
            if eager_at is not None:
                errors[eager_at] = f"{type(exc).__name__}: {exc}"
    alive: List[int] = []
    fused = [i for i, c in enumerate(cands) if i not in errors and not is_eager(c)]
    if threads > 1 and ref is not None:  # concurrent first calls hold one output set each
        out_bytes = sum(t.numel() * t.element_size() for t in _outputs(ref))
        threads = min(threads, max(1, PARALLEL_SCRATCH_BYTES // max(out_bytes, 1)))
    parallel = threads > 1 and len(fused) > 1
    if parallel:  # every fused candidate's first call at once: the compiles overlap
        if prepare is not None:
            prepare([lambda c=cands[i]: run(c) for i in fused])
        oom = _warm_parallel(cands, fused, run, ref, threads, errors) or oom
    fused_seen = 0
    for i, c in enumerate(cands):
        if i in errors:
            continue
        if parallel and not is_eager(c):
            # compiled and checked on a worker; one more call here before any timing: a
            # nested selection skipped on the worker tunes now, and a kernel a worker's
            # compile raced out of an in-memory cache is reloaded now, not in a timed call
            try:
                run(c)
                alive.append(i)
            except Exception as exc:
                was_oom, errors[i] = failure(exc)
                oom = oom or was_oom
            continue
        if not is_eager(c):
            fused_seen += 1
            # the first compiles (warm-up calls) are the expensive part of a cold key: past the
            # budget, only the planner's first two fused candidates (and eager) are still tried
            if budget and fused_seen > 2 and time.perf_counter() - t_start > budget:
                skipped.append(i)
                continue
        if i == eager_at and ref is not None:
            alive.append(i)
            continue
        try:
            out = run(c)  # compile + warm
            if ref is not None and not is_eager(c):
                bad = mismatch(out, ref)
                if bad is not None:
                    errors[i] = f"disagrees with eager: {bad}"
                    continue
            del out
            alive.append(i)
        except Exception as exc:
            was_oom, errors[i] = failure(exc)
            oom = oom or was_oom
    ref = None
    best = res.best
    for rnd in range(ROUNDS):
        for i in list(alive):
            c = cands[i]
            try:
                res.timer_calls += 1
                t = float(timer(lambda c=c: run(c), c))
            except Exception as exc:
                was_oom, errors[i] = failure(exc)
                oom = oom or was_oom
                alive.remove(i)
                best.pop(i, None)
                continue
            if not (t >= 0 and math.isfinite(t)):
                t = math.inf
            best[i] = min(best.get(i, math.inf), t)
        if rnd == 0 and best:
            lead = min(best.values())
            alive = [i for i in alive if best[i] <= DROP_FACTOR * lead]
    finite = [(t, i) for i, t in best.items() if math.isfinite(t)]
    if finite:  # the planner's earliest candidate among those within TIE_MARGIN of the fastest
        fastest = min(finite)[0]
        res.winner = min(i for t, i in finite if t <= TIE_MARGIN * fastest)
    res.oom = oom
    return res
