"""Timing primitives shared by bench.py, peer_lycoris.py and the variants scripts (no
lycoris_ops import).

Device time (``DeviceTimer.time``): CUDA events around each rep. Before each rep
the L2 cache is flushed by reading a 256 MiB buffer (H200 L2 is 50-60 MiB; the
read costs ~0.06 ms of device time, runs *before* the start event and leaves no
dirty lines behind), then
``torch.cuda._sleep`` keeps the GPU busy for about 1.3x the call's measured host
enqueue time, so every kernel of the call is already queued when the start event
fires: the median is device time without host launch gaps (host cost is measured
separately, see ``host_time``). A call that synchronizes the host inside (``.item()``,
an error check) is still charged the launch gaps after its sync. On CPU the same
interface falls back to wall clock (no claims).

Host time (``host_time``): tiny tensors, ``n`` calls back to back without a sync,
wall clock per call; the GPU idles (each kernel is a few microseconds), so this is
what the host pays per call. Median over rounds.

Cold time (``cold_call``): the first call of a callable in this process, wall clock
with a device sync on both sides (includes Triton JIT / Inductor compile / tuning). The
TileLang tier's cold call builds and runs its first config while the rest of the shortlist
builds in the background (``lycoris_ops.backends.tilelang.runner.DEFER``): ``settle_background`` waits
for those builds after it, so that the warm-up calls time the shortlist and the timed calls
run the tuned pick.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cold_call(fn: Callable, device) -> tuple:
    """(result, seconds) of one call, synchronized on both sides."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def settle_background() -> Optional[float]:
    """Seconds waited for the background builds of deferred cold keys (the tuner's, Triton's:
    ``tune.settle``; the TileLang tier's: ``plans/tilelang.settle``), after which each key's
    next call times its shortlist; None when nothing was building."""
    # looked up, not imported: a process that never loaded lycoris_ops (lycoris-lora's, whose
    # own ops take the same namespace) has nothing deferred
    tune = sys.modules.get("lycoris_ops.tuner.tune")
    tl_pick = sys.modules.get("lycoris_ops.backends.tilelang.runner")
    tl_busy = tl_pick is not None and bool(tl_pick._deferred or tl_pick._ahead)
    if not tl_busy and not (tune is not None and tune.pending()):
        return None
    t0 = time.perf_counter()
    if tune is not None:
        tune.settle()
    if tl_busy:
        tl_pick.settle()
    return time.perf_counter() - t0


def host_time(fn: Callable, device, n: int = 100, rounds: int = 5, warmup: int = 3) -> float:
    """Median host seconds per call of ``fn`` (calls issued back to back, no sync)."""
    for _ in range(warmup):
        fn()
    sync(device)
    per = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n)
        sync(device)
    return statistics.median(per)


class DeviceTimer:
    """Median device time of a callable; see the module docstring for the method."""

    def __init__(self, device, flush_mib: int = 256, target_ms: float = 30.0,
                 min_reps: int = 5, max_reps: int = 40, warmup: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.target_ms, self.min_reps, self.max_reps, self.warmup = target_ms, min_reps, max_reps, warmup
        self.flush_buf = None
        self.cycles_per_us = 0.0
        if self.cuda:
            self.flush_buf = torch.ones(flush_mib << 18, dtype=torch.int32, device=self.device)
            self._calibrate_sleep()

    def _calibrate_sleep(self) -> None:
        cycles = 2_000_000
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        torch.cuda.synchronize(self.device)
        ms = s.elapsed_time(e)
        self.cycles_per_us = cycles / max(ms * 1e3, 1.0)

    def _prefill(self, host_s: float) -> None:
        # a read of 256 MiB evicts L2 and leaves it clean: no write-back of dirty lines is
        # charged to the timed call (a memset here would leave ~50 MB dirty in L2)
        torch.sum(self.flush_buf, dtype=torch.int32)
        us = min(1.3 * host_s * 1e6 + 20.0, 20_000.0)
        torch.cuda._sleep(int(us * self.cycles_per_us))

    def time(self, fn: Callable, reps: Optional[int] = None) -> dict:
        """{'median_ms', 'min_ms', 'reps', 'host_enqueue_us'}; fn is called warmup + reps + 1 times."""
        for _ in range(self.warmup):
            fn()
        sync(self.device)
        # host enqueue time of one call (the GPU may still be running it when we stop the clock)
        t0 = time.perf_counter()
        fn()
        host_s = time.perf_counter() - t0
        sync(self.device)
        if not self.cuda:
            times = []
            for _ in range(reps or self.min_reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": len(times),
                    "host_enqueue_us": host_s * 1e6}
        if reps is None:
            # one measured rep to size the loop
            one = self._reps(fn, 1, host_s)[0]
            reps = int(max(self.min_reps, min(self.max_reps, self.target_ms / max(one, 1e-3))))
        times = self._reps(fn, reps, host_s)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps,
                "host_enqueue_us": host_s * 1e6}

    def _reps(self, fn: Callable, reps: int, host_s: float) -> List[float]:
        events = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._prefill(host_s)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in events]


def copy_bandwidth(device, gib: float = 1.0, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of reps.
    On CPU: a small copy (only so the smoke mode has a number; no claim)."""
    device = torch.device(device)
    n = int(gib * (1 << 30)) // 4 if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    timer = DeviceTimer(device, flush_mib=64, min_reps=reps, max_reps=reps)
    res = timer.time(lambda: dst.copy_(src), reps=reps)
    del src, dst
    return 2 * n * 4 / (res["median_ms"] * 1e-3)


def fmt_ms(v) -> str:
    if v is None:
        return "n/a"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


# --------------------------------------------------------------------------- one column of one spec

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure_column(fn: Callable, ts: list, grad_idx, G, timer: DeviceTimer, device, *, ref=None, tol=None,
                   phases=("fwd", "fwdbwd"), reps=None) -> dict:
    """Time ``fn(*ts)`` (fwd: a training forward, autograd recording) and fwd+bwd
    (forward + ``torch.autograd.grad`` of the output w.r.t. ``ts[grad_idx]`` with the
    fixed upstream grad ``G``). The first call of each phase is the cold call.

    Returns {cold_fwd_s, background_fwd_s, fwd: timer dict, cold_fwdbwd_s, background_fwdbwd_s,
    fwdbwd, out, grads, rel_err, grad_err, error} (``background_*_s``: ``settle_background``);
    ``ref`` = (out, grads) of the reference column for the errors, taken from each phase's
    cold call before it is timed. With ``tol``, a column whose rel_err or grad_err exceeds it
    is not timed (a timing of a wrong answer is no result): ``error`` says why.
    An exception is caught and reported in ``error`` (the phases done so far stay)."""
    res: dict = {}
    targets = [ts[i] for i in grad_idx]

    def fwd():
        return fn(*ts)

    def fwdbwd():
        out = fn(*ts)
        return out, torch.autograd.grad(out, targets, G)

    def agrees(key, errors) -> bool:
        """Record ``max(errors)`` under ``key``; False (and ``error``) beyond ``tol``."""
        res[key] = max(errors, default=0.0)
        if tol is not None and res[key] > tol:
            res["error"] = f"disagrees with the reference: {key} {res[key]:.3g} > {tol:g}"
            return False
        return True

    try:
        if "fwd" in phases:
            res["out"], res["cold_fwd_s"] = cold_call(fwd, device)
            if ref is not None and ref[0] is not None and not agrees("rel_err", [rel_err(res["out"], ref[0])]):
                return res
            res["background_fwd_s"] = settle_background()  # the warm-up then times a deferred shortlist
            res["fwd"] = timer.time(fwd, reps)
        if "fwdbwd" in phases:
            (out, grads), res["cold_fwdbwd_s"] = cold_call(fwdbwd, device)
            res.setdefault("out", out)
            res["grads"] = grads
            if ref is not None:
                if ref[0] is not None and "rel_err" not in res and not agrees("rel_err", [rel_err(out, ref[0])]):
                    return res
                if ref[1] is not None and not agrees("grad_err", [rel_err(g, r) for g, r in zip(grads, ref[1])]):
                    return res
            res["background_fwdbwd_s"] = settle_background()
            res["fwdbwd"] = timer.time(fwdbwd, reps)
    except Exception as exc:  # a column that fails is reported, the run goes on
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return res


def peak_bytes(fn: Callable, device) -> Optional[int]:
    """Device memory one call of ``fn`` allocates at its peak above what was allocated before
    it (its outputs included); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak


# --------------------------------------------------------------------------- the variants scripts

def variants_parser(shapes: str, variants, default: str) -> argparse.ArgumentParser:
    """The options every ``bench/tilelang_*_variants.py`` takes: --shapes, --dtype, --variants
    (of ``variants``, ``default`` when not given) and --smoke."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--variants", default=default, help=f"the variants to time, in order, of {list(variants)}")
    ap.add_argument("--smoke", action="store_true", help="CPU twins at fp32, tiny sizes: the script runs")
    return ap


def variants_device(args) -> tuple:
    """(dtype, device, DeviceTimer, seeded generator) of a variants script's ``args``: fp32 on
    the CPU with --smoke, else --dtype on CUDA."""
    dt = torch.float32 if args.smoke else {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dev = torch.device("cpu" if args.smoke else "cuda")
    return dt, dev, DeviceTimer(dev), torch.Generator(device=dev).manual_seed(0)


@contextlib.contextmanager
def module_settings(*settings):
    """``with module_settings((module, {name: value}), ...)``: those module attributes set for
    the block, restored after it (also when it raises)."""
    saved = [(mod, {k: getattr(mod, k) for k in kv}) for mod, kv in settings]
    try:
        for mod, kv in settings:
            for k, v in kv.items():
                setattr(mod, k, v)
        yield
    finally:
        for mod, kv in saved:
            for k, v in kv.items():
                setattr(mod, k, v)


def max_rel_diff(outs, refs) -> float:
    """The largest ``max|a − b| / max|b|`` over pairs of tensors (a variant against the first;
    empty pairs, such as an absent factor's gradient, count as equal)."""
    return max((((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                for a, b in zip(outs, refs) if b.numel()), default=0.0)


def _tensors(out) -> tuple:
    """An op's result as a flat tuple of tensors (a tuple / list flattened, None dropped)."""
    if isinstance(out, (tuple, list)):
        return tuple(t for o in out for t in _tensors(o))
    return () if out is None else (out,)


class VariantRows:
    """The rows of one variants table (one shape): each row runs ``fns`` once (their results)
    and times them under a variant's module settings; the first row that ran is the reference
    of the ratios and of the result differences."""

    def __init__(self, timer):
        self.timer = timer
        self.first = None

    def row(self, label: str, settings, *fns):
        """``(ms of each fn, ratio of each to the first row, max relative difference of the
        results from the first row's)`` under ``module_settings(*settings)``; None (and a line
        ``label failed: ...``) where the variant does not build or run here."""
        try:
            with module_settings(*settings):
                outs = tuple(t for fn in fns for t in _tensors(fn()))
                times = [self.timer.time(fn)["median_ms"] for fn in fns]
        except Exception as exc:  # a variant that does not build here: say so, go on
            print(f"{label} failed: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        if self.first is None:
            self.first = (times, outs)
        ratios = [t / f for t, f in zip(times, self.first[0])]
        return times, ratios, max_rel_diff(outs, self.first[1])
