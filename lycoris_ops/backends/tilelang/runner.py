"""The TileLang tier's tile selection and measured step-down: each TileLang op function
against the op's eager body and other tile configs, timed once per (device, op, operand
size buckets, dtypes, flags).

The shortlist of a call (``candidates``): on CUDA operands, the family's ``TILELANG``
shortlist (``backends/tilelang/tuning/<family>.py``): the kernel's fixed config first (the
untimed pick), the model's best tile configs (tile shape, pipeline stages, threads; the
cost model of the family's Triton kernels with the names mapped) and ``SENTINEL_EAGER``;
the op function gets the winner as ``cfg=``. Elsewhere the kernel's one launch
configuration (``{}``) and ``SENTINEL_EAGER``.

The tuner does the rest as for Triton (``tune.select_config``): best of three device-time
rounds after a check against eager, the winner memoized and stored in ``tuning.json`` under
backend ``tilelang`` with the family's kernel files' source hash as version (an edited
kernel is timed again), nothing timed while compiling, exporting or capturing a CUDA graph
(the planner's first pick then runs, not stored), ``LYCORIS_KERNEL_TUNE=off``: the planner's
first pick (a kernel config, never eager). Where eager wins, the op runs its eager body at
that shape: the TileLang tier never runs a kernel a measurement showed slower.

A cold key's shortlist is built in the background (``DEFER``): its first call builds the
kernels of the planner's first config only (or its quick twin's, ``TL_QUICK``) and runs that
config, while lower-priority children (``BACKGROUND_NICE``) build the rest of the
shortlist; the key's first call after those children exit times the whole shortlist (its
kernels load from the disk cache, a fraction of a build) and stores the winner. Until then
the first config runs, unchecked as under TUNE=off. ``settle()`` waits for those children
(a benchmark's timed calls, ``lycoris_ops.warmup``). The cold call's wall time is then one
config's build, not a shortlist's.

A cold forward call whose inputs need gradients also lists its backward's kernels
(``backward_pending``: the ``*_bwd`` calls ``autograd.backward_calls`` names, with stand-ins
of the outputs as their gradient, each through ``run`` listing its cold shortlist's kernels)
and builds them in forked children of their own, once its own kernels are built (alone on
the cores, they are the call's wait), without waiting for them (``AHEAD``): the first
config's at the normal priority, the rest of each deferred shortlist in the background; the
backward's cold call waits for the children building its first config's kernels and loads
what they built.

Before the first call of an exact signature builds anything, the TileLang kernels it would
build (``common.capturing``) are built at once in forked child processes
(``build_pool.compile_forked``, as for Triton's cold keys; same
``LYCORIS_KERNEL_TUNE_PROCS`` and memory limit) into TileLang's disk cache, so the call only
loads them: a TileLang build takes seconds and an op's first call may build a dozen. A child
builds its share one after the other, so a cold shortlist keeps only the configs whose
kernels fit one round of children (the fixed config and eager always).

Key: per tensor argument its dtype, rank and bucketed element count (``tune.bucket``: the
token count of an activation and the size of a weight land in one bucket with their
neighbours, which is enough for a two-way choice); per other argument its value, except
floats (γ, scales: they do not change the cost); the exact weight sizes the family's
``TILELANG`` adds (a tile choice is per layer shape).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lycoris_ops import settings
from lycoris_ops import reference
from lycoris_ops._library import autograd
from lycoris_ops.backends import select
from lycoris_ops.backends.tilelang import common
from lycoris_ops.backends.tilelang.common import BuildError
from lycoris_ops.backends.tilelang.tuning import add, boft, dora, ia3, loha, lokr, lora, oft, tucker
from lycoris_ops.backends.triton import precompile
from lycoris_ops.tuner import build_pool
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.device import facts

__all__ = ["BACKEND", "KERNEL", "key_parts", "run", "precompile_call", "backward_pending", "settle", "stats"]

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
           "ahead_children": 0, "ahead_waits": 0, "deferred_keys": 0, "background_kernels": 0,
           "background_children": 0}
#: ``LYCORIS_TILELANG_AHEAD=0`` (read at import): a forward's cold call does not build its
#: backward's kernels ahead (``backward_pending``)
AHEAD = settings.get("LYCORIS_TILELANG_AHEAD")
#: ``LYCORIS_TILELANG_DEFER=0`` (read at import): a cold key's first call builds its whole
#: shortlist (what one round of children builds) and times it at once
DEFER = settings.get("LYCORIS_TILELANG_DEFER")
#: niceness of the children building what no call waits for yet (the rest of a deferred
#: shortlist): the first configs' builds, this call's and its backward's, keep the CPUs
BACKGROUND_NICE = 10
#: seconds a background child may take (it shares the CPUs at a low priority)
BACKGROUND_TIMEOUT_S = 600.0
#: seconds between two looks at a deferred key's children (its calls run the first config)
DEFER_POLL_S = 0.05
#: children building kernels no call of this process has waited for yet (a backward's ahead of
#: its first call, the rest of a deferred shortlist): pid -> (their kernel keys, deadline)
_ahead: Dict[int, Tuple[frozenset, float]] = {}
#: the pids of ``_ahead`` building in the background (``BACKGROUND_NICE``)
_background: set = set()
#: background kernels waiting for a child: at most ``usable_procs()`` background children run
#: at once (a model's first step meets dozens of cold keys), more are forked as they exit
_queue: List[Any] = []
#: kernel keys ahead children built (a child that exited 0): a first call loads them from the disk cache
_built_ahead: set = set()
#: ``backward_pending``'s listing (thread-local): ``run`` adds a call's cold-shortlist kernels to it
_listing = threading.local()


class _Deferred:
    """A cold key whose first config runs while children build the rest of its shortlist."""

    __slots__ = ("first", "keys", "next_look")

    def __init__(self, first, keys: frozenset):
        self.first, self.keys, self.next_look = first, keys, time.monotonic() + DEFER_POLL_S


#: exact call key -> _Deferred (a ``tune.Front``: emptied with the tuner's memo, ``tune.clear``)
_deferred: Dict[tuple, _Deferred] = tune.Front()


def stats() -> Dict[str, float]:
    """Totals of this process's TileLang precompiles (first calls that built kernels in
    children, kernels, children, failed or killed children, seconds)."""
    return dict(_totals)


#: the families' tuning modules (``backends/tilelang/tuning``): each a ``TILELANG`` table, its
#: ``LAUNCHERS`` and its kernels' ``SOURCES``
FAMILIES = (lora, tucker, loha, lokr, add, ia3, dora, oft, boft)
#: op -> (shortlist of a call: f(DeviceFacts, *args) -> Plan, exact sizes of its key: f(*args))
_models: Dict[str, Tuple[Callable, Callable]] = {op: m for f in FAMILIES for op, m in f.TILELANG.items()}
#: op -> the TileLang launcher its op function runs (schema arguments, ``cfg``)
LAUNCHERS: Dict[str, Callable] = {op: fn for f in FAMILIES for op, fn in f.LAUNCHERS.items()}
#: op -> the modules whose source hash versions its tuning rows
_SOURCES = {op: f.SOURCES for f in FAMILIES for op in f.TILELANG}
#: op -> its quick twin (``TL_QUICK``): cfg -> the config a deferred cold call runs instead of
#: the shortlist's first, the same tiles in a form that builds in a fraction of the time; the
#: whole shortlist (that first config too) then builds in the background
_quick: Dict[str, Callable] = dict(lora.TL_QUICK)


def models() -> Dict[str, Tuple[Callable, Callable]]:
    """op -> (shortlist of a call: f(DeviceFacts, *args) -> Plan, exact sizes: f(*args))."""
    return _models


def quick_twin(op: str) -> Optional[Callable]:
    """``_quick``'s twin of ``op``'s first config, or None."""
    return _quick.get(op)


def version(op: str) -> str:
    """The version of ``op``'s tuning rows: the source hash of its family's kernel modules and
    of the step-down body it is timed and checked against."""
    return tune.source_version(*_SOURCES[op], sys.modules[reference.step_down(op).__module__])


def candidates(op: str, args: Sequence[Any]):
    """The shortlist of this call: the model's (CUDA operands, op with a model), else the
    kernel's one configuration and eager."""
    model = _models.get(op)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if model is None or device.type != "cuda":
        return [KERNEL, tune.SENTINEL_EAGER]
    return model[0](facts(device), *args)


def _call(kernel: Callable, args: Sequence[Any], c):
    return kernel(*args, cfg=c) if c else kernel(*args)


def _shortlist_kernels(kernel: Callable, args: Sequence[Any], cands: Sequence[Any], procs: int,
                       kept: Optional[List[Any]], built: Optional[set] = None) -> Tuple[list, list]:
    """(the kernels the candidates of ``cands`` would build, the candidates left out): in order,
    a candidate is kept (appended to ``kept``) while its new kernels fit one round of ``procs``
    children (the first and eager always; ``kept`` None: none left out). Kernels of ``built``
    (keys: on disk already) are neither listed nor counted."""
    pending, seen, dropped = [], set(built or ()), []
    with torch.no_grad():
        for c in cands:
            if tune.is_eager(c):
                if kept is not None:
                    kept.append(c)
                continue
            with common.capturing() as listed:
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
    exited 0) and fork queued background kernels into the room they leave (``_pump``); wait up
    to ``wait_s`` for those of ``wait_for`` still running; a child past its deadline is killed."""
    end = time.monotonic() + wait_s
    while True:
        for pid, (keys, deadline) in list(_ahead.items()):
            done, code = build_pool.poll(pid)  # code None: reaped elsewhere, what it built is unknown
            if not done and time.monotonic() > deadline:
                build_pool.kill(pid)
                done, code = True, None
            if done:
                del _ahead[pid]
                _background.discard(pid)
                if code == 0:
                    _built_ahead.update(keys)
        if _queue:
            _pump()
        if not any(pid in _ahead for pid in wait_for) or time.monotonic() >= end:
            return
        time.sleep(build_pool.POLL_S)


def _building() -> set:
    """Keys of the kernels children are building ahead or in the background, or that wait for
    a background child."""
    keys = set().union(*(k for k, _ in _ahead.values())) if _ahead else set()
    keys.update(p.key for p in _queue)
    return keys


def _fork_ahead(kernels: Sequence[Any], children: int, nice: int, timeout_s: float) -> Tuple[int, int]:
    """Fork up to ``children`` children building ``kernels`` (at ``nice``), not waited for:
    their keys are in ``_ahead`` until they exit. Returns (children forked, their kernels)."""
    if not kernels:
        return 0, 0
    deadline = time.monotonic() + timeout_s
    forked = build_pool.fork_builds(list(kernels), children, nice=nice)
    for pid, share in forked:
        _ahead[pid] = (frozenset(p.key for p in share), deadline)
        if nice:
            _background.add(pid)
    return len(forked), sum(len(share) for _, share in forked)


def _pump(most: Optional[int] = None) -> None:
    """Fork the queued background kernels into the children that may still run
    (``usable_procs()`` at once, at most ``most`` now). Where no child can be forked, the
    queue is dropped: the calls that need those kernels build them."""
    room = build_pool.usable_procs() - len(_background)
    if most is not None:
        room = min(room, most)
    if room < 1 or not _queue:
        return
    kernels = list(_queue)
    _queue.clear()
    n, k = _fork_ahead(kernels, room, BACKGROUND_NICE, BACKGROUND_TIMEOUT_S)
    _totals["background_children"] += n
    _totals["background_kernels"] += k
    if n:  # the shares whose fork failed wait for the next room
        forked = _building()
        _queue.extend(p for p in kernels if p.key not in forked)


def precompile_call(kernel: Callable, args: Sequence[Any], cands: Sequence[Any] = (KERNEL,),
                    kept: Optional[List[Any]] = None, ahead: Sequence[Any] = (),
                    background: Sequence[Any] = ()) -> int:
    """Build the TileLang kernels ``kernel(*args)`` would build with each candidate config of
    ``cands``, in forked children (when at least two, enabled, and not while compiling /
    capturing). Returns how many.

    ``kept`` (a list): receives the candidates whose kernels fit ONE round of children, in
    order (the first fused candidate and eager always): a candidate whose new kernels would
    take the count past the children is left out of the shortlist. A child builds its share
    one kernel after the other, so a second round doubles a cold call. Kernels built by
    children of earlier calls do not count.

    Kernels that children building ahead (``ahead`` of an earlier call) are building are waited
    for, then loaded, not built again. ``ahead`` (``backward_pending``'s first-config kernels):
    built in children of their own once this call's kernels are built (a single one then in a
    child too), not waited for. ``background`` (the rest of deferred shortlists): the same, at
    ``BACKGROUND_NICE``."""
    if _ahead:
        _reap_ahead()  # the ahead children that are done
    procs = build_pool.usable_procs()
    if procs < 2 or tune.unsafe_to_time():
        if kept is not None:
            kept.extend(cands)
        return 0
    t0 = time.perf_counter()
    pending, dropped = _shortlist_kernels(kernel, args, cands, procs, kept, built=_built_ahead)
    if dropped:
        log.info("lycoris_ops tilelang: %d configs left out of a cold shortlist (one round of %d children): %s",
                 len(dropped), procs, dropped)
    keys = {p.key for p in pending}
    if _queue:  # queued for a background child: built by this call now
        _queue[:] = [p for p in _queue if p.key not in keys]
    busy = [pid for pid, (k, _) in _ahead.items() if k & keys]
    if busy:  # this call's kernels, started ahead by its forward: wait for them rather than build them twice
        _totals["ahead_waits"] += 1
        _reap_ahead(busy, BACKGROUND_TIMEOUT_S)
    pending = [p for p in pending if p.key not in _built_ahead]
    # this call's own kernels first, alone on the cores (the call waits for them: with the ahead
    # and background children building beside them they took much longer); one kernel in a
    # child too where children follow it (the call would build it itself, beside them)
    later = bool(ahead) or bool(background)
    forked = len(pending) >= 2 or (later and len(pending) == 1)
    if forked:
        children, failures = build_pool.compile_forked(pending, procs, timeout_s=TIMEOUT_S)
        spent = time.perf_counter() - t0
        for k, v in (("calls", 1), ("kernels", len(pending)), ("children", children), ("failures", failures),
                     ("seconds", spent)):
            _totals[k] += v
        log.info("lycoris_ops tilelang: %d kernels built in %d processes (%d failed), %.2f s", len(pending),
                 children, failures, spent)
    # then, not waited for: the first configs' kernels of the backward (its call will wait for
    # them), the background's on the cores left, at a lower priority
    spare = max(1, min(procs, build_pool.cpus() - 1))
    n_ahead, k = _fork_ahead(ahead, spare, 0, TIMEOUT_S)
    _totals["ahead_children"] += n_ahead
    _totals["ahead_kernels"] += k
    if background:
        building = _building() | _built_ahead | keys
        _queue.extend(p for p in background if p.key not in building)
        _pump(max(1, spare - n_ahead))
    return len(pending) if forked else 0


def settle(timeout_s: float = BACKGROUND_TIMEOUT_S) -> int:
    """Wait up to ``timeout_s`` for the children building ahead and in the background, so that
    the next call of each deferred key times its shortlist (a benchmark before its timed
    calls, ``tune.warmup``). Returns the keys whose next call will."""
    end = time.monotonic() + timeout_s
    while _ahead and time.monotonic() < end:  # the queue's kernels are forked as children exit
        _reap_ahead(list(_ahead), end - time.monotonic())
    _queue.clear()  # no child could be forked for them: their calls build them
    for d in list(_deferred.values()):
        d.next_look = 0.0
    return len(_deferred)


def _builds_ahead(args: Sequence[Any]) -> bool:
    """Whether this cold call builds its backward's kernels ahead: ``AHEAD``, a gradient will
    flow back through it (grad mode, an input that requires one), and children may be forked
    (not compiling or capturing, at least two)."""
    return AHEAD and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
        and not tune.unsafe_to_time() and build_pool.usable_procs() >= 2


def _meta(a):
    return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) \
        else a


def backward_pending(op: str, args: Sequence[Any]) -> Tuple[list, list]:
    """The TileLang kernels the first backward of this forward call would build (the cold
    shortlist of each ``*_bwd`` call its autograd makes, ``autograd.backward_calls``, with
    stand-ins of the outputs as the gradient), for ``precompile_call(ahead=..., background=...)``:
    (its first configs' kernels: what the backward's cold call waits for, the rest of its
    shortlists: what it defers, ``DEFER``). None of a call that would not take the TileLang
    tier or whose key is stored already, none built or being built ahead. A guess: ([], []) on
    any error, never a failure of the forward."""
    try:
        names = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with torch.no_grad():
            metas = getattr(torch.ops.lycoris, op)(*(_meta(a) for a in args))
            outs = [torch.empty(m.shape, dtype=m.dtype, device=device)
                    for m in (metas if isinstance(metas, (tuple, list)) else (metas,))]
        firsts, rests = [], []
        for bop, bargs in autograd.backward_calls(op, dict(zip(names, args)), outs):
            if select.explain(bop, *bargs) != BACKEND:
                continue
            _listing.pending = ([], [])
            try:
                with torch.no_grad():
                    run(bop, bargs)  # lists the call's cold-shortlist kernels
                first, rest = _listing.pending
            finally:
                _listing.pending = None
            firsts += first
            rests += rest
        seen = _building() | _built_ahead
        out = ([], [])
        for listed, into in ((firsts, out[0]), (rests, out[1])):  # a kernel in both: the first config's
            for p in listed:
                if p.key not in seen:
                    seen.add(p.key)
                    into.append(p)
        return out
    except Exception as exc:  # a guess: the backward builds its own kernels when it comes
        log.debug("lycoris_ops tilelang: no kernels built ahead for %s: %s", op, exc)
        return [], []


def key_parts(args: Sequence[Any], op: str = "") -> Tuple[Tuple[str, Any], ...]:
    """The key parts of one call (see the module docstring)."""
    parts = []
    model = _models.get(op) if op else None
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


def _first_and_rest(op: str, kernel: Callable, args: Sequence[Any], cands: Sequence[Any], procs: int,
                    built: Optional[set] = None) -> Tuple[list, list, Any]:
    """(the kernels of the config a deferred cold call runs, the shortlist's other kernels, that
    config): the call builds the first, the background the rest (``built``: keys on disk already,
    left out of both). The config is the first candidate, or its quick twin (``quick_twin``),
    behind which the whole shortlist builds."""
    twin = quick_twin(op) if cands and not tune.is_eager(cands[0]) else None
    head = twin(cands[0]) if twin else cands[0]
    first = _shortlist_kernels(kernel, args, [head], procs, None, built=built)[0]
    rest = _shortlist_kernels(kernel, args, cands if twin else cands[1:], procs, None,
                              built={p.key for p in first} | set(built or ()))[0]
    return first, rest, head


def _listed_only(op: str, kernel: Callable, args: Sequence[Any], listing: Tuple[list, list]) -> None:
    """``run`` under ``backward_pending``: the kernels this call's cold shortlist would build,
    added to ``listing`` (the first config's, the rest's: the cold call defers them; without
    ``DEFER`` all to the first, as many as one round of children builds; TUNE=off: the first
    config's only). Nothing where the call's choice is known: in this process or stored."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if _front.get(_exact(op, args)) is not None or tune.stored(op, BACKEND, key_parts(args, op), device=device,
                                                               version=version(op)):
        return
    cands, procs = list(candidates(op, args)), build_pool.usable_procs()
    if not tune.tuning_enabled():
        cands = cands[:1]
    if not (DEFER and tune.tuning_enabled()):
        listing[0].extend(_shortlist_kernels(kernel, args, cands, procs, [])[0])
        return
    first, rest, _ = _first_and_rest(op, kernel, args, cands, procs)
    listing[0].extend(first)
    listing[1].extend(rest)


def _defers(op: str, args: Sequence[Any], parts, device, ver) -> bool:
    """Whether this cold call defers its shortlist (``DEFER``): the key is neither memoized nor
    stored, it would be timed (tuning on, not compiling or capturing, not on a tuner worker)
    and children may be forked."""
    return DEFER and tune.tuning_enabled() and not tune.unsafe_to_time() and not tune.in_worker() \
        and build_pool.usable_procs() >= 2 and not tune.stored(op, BACKEND, parts, device=device, version=ver)


def _defer(op: str, kernel: Callable, args: Sequence[Any], fk: tuple):
    """A cold key's first call (``DEFER``): build the planner's first config's kernels, or its
    quick twin's (``quick_twin``; in children when two or more, or when children follow), start
    children building the rest of the shortlist in the background (and the backward's kernels,
    ``backward_pending``), and return that config for this call and the key's next ones until
    those children are done (``_deferred``). None (the call times its shortlist now) where
    nothing is left to build."""
    cands = list(candidates(op, args))
    if len(cands) < 2 or tune.is_eager(cands[0]):
        return None
    if _ahead:
        _reap_ahead()
    _, rest, first = _first_and_rest(op, kernel, args, cands, build_pool.usable_procs(), built=_built_ahead)
    if not rest:
        return None  # the rest is built: timed now
    ahead, behind = backward_pending(op, args) if _builds_ahead(args) else ([], [])
    precompile_call(kernel, args, [first], ahead=ahead, background=rest + behind)
    _deferred[fk] = _Deferred(first, frozenset(p.key for p in rest))
    _totals["deferred_keys"] += 1
    log.info("lycoris_ops tilelang: %s runs %s while %d kernels of its shortlist build", op, first, len(rest))
    return first


def _deferred_pick(fk: tuple, d: _Deferred):
    """The first config of deferred key ``fk`` while children build its shortlist (looked at
    every ``DEFER_POLL_S``; never timed while compiling or capturing); None once they are done
    (the key is no longer deferred: this call times the shortlist; a kernel a child failed to
    build is left to that call)."""
    now = time.monotonic()
    if now < d.next_look or tune.unsafe_to_time():
        return d.first
    d.next_look = now + DEFER_POLL_S
    if _ahead:
        _reap_ahead()
    if d.keys & _building():
        return d.first
    _deferred.pop(fk, None)
    return None


def run(op: str, args: Sequence[Any], kernel: Optional[Callable] = None):
    """``kernel(*args)`` (the op's launcher, ``LAUNCHERS[op]`` unless given; validated in-scope
    arguments), or the op's eager body where eager won this shape's timing or where TileLang could not build
    the chosen config's kernel (``BuildError``: TUNE=off, a guarded first pick, a stored
    row; logged once per op; a timed key never picks such a config).

    A cold key's first call builds and runs the planner's first config, the rest of its
    shortlist building in the background until a later call times it (``DEFER``). A cold call
    whose inputs need gradients also starts building its backward's kernels
    (``backward_pending``, ``AHEAD``), in children it does not wait for: its backward's first
    call then loads them instead of compiling (the first training step's compile time)."""
    kernel = kernel or LAUNCHERS[op]
    listing = getattr(_listing, "pending", None)
    if listing is not None:
        return _listed_only(op, kernel, args, listing)
    fk = _exact(op, args)
    choice = _front.get(fk)
    deferred = _deferred.get(fk) if choice is None and _deferred else None
    if deferred is not None:
        choice = _deferred_pick(fk, deferred)
    if choice is None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        parts, ver = key_parts(args, op), version(op)
        if deferred is None and _defers(op, args, parts, device, ver):  # deferred once at most
            choice = _defer(op, kernel, args, fk)
    if choice is None:
        eager = reference.step_down(op)
        shortlist = []

        def cands():  # planned on a miss only (a table hit plans nothing)
            if not shortlist:
                plan = list(candidates(op, args))
                ahead, behind = backward_pending(op, args) if _builds_ahead(args) else ([], [])
                if tune.tuning_enabled():
                    precompile_call(kernel, args, plan, kept=shortlist, ahead=ahead, background=behind)
                else:  # the planner's first pick runs: its kernels only
                    shortlist.extend(plan)
                    precompile_call(kernel, args, plan[:1], ahead=ahead, background=behind)
            return shortlist

        choice = tune.select_config(
            op, BACKEND, parts, cands,
            lambda c: eager(*args) if tune.is_eager(c) else _call(kernel, args, c),
            device=device, version=ver, reference=lambda: eager(*args), front=(_front, fk),
            prepare=precompile.precompile)
        if not shortlist and not tune.is_eager(choice):  # a stored or memoized choice: its kernels only
            precompile_call(kernel, args, [choice])
    if tune.is_eager(choice):
        return reference.step_down(op)(*args)
    try:
        return _call(kernel, args, choice)
    except BuildError as exc:  # a kernel TileLang cannot build: this signature runs eager from now on
        if fk not in _deferred:  # (a deferred key's timing call still picks among the configs that build)
            _front[fk] = tune.SENTINEL_EAGER
        if op not in _build_warned:
            _build_warned.add(op)
            log.warning("lycoris_ops tilelang: %s runs its eager body here: %s", op, exc)
        return reference.step_down(op)(*args)
