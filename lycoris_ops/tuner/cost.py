"""A roofline-style cost model shared by the per-family planners.

A planner describes one candidate launch as a ``Work``: grid size, warps,
pipeline stages, the per-program register footprint (fp32 accumulators and other
register-resident values) and shared memory per stage, plus the totals the launch
moves and computes (DRAM bytes, tensor-core flops, FMA flops). ``estimate``
turns it into a predicted time on a ``DeviceFacts``:

1. occupancy: registers per thread = 40 + footprint / threads (spills above 255
   cost extra), allocated per warp in units of 256; shared memory per block =
   stages × stage bytes + the reserved bytes, rounded to the allocation unit;
   resident blocks per SM = min over registers, shared memory, threads and the
   block cap. A config that cannot be resident (or needs more shared memory per
   block than the opt-in maximum) is illegal: ``estimate`` returns None.
2. memory time: DRAM bytes over the bandwidth the resident programs can sustain:
   Little's law, bytes in flight (per program: stages × stage bytes with
   cp.async, one stage without) over the DRAM latency, capped at the measured
   bandwidth.
3. compute time: flops over the matmul peak (or the FMA rate when the dots cannot
   use tensor cores, e.g. IEEE fp32), scaled by the fraction of the GPU the grid
   keeps busy, wave-quantized: ``grid / (waves × slots)`` where a slot is one
   SM × the blocks it needs to saturate (8 warps), and by the dot tile size (a
   loop step's dot below 64x64x32 loses issue efficiency, cube-root falloff).
4. time = max(memory, compute) + the part pipelining cannot hide (none with
   cp.async and ≥ 2 stages; half with ≥ 2 resident blocks; all otherwise)
   + per-launch and per-wave overheads.

The model ranks configs; the timed shortlist decides. It deliberately ignores
L2 hit rates except through ``l2_reads`` helpers below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.keys import SENTINEL_EAGER, Plan, is_eager

__all__ = ["Work", "Estimate", "estimate", "total", "once_or_each", "eager_time", "pow2_between", "rank", "shortlist",
           "LAUNCH_S", "EAGER_LAUNCH_S", "make_plan", "make_shared_plan", "COMPILE_BUDGET", "MIN_FUSED",
           "STREAM_TILE_MAX", "predict", "fixed_first", "tl_stages", "tl_threads", "cdiv", "p2", "gemm_reads", "esize"]

#: host + launch overhead of one kernel launch (s)
LAUNCH_S = 3e-6
#: one eager torch op (dispatcher + launch), for the eager estimates (s)
EAGER_LAUNCH_S = 6e-6
#: block drain/refill overhead per wave (s)
WAVE_S = 0.4e-6
#: DRAM latency (s) for the bytes-in-flight model
DRAM_LATENCY_S = 0.8e-6
#: an SM draws at most this multiple of its fair share (1/sm_count) of the DRAM bandwidth:
#: a grid that keeps few SMs busy cannot stream at full rate, whatever it has in flight
SM_BW_SHARE = 2.0
#: fraction of tensor-core / FMA peak a well-fed kernel reaches
COMPUTE_EFF = 0.8
BASE_REGS = 40
MAX_REGS = 255
#: a dot of at least this M·N·K per loop step runs the tensor cores at full rate (smaller: cube-root falloff)
FULL_MMA_TILE = 64 * 64 * 32
#: shared memory a config may plan for: its estimate x this must fit the per-block maximum
SMEM_MARGIN = 1.15


@dataclass
class Work:
    """One launch (or a fixed sequence of launches sharing the same geometry)."""

    grid: int
    warps: int = 4
    stages: int = 1
    acc: int = 0  # fp32 accumulator elements per program (register tiles)
    regs: int = 0  # other 32-bit register-resident values per program
    smem: int = 0  # shared-memory bytes per pipeline stage
    dram: float = 0.0  # DRAM bytes moved (reads + writes)
    mma: float = 0.0  # dot flops
    fma: float = 0.0  # vector flops
    inflight: int = 0  # bytes one program has in flight per stage (default: smem, else dram/grid capped)
    launches: int = 1
    tc: bool = True  # the dots reach tensor cores (16-bit, tf32); False: IEEE fp32 on FMA units
    mma_tile: int = 0  # M·N·K of one dot in the main loop (0: unknown); small dots waste issue slots
    name: str = ""


@dataclass
class Estimate:
    time: float  # seconds
    limiter: str  # "dram", "mma", "fma" or "launch"
    resident: int  # blocks per SM
    regs: int  # registers per thread
    waves: int
    parts: Dict[str, float] = field(default_factory=dict)


def smem_fits(dev: DeviceFacts, nbytes: float) -> bool:
    """Whether ``nbytes`` of shared memory fit one block of ``dev`` with ``SMEM_MARGIN`` (the
    compiler adds its own scratch)."""
    return nbytes * SMEM_MARGIN <= dev.smem_per_block


def estimate(w: Work, dev: DeviceFacts) -> Optional[Estimate]:
    """Predicted time of ``w`` on ``dev`` (None: the config cannot run there)."""
    if w.grid <= 0:
        return Estimate(w.launches * LAUNCH_S, "launch", 0, 0, 0)
    threads = 32 * w.warps
    if threads > 1024 or w.warps < 1:
        return None
    regs = BASE_REGS + math.ceil((w.acc + w.regs) / threads)
    spill = max(0, regs - MAX_REGS)
    if spill > 2 * MAX_REGS:
        return None  # hopeless: register tile far beyond the file
    regs = min(regs, MAX_REGS)
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = dev.regs_per_sm // (w.warps * per_warp)
    smem_block = w.smem * max(1, w.stages)
    if not smem_fits(dev, smem_block):
        return None
    if smem_block:
        unit = dev.smem_unit
        alloc = math.ceil((smem_block + dev.smem_reserved) / unit) * unit
        by_smem = dev.smem_per_sm // alloc
    else:
        by_smem = dev.max_blocks_per_sm
    by_threads = dev.max_threads_per_sm // threads
    resident = min(by_regs, by_smem, by_threads, dev.max_blocks_per_sm)
    if resident <= 0:
        return None
    sm = dev.sm_count
    slots = resident * sm
    waves = math.ceil(w.grid / slots)
    per_sm = min(resident, math.ceil(w.grid / sm))  # programs an SM actually holds
    busy = min(sm, w.grid)
    # --- memory: Little's law on the bytes in flight
    pipelined = dev.cp_async and w.stages >= 2
    per_prog = w.inflight or w.smem or (w.dram / w.grid if w.dram else 0)
    per_prog = min(per_prog, w.dram / w.grid if w.dram else per_prog)
    depth = w.stages if pipelined else 1
    in_flight = busy * per_sm * per_prog * depth
    bw = min(dev.dram_bw, in_flight / DRAM_LATENCY_S) if in_flight > 0 else dev.dram_bw
    bw = min(bw, dev.dram_bw * SM_BW_SHARE * busy / sm)
    mem = w.dram / bw if w.dram else 0.0
    # --- compute: wave-quantized share of the peak
    need = max(1, math.ceil(8 / w.warps))  # blocks per SM that saturate an SM (8 warps)
    cslots = sm * min(resident, need)
    cwaves = math.ceil(w.grid / cslots)
    wave_eff = w.grid / (cwaves * cslots)
    tile_eff = min(1.0, (w.mma_tile / FULL_MMA_TILE) ** (1.0 / 3.0)) if w.mma_tile else 1.0
    mma_rate = (dev.mma_peak if w.tc else dev.fma_rate) * COMPUTE_EFF * wave_eff * tile_eff
    fma_rate = dev.fma_rate * COMPUTE_EFF * wave_eff
    comp_mma = w.mma / mma_rate if w.mma else 0.0
    comp_fma = w.fma / fma_rate if w.fma else 0.0
    comp = comp_mma + comp_fma
    if spill:
        comp *= 1.0 + spill / 64.0
        mem *= 1.0 + spill / 128.0
    hidden = 1.0 if pipelined else (0.5 if per_sm >= 2 else 0.0)
    t = max(mem, comp) + (1.0 - hidden) * min(mem, comp)
    t += w.launches * LAUNCH_S + waves * WAVE_S
    if mem >= comp:
        limiter = "dram"
    else:
        limiter = "mma" if comp_mma >= comp_fma and w.tc else "fma"
    return Estimate(t, limiter, resident, regs, waves, {"mem": mem, "compute": comp})


def total(works: Iterable[Work], dev: DeviceFacts) -> Optional[Estimate]:
    """Sum of the estimates of launches run one after the other (None if any is illegal)."""
    out = None
    for w in works:
        e = estimate(w, dev)
        if e is None:
            return None
        if out is None:
            out = Estimate(e.time, e.limiter, e.resident, e.regs, e.waves, dict(e.parts))
        else:
            out.time += e.time
            out.waves += e.waves
            out.resident = min(out.resident, e.resident)
            out.regs = max(out.regs, e.regs)
            for k, v in e.parts.items():
                out.parts[k] = out.parts.get(k, 0.0) + v
    if out is not None and out.parts:
        out.limiter = "dram" if out.parts.get("mem", 0) >= out.parts.get("compute", 0) else out.limiter
    return out


def once_or_each(nbytes: float, readers: int, dev: DeviceFacts) -> float:
    """DRAM bytes of an operand that ``readers`` programs each read whole: one DRAM read
    while it fits half of L2 (later readers hit L2), else one per reader."""
    if nbytes <= dev.l2_bytes / 2:
        return float(nbytes)
    return float(nbytes) * max(1, readers)


def eager_time(dev: DeviceFacts, steps: Sequence[Tuple[float, float]], *, tc: bool = True) -> float:
    """Rough time of an eager torch composition: ``steps`` = [(DRAM bytes, flops)] one per
    torch op (cuBLAS / elementwise at the roofline, plus dispatch overhead each)."""
    t = 0.0
    rate = dev.mma_peak if tc else dev.fma_rate
    for nbytes, flops in steps:
        t += max(nbytes / dev.dram_bw, flops / (rate * COMPUTE_EFF)) + EAGER_LAUNCH_S
    return t


def pow2_between(lo: int, hi: int) -> List[int]:
    """Powers of two in [lo, hi] (at least [lo])."""
    out, p = [], max(1, lo)
    while p <= max(lo, hi):
        out.append(p)
        p *= 2
    return out


def rank(configs: Iterable[dict], work: Callable[[dict], object], dev: DeviceFacts) -> List[Tuple[float, dict]]:
    """``[(predicted seconds, config)]`` of the legal configs, fastest first. ``work(cfg)``
    returns a Work, a list of Works (run in sequence), or None (illegal)."""
    out = []
    for i, cfg in enumerate(configs):
        w = work(cfg)
        if w is None:
            continue
        e = estimate(w, dev) if isinstance(w, Work) else total(w, dev)
        if e is None:
            continue
        grid = w.grid if isinstance(w, Work) else (w[0].grid if w else 0)
        out.append((e.time, grid, i, cfg))
    # near-ties (same 3 significant digits, e.g. all at the DRAM floor) go to the
    # config with fewer programs (bigger tiles: fewer loop steps and stores per byte)
    out.sort(key=lambda x: (float(f"{x[0]:.3g}"), x[1], x[2]))
    return [(t, c) for t, _, _, c in out]


#: an axis-diversity pick must be predicted within this factor of the model's best
DIVERSITY_MAX = 2.0


def shortlist(ranked: Sequence[Tuple[float, dict]], n: int = 6, tile_axes: Sequence[str] = (),
              extra: Sequence[dict] = ()) -> List[dict]:
    """Up to ``n`` configs from a ranking: one per tile shape (its best launch settings),
    the model's best first, then, axis by axis, the best config with a value of that
    axis not yet covered (if predicted within ``DIVERSITY_MAX`` of the best), then model
    order. ``extra`` configs (e.g. the launcher's fixed default) are appended when not
    already present (the list may then exceed n by their number)."""
    def tile(c):
        return tuple(c.get(a) for a in tile_axes) if tile_axes else _ckey(c)

    best_per_tile: Dict[tuple, dict] = {}
    order: List[dict] = []
    cap = ranked[0][0] * DIVERSITY_MAX if ranked else 0.0
    near: List[dict] = []
    for t, c in ranked:
        k = tile(c)
        if k not in best_per_tile:
            best_per_tile[k] = c
            order.append(c)
            if t <= cap:
                near.append(c)
    picked: List[dict] = []
    if order:
        picked.append(order[0])
    for axis in tile_axes:
        if len(picked) >= n:
            break
        seen = {p.get(axis) for p in picked}
        for c in near:
            if c.get(axis) not in seen:
                picked.append(c)
                break
    for c in order:
        if len(picked) >= n:
            break
        if c not in picked:
            picked.append(c)
    for e in extra:
        if e is not None and e not in picked:
            picked.append(e)
    return picked


def _ckey(c) -> str:
    return repr(sorted(c.items(), key=str))


#: the launcher's default goes first (the pick without timing) unless the model's best beats it by this
DEFAULT_MARGIN = 1.05


def make_plan(op: str, ranked: Sequence[Tuple[float, dict]], *, tile_axes: Sequence[str] = (), n: int = 5,
              default: Optional[dict] = None, default_s: Optional[float] = None, eager_s: Optional[float] = None):
    """The shortlist of an op: ``shortlist(ranked, n, tile_axes)`` plus the launcher's fixed
    default config (so the tuned pick is never worse than it), then ``SENTINEL_EAGER``,
    always: the model misjudged eager by 10x on the H200 (lora_tucker_fwd, bench/RESULTS.md
    2026-11-30), so whether eager wins is measured, never predicted. No legal config:
    eager alone.

    Order = the pick without timing (TUNE=off, capture, tracing) first: the model's best,
    except that the default (``default_s`` = its predicted time, None: unknown) goes first
    unless the model predicts a gain of more than ``DEFAULT_MARGIN``."""
    picked = shortlist(ranked, n, tile_axes, extra=[default] if default is not None else ())
    times = {}
    for t, c in ranked:
        times.setdefault(_ckey(c), t)
    if default is not None and default_s is not None:
        times[_ckey(default)] = default_s
    predicted = [times.get(_ckey(c), math.inf) for c in picked]
    best = ranked[0][0] if ranked else math.inf
    if default is not None and picked and picked[0] != default:
        # the default goes first (within DEFAULT_MARGIN of the best, or unknown) or second, so
        # it is among the candidates a cold key always tries (tune.tune_budget)
        first = default_s is None or default_s <= DEFAULT_MARGIN * best
        i = picked.index(default)
        picked.insert(0 if first else 1, picked.pop(i))
        predicted.insert(0 if first else 1, predicted.pop(i))
    picked.append(SENTINEL_EAGER)
    predicted.append(eager_s if eager_s is not None else math.inf)
    return Plan(op, picked, predicted)


#: distinct Triton compilations (kernel x constexprs x specialization x warps/stages) a cold
#: key's shortlist may cost: a cold key compiles every one of them (0.3-1.5 s each on the
#: H200 host; the tuner's worker threads overlap them only partly: Triton's front end holds
#: the GIL), and the target is <= 2 s per cold key
COMPILE_BUDGET = 8
#: fused candidates a shared-structure shortlist keeps even past the budget (+ eager: 5)
MIN_FUSED = 4
#: fp32 elements of the tiles one loop step of a streaming kernel holds (channel rows x
#: positions, summed over the streamed operands): the tf32x3 dots' compile time grows with
#: the tile (sm_90, ptxas: 0.3-0.9 s up to 4096 elements, 1.8 s at 8192, 5.5 s at 16384)
#: while the model predicts no gain from bigger ones (those streams are DRAM-bound)
STREAM_TILE_MAX = 4096


def make_shared_plan(op: str, ranked: Sequence[Tuple[float, dict]], *, kernels: Callable[[dict], Iterable],
                     structure: Optional[Callable[[dict], object]] = None, tile_axes: Sequence[str] = (),
                     n: int = 5, default: Optional[dict] = None, default_s: Optional[float] = None,
                     eager_s: Optional[float] = None, budget: int = COMPILE_BUDGET, min_fused: int = MIN_FUSED):
    """The shortlist of an op whose candidates launch several kernels (a main streaming kernel
    plus reductions, chain / factor-gradient kernels, Cayley or group-matrix launches), built
    so a cold key compiles few kernels (``make_plan`` otherwise).

    The first candidate is ``make_plan``'s (the launcher's default unless the model predicts a
    gain of more than ``DEFAULT_MARGIN``, else the model's best). Every other candidate has the
    first one's ``structure(cfg)`` (what decides the auxiliary kernels and their configs, e.g.
    the channel group of a chain kernel), so the auxiliary kernels compile once per key and the
    candidates differ in the main kernel's config. ``kernels(cfg)``: hashable identities of the
    distinct Triton compilations ``cfg`` launches (the launcher's config -> constexpr mapping).
    Candidates are taken in ``shortlist`` order (model's best per tile, axis diversity; then the
    other launch settings in model order) while the union of their kernels stays within
    ``budget`` (``min_fused`` of them in any case), up to ``n`` fused ones; one that adds no
    kernel (the same compiled launches) is skipped. The
    launcher's default goes second when it is not first and shares the structure; a default
    of another structure that is not first (predicted more than ``DEFAULT_MARGIN`` slower) is
    left out. ``SENTINEL_EAGER`` last, always."""
    times: Dict[str, float] = {}
    for t, c in ranked:
        times.setdefault(_ckey(c), t)
    if default is not None and default_s is not None:
        times[_ckey(default)] = default_s
    best = ranked[0][0] if ranked else math.inf
    default_first = default is not None and (default_s is None or default_s <= DEFAULT_MARGIN * best)
    first = default if default_first or not ranked else ranked[0][1]
    if first is None:
        return Plan(op, [SENTINEL_EAGER], [eager_s if eager_s is not None else math.inf])
    key = structure(first) if structure is not None else None

    def same(c) -> bool:
        return structure is None or structure(c) == key

    mine_ranked = [(t, c) for t, c in ranked if same(c)]
    order = shortlist(mine_ranked, len(ranked), tile_axes)  # one per tile, diversity first
    queue = ([default] if default is not None and not default_first and same(default) else []) + order
    queue += [c for _, c in mine_ranked]  # then other launch settings of the tiles, model order
    picked = [first]
    used = set(kernels(first))
    for c in queue:
        if len(picked) >= n:
            break
        if any(c == p for p in picked):
            continue
        mine = set(kernels(c))
        if mine <= used:
            continue
        if len(used | mine) > budget and len(picked) >= min_fused:
            continue
        picked.append(c)
        used |= mine
    predicted = [times.get(_ckey(c), math.inf) for c in picked]
    picked.append(SENTINEL_EAGER)
    predicted.append(eager_s if eager_s is not None else math.inf)
    return Plan(op, picked, predicted)


def tl_stages(dev: DeviceFacts, options: Sequence[int]) -> Tuple[int, ...]:
    """The pipeline depths of a TileLang space the device can use (at least the first)."""
    return tuple(s for s in dev.stages if s in options) or tuple(options[:1])


def tl_threads(options: Sequence[int], rows: int) -> List[int]:
    """The threads of a TileLang space usable with a ``rows``-row tile: sm_90's WGMMA issues
    per 128-thread warpgroup, one warpgroup per 64 rows, so 256 threads only with 128 rows."""
    return [t for t in options if t == 128 or rows >= 128]


def fixed_first(plan, fixed: dict):
    """``plan`` with the kernel's fixed config moved first: the TileLang shortlists'
    untimed pick (TUNE=off, capture, tracing) is the configuration the GPU parity tests run,
    not the model's guess."""
    i = plan.candidates.index(fixed)
    plan.candidates.insert(0, plan.candidates.pop(i))
    plan.predicted.insert(0, plan.predicted.pop(i))
    return plan


def add_before_eager(plan, cand) -> None:
    """Put ``cand`` into ``plan`` just before its eager sentinel (at the end without one),
    predicted as the plan's first candidate: a variant the model cannot separate from it,
    decided by timing alone (never the untimed pick)."""
    at = len(plan.candidates) - 1 if plan.candidates and is_eager(plan.candidates[-1]) else len(plan.candidates)
    plan.candidates.insert(at, cand)
    plan.predicted.insert(at, plan.predicted[0])


def add_second(plan, cand, predicted: float) -> None:
    """Put ``cand`` right after the plan's first candidate: the planner's first two are timed
    even on the tuner's sequential path (one thread: outputs over half of
    ``tune.PARALLEL_SCRATCH_BYTES``) once a cold key's compiles overrun the tune budget
    (``tune.tune_budget``), which a variant placed before eager may not be. The first (the
    untimed pick) stays first."""
    plan.candidates.insert(1, cand)
    plan.predicted.insert(1, predicted)


def tl_shortlist(op: str, cfgs, work, dev: DeviceFacts, fixed: dict, eager_s: float, tile_axes, n: int):
    """A TileLang shortlist: the kernel's fixed config first, then the model's best of ``cfgs``
    (``work`` scores them, ``tile_axes`` keep the picks diverse), eager where it could win."""
    return fixed_first(make_plan(op, rank(cfgs, work, dev), tile_axes=tile_axes, n=n, default=fixed,
                                 default_s=predict(work, fixed, dev), eager_s=eager_s), fixed)


def predict(work: Callable[[dict], object], cfg: Optional[dict], dev: DeviceFacts) -> Optional[float]:
    """Predicted seconds of one config through a planner's ``work`` function (None: illegal
    or no config)."""
    if cfg is None:
        return None
    try:
        w = work(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if w is None:
        return None
    e = estimate(w, dev) if isinstance(w, Work) else total(w, dev)
    return None if e is None else e.time


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def p2(n: int, lo: int = 1) -> int:
    """Next power of two >= max(n, lo)."""
    n = max(int(n), lo, 1)
    return 1 << (n - 1).bit_length()


def gemm_reads(nbytes: float, other_tiles: int, dev: DeviceFacts, reuse: int = 8) -> float:
    """DRAM bytes of a GEMM operand re-read by ``other_tiles`` tile columns: once while
    it fits half of L2, else once per ``reuse`` tiles (grouped launch order)."""
    if nbytes <= dev.l2_bytes / 2:
        return float(nbytes)
    return float(nbytes) * max(1.0, other_tiles / reuse)


def esize(dtype) -> int:
    """Bytes per element of a torch dtype (0 for None)."""
    return 0 if dtype is None else int(dtype.itemsize)
