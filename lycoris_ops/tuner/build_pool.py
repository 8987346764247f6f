"""Build jobs in forked child processes: the process pool both fused backends' tuning uses
for a cold key's kernels (Triton's ``backends/triton/precompile.py``, TileLang's
``backends/tilelang/runner.py``).

A job is anything with ``build()`` (compile into the backend's on-disk cache). Children
never touch CUDA and leave with ``os._exit``; a job a child did not build (failed, killed
at the deadline) is built by its first call as before. How many children: the
``LYCORIS_KERNEL_TUNE_PROCS`` setting within what forking this process costs
(``usable_procs``). POSIX only (``os.fork``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import warnings
from typing import List, Optional, Sequence, Tuple

from lycoris_ops import settings

__all__ = ["ENV_PROCS", "cpus", "tune_procs", "fork_builds", "poll", "kill", "compile_forked", "usable_procs", "fork_limit",
           "anon_gib"]

ENV_PROCS = "LYCORIS_KERNEL_TUNE_PROCS"
#: most children by default (each compiles its share one kernel after the other). 12: the
#: largest cold keys build 10-11 kernels (Triton's loha_bypass_bwd, TileLang's boft_bwd),
#: which fewer children build in two rounds
MAX_DEFAULT_PROCS = 12
#: seconds the parent waits for all children before killing the rest (their kernels are
#: then compiled by the first calls, as without precompile)
TIMEOUT_S = 30.0
#: fork costs time in proportion to the parent's anonymous memory (page tables copied, then
#: torn down at the child's exit): FORK_S_PER_GIB seconds per GiB per child, as measured
#: (``bench/compile_children.py --forks``). Children are limited so that their forks cost at
#: most FORK_BUDGET_S together; fewer than 2: no precompile.
FORK_S_PER_GIB = 0.025
FORK_BUDGET_S = 0.5
#: seconds between two polls of the children's exit
POLL_S = 0.002


def cpus() -> int:
    """The CPUs this process may use (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tune_procs() -> int:
    """Child processes that compile a cold key's kernels (``LYCORIS_KERNEL_TUNE_PROCS``;
    default ``min(12, CPUs this process may use - 1)``; 0/1: no precompile)."""
    procs = settings.get(ENV_PROCS)
    return max(0, min(MAX_DEFAULT_PROCS, cpus() - 1)) if procs is None else procs


def _child(kernels: Sequence, nice: int = 0) -> None:
    """A forked child: build ``kernels`` (into Triton's / TileLang's on-disk cache) and
    leave at once, status 1 if one failed; no atexit handlers, no CUDA. ``nice``: added to
    its niceness first (the compilers it starts inherit it)."""
    status = 1
    try:
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        try:
            from triton import knobs
        except ImportError:  # TileLang jobs without Triton installed
            knobs = None

        # the parent's objects are not this process's to finalize (a CUDA tensor in a cycle),
        # nor its Python handlers (a trainer's checkpoint on SIGTERM, a profiler's compile
        # listener): they may touch CUDA
        gc.disable()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if knobs is not None:
            knobs.compilation.listener = None
        failed = 0
        for k in kernels:  # a job: anything with build() (Kernel; tilelang/common.Pending)
            try:
                k.build()
            except Exception:
                failed += 1
        status = 1 if failed else 0
    finally:
        os._exit(status)


def fork_builds(kernels: Sequence, procs: int, nice: int = 0) -> List[Tuple[int, list]]:
    """Fork up to ``procs`` children that each ``build()`` their round-robin share of ``kernels``
    and exit (0: all built); returns (pid, share) of each, without waiting. A share whose fork
    fails (no memory, no process slot) is left to the first calls. ``nice``: the children's
    added niceness (builds no call waits for yet)."""
    shares = [list(kernels[i::procs]) for i in range(min(procs, len(kernels)))]
    for stream in (sys.stdout, sys.stderr):  # a child must not write the parent's buffered output again
        with contextlib.suppress(AttributeError, ValueError, OSError):  # None, closed
            stream.flush()
    out = []
    for share in shares:
        with warnings.catch_warnings():  # Python 3.12: forking a multi-threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                pid = os.fork()
            except OSError:
                break
        if pid == 0:
            _child(share, nice)  # never returns
        out.append((pid, share))
    return out


def poll(pid: int) -> Tuple[bool, Optional[int]]:
    """(exited, exit code) of a forked child, without blocking; (True, None) where it was
    reaped elsewhere (SIGCHLD ignored): it is gone, its exit code unknown."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True, None
    return (True, os.waitstatus_to_exitcode(status)) if done else (False, None)


def kill(pid: int) -> None:
    """Kill a forked child and reap it (one already gone is ignored)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def compile_forked(kernels: Sequence, procs: int, timeout_s: float = TIMEOUT_S) -> Tuple[int, int]:
    """Build ``kernels`` (``build()`` each) in up to ``procs`` forked children (round robin) and wait for
    them, killing those still running after ``timeout_s``. Returns (children, failed or
    killed children). A share whose fork fails (no memory, no process slot) is left to
    the first calls."""
    pending: List[int] = []
    children = failures = 0
    try:
        pending += [pid for pid, _ in fork_builds(kernels, procs)]
        children = len(pending)
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for pid in list(pending):
                done, code = poll(pid)
                if done:
                    pending.remove(pid)
                    failures += code not in (0, None)  # reaped elsewhere: not counted as failed
            if pending:
                time.sleep(POLL_S)
    finally:
        for pid in pending:  # past the deadline (or the parent was interrupted)
            kill(pid)
            failures += 1
    return children, failures


def anon_gib() -> float:
    """This process's anonymous resident memory in GiB (``RssAnon``; 0 where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / (1 << 20)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def fork_limit(gib: Optional[float] = None) -> int:
    """Most children whose forks together stay within ``FORK_BUDGET_S`` for a parent with
    ``gib`` GiB of anonymous memory (default: this process's)."""
    gib = anon_gib() if gib is None else gib
    per_fork = FORK_S_PER_GIB * gib
    return 1 << 16 if per_fork <= 0 else int(FORK_BUDGET_S / per_fork)


def usable_procs(procs: Optional[int] = None) -> int:
    """Children a precompile may fork: ``procs`` (default ``tune_procs()``) within
    ``fork_limit()`` (a parent with a large memory footprint, a training process holding
    tens of GiB, gets fewer or none); 0 without ``os.fork``. Below 2: no precompile."""
    if not hasattr(os, "fork"):
        return 0
    return min(tune_procs() if procs is None else procs, fork_limit())
