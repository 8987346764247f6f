"""The TileLang tier's tile selection and measured step-down: each TileLang op function
against the op's eager body (and, where its family has a TileLang model, against other
tile configs), timed once per (device, op, operand size buckets, dtypes, flags).

The shortlist of a call:
* ops with a TileLang model (``TILELANG`` of ``plans/<family>.py``: the LoRA family's
  four ops, the tucker rebuild, LoHa's three, LoKr's six, ``add_scaled``, IA3, DoRA, diag-OFT's and BOFT's two each: 23 of the 23): the kernel's fixed config first
  (the untimed pick), the model's best tile configs (tile shape, pipeline stages,
  threads; the cost model of the family's Triton kernels with the names mapped) and
  ``SENTINEL_EAGER``; the op function gets the winner as ``cfg=``;
* calls without a model (an op outside ``MODEL_FAMILIES``, operands off CUDA): the
  kernel's one launch configuration (``{}``) and ``SENTINEL_EAGER``.

The tuner does the rest as for Triton (``tune.select_config``): best of three
device-time rounds after a check against eager, the winner memoized and stored in
``tuning.json`` under backend ``tilelang`` with the kernel file's source hash as version
(an edited kernel is timed again), nothing timed while compiling, exporting or capturing
a CUDA graph (the planner's first pick then runs, not stored), ``LYCORIS_KERNEL_TUNE=off``:
the planner's first pick (a kernel config, never eager). Where eager wins, the op runs
its eager body at that shape: the TileLang tier never runs a kernel a measurement
showed slower.

A cold forward call whose inputs need gradients also lists its backward's kernels
(``backward_pending``: the ``*_bwd`` calls ``autograd.backward_calls`` names, with stand-ins
of the outputs as their gradient, each through the TileLang op set with ``run`` listing its
cold shortlist's kernels) and builds them in forked children of their own, on the cores its
own children leave, without waiting (``AHEAD``); the backward's cold call waits for the
children building its kernels and loads what they built.

Before the first call of an exact signature builds anything, the TileLang kernels it
would build (``tilelang/_common.capturing``) are built at once in forked child
processes (``precompile.compile_forked``, as for Triton's cold keys; same
``LYCORIS_KERNEL_TUNE_PROCS`` and memory limit) into TileLang's disk cache, so the call
only loads them: a TileLang compile takes 3-10 s on the H200's host and an op's first
call builds up to 14. A child builds its share one after the other, so a cold shortlist
keeps only the configs whose kernels fit one round of children (the fixed config and
eager always).

Key: per tensor argument its dtype, rank and bucketed element count (``tune.bucket``:
the token count of an activation and the size of a weight land in one bucket with
their neighbours, which is enough for a two-way choice); per other argument its value,
except floats (γ, scales: they do not change the cost); for ops with a model also the
exact weight sizes (a tile choice is per layer shape).
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import precompile, tune
from .. import registry
from ..tilelang._common import BuildError

__all__ = ["BACKEND", "KERNEL", "key_parts", "run", "precompile_call", "backward_pending", "stats"]

log = logging.getLogger("lycoris_ops.tune")

BACKEND = "tilelang"
#: the shortlist entry of the TileLang kernel (its fixed configuration)
KERNEL: Dict[str, Any] = {}
_front = tune.Front()
#: ops whose step-down for a kernel TileLang could not build was logged (once each)
_build_warned: set = set()
#: seconds the parent waits for the TileLang compile children before killing the rest
TIMEOUT_S = 120.0
_totals = {"calls": 0, "kernels": 0, "children": 0, "failures": 0, "seconds": 0.0, "ahead_kernels": 0,
           "ahead_children": 0, "ahead_waits": 0}
#: ``LYCORIS_TILELANG_AHEAD=0`` (read at import): a forward's cold call does not build its
#: backward's kernels ahead (``backward_pending``)
AHEAD = os.environ.get("LYCORIS_TILELANG_AHEAD", "1").strip().lower() not in ("0", "off", "false", "no")
#: children building a backward's kernels ahead of its first call: pid -> (their kernel keys, deadline)
_ahead: Dict[int, Tuple[frozenset, float]] = {}
#: kernel keys ahead children built (a child that exited 0): a first call loads them from the disk cache
_built_ahead: set = set()
#: ``backward_pending``'s listing (thread-local): ``run`` adds a call's cold-shortlist kernels to it
_listing = threading.local()


def stats() -> Dict[str, float]:
    """Totals of this process's TileLang precompiles (first calls that built kernels in
    children, kernels, children, failed or killed children, seconds)."""
    return dict(_totals)


#: the families whose plans/<family>.py has TileLang models (``TILELANG``)
MODEL_FAMILIES = ("lora", "tucker", "loha", "lokr", "add", "ia3", "dora", "oft", "boft")
_models: Dict[str, Tuple[Callable, Callable]] = {}


def models() -> Dict[str, Tuple[Callable, Callable]]:
    """op -> (shortlist of a call: f(DeviceFacts, *args) -> Plan, exact sizes: f(*args))."""
    if not _models:
        for family in MODEL_FAMILIES:
            _models.update(importlib.import_module(f"{__package__}.{family}").TILELANG)
    return _models


def candidates(op: str, args: Sequence[Any]):
    """The shortlist of this call: the model's (CUDA operands, op with a model), else the
    kernel's one configuration and eager."""
    model = models().get(op)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if model is None or device.type != "cuda":
        return [KERNEL, tune.SENTINEL_EAGER]
    from .device import facts
    return model[0](facts(device), *args)


def _call(kernel: Callable, args: Sequence[Any], c):
    return kernel(*args, cfg=c) if c else kernel(*args)


def _shortlist_kernels(kernel: Callable, args: Sequence[Any], cands: Sequence[Any], procs: int,
                       kept: Optional[List[Any]]) -> Tuple[list, list]:
    """(the kernels the candidates of ``cands`` would build, the candidates left out): in order,
    a candidate is kept (appended to ``kept``) while its new kernels fit one round of ``procs``
    children (the first and eager always)."""
    from ..tilelang import _common

    pending, seen, dropped = [], set(), []
    with torch.no_grad():
        for c in cands:
            if tune.is_eager(c):
                if kept is not None:
                    kept.append(c)
                continue
            with _common.capturing() as listed:
                try:
                    _call(kernel, args, c)  # nothing is built or launched: the kernels are listed
                except Exception:
                    pass  # the real call reports it
            new = [p for p in listed if p.key not in seen]
            if kept is not None and pending and len(pending) + len(new) > procs:
                dropped.append(c)
                continue
            seen.update(p.key for p in new)
            pending.extend(new)
            if kept is not None:
                kept.append(c)
    return pending, dropped


def _reap_ahead(wait_for: Sequence[int] = (), wait_s: float = 0.0) -> None:
    """Collect the ahead children that exited (their kernel keys count as built when the child
    exited 0); wait up to ``wait_s`` for those of ``wait_for`` still running; a child past its
    deadline is killed."""
    end = time.monotonic() + wait_s
    while True:
        for pid, (keys, deadline) in list(_ahead.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: what it built is unknown
                done, status = pid, None
            if not done and time.monotonic() > deadline:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except OSError:
                    pass
                done, status = pid, None
            if done:
                del _ahead[pid]
                if status is not None and os.waitstatus_to_exitcode(status) == 0:
                    _built_ahead.update(keys)
        if not any(pid in _ahead for pid in wait_for) or time.monotonic() >= end:
            return
        time.sleep(precompile.POLL_S)


def precompile_call(kernel: Callable, args: Sequence[Any], cands: Sequence[Any] = (KERNEL,),
                    kept: Optional[List[Any]] = None, ahead: Sequence[Any] = ()) -> int:
    """Build the TileLang kernels ``kernel(*args)`` would build with each candidate config of
    ``cands``, in forked children (when at least two, enabled, and not while compiling /
    capturing). Returns how many.

    ``kept`` (a list): receives the candidates whose kernels fit ONE round of children, in
    order (the first fused candidate and eager always): a candidate whose new kernels would
    take the count past the children is left out of the shortlist. A child builds its share
    one kernel after the other, so a second round doubles a cold call (the H200 host:
    boft_bwd's 14 kernels on 12 children, 13.1 s).

    Kernels that children building ahead (``ahead`` of an earlier call) are building are waited
    for, then loaded, not built again. ``ahead`` (``backward_pending``'s kernels): built at the
    same time in children of their own on the cores this call leaves free, not waited for."""
    if _ahead:
        _reap_ahead()  # the ahead children that are done
    procs = precompile.usable_procs()
    if procs < 2 or tune.unsafe_to_time():
        if kept is not None:
            kept.extend(cands)
        return 0
    t0 = time.perf_counter()
    pending, dropped = _shortlist_kernels(kernel, args, cands, procs, kept)
    if dropped:
        log.info("lycoris_ops tilelang: %d configs left out of a cold shortlist (one round of %d children): %s",
                 len(dropped), procs, dropped)
    keys = {p.key for p in pending}
    busy = [pid for pid, (k, _) in _ahead.items() if k & keys]
    if busy:  # this call's kernels, started ahead by its forward: wait for them rather than build them twice
        _totals["ahead_waits"] += 1
        _reap_ahead(busy, TIMEOUT_S)
    pending = [p for p in pending if p.key not in _built_ahead]
    if ahead:  # on the cores this call's own children leave free
        spare = max(1, min(procs, precompile.cpus() - 1 - (len(pending) if len(pending) >= 2 else 0)))
        deadline = time.monotonic() + TIMEOUT_S
        forked = precompile.fork_builds(list(ahead), spare)
        for pid, share in forked:
            _ahead[pid] = (frozenset(p.key for p in share), deadline)
        _totals["ahead_kernels"] += sum(len(share) for _, share in forked)
        _totals["ahead_children"] += len(forked)
    if len(pending) < 2:
        return 0
    children, failures = precompile.compile_forked(pending, procs, timeout_s=TIMEOUT_S)
    spent = time.perf_counter() - t0
    for k, v in (("calls", 1), ("kernels", len(pending)), ("children", children), ("failures", failures),
                 ("seconds", spent)):
        _totals[k] += v
    log.info("lycoris_ops tilelang: %d kernels built in %d processes (%d failed), %.2f s", len(pending), children,
             failures, spent)
    return len(pending)


def _builds_ahead(args: Sequence[Any]) -> bool:
    """Whether this cold call builds its backward's kernels ahead: ``AHEAD``, a gradient will
    flow back through it (grad mode, an input that requires one), and children may be forked
    (not compiling or capturing, at least two)."""
    return AHEAD and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
        and not tune.unsafe_to_time() and precompile.usable_procs() >= 2


def _meta(a):
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) \
        else a


def backward_pending(op: str, args: Sequence[Any]) -> list:
    """The TileLang kernels the first backward of this forward call would build (the cold
    shortlist of each ``*_bwd`` call its autograd makes, ``autograd.backward_calls``, with
    stand-ins of the outputs as the gradient): for ``precompile_call(ahead=...)``. None of a
    call that would not take the TileLang tier or whose key is stored already, none built or
    being built ahead. A guess: [] on any error, never a failure of the forward."""
    from .. import autograd, select
    from ..tilelang import ops as tl_ops

    try:
        names = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with torch.no_grad():
            metas = getattr(torch.ops.lycoris, op)(*(_meta(a) for a in args))
            outs = [torch.empty(m.shape, dtype=m.dtype, device=device)
                    for m in (metas if isinstance(metas, (tuple, list)) else (metas,))]
        building = set().union(*(k for k, _ in _ahead.values())) if _ahead else set()
        pending, seen = [], set(building) | _built_ahead
        for bop, bargs in autograd.backward_calls(op, dict(zip(names, args)), outs):
            if select.explain(bop, *bargs) != BACKEND:
                continue
            _listing.pending = []
            try:
                with torch.no_grad():
                    getattr(tl_ops, bop)(*bargs)  # run() lists the call's cold-shortlist kernels
                listed = _listing.pending
            finally:
                _listing.pending = None
            for p in listed:
                if p.key not in seen:
                    seen.add(p.key)
                    pending.append(p)
        return pending
    except Exception as exc:  # a guess: the backward builds its own kernels when it comes
        log.debug("lycoris_ops tilelang: no kernels built ahead for %s: %s", op, exc)
        return []


def key_parts(args: Sequence[Any], op: str = "") -> Tuple[Tuple[str, Any], ...]:
    """The key parts of one call (see the module docstring)."""
    parts = []
    model = models().get(op) if op else None
    if model is not None:
        parts.append(("sizes", model[1](*args)))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            parts.append((f"t{i}", (str(a.dtype).replace("torch.", ""), a.dim(), tune.bucket(a.numel()))))
        elif isinstance(a, float):
            continue
        elif isinstance(a, (list, tuple)):
            parts.append((f"a{i}", tuple(a)))
        else:
            parts.append((f"a{i}", a))
    return tuple(parts)


def _exact(op: str, args) -> tuple:
    """The front-cache key: exact shapes and dtypes, the non-float arguments."""
    out = [op]
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.shape, a.dtype, a.device))
        elif not isinstance(a, float):
            out.append(tuple(a) if isinstance(a, list) else a)
    return tuple(out)


def _listed_only(op: str, kernel: Callable, args: Sequence[Any], listing: list) -> None:
    """``run`` under ``backward_pending``: the kernels this call's cold shortlist would build,
    added to ``listing`` (nothing where the call's choice is known: in this process or stored)."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    version = tune.source_version(sys.modules[kernel.__module__])
    if _front.get(_exact(op, args)) is not None or tune.stored(op, BACKEND, key_parts(args, op), device=device,
                                                               version=version):
        return
    pending, _ = _shortlist_kernels(kernel, args, candidates(op, args), precompile.usable_procs(), [])
    listing.extend(pending)


def run(op: str, kernel: Callable, args: Sequence[Any]):
    """``kernel(*args)`` (the TileLang op function, validated in-scope arguments), or the
    op's eager body where eager won this shape's timing or where TileLang could not build
    the chosen config's kernel (``BuildError``: TUNE=off, a guarded first pick, a stored
    row; logged once per op; a timed key never picks such a config).

    A cold call whose inputs need gradients also starts building its backward's kernels
    (``backward_pending``, ``AHEAD``), in children it does not wait for: its backward's first
    call then loads them instead of compiling (the first training step's compile time)."""
    listing = getattr(_listing, "pending", None)
    if listing is not None:
        return _listed_only(op, kernel, args, listing)
    fk = _exact(op, args)
    choice = _front.get(fk)
    if choice is None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        eager = registry.eager(op)
        shortlist = []

        def cands():  # planned on a miss only (a table hit plans nothing)
            if not shortlist:
                ahead = backward_pending(op, args) if _builds_ahead(args) else ()
                precompile_call(kernel, args, candidates(op, args), kept=shortlist, ahead=ahead)
            return shortlist

        choice = tune.select_config(
            op, BACKEND, key_parts(args, op), cands,
            lambda c: eager(*args) if tune.is_eager(c) else _call(kernel, args, c),
            device=device, version=tune.source_version(sys.modules[kernel.__module__]),
            reference=lambda: eager(*args), front=(_front, fk))
        if not shortlist and not tune.is_eager(choice):  # a stored or memoized choice: its kernels only
            precompile_call(kernel, args, [choice])
    if tune.is_eager(choice):
        return registry.eager(op)(*args)
    try:
        return _call(kernel, args, choice)
    except BuildError as exc:  # a kernel TileLang cannot build: this signature runs eager from now on
        _front[fk] = tune.SENTINEL_EAGER
        if op not in _build_warned:
            _build_warned.add(op)
            log.warning("lycoris_ops tilelang: %s runs its eager body here: %s", op, exc)
        return registry.eager(op)(*args)
