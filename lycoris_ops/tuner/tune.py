"""The tuner: pick each op's launch config once per (device, op, shape bucket, dtype),
by timing a short list of candidates ranked by the op's cost model.

Flow of ``select_config(op, backend, key_parts, candidates, run_candidate)``:

1. in-memory memo (one dict lookup) -> the config picked earlier in this process;
2. the table ``tuning.json`` under ``LYCORIS_KERNEL_CACHE_DIR`` (default
   ``~/.cache/lycoris_kernels``), read once per process -> a config picked by an
   earlier process: nothing is timed;
3. otherwise the shortlist (``candidates``: a ``Plan``, a list, or a callable
   returning one - only called on a miss) is timed (``timing.time_candidates``: first
   calls checked against the eager output, on worker threads on CUDA,
   ``LYCORIS_KERNEL_TUNE_THREADS``, default 8, after the caller's ``prepare`` hook;
   one after the other past ``LYCORIS_KERNEL_TUNE_BUDGET`` seconds of warm-up, default
   1.5, only the planner's first two fused candidates and eager are still tried; then
   rounds of device time). The winner is memoized and stored as a row of the table
   (merge with the rows on disk + atomic replace, see ``store.py``), and one line is
   logged (logger ``lycoris_ops.tune``: op, shape bucket, winner, time).

Deferred cold keys (``LYCORIS_KERNEL_TUNE_DEFER``, default off): where the backend registered a
deferrer (``register_deferrer``; Triton's builds the planner's first config's kernels and
starts low-priority children building the rest of the shortlist), a cold CUDA key's first
call runs that first config, unchecked as with tuning off, and so do the key's calls until
the children are done; the first call after that times the shortlist (its kernels load from
the disk cache) as in step 3. ``settle()`` waits for those children (a benchmark before its
timed calls, ``lycoris_ops.warmup``). The cold call then costs one config's compiles, not
a shortlist's compiles and timing. Off by default: a CUDA graph captured while a key is
deferred keeps its first config (nothing is timed during a capture), where a cold key used to
be tuned by the eager warm-up call before the capture; with it on, ``settle()`` and one more
eager step before capturing.

``SENTINEL_EAGER`` is a candidate like the others: if it wins, the op runs its
eager body at that shape and the row records ``"eager"``. Keys: ``keys.py``. Table file:
``{"version": 1, "rows": {key: row}}``; a corrupt file or another format version is
ignored with one warning.

Safety:
* never times while a CUDA graph is being captured or while ``torch.compile`` /
  ``torch.export`` traces: the planner's first candidate is used and neither
  memoized nor stored (the key is timed at the next safe call);
* ``LYCORIS_KERNEL_TUNE=off`` (or ``set_tuning(False)``): a key missing from the
  memo and the table takes the planner's first candidate, remembered for the
  process, never stored, timed once tuning is turned back on;
* no ``torch.cuda.empty_cache()``; scratch is one output set per call (candidates
  run on the caller's operands; outputs are fresh and dropped; the concurrent first
  calls hold one set per worker thread, at most ``timing.PARALLEL_SCRATCH_BYTES``
  together); a candidate that raises (compile error, out of resources) times as
  infinity; after an out-of-memory the winner is kept for the process only, not stored;
* selection is serialized by a re-entrant lock (a candidate being timed may
  itself select another key).

State of this process: the memo, the ``Front`` caches ops keep, the loaded tables and the
counters; ``clear()`` drops them (see its contract).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from lycoris_ops import settings
from lycoris_ops.tuner import device as _device
from lycoris_ops.tuner.keys import (SENTINEL_EAGER, Candidate, Plan, as_dict, bucket, is_eager, label, make_key,
                                    normalize_parts, shape_key, source_version)
from lycoris_ops.tuner.store import JsonTable, cache_dir
from lycoris_ops.tuner.timing import (TIE_MARGIN, Timer, cuda_timer, drop_flush_buffers, in_worker, mismatch,
                                      time_candidates, worker)

__all__ = [
    # keys.py / timing.py names the ops and backends use through this module
    "SENTINEL_EAGER", "Candidate", "Plan", "is_eager", "as_dict", "bucket", "shape_key", "make_key", "label",
    "source_version", "Timer", "cuda_timer", "mismatch", "in_worker", "worker", "TIE_MARGIN",
    # the selection
    "TABLE_VERSION", "select_config", "stored", "pick", "set_tuning", "tuning_enabled", "set_budget", "tune_budget",
    "set_timer", "tune_threads", "table", "table_path", "unsafe_to_time", "stats", "clear", "Front",
    "register_deferrer", "defer_enabled", "settle", "pending", "deferred_calls", "on_deferred_final",
]

log = logging.getLogger("lycoris_ops.tune")

TABLE_VERSION = 1
#: memo entries before the memo is emptied (bounded memory under shape churn)
MEMO_MAX = 1 << 16

ENV_TUNE = "LYCORIS_KERNEL_TUNE"
ENV_BUDGET = "LYCORIS_KERNEL_TUNE_BUDGET"
ENV_THREADS = "LYCORIS_KERNEL_TUNE_THREADS"
ENV_DEFER = "LYCORIS_KERNEL_TUNE_DEFER"
#: seconds between two looks at a deferred key's children (its calls run the first config)
DEFER_POLL_S = 0.05
#: device types whose cold keys may defer (tests add "cpu" with a fake deferrer)
DEFER_DEVICES = {"cuda"}
#: default seconds a cold key may spend compiling candidates before the rest are skipped
DEFAULT_BUDGET_S = settings.SETTINGS[ENV_BUDGET].default

_tuning: List[Optional[bool]] = [None]  # None: read LYCORIS_KERNEL_TUNE on next use
_budget: List[Optional[float]] = [None]  # None: read LYCORIS_KERNEL_TUNE_BUDGET on next use
_timer: List[Optional[Timer]] = [None]
_lock = threading.RLock()
_memo: Dict[tuple, "_Entry"] = {}
_tables: Dict[str, JsonTable] = {}
_fronts: List[dict] = []
_names: Dict[tuple, str] = {}
_stats = {"tuned": 0, "timer_calls": 0, "table_hits": 0, "first_pick": 0, "guarded": 0, "deferred": 0,
          "tune_s": 0.0}
#: backend -> deferrer(first_runs, rest_runs): a ``Background`` building the rest, or None (nothing to defer)
_deferrers: Dict[str, Callable[[list, list], Any]] = {}
#: memo key -> the deferred key's state while its shortlist builds
_pending: Dict[tuple, "_Pending"] = {}
#: per thread: calls answered with a deferred key's first config (``deferred_calls``)
_deferred_local = threading.local()
#: called after a deferred key got its final pick (``on_deferred_final``)
_final_hooks: List[Callable[[], Any]] = []


@dataclass
class _Entry:
    value: Any  # resolved config (or SENTINEL_EAGER)
    candidate: Candidate
    tuned: bool  # False: the planner's pick with tuning off (retimed when tuning is on again)


@dataclass
class _Pending:
    value: Any  # the resolved first config, run until the background is done
    background: Any  # ``.done() -> bool``, ``.wait(timeout_s)``, ``.cancel()``
    next_look: float = 0.0


# --------------------------------------------------------------------------- settings

def tuning_enabled() -> bool:
    """Whether missing keys are timed (``LYCORIS_KERNEL_TUNE``, read once; ``set_tuning``)."""
    t = _tuning[0]
    if t is None:
        t = _tuning[0] = settings.get(ENV_TUNE)
    return t


def set_tuning(enabled: Optional[bool]) -> bool:
    """Turn timing on/off for the process (``None``: re-read ``LYCORIS_KERNEL_TUNE``).
    Returns the previous state. Untuned picks made while off are timed at their next call."""
    previous = tuning_enabled()
    _tuning[0] = None if enabled is None else bool(enabled)
    _clear_fronts()
    return previous


def tune_threads() -> int:
    """Worker threads for the first calls of a cold key's candidates (0/1: none): their
    launches, output checks and the GIL-free parts of the compiles overlap."""
    return settings.get(ENV_THREADS)


def _parallel_ok(dev_id) -> bool:
    """Worker threads only for CUDA operands outside Triton's interpreter (which patches
    module state while it runs and is not thread-safe)."""
    return dev_id[0] == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def tune_budget() -> float:
    """Seconds of warm-up (compiles) a cold key may spend before lower-ranked candidates are
    skipped (the planner's first two and eager are always tried); 0 = no limit.
    ``LYCORIS_KERNEL_TUNE_BUDGET`` (default 1.5), ``set_budget``; ``warmup`` and its CLI
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


def defer_enabled() -> bool:
    """Whether cold keys may defer their shortlist (``LYCORIS_KERNEL_TUNE_DEFER``)."""
    return settings.get(ENV_DEFER)


def register_deferrer(backend: str, deferrer: Optional[Callable[[list, list], Any]]) -> None:
    """``deferrer(first_runs, rest_runs)`` for ``backend``'s cold keys (None: remove):
    ``first_runs`` is the planner's first config's call, ``rest_runs`` the other fused
    candidates' calls; it readies the first's kernels and returns a handle on what builds the
    rest (``done()``, ``wait(timeout_s)``, ``cancel()``), or None when nothing is left to build
    (the key is timed at once). The tuner core imports no backend: a backend registers itself."""
    if deferrer is None:
        _deferrers.pop(backend, None)
    else:
        _deferrers[backend] = deferrer


def deferred_calls() -> int:
    """Selections this thread answered with a deferred key's first config (not its final pick):
    a launch recorder compares it before and after a call, and records none of such a call."""
    return getattr(_deferred_local, "n", 0)


def _count_deferred() -> None:
    _deferred_local.n = deferred_calls() + 1


def on_deferred_final(hook: Callable[[], Any]) -> None:
    """Call ``hook()`` each time a deferred key gets its final pick (the C++ launch replay
    forgets its plans: the calls that ran the key's first config were not recorded)."""
    if hook not in _final_hooks:
        _final_hooks.append(hook)


def pending() -> int:
    """Keys whose calls run their first config while their shortlist builds."""
    return len(_pending)


def settle(timeout_s: float = 600.0) -> int:
    """Wait up to ``timeout_s`` for the deferred keys' background builds, so that each key's
    next call times its shortlist (a benchmark before its timed calls, ``warmup``). Returns
    the keys whose next call will."""
    end = time.monotonic() + timeout_s
    with _lock:
        waiting = list(_pending.values())
    for p in waiting:
        p.background.wait(max(0.0, end - time.monotonic()))
        p.next_look = 0.0
    return len(waiting)


def set_timer(timer: Optional[Timer]) -> Optional[Timer]:
    """Replace the timer (``timer(fn, candidate) -> seconds per call`` for one round);
    ``None`` restores CUDA-event timing. Returns the previous one."""
    previous = _timer[0]
    _timer[0] = timer
    return previous


def table_path() -> str:
    return os.path.join(cache_dir(), "tuning.json")


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
    """Forget what this process picked, as in a fresh process (the files are untouched):
    the memo and every ``Front`` cache; by default also the loaded tuning tables (re-read
    from disk at the next lookup), the budget set by ``set_budget`` (the environment is
    read again) and the counters. The tuning switch (``set_tuning``), the timer
    (``set_timer``) and the device facts (``device.clear``) are kept."""
    with _lock:
        _memo.clear()
        _clear_fronts()
        for p in _pending.values():  # a deferred key's children: no call will wait for them
            p.background.cancel()
        _pending.clear()
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


def unsafe_to_time() -> bool:
    """True while ``torch.compile``/``torch.export`` traces or a CUDA graph is captured."""
    return _device.unsafe_to_measure()


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
    parts = normalize_parts(key_parts)
    entry = _memo.get((dev_id, backend, op, version, parts))
    if entry is not None and entry.tuned:
        return True
    return _row_candidate(table().get(make_key(_device_name(dev_id), backend, op, version, parts))) is not None


def select_config(op: str, backend: str, key_parts, candidates, run_candidate: Callable[[Candidate], Any], *,
                  device=None, version=0, resolve: Optional[Callable[[dict], Any]] = None,
                  timer: Optional[Timer] = None, validate: Optional[Callable[[Candidate], bool]] = None,
                  check: bool = True, reference: Optional[Callable[[], Any]] = None,
                  front: Optional[Tuple[dict, Any]] = None, prepare: Optional[Callable[[list], Any]] = None):
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
    to fill. ``prepare(runs)``: called before the parallel first calls with one no-argument
    call per fused candidate (a backend compiling their kernels ahead, e.g. in child
    processes).

    Returns the resolved winner, or ``SENTINEL_EAGER``.
    """
    dev_id = _device_id(device)
    parts = normalize_parts(key_parts)
    mkey = (dev_id, backend, op, version, parts)
    entry = _memo.get(mkey)
    if entry is None or not (entry.tuned or not tuning_enabled()):
        if in_worker():  # inside a candidate's first call on a tuner worker: no lock, no timing
            _stats["guarded"] += 1
            return _resolve(resolve, _candidates(candidates)[0])
        with _lock:
            return _select_locked(op, backend, candidates, run_candidate, dev_id, parts, mkey, version, resolve,
                                  timer, validate, check, reference, front, prepare)
    if front is not None:  # another exact shape of the same bucket
        front[0][front[1]] = entry.value
    return entry.value


def _select_locked(op, backend, candidates, run_candidate, dev_id, parts, mkey, version, resolve, timer, validate,
                   check, reference, front, prepare):
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
    waiting = _pending.get(mkey)
    if waiting is not None:  # a deferred key: its first config until the background is done
        now = time.monotonic()
        if now < waiting.next_look or unsafe_to_time() or in_worker() or not waiting.background.done():
            if now >= waiting.next_look:
                waiting.next_look = now + DEFER_POLL_S
            _count_deferred()
            return waiting.value
        del _pending[mkey]  # built: timed below, its kernels loaded from the disk cache
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
    if waiting is None:
        value = _defer(op, backend, cands, run_candidate, dev_id, skey, mkey, resolve)
        if value is not None:
            return value
    t0 = time.perf_counter()
    # the operands' GPU current while timing (events and launches on its current stream)
    on_device = torch.cuda.device(dev_id[1]) if dev_id[0] == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), on_device:
        res = time_candidates(cands, run_candidate, use_timer or cuda_timer, check, reference, tune_budget(),
                              tune_threads() if _parallel_ok(dev_id) else 0, prepare)
    drop_flush_buffers()
    winner, best, errors, oom, skipped = res.winner, res.best, res.errors, res.oom, res.skipped
    _stats["timer_calls"] += res.timer_calls
    spent = time.perf_counter() - t0
    _stats["tune_s"] += spent
    _stats["tuned"] += 1
    for i, why in errors.items():
        log.warning("lycoris_ops tune: %s [%s] candidate %s failed: %s", op, skey.rsplit("|", 1)[-1],
                    label(cands[i]), why)
    if waiting is not None:  # a deferred key's final pick follows
        for hook in _final_hooks:
            hook()
    if winner < 0:  # every candidate failed: the planner's pick for this process, not stored
        value = _resolve(resolve, cands[0])
        _memoize(mkey, _Entry(value, cands[0], True), front)
        log.warning("lycoris_ops tune: %s [%s]: no candidate ran; using %s for this process",
                    op, skey.rsplit("|", 1)[-1], label(cands[0]))
        return value
    c = cands[winner]
    value = _resolve(resolve, c)
    row = {"config": c, "ms": round(best[winner] * 1e3, 6),
           "times": {label(cands[i]): round(t * 1e3, 6) for i, t in sorted(best.items())},
           "tuned_s": round(spent, 3), "torch": torch.__version__}
    if errors:
        row["failed"] = {label(cands[i]): why[:200] for i, why in errors.items()}
    if skipped:
        row["skipped"] = [label(cands[i]) for i in skipped]  # past the time budget
    if not oom:
        tab.put(skey, row)
    _memoize(mkey, _Entry(value, c, True), front)
    log.info("lycoris_ops tune: %s [%s] -> %s %.4f ms (%d candidates, %.2f s)%s", op,
             skey.rsplit("|", 1)[-1], label(c), best[winner] * 1e3, len(cands) - len(skipped), spent,
             " (not stored: out of memory during timing)" if oom else "")
    return value


def _defer(op, backend, cands, run_candidate, dev_id, skey, mkey, resolve):
    """A cold key's first call under ``LYCORIS_KERNEL_TUNE_DEFER``: the backend's deferrer
    readies the first config and builds the rest of the shortlist in the background; returns
    the resolved first config (this call's and the key's until then), or None (time now)."""
    deferrer = _deferrers.get(backend)
    fused = [c for c in cands[1:] if not is_eager(c)]
    if (deferrer is None or dev_id[0] not in DEFER_DEVICES or not defer_enabled() or is_eager(cands[0])
            or not fused):
        return None
    try:
        background = deferrer([lambda: run_candidate(cands[0])], [lambda c=c: run_candidate(c) for c in fused])
    except Exception as exc:  # an optimization only: the key is timed now
        log.warning("lycoris_ops tune: %s: deferring its shortlist failed (%s: %s); timing it now", op,
                    type(exc).__name__, exc)
        return None
    if background is None:
        return None
    value = _resolve(resolve, cands[0])
    _pending[mkey] = _Pending(value, background, time.monotonic() + DEFER_POLL_S)
    _stats["deferred"] += 1
    _count_deferred()
    log.info("lycoris_ops tune: %s [%s] runs %s while %d candidates build", op, skey.rsplit("|", 1)[-1],
             label(cands[0]), len(fused))
    return value


def pick(op: str, backend: str, key_parts, plan, run_fused: Callable[[Any], Any], run_eager: Callable[[], Any], *,
         device, version, resolve: Callable[[dict], Any], front: Optional[Tuple[dict, Any]] = None,
         prepare: Optional[Callable[[list], Any]] = None):
    """``select_config`` for the usual op: ``run_fused(resolve(c))`` runs a tile config,
    ``run_eager()`` the eager body (also the reference every fused candidate's output is
    checked against while timing); ``prepare`` as ``select_config``'s. Returns the
    resolved winner or ``SENTINEL_EAGER``."""
    def run(c):
        return run_eager() if is_eager(c) else run_fused(resolve(c))

    return select_config(op, backend, key_parts, plan, run, device=device, version=version, resolve=resolve,
                         reference=run_eager, front=front, prepare=prepare)


