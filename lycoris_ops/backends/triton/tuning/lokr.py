"""Cost models and tuned launch configs of the Triton LoKr kernels
(``lycoris_ops/backends/triton/kernels/lokr.py``): the Kronecker merges (``lokr_full_merge_fwd``,
``lokr_merge_fwd``) and their backward (``lokr_full_merge_bwd``,
``lokr_merge_bwd``), ``lokr_bypass_fwd``, ``lokr_bypass_bwd``.

Merges: program = a (block_m x block_n) tile of the *tile* factor (w2, or w1
with ``swap``) times a range of entries of the *loop* factor; write-bound:
a·b·c·d outputs. The stores of one tile are contiguous runs of the tile's
column count when w2 is tiled, single elements (stride d) when w1 is: runs
shorter than a 32-byte sector cost a whole sector. Backward: the same program
layout reading G, plus fp32 partials and reduce / chain launches.

Bypass forward: program = (block_t tokens, block_c of c): Z = X·w2ᵀ
(bt·pow2(b) x bc, fp32, hi/lo 16-bit dots) then Y = γ·w1·Z per block_a of a;
``swap`` runs the transposed contraction. Register tile bt·pow2(b)·bc <= 16384.
Bypass backward: persistent programs over token tiles, one pass (gx, g_w1,
g_w2) or two (``passes``), fp32 partials per program + reduce launches.

TileLang (``TILELANG``, ``backends/tilelang/runner.py``): ``backends/tilelang/kernels/lokr.py``'s merge output tile
(TL_KRON: also the streamed form, a tile of w2 a program, its base blocks in registers or a
3-stage pipeline), gradient tile (TL_GRADS: also the one-pass form, registers or a 3-stage
pipeline; its model is the Triton one-pass program's, the two-pass form's adds a G read)
and bypass token rows (TL_BYPASS), each with its threads, scored by the models above with
the names mapped; only configs that build kernels of their own and fit shared memory and
registers (``tl_configs``); the fixed config first.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math

import torch

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import fusedkit, lokr as kernels
from lycoris_ops.reference import lokr as reference
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import (Work, add_second, cdiv, esize, make_plan, make_shared_plan, p2, predict, rank, smem_fits, tl_shortlist)
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import lokr as models
from lycoris_ops.backends.triton.tuning.oft import TL_ACC_PER_THREAD

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, fusedkit)


# =============================================================================== merges

def _merge_configs(dev: DeviceFacts, a, b, c, d, r1, r2, grad):
    out = []
    for swap in (False, True):
        M1, N1, _, _ = models.merge_geometry(a, b, c, d, swap)
        for bm in (16, 32, 64, 128):
            if bm > max(16, p2(M1)):
                continue
            for bn in (16, 32, 64, 128):
                if bn > max(16, p2(N1)) or bm * bn > 8192:
                    continue
                for w in (2, 4, 8):
                    for s in ((1, 2) if not grad else (1,)):
                        out.append(dict(block_m=bm, block_n=bn, block_r=16 if max(r1, r2) <= 16 else 32,
                                        block_rl=16 if max(r1, r2) <= 16 else 32, split=0, swap=swap,
                                        num_warps=w, num_stages=s))
    return out


def plan_merge(op: str, dev: DeviceFacts, a: int, b: int, c: int, d: int, r1: int, r2: int, compute, out_dtype,
               base_dtype, *, grad: bool = False, default=None, n: int = 5):
    """``lokr_(full_)merge_fwd`` (grad False; out/base dtypes) or ``..._bwd`` (grad True; out = G)."""
    e, eo, eb = esize(compute), esize(out_dtype), esize(base_dtype)

    def work(cfg):
        return models.merge_works(dev, cfg, a, b, c, d, r1, r2, e, eo, eb, grad)

    ranked = rank(_merge_configs(dev, a, b, c, d, r1, r2, grad), work, dev)
    eager_s = models.merge_eager(dev, a, b, c, d, r1, r2, compute, eo, eb, grad)
    if not grad:
        return make_plan(op, ranked, tile_axes=("swap", "block_m", "block_n"), n=n, default=default,
                         default_s=predict(work, default, dev), eager_s=eager_s)

    def compiles(cfg):  # the Triton compilations (backends/triton/kernels/lokr.py merge_bwd; the reductions' counts unspecialized)
        swap = bool(cfg["swap"])
        M1, N1, M2, N2 = models.merge_geometry(a, b, c, d, swap)
        rt, rl = (r1, r2) if swap else (r2, r1)
        n_tiles, E = cdiv(M1, cfg["block_m"]) * cdiv(N1, cfg["block_n"]), M2 * N2
        split = max(1, min(cdiv(4 * dev.sm_count, n_tiles), E, kernels._grad_split_cap(E, rt, M1, N1)))
        grad_kernel = ("kron_grad", swap, cfg["block_m"], cfg["block_n"], cfg["block_r"], cfg["block_rl"],
                       cfg["num_warps"], cfg["num_stages"])
        reduces, chains = [], []
        for side, fact, parts in (("tile", rt, split), ("loop", rl, n_tiles)):
            if fact:  # g_a = (Σ partials)·bᵀ, g_b = aᵀ·(Σ partials), after a presum of a deep stack
                chains.append(side)
                if kernels._presums(parts, *((M1, N1) if side == "tile" else (M2, N2))):
                    reduces.append(side)
            elif parts > 1:
                reduces.append(side)
        dims = [(M1, N1, rt) if side == "tile" else (M2, N2, rl) for side in chains]
        if kernels._chain_fuses(n_tiles * split, len(reduces), dims):  # the chains inside the one program
            return {grad_kernel + ("chain",)}
        out = {grad_kernel}
        if reduces:  # two reduces share one launch (_fusedkit.reduce_pair_launch)
            out.add(("reduce", *reduces, swap))
        if chains:  # both sides factorized: one launch (_fusedkit.chain_pair_launch)
            out.add(("chain", *chains, swap))
        return out

    # the candidates share the tiled side (swap): the partial reductions / factor-gradient
    # GEMMs after the main kernel compile once per key
    return make_shared_plan(op, ranked, kernels=compiles, structure=lambda cfg: bool(cfg["swap"]),
                            tile_axes=("block_m", "block_n"), n=n, default=default,
                            default_s=predict(work, default, dev), eager_s=eager_s)


# =============================================================================== bypass

def plan_bypass_fwd(dev: DeviceFacts, T: int, a: int, b: int, c: int, d: int, compute, x_dtype, out_dtype,
                    has_base: bool, *, default=None, n: int = 5):
    work, eager_s = models.fwd_model(dev, T, a, b, c, d, compute, x_dtype, out_dtype, has_base)
    # split False (16-bit): Z = X_t·w2ᵀ rounded to 16 bits before w1·Z, where eager rounds it
    # (one dot instead of the hi/lo pair's two); the default keeps Z unrounded, and the
    # tuner checks every candidate against eager
    splits = (True,) if compute == torch.float32 else (True, False)
    cfgs = [dict(block_t=bt, block_d=bd, block_c=bc, block_a=min(models.p16(c if sw else a), 64), split=sp, swap=sw,
                 num_warps=w, num_stages=s)
            for sw in (False, True) for bt in (1, 2, 4, 8, 16) if bt <= max(1, p2(T))
            for bc in (16, 32, 64, 128) for bd in (16, 64) for w in (4, 8) for s in (1, 2) for sp in splits]
    plan = make_plan("lokr_bypass_fwd", rank(cfgs, work, dev), tile_axes=("swap", "block_t", "block_c", "block_d"),
                     n=n, default=default, default_s=predict(work, default, dev), eager_s=eager_s)
    if len(splits) > 1 and not any(isinstance(c, dict) and c["split"] is False for c in plan.candidates):
        # the model ties the two where memory bounds the tile: time the twin of its best config,
        # second, where the sequential path's tune budget never skips it (H200, 32768 tokens,
        # 64x64, bf16, no base: 0.165 ms against 0.367 for the launcher default)
        best, t = next(((c, t) for c, t in zip(plan.candidates, plan.predicted)
                        if isinstance(c, dict) and math.isfinite(t)), (None, math.inf))
        if best is not None:
            add_second(plan, dict(best, split=False), t)
    return plan


def plan_bypass_bwd(dev: DeviceFacts, T: int, a: int, b: int, c: int, d: int, compute, x_dtype, g_dtype, *,
                    default=None, n: int = 5):
    work, eager_s = models.bwd_model(dev, T, a, b, c, d, compute, x_dtype, g_dtype, grid=kernels.bwd_grid,
                                     reduce_block=fusedkit.reduce_block)
    # 16-bit: 4 warps only (8 were 1.5-3x slower at every setting the H200 timed, which
    # the model cannot see: triton/lokr.bwd_grid); programs 0 = the launcher's two per
    # SM at 4 warps, sm_count = one. split False: H and P rounded to 16 bits as eager rounds
    # them (5 dots a tile instead of 8: 0.28 against 0.39 ms at 32768 tokens, 64x64, bf16);
    # the default keeps them unrounded, and the tuner checks every candidate against eager
    f32 = compute == torch.float32
    warps, splits = ((4, 8), (True,)) if f32 else ((4,), (True, False))
    cfgs = [dict(block_t=bt, passes=p, programs=pr, split=sp, swap=sw, num_warps=w, num_stages=s)
            for sw in (False, True) for bt in (1, 2, 4, 8, 16) if bt <= max(1, p2(T))
            for p in (1, 2) for w in warps for s in (1, 2) for pr in ((0, dev.sm_count) if w == 4 else (0,))
            for sp in splits]
    return make_plan("lokr_bypass_bwd", rank(cfgs, work, dev), tile_axes=("programs", "swap", "block_t", "passes"),
                     n=n, default=default, default_s=predict(work, default, dev), eager_s=eager_s)


# =============================================================================== TileLang models

#: ``backends/tilelang/kernels/lokr.py``'s launch configs: the Kronecker build's (BM x BN) output tile and threads
#: (TL_KRON, tiles of TL_KRON_TILE elements: the merge forwards), the gradient kernels' most
#: tile elements and threads (TL_GRADS: the merge backwards), the bypass kernels' most token
#: rows per program and most threads (TL_BYPASS; a kernel takes 256 only where its GEMMs have
#: >= 128 rows: ``tilelang/lokr._threads``). ``tl_configs`` keeps a config when it builds
#: kernels of its own (not the fixed config's, not an earlier config's) that fit
#: (``tl_fits``); the corners compile for sm_90a (tests/test_tilelang_lokr.py)
TL_KRON = dict(BM=(16, 32, 64), BN=(64, 128, 256), threads=(128, 256), stream=(False, True), stages=(0, 3))
TL_KRON_TILE = (2048, 8192)
TL_GRADS = dict(elems=(2048, 4096, 8192), threads=(128, 256), one_pass=(False, True), stages=(0, 3))
TL_BYPASS = dict(rows=(64, 128, 256), threads=(128, 256))
TL_N = 3
#: fp32 elements a gradient-kernel thread owns at least (one 16-byte vector)
TL_GRAD_MIN_PER_THREAD = 4
#: op -> (its space, the name of its fixed config in backends/tilelang/kernels/lokr.py, the shortlist's tile axes)
_TL_SPACES = {
    "lokr_full_merge_fwd": (TL_KRON, "KRON", ("stream", "stages", "BM", "BN")),
    "lokr_merge_fwd": (TL_KRON, "KRON", ("stream", "stages", "BM", "BN")),
    "lokr_full_merge_bwd": (TL_GRADS, "GRADS", ("one_pass", "stages", "elems")),
    "lokr_merge_bwd": (TL_GRADS, "GRADS", ("one_pass", "stages", "elems")),
    "lokr_bypass_fwd": (TL_BYPASS, "BYPASS", ("rows",)), "lokr_bypass_bwd": (TL_BYPASS, "BYPASS", ("rows",)),
}


def _tl_lokr():
    return importlib.import_module("lycoris_ops.backends.tilelang.kernels.lokr")


def tl_fixed(op: str) -> dict:
    """The fixed config of ``op``'s TileLang launcher (a copy)."""
    return dict(getattr(_tl_lokr(), _TL_SPACES[op][1]))


def _bypass_kernels(op: str, dims) -> list:
    """(kernel, its factor dims) of a bypass op: the backward's gx is kron_apply with (G, w1ᵀ, w2ᵀ)."""
    a, b, c, d = dims
    if op == "lokr_bypass_fwd":
        return [("apply", dims)]
    return [("apply", (b, a, d, c)), ("wgrad1", dims), ("wgrad2", dims)]


def tl_kernels(op: str, dims, cfg: dict) -> tuple:
    """What ``cfg`` builds for ``op`` on factors dims = (a, b, c, d): per kernel (kind, tile,
    threads); a bypass kernel's tile is (its factor dims, tokens per program step)."""
    L = _tl_lokr()
    a, b, c, d = dims
    if op.endswith("merge_fwd"):  # the output-tile form ignores stages; the stream's w2 tile is (BM, BN)
        if cfg.get("stream"):
            return (("stream", (cfg["BM"], cfg["BN"]), cfg["threads"], cfg.get("stages", 0)),)
        return (("kron", (cfg["BM"], cfg["BN"]), cfg["threads"]),)
    if op.endswith("merge_bwd"):  # the two-pass form ignores stages; the one pass's stages are its own kernel
        tile = L._grad_tile(c, d, cfg["elems"])
        if cfg.get("one_pass"):
            return (("grads1", tile, cfg["threads"], cfg.get("stages", 0)),)
        return (("grads", tile, cfg["threads"]),)
    geometry = {"apply": L.apply_geometry, "wgrad1": L.wgrad1_geometry, "wgrad2": L.wgrad2_geometry}
    out = []
    for kind, kd in _bypass_kernels(op, dims):
        bt, threads = geometry[kind](*kd, cfg["rows"], cfg["threads"])
        out.append((kind, (kd, bt), threads))
    return tuple(out)


def bypass_footprint(kind: str, dims, bt: int) -> tuple:
    """(shared-memory elements, fp32 fragment elements) of a bypass kernel on factors dims at
    bt tokens per step: ``backends/tilelang/kernels/lokr.py``'s allocations (padded dims)."""
    Ap, Bp, Cp, Dp = (models.p16(n) for n in dims)
    if kind == "apply":  # xs, w1s, w2s, zs | z, y
        return bt * Bp * Dp + Ap * Bp + Cp * Dp + Bp * bt * Cp, bt * Bp * Cp + Ap * bt * Cp
    if kind == "wgrad1":  # xs, w2s, gs, zs | z, g1
        return bt * Bp * Dp + Cp * Dp + Ap * bt * Cp + Bp * bt * Cp, bt * Bp * Cp + Ap * Bp
    return Bp * bt * Dp + Ap * Bp + bt * Ap * Cp + bt * Ap * Dp, Ap * bt * Dp + Cp * Dp  # wgrad2: xs, w1s, gs, ps | p, g2


def tl_fits(dev: DeviceFacts, kind: str, tile, threads: int, dims, csize: int) -> bool:
    """Whether one kernel of a TileLang config fits: the merge tile within TL_KRON_TILE and no
    larger than the output (a power of two up; the smallest of each axis always), a gradient
    tile of at least TL_GRAD_MIN_PER_THREAD elements a thread; a bypass kernel's shared memory
    (csize-byte operands, the planners' margin) and every kernel's fp32 fragments within
    TL_ACC_PER_THREAD registers a thread."""
    a, b, c, d = dims
    if kind in ("kron", "stream"):  # an output tile, or (stream) a tile of w2
        (bm, bn), acc = tile, tile[0] * tile[1]
        rows, cols = (a * c, b * d) if kind == "kron" else (c, d)
        if not (TL_KRON_TILE[0] <= acc <= TL_KRON_TILE[1] and bm <= max(16, p2(rows))
                and bn <= max(64 if kind == "kron" else 16, p2(cols))):
            return False
    elif kind in ("grads", "grads1"):
        acc = tile[0] * tile[1]
        if acc < TL_GRAD_MIN_PER_THREAD * threads:
            return False
    else:
        smem, acc = bypass_footprint(kind, *tile)
        if not smem_fits(dev, smem * csize):
            return False
    return acc <= TL_ACC_PER_THREAD * threads


def tl_built(op: str, dims, cfg: dict) -> tuple:
    """What the launcher builds for ``cfg``, to tell configs apart: ``tl_kernels``, except the
    backward bypass (its one pass, ``kron_wgrads_kernel``, takes its token step from
    ``wgrads_geometry``: at 64 x 64 factors rows 64 and 128 build the same kernel)."""
    L = _tl_lokr()
    if op == "lokr_bypass_bwd":
        return (("wgrads", (tuple(dims), *L.wgrads_geometry(*dims, cfg["rows"], cfg["threads"]))),)
    return tl_kernels(op, dims, cfg)


def tl_configs(dev: DeviceFacts, op: str, dims, csize: int) -> list:
    """The legal configs of ``op``'s space on factors dims = (a, b, c, d), csize-byte GEMM
    operands: the first of each distinct build (``tl_built``), none the fixed config's; each
    kernel fits (``tl_fits``) or is one the fixed config builds too (it runs anyway)."""
    space = _TL_SPACES[op][0]
    fixed = tl_kernels(op, dims, tl_fixed(op))
    seen = {tl_built(op, dims, tl_fixed(op))}
    out = []
    for values in itertools.product(*space.values()):
        cfg = dict(zip(space, values))
        for form in ("one_pass", "stream"):  # the form it is an option of off: its config as before (no stages)
            if not cfg.get(form, True):
                cfg = {k: v for k, v in cfg.items() if k not in (form, "stages")}
        kernels = tl_kernels(op, dims, cfg)
        built = tl_built(op, dims, cfg)
        if built in seen or not all(k in fixed or tl_fits(dev, *k[:3], dims, csize) for k in kernels):
            continue
        seen.add(built)
        out.append(cfg)
    return out


def _tl_plan(op: str, dev: DeviceFacts, dims, csize: int, work, eager: float, n: int):
    """The shortlist: the fixed config first, the model's best legal configs, eager."""
    return tl_shortlist(op, tl_configs(dev, op, dims, csize), work, dev, tl_fixed(op), eager, _TL_SPACES[op][2], n)


def _tl_kron(op, dev, dims, r1, r2, compute, out_dtype, base, n):
    """kron_kernel through the Triton merge model, names mapped: the whole product is the tile
    factor and a 1 x 1 loop factor (a program per output tile, no split); threads -> warps,
    one stage. kron_stream_kernel is the Triton merge program itself (a tile of w2, generated
    when factored, and a split of the w1 entries), its stages or one. Eager: the Triton
    planner's."""
    e, eo, eb = esize(compute), esize(out_dtype), esize(None if base is None else base.dtype)
    a, b, c, d = dims

    def work(k):
        cfg = dict(block_m=k["BM"], block_n=k["BN"], block_r=16, block_rl=16, swap=False,
                   num_warps=k["threads"] // 32, num_stages=max(1, k.get("stages", 0)))
        if k.get("stream"):
            return models.merge_works(dev, cfg, a, b, c, d, r1, r2, e, eo, eb, False)
        return models.merge_works(dev, {**cfg, "num_stages": 1}, 1, 1, a * c, b * d, 0, 0, e, eo, eb, False)

    return _tl_plan(op, dev, dims, e, work, models.merge_eager(dev, a, b, c, d, r1, r2, compute, eo, eb, False), n)


def _tl_grads(op, dev, dims, r1, r2, compute, g_dtype, n):
    """kron_grad2 and the one-pass kron_grads_kernel are the Triton merge backward's program (a
    tile of w2 = the gradient tile, a split of the a·b loop entries; threads -> warps, its stages
    or one); the two-pass form's kron_grad1 reads G once more, a program per w1 entry."""
    e, eg = esize(compute), esize(g_dtype)
    a, b, c, d = dims

    def work(k):
        (kind, (bc, bd), threads, *stages), = tl_kernels(op, dims, k)
        if kind == "grads1" and p2(max(r1, r2)) > _tl_lokr().MAX_ONE_PASS_RANK:
            return None  # its finishing kernel's factor blocks would not fit shared memory
        cfg = dict(block_m=bc, block_n=bd, block_r=16, block_rl=16, swap=False, num_warps=threads // 32,
                   num_stages=max([1, *stages]))
        works = models.merge_works(dev, cfg, a, b, c, d, 0, 0, e, eg, 0, True)
        if kind == "grads1":
            return works
        return [Work(grid=a * b, warps=threads // 32, acc=bc * bd, dram=a * b * c * d * eg + c * d * e,
                     fma=2.0 * a * b * c * d, inflight=bc * bd * eg)] + works

    return _tl_plan(op, dev, dims, e, work, models.merge_eager(dev, a, b, c, d, r1, r2, compute, eg, 0, True), n)


def _tl_apply_cfg(dims, bt: int, threads: int) -> dict:
    """The Triton forward bypass config of kron_apply's program: bt tokens, whole padded
    factors (block_a, block_c, block_d), no swap; threads -> warps, one stage."""
    Ap, _, Cp, Dp = (models.p16(n) for n in dims)
    return dict(block_t=bt, block_c=Cp, block_d=Dp, block_a=Ap, split=True, swap=False, num_warps=threads // 32,
                num_stages=1)


def _tl_dims(w1, w2) -> tuple:
    return tuple(int(s) for s in (*w1.shape, *w2.shape))


def _full_merge_fwd_tl(dev, w1, w2, base, gamma, out_dtype=None, n: int = TL_N):
    return _tl_kron("lokr_full_merge_fwd", dev, _tl_dims(w1, w2), 0, 0, compute_dtype(w1.dtype, w2.dtype),
                    w2.dtype if out_dtype is None else out_dtype, base, n)


def _full_merge_bwd_tl(dev, grad, w1, w2, gamma, n: int = TL_N):
    return _tl_grads("lokr_full_merge_bwd", dev, _tl_dims(w1, w2), 0, 0, compute_dtype(w1.dtype, w2.dtype),
                     grad.dtype, n)


def _tl_factored(w1a, w1b, w2a, w2b, shape) -> tuple:
    """(a, b, c, d, r1, r2) of a factored merge (rank 0: a whole factor)."""
    return (*(int(s) for s in shape), *models.ranks(w1b, w1a, w2b, w2a))


def _merge_fwd_tl(dev, w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None, n: int = TL_N):
    a, b, c, d, r1, r2 = _tl_factored(w1a, w1b, w2a, w2b, shape)
    compute = compute_dtype(*(t.dtype for t in (w1a, w1b, w2a, w2b) if t is not None))
    return _tl_kron("lokr_merge_fwd", dev, (a, b, c, d), r1, r2, compute, w2a.dtype if out_dtype is None else out_dtype,
                    base, n)


def _merge_bwd_tl(dev, grad, w1a, w1b, w2a, w2b, shape, gamma, n: int = TL_N):
    a, b, c, d, r1, r2 = _tl_factored(w1a, w1b, w2a, w2b, shape)
    compute = compute_dtype(*(t.dtype for t in (w1a, w1b, w2a, w2b) if t is not None))
    return _tl_grads("lokr_merge_bwd", dev, (a, b, c, d), r1, r2, compute, grad.dtype, n)


def _with_staged_twin(plan, dev: DeviceFacts, kd, csize: int, osize: int, bsize: int):
    """``plan`` with its fixed config's other apply epilogue (``staged`` flipped) second, where
    the staged blocks fit: the model cannot tell the two apart and neither wins the forward
    at every shape (the launcher's default is staged), so the tuner times both. The backward's gx
    (no base) gets no twin: staged won it at both bench shapes, and each twin is one more
    cold compile."""
    L = _tl_lokr()
    first = plan.candidates[0]
    cf = L.launch_config(L.BYPASS, first)
    if L.apply_staged_fits(*kd, cf["rows"], cf["threads"], csize, osize, bsize, dev.smem_per_block):
        add_second(plan, {**first, "staged": not first.get("staged", True)}, plan.predicted[0])
    return plan


def _bypass_fwd_tl(dev, x, w1, w2, gamma, base=None, n: int = TL_N):
    """kron_apply through the Triton forward bypass model (``_tl_apply_cfg``)."""
    dims, compute = _tl_dims(w1, w2), compute_dtype(x.dtype, w1.dtype, w2.dtype)
    work, eager = models.fwd_model(dev, int(x.shape[0]), *dims, compute, x.dtype, x.dtype if base is None else base.dtype,
                             base is not None)

    def tl_work(k):
        (_, (kd, bt), threads), = tl_kernels("lokr_bypass_fwd", dims, k)
        return work(_tl_apply_cfg(kd, bt, threads))

    plan = _tl_plan("lokr_bypass_fwd", dev, dims, esize(compute), tl_work, eager, n)
    out = x if base is None else base
    return _with_staged_twin(plan, dev, dims, esize(compute), esize(out.dtype), 0 if base is None else esize(base.dtype))


def _bypass_bwd_tl(dev, grad, x, w1, w2, gamma, n: int = TL_N):
    """gx's kron_apply through the forward bypass model (G in, roles transposed), the two
    weight-gradient kernels as the Triton backward's two passes over the tokens (their larger
    fp32 fragments live, the more threads; its gx share is counted once more, the same for
    every config). Eager: the Triton planner's."""
    T, dims = int(x.shape[0]), _tl_dims(w1, w2)
    a, b, c, d = dims
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    gx_work, _ = models.fwd_model(dev, T, b, a, d, c, compute, grad.dtype, x.dtype, False)
    wg_work, eager = models.bwd_model(dev, T, a, b, c, d, compute, x.dtype, grad.dtype, grid=kernels.bwd_grid,
                                       reduce_block=fusedkit.reduce_block)

    def tl_work(k):
        (_, (kd, bt), threads), (_, (_, bt1), th1), (_, (_, bt2), th2) = tl_kernels("lokr_bypass_bwd", dims, k)
        gx = gx_work(_tl_apply_cfg(kd, bt, threads))
        live = max(bypass_footprint("wgrad1", dims, bt1)[1], bypass_footprint("wgrad2", dims, bt2)[1])
        wg = wg_work(dict(block_t=bt1, passes=2, swap=False, num_warps=max(th1, th2) // 32, num_stages=1,
                          programs=dev.sm_count), live=live)
        return None if gx is None or wg is None else [gx] + wg

    return _tl_plan("lokr_bypass_bwd", dev, dims, esize(compute), tl_work, eager, n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key: the factor
#: shapes (and ranks); the token count stays bucketed); ``backends/tilelang/runner.py``
TILELANG = {
    "lokr_full_merge_fwd": (_full_merge_fwd_tl, lambda w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_full_merge_bwd": (_full_merge_bwd_tl, lambda g, w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_merge_fwd": (_merge_fwd_tl, lambda w1a, w1b, w2a, w2b, shape, *a: _tl_factored(w1a, w1b, w2a, w2b, shape)),
    "lokr_merge_bwd": (_merge_bwd_tl, lambda g, w1a, w1b, w2a, w2b, shape, *a: _tl_factored(w1a, w1b, w2a, w2b,
                                                                                              shape)),
    "lokr_bypass_fwd": (_bypass_fwd_tl, lambda x, w1, w2, *a: _tl_dims(w1, w2)),
    "lokr_bypass_bwd": (_bypass_bwd_tl, lambda g, x, w1, w2, *a: _tl_dims(w1, w2)),
}

_F = {k: tune.Front() for k in ("ffwd", "fbwd", "mfwd", "mbwd", "bfwd", "bbwd")}


def _merge_default(a, b, c, d, compute):
    """The launcher's automatic merge config (default tiles, tiled side) spelled out."""
    return {**as_dict(kernels.default_merge_cfg(c, d, a, b, compute)), "swap": bool(kernels._swap_default(a, b, c, d))}


def _merge_kwargs(op, fk_name, fk, a, b, c, d, r1, r2, compute, out_dtype, base_dtype, grad, dev, fused, eager):
    hit = _F[fk_name].get(fk)
    if hit is not None:
        return hit
    key = tune.shape_key(compute, exact={"a": a, "b": b, "c": c, "d": d, "r1": r1, "r2": r2},
                         flags={"out": out_dtype, "base": base_dtype})
    return tune.pick(
        op, BACKEND, key,
        lambda: plan_merge(op, facts(dev), a, b, c, d, r1, r2, compute, out_dtype, base_dtype, grad=grad,
                           default=_merge_default(a, b, c, d, compute)),
        fused, eager, device=dev, version=version(), resolve=lambda cfg: {"cfg": kernels.MergeCfg(**cfg)},
        front=(_F[fk_name], fk), prepare=precompile.precompile)


def full_merge_fwd_kwargs(w1, w2, base, gamma, out_dtype=None):
    """Launcher kwargs for ``triton.lokr.merge_fwd`` as ``lokr_full_merge_fwd`` calls it."""
    dev = w2.device
    if dev.type not in DEVICE_TYPES:
        return {}
    (a, b), (c, d) = w1.shape, w2.shape
    out = w2.dtype if out_dtype is None else out_dtype
    fk = (w1.shape, w2.shape, w1.dtype, w2.dtype, None if base is None else base.dtype, out, dev)
    return _merge_kwargs("lokr_full_merge_fwd", "ffwd", fk, int(a), int(b), int(c), int(d), 0, 0,
                         compute_dtype(w1.dtype, w2.dtype), out, None if base is None else base.dtype, False, dev,
                         lambda kw: kernels.lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype, **kw),
                         lambda: reference.lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype))


def full_merge_bwd_kwargs(grad, w1, w2, gamma):
    """Launcher kwargs for ``triton.lokr.merge_bwd`` as ``lokr_full_merge_bwd`` calls it."""
    dev = grad.device
    if dev.type not in DEVICE_TYPES:
        return {}
    (a, b), (c, d) = w1.shape, w2.shape
    fk = (w1.shape, w2.shape, grad.dtype, w1.dtype, w2.dtype, dev)
    return _merge_kwargs("lokr_full_merge_bwd", "fbwd", fk, int(a), int(b), int(c), int(d), 0, 0,
                         compute_dtype(w1.dtype, w2.dtype), grad.dtype, None, True, dev,
                         lambda kw: kernels.lokr_full_merge_bwd(grad, w1, w2, gamma, **kw),
                         lambda: reference.lokr_full_merge_bwd(grad, w1, w2, gamma))


def merge_fwd_kwargs(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    """Launcher kwargs for ``triton.lokr.merge_fwd`` as ``lokr_merge_fwd`` calls it."""
    dev = w2a.device
    if dev.type not in DEVICE_TYPES:
        return {}
    a, b, c, d = (int(s) for s in shape)
    r1, r2 = models.ranks(w1b, w1a, w2b, w2a)
    out = w2a.dtype if out_dtype is None else out_dtype
    dts = tuple(None if t is None else t.dtype for t in (w1a, w1b, w2a, w2b, base))
    fk = (a, b, c, d, r1, r2, dts, out, dev)
    return _merge_kwargs("lokr_merge_fwd", "mfwd", fk, a, b, c, d, r1, r2,
                         compute_dtype(*dts[:4]), out, dts[4], False, dev,
                         lambda kw: kernels.lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype, **kw),
                         lambda: reference.lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma,
                                                                         out_dtype))


def merge_bwd_kwargs(grad, w1a, w1b, w2a, w2b, shape, gamma):
    """Launcher kwargs for ``triton.lokr.merge_bwd`` as ``lokr_merge_bwd`` calls it."""
    dev = grad.device
    if dev.type not in DEVICE_TYPES:
        return {}
    a, b, c, d = (int(s) for s in shape)
    r1, r2 = models.ranks(w1b, w1a, w2b, w2a)
    dts = tuple(None if t is None else t.dtype for t in (w1a, w1b, w2a, w2b))
    fk = (a, b, c, d, r1, r2, dts, grad.dtype, dev)
    return _merge_kwargs("lokr_merge_bwd", "mbwd", fk, a, b, c, d, r1, r2, compute_dtype(*dts), grad.dtype, None,
                         True, dev, lambda kw: kernels.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma, **kw),
                         lambda: reference.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma))


def _bypass_default(default_fn, cost, T, a, b, c, d, compute):
    """The launcher's automatic config (default tiles, cheaper contraction order) spelled out."""
    split = compute != torch.float32
    swap = cost(c, d, a, b, split) * 4 < cost(a, b, c, d, split) * 3
    A, B, C, D = (c, d, a, b) if swap else (a, b, c, d)
    return {**as_dict(default_fn(T, A, B, C, D, compute)), "swap": swap}


def bypass_fwd_kwargs(x, w1, w2, gamma, base=None):
    """Launcher kwargs for ``triton.lokr.bypass_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, w1.shape, w2.shape, x.dtype, w1.dtype, w2.dtype, None if base is None else base.dtype, dev)
    hit = _F["bfwd"].get(fk)
    if hit is not None:
        return hit
    T = int(x.shape[0])
    (a, b), (c, d) = ((int(s) for s in w1.shape), (int(s) for s in w2.shape))
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    out = x.dtype if base is None else base.dtype
    key = tune.shape_key(compute, tokens={"T": T}, exact={"a": a, "b": b, "c": c, "d": d},
                         flags={"x": x.dtype, "out": out, "base": base is not None})

    def plan():
        try:
            default = _bypass_default(kernels.default_bypass_fwd_cfg, models.fwd_cost, T, a, b, c, d, compute)
        except Exception:
            default = None
        return plan_bypass_fwd(facts(dev), T, a, b, c, d, compute, x.dtype, out, base is not None, default=default)

    return tune.pick(
        "lokr_bypass_fwd", BACKEND, key, plan,
        lambda kw: kernels.bypass_fwd(x, w1, w2, gamma, base, **kw),
        lambda: reference.lokr_bypass_fwd(x, w1, w2, gamma, base),
        device=dev, version=version(), resolve=lambda cfg: {"cfg": kernels.BypassFwdCfg(**cfg)}, front=(_F["bfwd"], fk), prepare=precompile.precompile)


def bypass_bwd_kwargs(grad, x, w1, w2, gamma):
    """Launcher kwargs for ``triton.lokr.bypass_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, w1.shape, w2.shape, grad.dtype, x.dtype, w1.dtype, w2.dtype, dev)
    hit = _F["bbwd"].get(fk)
    if hit is not None:
        return hit
    T = int(x.shape[0])
    (a, b), (c, d) = ((int(s) for s in w1.shape), (int(s) for s in w2.shape))
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    key = tune.shape_key(compute, tokens={"T": T}, exact={"a": a, "b": b, "c": c, "d": d},
                         flags={"x": x.dtype, "g": grad.dtype})

    def plan():
        try:
            default = _bypass_default(kernels.default_bypass_bwd_cfg, models.bwd_cost, T, a, b, c, d, compute)
        except Exception:
            default = None
        return plan_bypass_bwd(facts(dev), T, a, b, c, d, compute, x.dtype, grad.dtype, default=default)

    return tune.pick(
        "lokr_bypass_bwd", BACKEND, key, plan,
        lambda kw: kernels.bypass_bwd(grad, x, w1, w2, gamma, **kw),
        lambda: reference.lokr_bypass_bwd(grad, x, w1, w2, gamma),
        device=dev, version=version(), resolve=lambda cfg: {"cfg": kernels.BypassBwdCfg(**cfg)}, front=(_F["bbwd"], fk), prepare=precompile.precompile)


KWARGS = {"lokr_full_merge_fwd": full_merge_fwd_kwargs, "lokr_full_merge_bwd": full_merge_bwd_kwargs,
          "lokr_merge_fwd": merge_fwd_kwargs, "lokr_merge_bwd": merge_bwd_kwargs,
          "lokr_bypass_fwd": bypass_fwd_kwargs, "lokr_bypass_bwd": bypass_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"lokr_full_merge_fwd": kernels.lokr_full_merge_fwd,
             "lokr_full_merge_bwd": kernels.lokr_full_merge_bwd, "lokr_merge_fwd": kernels.lokr_merge_fwd,
             "lokr_merge_bwd": kernels.lokr_merge_bwd, "lokr_bypass_fwd": kernels.bypass_fwd,
             "lokr_bypass_bwd": kernels.bypass_bwd}
