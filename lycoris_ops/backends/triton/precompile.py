"""Compile a cold key's Triton kernels in forked child processes before the tuner's
first calls, so those calls only load them from Triton's on-disk cache.

A cold key's wall time is mostly Triton compiling the 5-10 distinct kernels of its
shortlist. The tuner's first calls run on worker threads, but Triton's front end
holds the GIL, so threads barely overlap the compiles; processes do.

``precompile(runs)``:

1. capture (calling thread): each fused candidate runs once with a
   ``triton.knobs.runtime.jit_cache_hook`` installed. The JIT calls the hook right
   before a compile (an in-memory cache miss) with what it is about to compile; the
   hook records it and answers True, so the JIT neither compiles nor launches
   (``FastJIT`` keeps nothing: the launch returns None). Calls from other threads go
   to the hook installed before (if any);
2. the kernels not already in Triton's on-disk cache are compiled by up to
   ``LYCORIS_KERNEL_TUNE_PROCS`` forked children (``tuner/build_pool.py``; default ``min(12, CPUs - 1)``; 0 or
   1: no precompile), round robin, with the same ``triton.compile`` call
   ``JITFunction._do_compile`` makes (same source, target and options: same cache
   entry), then builds the kernel's host launcher (Triton 3.6 compiles one per
   signature with the host C compiler; also cached on disk). A child never touches
   CUDA and leaves with ``os._exit``.

``defer(first_runs, rest_runs)`` (the tuner's deferrer for Triton, ``tune.register_deferrer``,
``LYCORIS_KERNEL_TUNE_DEFER``): the first config's kernels as above (waited for), the rest of
the shortlist's by children at a lower priority (``BACKGROUND_NICE``) that no call waits for;
the key's calls run the first config until they are done (``Background``), then one call times
the shortlist with every kernel on disk.

Nothing here is required for correctness: a kernel a child did not compile (failed,
killed at the deadline, never captured) is compiled by its first call as before.
POSIX only (``os.fork``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lycoris_ops.tuner import build_pool, tune

__all__ = ["Kernel", "Report", "Background", "capturing", "capture", "on_disk", "precompile", "defer", "stats"]

#: niceness of the children building a deferred shortlist (no call waits for them; the first
#: config's compiles and the caller's own work keep the CPUs)
BACKGROUND_NICE = 10
#: seconds a background child may take before it is killed (its kernels are then compiled by
#: the timing call, as without precompile)
BACKGROUND_TIMEOUT_S = 300.0


log = logging.getLogger("lycoris_ops.tune")
_warned: set = set()
_totals = {"keys": 0, "captured": 0, "compiled": 0, "children": 0, "failures": 0, "seconds": 0.0, "deferred": 0}


@dataclass
class Kernel:
    """One compile the JIT was about to do: the arguments ``JITFunction._do_compile``
    hands to ``triton.compile``."""

    fn: Any  # the triton.JITFunction
    signature: Dict[str, Any]
    constants: Dict[Tuple[int, ...], Any]
    attrs: Dict[Tuple[int, ...], Any]
    options: Dict[str, Any]
    target: Any  # triton.backends.compiler.GPUTarget

    def source(self):
        from triton.compiler import ASTSource

        return ASTSource(self.fn, self.signature, self.constants, self.attrs)

    def compile(self):
        import triton

        return triton.compile(self.source(), target=self.target, options=dict(self.options))

    def build(self):
        """What a child does: compile, then the host launcher."""
        _build_launcher(self.compile())


def _build_launcher(compiled) -> None:
    """The host-side launcher of ``compiled``, as its first launch would make it. Triton 3.6
    builds a C launcher per kernel signature with the host compiler (cached on disk by its
    source): built here, the parent only loads it. Triton 3.7 has one generic
    launcher: nothing is built. Optional: a failure leaves it to the first launch."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:
        pass


@dataclass
class Report:
    """What one ``precompile`` did: distinct kernels its candidates would compile
    (``captured``), those sent to children (``compiled``: not yet on disk), children
    forked, children that failed or were killed, seconds (capture included)."""

    captured: int = 0
    compiled: int = 0
    children: int = 0
    failures: int = 0
    seconds: float = 0.0


def stats() -> Dict[str, float]:
    """Totals of this process: ``precompile`` calls (cold keys), kernels captured / compiled
    in children, children forked, failures, seconds (``bench/gpu_tuning.py`` shows them per key)."""
    return dict(_totals)


def _tuples(v):
    """JSON lists back to the tuples the options held (as ``JITFunction.preload`` does, nested
    ones too): a list would change the options' hash, so the cache key."""
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


@contextlib.contextmanager
def capturing(target=None) -> Iterator[List[Kernel]]:
    """While active, Triton JIT compiles on this thread are recorded (into the yielded
    list, one per distinct kernel) instead of done: that launch returns None without
    running. ``target``: default the JIT's own (``driver.active.get_current_target()``)."""
    from triton import knobs

    if target is None:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    me = threading.get_ident()
    previous = knobs.runtime.jit_cache_hook
    kernels: List[Kernel] = []
    seen = set()

    def hook(**kw):
        if threading.get_ident() != me:  # another thread compiles for real
            return previous(**kw) if previous is not None else None
        fn, c = kw["fn"].jit_function, kw["compile"]
        if (id(fn), c["key"]) not in seen:
            seen.add((id(fn), c["key"]))
            options = {k: _tuples(v) for k, v in json.loads(c["specialization_data"])["options"].items()}
            kernels.append(Kernel(fn, c["signature"], c["constants"], c["configs"][0], options, target))
        return True  # skip the compile (and the launch)

    knobs.runtime.jit_cache_hook = hook
    try:
        yield kernels
    finally:
        knobs.runtime.jit_cache_hook = previous


def capture(runs: Sequence[Callable[[], Any]], target=None) -> List[Kernel]:
    """The distinct kernels ``runs`` would compile: each runs once under ``capturing``,
    without autograd and as a tuner worker (a nested selection takes the planner's first
    pick, neither timed nor stored). A run that raises is skipped (its real first call
    reports it)."""
    with tune.worker(), torch.no_grad(), capturing(target) as kernels:
        for run in runs:
            try:
                run()
            except Exception:
                pass
    return kernels


def on_disk(kernel: Kernel) -> bool:
    """Whether Triton's on-disk cache already holds ``kernel`` (its first call only loads
    it): the lookup ``triton.compile`` starts with. False when unsure."""
    try:
        from triton import knobs
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        if knobs.compilation.always_compile or getattr(knobs.runtime, "add_stages_inspection_hook", None):
            return False  # the key has more to it, or nothing is loaded from disk
        src = kernel.source()
        backend = make_backend(kernel.target)
        options = backend.parse_options(dict(kernel.options))
        key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        return name in (get_cache_manager(hashlib.sha256(key.encode()).hexdigest()).get_group(name) or {})
    except Exception:
        return False


def precompile(runs: Sequence[Callable[[], Any]], procs: Optional[int] = None) -> Optional[Report]:
    """Compile what ``runs`` (the fused candidates' first calls) would compile, in forked
    children, when that is at least two kernels not yet on disk. None when
    ``usable_procs(procs)`` is below 2 (disabled, or forking this process would cost more
    than it saves)."""
    procs = build_pool.usable_procs(procs)
    if procs < 2:
        return None
    t0 = time.perf_counter()
    report = Report()
    try:
        kernels = capture(runs)
        report.captured = len(kernels)
        todo = [k for k in kernels if not on_disk(k)]
        if len(todo) >= 2:
            report.compiled = len(todo)
            report.children, report.failures = build_pool.compile_forked(todo, procs)
    except Exception as exc:  # an optimization only: the first calls compile in-process as before
        report.failures += 1
        why = f"{type(exc).__name__}: {exc}"
        if why not in _warned:
            _warned.add(why)
            log.warning("lycoris_ops precompile failed (the first calls compile in-process): %s", why)
    report.seconds = time.perf_counter() - t0
    _totals["keys"] += 1
    for k in ("captured", "compiled", "children", "failures", "seconds"):
        _totals[k] += getattr(report, k)
    log.debug("lycoris_ops tune: precompiled %d of %d kernels in %d processes (%d failed), %.2f s",
              report.compiled, report.captured, report.children, report.failures, report.seconds)
    return report


class Background:
    """The children building a deferred key's shortlist (``fork_builds``' pids), reaped without
    blocking: ``done()`` once every child exited or the deadline passed (the rest killed)."""

    def __init__(self, pids: Sequence[int], timeout_s: float = BACKGROUND_TIMEOUT_S):
        self.pids = list(pids)
        self.deadline = time.monotonic() + timeout_s
        self.failures = 0

    def done(self) -> bool:
        for pid in list(self.pids):
            exited, code = build_pool.poll(pid)
            if exited:
                self.pids.remove(pid)
                self.failures += code not in (0, None)
        if self.pids and time.monotonic() >= self.deadline:
            self.cancel()
        return not self.pids

    def wait(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not self.done() and time.monotonic() < end:
            time.sleep(build_pool.POLL_S * 10)
        return not self.pids

    def cancel(self) -> None:
        for pid in self.pids:
            build_pool.kill(pid)
            self.failures += 1
        self.pids = []


def defer(first_runs: Sequence[Callable[[], Any]], rest_runs: Sequence[Callable[[], Any]],
          procs: Optional[int] = None) -> Optional[Background]:
    """The tuner's deferrer for Triton cold keys: compile the first config's kernels (in
    children when two or more, waited for), then fork low-priority children compiling the rest
    of the shortlist's kernels not on disk yet and return them (``Background``), without
    waiting. None (the key is timed at once, as without deferral) when fewer than two
    children can be forked or nothing of the rest is left to compile."""
    procs = build_pool.usable_procs(procs)
    if procs < 2:
        return None
    first = [k for k in capture(first_runs) if not on_disk(k)]
    if len(first) >= 2:
        build_pool.compile_forked(first, procs)
    rest = [k for k in capture(rest_runs) if not on_disk(k)]  # what the first's children built is on disk
    if not rest:
        return None
    forked = build_pool.fork_builds(rest, procs, nice=BACKGROUND_NICE)
    if not forked:
        return None
    _totals["deferred"] += 1
    return Background([pid for pid, _ in forked])


tune.register_deferrer("triton", defer)
