"""The tuner: pick each op's launch config once per (device, op, shape bucket, dtype),
by timing a short list of candidates ranked by the op's cost model.

Flow of ``select_config(op, backend, key_parts, candidates, run_candidate)``:

1. in-memory memo (one dict lookup) -> the config picked earlier in this process;
2. the table ``tuning.json`` under ``LYCORIS_KERNEL_CACHE_DIR`` (default
   ``~/.cache/lycoris_kernels``), read once per process -> a config picked by an
   earlier process: nothing is timed;
3. otherwise the shortlist (``candidates``: a ``Plan``, a list, or a callable
   returning one - only called on a miss) is timed: each candidate runs once
   (compile + warm-up; every fused candidate's output is checked against the
   eager output - ``SENTINEL_EAGER``'s, or ``reference()`` - and a mismatch
   disqualifies it; on CUDA the fused candidates' first calls run in worker
   threads (``LYCORIS_KERNEL_TUNE_THREADS``, default 8; 0 or 1: one after the
   other, and then, once the warm-ups exceed the budget, ``LYCORIS_KERNEL_TUNE_BUDGET``
   seconds (default 1.5; ``warmup`` and the CLI: none), only the planner's first
   two fused candidates and eager are still tried); before those threads start, the
   Triton kernels the first calls would compile are compiled in forked child processes
   (``precompile.py``; ``LYCORIS_KERNEL_TUNE_PROCS``, default ``min(12, CPUs - 1)``; 0 or
   1: none), so the threads only load them from Triton's cache (threads hold the GIL
   through Triton's front end: processes overlap the compiles, threads do not),
   then three rounds, each the median of a few calls timed
   alone with CUDA events after an L2 flush (device time: the GPU is held busy while they are
   enqueued, see ``cuda_timer``); a candidate more than twice as slow as the leader after round one
   is dropped; the score is the best round. The winner is memoized and stored as
   a row of the table (merge with the rows on disk + atomic replace, see
   ``store.py``), and one line is logged (logger ``lycoris_ops.tune``: op, shape
   bucket, winner, time).

``SENTINEL_EAGER`` is a candidate like the others: if it wins, the op runs its
eager body at that shape and the row records ``"eager"``.

Keys: ``<device name>|<backend>|<op>|v<kernel version>|<k=v,...>`` where the parts
are the op's bucketed shape, dtypes and flags (``shape_key``). Token-like axes
(tokens, numel of elementwise ops, positions streamed by OFT/BOFT/IA3) are
bucketed by ``bucket``: up to 4096 -> the next power of two, above -> the next
multiple of 4096; weight dimensions are exact. The kernel version (see
``source_version``) changes when a kernel's source changes, which invalidates
that kernel's rows only. Table file: ``{"version": 1, "rows": {key: row}}``; a
corrupt file or another format version is ignored with one warning.

Safety:
* never times while a CUDA graph is being captured or while ``torch.compile`` /
  ``torch.export`` traces: the planner's first candidate is used and neither
  memoized nor stored (the key is timed at the next safe call);
* ``LYCORIS_KERNEL_TUNE=off`` (or ``set_tuning(False)``): a key missing from the
  memo and the table takes the planner's first candidate, remembered for the
  process, never stored, timed once tuning is turned back on;
* no ``torch.cuda.empty_cache()``; scratch is one output set per call (candidates
  run on the caller's operands; outputs are fresh and dropped; the concurrent first
  calls hold one set per worker thread, at most ``PARALLEL_SCRATCH_BYTES`` together); a candidate that
  raises (compile error, out of resources) times as infinity; after an
  out-of-memory the winner is kept for the process only, not stored;
* selection is serialized by a re-entrant lock (a candidate being timed may
  itself select another key).

``warmup(layers, ...)`` pre-tunes given layer shapes in this process (and so
fills the table); ``python -m lycoris_ops.plans.tune --shapes 4096x4096,...``
does the same from the command line.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .. import dispatch, settings
from . import device as _device
from .store import JsonTable

__all__ = [
    "SENTINEL_EAGER", "TABLE_VERSION", "Plan", "Candidate", "is_eager", "bucket", "shape_key", "make_key",
    "select_config", "stored", "pick", "set_tuning", "tuning_enabled", "set_budget", "tune_budget", "set_timer",
    "cuda_timer", "table", "table_path", "source_version", "unsafe_to_time", "stats", "clear", "warmup", "Front", "Layer", "parse_layer", "main",
    "tune_threads",
]

log = logging.getLogger("lycoris_ops.tune")

#: the eager body of the op, a candidate like the tiles
SENTINEL_EAGER = "eager"
TABLE_VERSION = 1
#: timing rounds per candidate (best round wins)
ROUNDS = 3
#: target duration of one timed round (s): reps = this / one call, within [1, MAX_REPS]
ROUND_S = 1e-3
MAX_REPS = 32
#: after round one, candidates slower than this factor of the leader are dropped
DROP_FACTOR = 2.0
#: timings within this factor of the fastest count as a tie, won by the planner's earlier candidate
#: (the fixed default, placed first or second): on the H200 two re-measurements of one config
#: differed by 10% (bench/RESULTS.md 2026-11-30 16:40), so a noise-sized lead does not displace it
TIE_MARGIN = 1.03
#: memo entries before the memo is emptied (bounded memory under shape churn)
MEMO_MAX = 1 << 16
#: agreement with the eager output required of a fused candidate (relative Frobenius)
CHECK_TOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float64: 1e-6}

Candidate = Union[Dict[str, Any], str]
Timer = Callable[[Callable[[], Any], Candidate], float]


def is_eager(c) -> bool:
    return isinstance(c, str) and c == SENTINEL_EAGER


@dataclass
class Plan:
    """A planner's answer: the shortlist, best predicted first, with the predicted
    seconds of each (``inf`` where the model has no estimate, e.g. eager)."""

    op: str
    candidates: List[Candidate]
    predicted: List[float] = field(default_factory=list)

    def first(self) -> Candidate:
        return self.candidates[0]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self):
        return iter(self.candidates)


# --------------------------------------------------------------------------- keys

def bucket(n: int) -> int:
    """Bucket of a token-like size: <= 4096 -> next power of two (minimum 1),
    larger -> next multiple of 4096."""
    n = int(n)
    if n <= 1:
        return 1
    if n <= 4096:
        return 1 << (n - 1).bit_length()
    return -(-n // 4096) * 4096


def _value(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return v
    if isinstance(v, torch.Size) or isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    if isinstance(v, torch.device):
        return str(v)
    return str(v)


def shape_key(dtype=None, *, tokens: Optional[Dict[str, int]] = None, exact: Optional[Dict[str, Any]] = None,
              flags: Optional[Dict[str, Any]] = None) -> Tuple[Tuple[str, Any], ...]:
    """The key parts of one call: ``tokens`` are bucketed, ``exact`` and ``flags`` kept,
    dtypes written without ``torch.``; order: dtype, tokens, exact, flags."""
    parts: List[Tuple[str, Any]] = []
    if dtype is not None:
        parts.append(("dtype", _value(dtype)))
    for k, v in (tokens or {}).items():
        parts.append((k, bucket(v)))
    for k, v in (exact or {}).items():
        parts.append((k, _value(v)))
    for k, v in (flags or {}).items():
        parts.append((k, _value(v)))
    return tuple(parts)


def _parts(key_parts) -> Tuple[Tuple[str, Any], ...]:
    if isinstance(key_parts, dict):
        return tuple((str(k), _value(v)) for k, v in key_parts.items())
    out = []
    for item in key_parts:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((item[0], _value(item[1])))
        else:
            out.append(("", _value(item)))
    return tuple(out)


def _fmt(v) -> str:
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt(x) for x in v) + ")"
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def make_key(device_name: str, backend: str, op: str, version, key_parts) -> str:
    """The table key of one (device, backend, op, kernel version, shape bucket, dtypes)."""
    shape = ",".join(f"{k}={_fmt(v)}" if k else _fmt(v) for k, v in _parts(key_parts))
    return f"{device_name}|{backend}|{op}|v{version}|{shape}"


_versions: Dict[tuple, str] = {}


def source_version(*objs, extra: str = "") -> str:
    """A short hash of the source of ``objs`` (modules, functions, Triton JIT functions,
    file paths): the kernel version in the keys, so editing a kernel retunes it only."""
    key = tuple(id(o) if not isinstance(o, str) else o for o in objs) + (extra,)
    v = _versions.get(key)
    if v is None:
        h = hashlib.sha1(extra.encode())
        for o in objs:
            text = None
            path = o if isinstance(o, str) else getattr(o, "__file__", None)
            if path and os.path.exists(path):
                with open(path, "rb") as f:
                    h.update(f.read())
                continue
            text = getattr(o, "src", None)  # triton.JITFunction
            if text is None:
                import inspect

                try:
                    text = inspect.getsource(o)
                except (OSError, TypeError):
                    text = repr(o)
            h.update(text.encode())
        v = _versions[key] = h.hexdigest()[:10]
    return v


# --------------------------------------------------------------------------- settings

_tuning: List[Optional[bool]] = [None]  # None: read LYCORIS_KERNEL_TUNE on next use
_timer: List[Optional[Timer]] = [None]
_lock = threading.RLock()
_memo: Dict[tuple, "_Entry"] = {}
_tables: Dict[str, JsonTable] = {}
_fronts: List[dict] = []
_names: Dict[tuple, str] = {}
_stats = {"tuned": 0, "timer_calls": 0, "table_hits": 0, "first_pick": 0, "guarded": 0, "tune_s": 0.0}


@dataclass
class _Entry:
    value: Any  # resolved config (or SENTINEL_EAGER)
    candidate: Candidate
    tuned: bool  # False: the planner's pick with tuning off (retimed when tuning is on again)


def tuning_enabled() -> bool:
    """Whether missing keys are timed (``LYCORIS_KERNEL_TUNE``, read once; ``set_tuning``)."""
    t = _tuning[0]
    if t is None:
        t = _tuning[0] = dispatch.tuning_enabled()
    return t


def set_tuning(enabled: Optional[bool]) -> bool:
    """Turn timing on/off for the process (``None``: re-read ``LYCORIS_KERNEL_TUNE``).
    Returns the previous state. Untuned picks made while off are timed at their next call."""
    previous = tuning_enabled()
    _tuning[0] = None if enabled is None else bool(enabled)
    _clear_fronts()
    return previous


ENV_BUDGET = "LYCORIS_KERNEL_TUNE_BUDGET"
#: default seconds a cold key may spend compiling candidates before the rest are skipped
DEFAULT_BUDGET_S = settings.SETTINGS[ENV_BUDGET].default
_budget: List[Optional[float]] = [None]  # None: read LYCORIS_KERNEL_TUNE_BUDGET on next use


ENV_THREADS = "LYCORIS_KERNEL_TUNE_THREADS"
#: worker threads that run a cold key's fused candidates' first calls (their launches,
#: output checks and the GIL-free parts of the compile overlap; Triton's front end holds
#: the GIL, so the compiles themselves overlap little: ``precompile.py`` runs them first in
#: child processes, ``LYCORIS_KERNEL_TUNE_PROCS``)
_worker = threading.local()
#: output bytes the concurrent first calls of one cold key may hold at once (fewer
#: threads for bigger outputs; one: the sequential path)
PARALLEL_SCRATCH_BYTES = 1 << 30


def tune_threads() -> int:
    """Worker threads for the first calls of a cold key's candidates (0/1: none)."""
    return settings.get(ENV_THREADS)


def _in_worker() -> bool:
    """True on a tuner worker thread: a nested selection there takes the planner's first
    pick (neither timed nor stored) instead of waiting for the lock the tuning thread holds."""
    return getattr(_worker, "active", False)


def _parallel_ok(dev_id) -> bool:
    """Worker threads only for CUDA operands outside Triton's interpreter (which patches
    module state while it runs and is not thread-safe)."""
    return dev_id[0] == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def tune_budget() -> float:
    """Seconds of warm-up (compiles) a cold key may spend before lower-ranked candidates are
    skipped (the planner's first two and eager are always tried); 0 = no limit.
    ``LYCORIS_KERNEL_TUNE_BUDGET`` (default 1.5), ``set_budget``; ``warmup`` and the CLI
    use no limit."""
    b = _budget[0]
    if b is None:
        _budget[0] = b = settings.get(ENV_BUDGET)
    return b


def set_budget(seconds: Optional[float]) -> float:
    """Set the per-key warm-up budget (0: no limit; None: re-read the environment).
    Returns the previous value."""
    previous = tune_budget()
    _budget[0] = None if seconds is None else max(0.0, float(seconds))
    return previous


def set_timer(timer: Optional[Timer]) -> Optional[Timer]:
    """Replace the timer (``timer(fn, candidate) -> seconds per call`` for one round);
    ``None`` restores CUDA-event timing. Returns the previous one."""
    previous = _timer[0]
    _timer[0] = timer
    return previous


def table_path() -> str:
    return dispatch.tuning_table_path()


def table(path: Optional[str] = None) -> JsonTable:
    """The tuning table of ``path`` (default ``table_path()``), loaded once per process."""
    path = os.path.abspath(os.path.expanduser(path or table_path()))
    t = _tables.get(path)
    if t is None:
        with _lock:
            t = _tables.get(path)
            if t is None:
                t = _tables[path] = JsonTable(path, TABLE_VERSION, "rows", what="tuning table")
    return t


def stats() -> Dict[str, float]:
    """Counters of this process: keys tuned, timer calls, table hits, planner first picks
    (tuning off), guarded picks (capture/compile), seconds spent tuning."""
    return dict(_stats)


def _clear_fronts() -> None:
    for f in _fronts:
        f.clear()


def clear(*, tables: bool = True) -> None:
    """Forget memoized picks (and, by default, the loaded tables and counters): as in a
    fresh process. The files are untouched."""
    with _lock:
        _memo.clear()
        _clear_fronts()
        if tables:
            _tables.clear()
            _budget[0] = None
            for k in _stats:
                _stats[k] = 0 if k != "tune_s" else 0.0


class Front(dict):
    """An exact-argument front cache an op keeps (``key -> resolved config``): filled by
    ``select_config(..., front=(cache, key))`` only with final picks, emptied by
    ``clear``/``set_tuning``. Lets the hot path be one tuple + one dict lookup."""

    def __init__(self):
        super().__init__()
        _fronts.append(self)


# --------------------------------------------------------------------------- guards

def unsafe_to_time() -> bool:
    """True while ``torch.compile``/``torch.export`` traces or a CUDA graph is captured."""
    return _device.unsafe_to_measure()


# --------------------------------------------------------------------------- timing

#: GPU cycles spun before a process's first timing on a device (~50 ms at 1.98 GHz)
SPIN_CYCLES = 100_000_000
_clocked: set = set()


#: GPU clock cycles per microsecond assumed when sizing ``torch.cuda._sleep`` (about 2 GHz
#: parts; a slower clock only sleeps longer)
SLEEP_CYCLES_PER_US = 2000
#: longest sleep before a timed block (s)
MAX_SLEEP_S = 0.02
#: host time of the flush and the two event records around each timed call (s)
FLUSH_HOST_S = 15e-6


def _hold(host_s: float, calls: int) -> None:
    """Keep the GPU busy while the host enqueues ``calls`` calls of ``host_s`` each, so the
    timed kernels then run back to back: device time, not the host's launch path."""
    us = min(1.5 * calls * host_s * 1e6 + 20.0, MAX_SLEEP_S * 1e6)
    torch.cuda._sleep(int(us * SLEEP_CYCLES_PER_US))


#: the L2 flush buffer is this many times the device's L2 (bounded scratch: one per device,
#: dropped when the key's timing ends)
FLUSH_L2_FACTOR = 2
FLUSH_MAX_BYTES = 256 << 20
_flush: Dict[int, torch.Tensor] = {}


def _flush_buffer(dev: int) -> torch.Tensor:
    buf = _flush.get(dev)
    if buf is None:
        l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (32 << 20))
        n = min(max(FLUSH_L2_FACTOR * l2, 8 << 20), FLUSH_MAX_BYTES)
        buf = _flush[dev] = torch.ones(n // 4, dtype=torch.int32, device=torch.device("cuda", dev))
    return buf


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


def _outputs(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _mismatch(got, want) -> Optional[str]:
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


def _label(c: Candidate) -> str:
    if is_eager(c):
        return SENTINEL_EAGER
    return ",".join(f"{k}={_fmt(_value(v))}" for k, v in c.items()) if isinstance(c, dict) else str(c)


def _failure(exc: Exception) -> Tuple[bool, str]:
    """(whether it ran out of memory, the row's failure text) for a candidate that raised."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True, f"out of memory: {exc}"
    return False, f"{type(exc).__name__}: {str(exc)[:300]}"


def _warm_parallel(cands, idx, run, ref, threads, errors) -> bool:
    """First call (compile + warm-up, output checked against ``ref``) of the candidates
    ``idx`` on worker threads, on the calling thread's device and stream; failures go to
    ``errors``. Returns whether one ran out of memory."""
    from concurrent.futures import ThreadPoolExecutor
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
                return _mismatch(out, ref) if ref is not None else None
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
                    was_oom, errors[i] = _failure(exc)
                    oom = oom or was_oom
        except BaseException:  # a Ctrl-C: the first calls not started are dropped, not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if cuda:
        stream.synchronize()  # the workers' launches are done before anything is timed
    return oom


def _time_candidates(cands: Sequence[Candidate], run: Callable[[Candidate], Any], timer: Timer,
                     check: bool, reference: Optional[Callable[[], Any]] = None, budget: Optional[float] = None,
                     threads: int = 0) -> Tuple[int, Dict[int, float], Dict[int, str], bool, List[int]]:
    """(winner index or -1, best seconds per index, failure per index, an OOM happened,
    indices skipped for the time budget)."""
    errors: Dict[int, str] = {}
    skipped: List[int] = []
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
        from . import precompile

        # their kernels compiled in child processes first: the first calls then load them from disk
        pre = precompile.precompile([lambda c=cands[i]: run(c) for i in fused])
        if pre is not None:
            log.debug("lycoris_ops tune: precompiled %d of %d kernels in %d processes (%d failed), %.2f s",
                      pre.compiled, pre.captured, pre.children, pre.failures, pre.seconds)
        oom = _warm_parallel(cands, fused, run, ref, threads, errors) or oom
    fused_seen = 0
    for i, c in enumerate(cands):
        if i in errors:
            continue
        if parallel and not is_eager(c):
            # compiled and checked on a worker; one more call here before any timing: a
            # nested selection skipped on the worker tunes now, and a kernel a worker's
            # compile raced out of Triton's in-memory cache is reloaded now, not in a timed call
            try:
                run(c)
                alive.append(i)
            except Exception as exc:
                was_oom, errors[i] = _failure(exc)
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
                bad = _mismatch(out, ref)
                if bad is not None:
                    errors[i] = f"disagrees with eager: {bad}"
                    continue
            del out
            alive.append(i)
        except Exception as exc:
            was_oom, errors[i] = _failure(exc)
            oom = oom or was_oom
    ref = None
    best: Dict[int, float] = {}
    for rnd in range(ROUNDS):
        for i in list(alive):
            c = cands[i]
            try:
                _stats["timer_calls"] += 1
                t = float(timer(lambda c=c: run(c), c))
            except Exception as exc:
                was_oom, errors[i] = _failure(exc)
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
    winner = -1
    if finite:  # the planner's earliest candidate among those within TIE_MARGIN of the fastest
        fastest = min(finite)[0]
        winner = min(i for t, i in finite if t <= TIE_MARGIN * fastest)
    return winner, best, errors, oom, skipped


# --------------------------------------------------------------------------- selection

def _device_id(device) -> Tuple[str, Optional[int]]:
    if device is None:
        return ("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else ("cpu", None)
    if isinstance(device, int):
        return ("cuda", device)
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return ("cuda", torch.cuda.current_device())
    return (d.type, d.index)


def _device_name(dev_id: Tuple[str, Optional[int]]) -> str:
    name = _names.get(dev_id)
    if name is None:
        if dev_id[0] == "cuda":
            try:
                name = torch.cuda.get_device_name(dev_id[1])
            except Exception:
                name = f"cuda:{dev_id[1]}"
        else:
            name = dev_id[0]
        _names[dev_id] = name
    return name


def _memoize(mkey, entry: _Entry, front) -> None:
    if len(_memo) >= MEMO_MAX:
        _memo.clear()
        _clear_fronts()
    _memo[mkey] = entry
    if front is not None:
        cache, fkey = front
        if len(cache) >= MEMO_MAX:
            cache.clear()
        cache[fkey] = entry.value


def _resolve(resolve, c: Candidate):
    if is_eager(c) or resolve is None:
        return c
    return resolve(c)


def _candidates(candidates) -> List[Candidate]:
    if callable(candidates) and not isinstance(candidates, (list, tuple, Plan)):
        candidates = candidates()
    cands = list(candidates.candidates if isinstance(candidates, Plan) else candidates)
    if not cands:
        raise ValueError("lycoris_ops.tune: empty candidate list")
    return cands


def _row_candidate(row) -> Optional[Candidate]:
    c = row.get("config") if isinstance(row, dict) else None
    if is_eager(c) or isinstance(c, dict):
        return c
    return None


def stored(op: str, backend: str, key_parts, *, device=None, version=0) -> bool:
    """Whether ``select_config`` of this key would find its choice without timing: memoized in
    this process (timed) or a row of the tuning table."""
    dev_id = _device_id(device)
    parts = _parts(key_parts)
    entry = _memo.get((dev_id, backend, op, version, parts))
    if entry is not None and entry.tuned:
        return True
    return _row_candidate(table().get(make_key(_device_name(dev_id), backend, op, version, parts))) is not None


def select_config(op: str, backend: str, key_parts, candidates, run_candidate: Callable[[Candidate], Any], *,
                  device=None, version=0, resolve: Optional[Callable[[dict], Any]] = None,
                  timer: Optional[Timer] = None, validate: Optional[Callable[[Candidate], bool]] = None,
                  check: bool = True, reference: Optional[Callable[[], Any]] = None,
                  front: Optional[Tuple[dict, Any]] = None):
    """The config ``op`` should launch with for this call (see the module docstring).

    ``key_parts``: the bucketed shape / dtypes / flags (``shape_key``; a dict or
    (name, value) pairs). ``candidates``: the shortlist (``Plan``, list, or a callable
    giving one, called only on a miss), best predicted first; each a dict of launch
    parameters or ``SENTINEL_EAGER``. ``run_candidate(c)`` runs the op on the call's
    operands with candidate ``c`` (the eager body for the sentinel) and returns its
    output(s). ``device``: the operands' device (key and timing). ``version``: the
    kernel version (``source_version``). ``resolve(c)``: maps a dict candidate to what
    the caller launches with (memoized; default the dict itself). ``validate(c)``: a
    stored row whose candidate fails it is ignored. ``check``: compare fused outputs
    with the eager one during timing (``run_candidate(SENTINEL_EAGER)`` when it is a
    candidate, else ``reference()`` when given). ``front``: ``(Front cache, exact key)``
    to fill.

    Returns the resolved winner, or ``SENTINEL_EAGER``.
    """
    dev_id = _device_id(device)
    parts = _parts(key_parts)
    mkey = (dev_id, backend, op, version, parts)
    entry = _memo.get(mkey)
    if entry is None or not (entry.tuned or not tuning_enabled()):
        if _in_worker():  # inside a candidate's first call on a tuner worker: no lock, no timing
            _stats["guarded"] += 1
            return _resolve(resolve, _candidates(candidates)[0])
        with _lock:
            return _select_locked(op, backend, candidates, run_candidate, dev_id, parts, mkey, version, resolve,
                                  timer, validate, check, reference, front)
    if front is not None:  # another exact shape of the same bucket
        front[0][front[1]] = entry.value
    return entry.value


def _select_locked(op, backend, candidates, run_candidate, dev_id, parts, mkey, version, resolve, timer, validate,
                   check, reference, front):
    entry = _memo.get(mkey)
    if entry is not None and (entry.tuned or not tuning_enabled()):
        if front is not None:
            front[0][front[1]] = entry.value
        return entry.value
    name = _device_name(dev_id)
    skey = make_key(name, backend, op, version, parts)
    tab = table()
    if entry is None or not entry.tuned:
        c = _row_candidate(tab.get(skey))
        if c is not None and (validate is None or is_eager(c) or validate(c)):
            try:
                value = _resolve(resolve, c)
            except Exception:
                value = None  # a row this build cannot use: retune
            if value is not None:
                _stats["table_hits"] += 1
                _memoize(mkey, _Entry(value, c, True), front)
                return value
    cands = _candidates(candidates)
    use_timer = timer or _timer[0]
    if unsafe_to_time():
        _stats["guarded"] += 1
        return _resolve(resolve, cands[0])  # not memoized, not stored
    if not tuning_enabled() or (use_timer is None and dev_id[0] != "cuda"):
        _stats["first_pick"] += 1
        value = _resolve(resolve, cands[0])
        _memoize(mkey, _Entry(value, cands[0], False), front)
        return value
    t0 = time.perf_counter()
    # the operands' GPU current while timing (events and launches on its current stream)
    on_device = torch.cuda.device(dev_id[1]) if dev_id[0] == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), on_device:
        winner, best, errors, oom, skipped = _time_candidates(
            cands, run_candidate, use_timer or cuda_timer, check, reference, tune_budget(),
            tune_threads() if _parallel_ok(dev_id) else 0)
    _flush.clear()  # the L2 flush buffer lives while a key is timed only (not in the model's peak memory)
    spent = time.perf_counter() - t0
    _stats["tune_s"] += spent
    _stats["tuned"] += 1
    for i, why in errors.items():
        log.warning("lycoris_ops tune: %s [%s] candidate %s failed: %s", op, skey.rsplit("|", 1)[-1],
                    _label(cands[i]), why)
    if winner < 0:  # every candidate failed: the planner's pick for this process, not stored
        value = _resolve(resolve, cands[0])
        _memoize(mkey, _Entry(value, cands[0], True), front)
        log.warning("lycoris_ops tune: %s [%s]: no candidate ran; using %s for this process",
                    op, skey.rsplit("|", 1)[-1], _label(cands[0]))
        return value
    c = cands[winner]
    value = _resolve(resolve, c)
    row = {"config": c, "ms": round(best[winner] * 1e3, 6),
           "times": {_label(cands[i]): round(t * 1e3, 6) for i, t in sorted(best.items())},
           "tuned_s": round(spent, 3), "torch": torch.__version__}
    if errors:
        row["failed"] = {_label(cands[i]): why[:200] for i, why in errors.items()}
    if skipped:
        row["skipped"] = [_label(cands[i]) for i in skipped]  # past the time budget
    if not oom:
        tab.put(skey, row)
    _memoize(mkey, _Entry(value, c, True), front)
    log.info("lycoris_ops tune: %s [%s] -> %s %.4f ms (%d candidates, %.2f s)%s", op,
             skey.rsplit("|", 1)[-1], _label(c), best[winner] * 1e3, len(cands) - len(skipped), spent,
             " (not stored: out of memory during timing)" if oom else "")
    return value


def pick(op: str, backend: str, key_parts, plan, run_fused: Callable[[Any], Any], run_eager: Callable[[], Any], *,
         device, version, resolve: Callable[[dict], Any], front: Optional[Tuple[dict, Any]] = None):
    """``select_config`` for the usual op: ``run_fused(resolve(c))`` runs a tile config,
    ``run_eager()`` the eager body (also the reference every fused candidate's output is
    checked against while timing). Returns the resolved winner or ``SENTINEL_EAGER``."""
    def run(c):
        return run_eager() if is_eager(c) else run_fused(resolve(c))

    return select_config(op, backend, key_parts, plan, run, device=device, version=version, resolve=resolve,
                         reference=run_eager, front=front)


# --------------------------------------------------------------------------- warmup / CLI

@dataclass(frozen=True)
class Layer:
    """A layer shape to pre-tune: ``out_features`` x ``in_features``, adapter ``rank``."""

    out_features: int
    in_features: int
    rank: int = 16


def parse_layer(text: str, rank: int = 16) -> Layer:
    """``"OxI"``, ``"OxI:rR"`` or ``"OxIxR"`` -> Layer."""
    t = text.strip().lower()
    if ":r" in t:
        t, r = t.split(":r", 1)
        rank = int(r)
    dims = [int(v) for v in t.replace("*", "x").split("x") if v]
    if len(dims) == 3:
        dims, rank = dims[:2], dims[2]
    if len(dims) != 2:
        raise ValueError(f"lycoris_ops.tune: bad layer shape {text!r} (expected OxI, OxI:rR or OxIxR)")
    return Layer(dims[0], dims[1], rank)


def _families():
    import importlib

    out = []
    for fam in ("lora", "tucker", "loha", "lokr", "dora", "oft", "boft", "ia3", "add"):
        try:
            out.append(importlib.import_module(f"{__package__}.{fam}"))
        except Exception as exc:  # a family whose launcher is missing
            log.debug("plans.%s not available: %s", fam, exc)
    return out


def warmup(layers: Iterable, *, tokens: Sequence[int] = (1024,), dtype=torch.bfloat16, device=None,
           ops: Optional[Sequence[str]] = None, rank: int = 16, backward: bool = True,
           budget: Optional[float] = None, direct: bool = False) -> Dict[str, Any]:
    """Pre-tune the ops for the given layer shapes: runs each op once per (layer, token
    count) through ``torch.ops.lycoris`` on ``device`` (default the current CUDA device),
    so every key they meet is tuned now (and stored) instead of on first use.

    ``layers``: ``Layer``s, ``(out, in)`` / ``(out, in, rank)`` tuples or strings
    ``"OxI[:rR]"``. ``ops``: only these op names (default: every op with a sample in its
    family planner; ``backward=False`` skips the ``*_bwd`` ops). ``budget``: per-key
    warm-up budget while pre-tuning (default None = no limit: the whole shortlist is
    timed). ``direct``: tune the Triton configs through the planners' glue
    (``plans/<family>.py: KWARGS``) instead of calling the ops (which tune whatever
    backend the dispatcher picks). TileLang keys that deferred their shortlists
    (``plans/tilelang.DEFER``) are waited for and called once more, so they are timed too.
    Returns a summary (calls made, keys tuned, table hits, seconds). Without CUDA it does
    nothing."""
    summary: Dict[str, Any] = {"calls": 0, "tuned": 0, "table_hits": 0, "seconds": 0.0, "errors": []}
    if not torch.cuda.is_available():
        summary["skipped"] = "no CUDA device"
        return summary
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    parsed = []
    for item in layers:
        if isinstance(item, Layer):
            parsed.append(item)
        elif isinstance(item, str):
            parsed.append(parse_layer(item, rank))
        else:
            vals = tuple(int(v) for v in item)
            parsed.append(Layer(vals[0], vals[1], vals[2] if len(vals) > 2 else rank))
    before = stats()
    t0 = time.perf_counter()
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    previous_budget = set_budget(0.0 if budget is None else budget)
    try:
        _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, summary, direct)
        tl_pick = sys.modules.get(f"{__package__}.tilelang")
        if tl_pick is not None and tl_pick.settle():  # TileLang keys that deferred their shortlists
            again: Dict[str, Any] = {"calls": 0, "errors": []}
            _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, again, direct)  # they time them now
            summary["errors"] += again["errors"]
    finally:
        set_budget(previous_budget)
    torch.cuda.synchronize(dev)
    after = stats()
    summary["tuned"] = after["tuned"] - before["tuned"]
    summary["table_hits"] = after["table_hits"] - before["table_hits"]
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, summary, direct) -> None:
    from .. import scope, select

    with torch.no_grad():
        for fam in _families():
            samples = getattr(fam, "samples", None)
            if samples is None:
                continue
            for layer in parsed:
                for T in tokens:
                    for op, args in samples(layer, int(T), dtype, dev, gen):
                        if ops is not None and op not in ops:
                            continue
                        if not backward and op.endswith("_bwd"):
                            continue
                        try:
                            if direct:
                                glue = getattr(fam, "KWARGS", {}).get(op)
                                full = select._full_args(op, args)
                                if glue is None or scope.why_not(op, "triton", full) is not None:
                                    continue
                                glue(*full)
                            else:
                                getattr(torch.ops.lycoris, op)(*args)
                            summary["calls"] += 1
                        except Exception as exc:
                            summary["errors"].append(f"{op} {layer} T={T}: {type(exc).__name__}: {exc}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lycoris_ops.plans.tune",
        description="Pre-tune the lycoris ops for a list of layer shapes (fills tuning.json).")
    p.add_argument("--shapes", default="", help="comma-separated layer shapes OxI[:rR] (e.g. 4096x4096,11008x4096:r32)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank when a shape gives none (default 16)")
    p.add_argument("--tokens", default="1024", help="comma-separated token counts (default 1024)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--ops", default="", help="comma-separated op names (default: all with samples)")
    p.add_argument("--no-backward", action="store_true", help="skip the *_bwd ops")
    p.add_argument("--cache-dir", default=None, help="table directory (default LYCORIS_KERNEL_CACHE_DIR)")
    p.add_argument("--device", default=None, help="CUDA device (default the current one)")
    p.add_argument("--show", action="store_true", help="print the table's rows and exit")
    p.add_argument("--direct", action="store_true",
                   help="tune the Triton configs through the planners directly, not through torch.ops.lycoris")
    a = p.parse_args(argv)
    if a.cache_dir:
        os.environ[dispatch.ENV_CACHE_DIR] = a.cache_dir
    if a.show:
        rows = table().rows
        print(f"{table().path}: {len(rows)} rows")  # the sibling file where another program's table sits at the path
        for k, row in sorted(rows.items()):
            print(f"  {k} -> {_label(row.get('config'))} {row.get('ms')} ms")
        return 0
    if not torch.cuda.is_available():
        print("lycoris_ops.plans.tune: no CUDA device here; nothing to tune (the table is filled on a GPU machine).")
        return 0
    layers = [parse_layer(s, a.rank) for s in a.shapes.split(",") if s.strip()]
    if not layers:
        print("lycoris_ops.plans.tune: no --shapes given; nothing to tune.")
        return 0
    import lycoris_ops  # noqa: F401  (registers the ops)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_tuning(True)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] or None
    s = warmup(layers, tokens=tokens, dtype=getattr(torch, a.dtype), device=a.device, ops=ops, rank=a.rank,
               backward=not a.no_backward, direct=a.direct)
    print(f"lycoris_ops.plans.tune: {s['calls']} calls, {s['tuned']} keys tuned, {s['table_hits']} from the table, "
          f"{s['seconds']} s -> {table_path()}")
    for e in s["errors"]:
        print("  error:", e)
    return 0


if __name__ == "__main__":  # run the package's module, not this __main__ copy (one state)
    from lycoris_ops.plans import tune as _tune

    sys.exit(_tune.main())
