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
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import precompile, tune
from .. import registry
from ..tilelang._common import BuildError

__all__ = ["BACKEND", "KERNEL", "key_parts", "run", "precompile_call", "stats"]

log = logging.getLogger("lycoris_ops.tune")

BACKEND = "tilelang"
#: the shortlist entry of the TileLang kernel (its fixed configuration)
KERNEL: Dict[str, Any] = {}
_front = tune.Front()
#: ops whose step-down for a kernel TileLang could not build was logged (once each)
_build_warned: set = set()
#: seconds the parent waits for the TileLang compile children before killing the rest
TIMEOUT_S = 120.0
_totals = {"calls": 0, "kernels": 0, "children": 0, "failures": 0, "seconds": 0.0}


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


def precompile_call(kernel: Callable, args: Sequence[Any], cands: Sequence[Any] = (KERNEL,),
                    kept: Optional[List[Any]] = None) -> int:
    """Build the TileLang kernels ``kernel(*args)`` would build with each candidate config of
    ``cands``, in forked children (when at least two, enabled, and not while compiling /
    capturing). Returns how many.

    ``kept`` (a list): receives the candidates whose kernels fit ONE round of children, in
    order (the first fused candidate and eager always): a candidate whose new kernels would
    take the count past the children is left out of the shortlist. A child builds its share
    one kernel after the other, so a second round doubles a cold call (the H200 host:
    boft_bwd's 14 kernels on 12 children, 13.1 s)."""
    procs = precompile.usable_procs()
    if procs < 2 or tune.unsafe_to_time():
        if kept is not None:
            kept.extend(cands)
        return 0
    from ..tilelang import _common

    t0 = time.perf_counter()
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
    if dropped:
        log.info("lycoris_ops tilelang: %d configs left out of a cold shortlist (one round of %d children): %s",
                 len(dropped), procs, dropped)
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


def run(op: str, kernel: Callable, args: Sequence[Any]):
    """``kernel(*args)`` (the TileLang op function, validated in-scope arguments), or the
    op's eager body where eager won this shape's timing or where TileLang could not build
    the chosen config's kernel (``BuildError``: TUNE=off, a guarded first pick, a stored
    row; logged once per op; a timed key never picks such a config)."""
    fk = _exact(op, args)
    choice = _front.get(fk)
    if choice is None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        eager = registry.eager(op)
        shortlist = []

        def cands():  # planned on a miss only (a table hit plans nothing)
            if not shortlist:
                precompile_call(kernel, args, candidates(op, args), kept=shortlist)
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
