"""Tuned launch configs of the Triton LoKr kernels (``kernels/lokr.py``): the Kronecker
merges (``lokr_full_merge_fwd``, ``lokr_merge_fwd``), their backward
(``lokr_full_merge_bwd``, ``lokr_merge_bwd``), ``lokr_bypass_fwd``, ``lokr_bypass_bwd``.
Work models: ``tuner/models/lokr.py``.
"""
from __future__ import annotations

import functools
import math

import torch

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import fusedkit, lokr as kernels, lokr_bypass as bypass_kernels
from lycoris_ops.reference import lokr as reference
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import add_second, cdiv, esize, make_plan, make_shared_plan, p2, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import lokr as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, bypass_kernels, fusedkit, reference)


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
        if reduces:  # two reduces share one launch (fusedkit.reduce_pair_launch)
            out.add(("reduce", *reduces, swap))
        if chains:  # both sides factorized: one launch (fusedkit.chain_pair_launch)
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
            for sw in bypass_kernels.fwd_swaps(a, b, c, d) for bt in (1, 2, 4, 8, 16) if bt <= max(1, p2(T))
            for bc in (16, 32, 64, 128) for bd in (16, 64) for w in (4, 8) for s in (1, 2) for sp in splits]
    plan = make_plan("lokr_bypass_fwd", rank(cfgs, work, dev), tile_axes=("swap", "block_t", "block_c", "block_d"),
                     n=n, default=default, default_s=predict(work, default, dev), eager_s=eager_s)
    if len(splits) > 1 and not any(isinstance(c, dict) and c["split"] is False for c in plan.candidates):
        # the model ties the two where memory bounds the tile: time the twin of its best config,
        # second, where the sequential path's tune budget never skips it (measured twice as
        # fast as the launcher default at long token counts)
        best, t = next(((c, t) for c, t in zip(plan.candidates, plan.predicted)
                        if isinstance(c, dict) and math.isfinite(t)), (None, math.inf))
        if best is not None:
            add_second(plan, dict(best, split=False), t)
    return plan


def plan_bypass_bwd(dev: DeviceFacts, T: int, a: int, b: int, c: int, d: int, compute, x_dtype, g_dtype, *,
                    default=None, n: int = 5):
    work, eager_s = models.bwd_model(dev, T, a, b, c, d, compute, x_dtype, g_dtype, grid=bypass_kernels.bwd_grid,
                                     reduce_block=fusedkit.reduce_block)
    # 16-bit: 4 warps only (8 measured slower at every setting, which the model cannot see:
    # bypass_kernels.bwd_grid); programs 0 = the launcher's two per SM at 4 warps, sm_count = one.
    # split False: H and P rounded to 16 bits as eager rounds them (5 dots a tile instead of
    # 8); the default keeps them unrounded, and the tuner checks every candidate against eager
    f32 = compute == torch.float32
    warps, splits = ((4, 8), (True,)) if f32 else ((4,), (True, False))
    cfgs = [dict(block_t=bt, passes=p, programs=pr, split=sp, swap=sw, num_warps=w, num_stages=s)
            for sw in (False, True) for bt in (1, 2, 4, 8, 16)
            if bt <= max(1, p2(T)) and bt <= bypass_kernels.max_bwd_block_t(*((c, d, a, b) if sw else (a, b, c, d)))
            for p in (1, 2) for w in warps for s in (1, 2) for pr in ((0, dev.sm_count) if w == 4 else (0,))
            for sp in splits]
    return make_plan("lokr_bypass_bwd", rank(cfgs, work, dev), tile_axes=("programs", "swap", "block_t", "passes"),
                     n=n, default=default, default_s=predict(work, default, dev), eager_s=eager_s)


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
    """Launcher kwargs for ``kernels.merge_fwd`` as ``lokr_full_merge_fwd`` calls it."""
    dev = w2.device
    if dev.type not in DEVICE_TYPES:
        return {}
    (a, b), (c, d) = w1.shape, w2.shape
    out = w2.dtype if out_dtype is None else out_dtype
    fk = (w1.shape, w2.shape, w1.dtype, w2.dtype, None if base is None else base.dtype, out, dev)
    return _merge_kwargs("lokr_full_merge_fwd", "ffwd", fk, int(a), int(b), int(c), int(d), 0, 0,
                         compute_dtype(w1.dtype, w2.dtype), out, None if base is None else base.dtype, False, dev,
                         lambda kw: kernels.lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype, **kw),
                         lambda: reference.lokr_full_merge_fwd_native(w1, w2, base, gamma, out_dtype))


def full_merge_bwd_kwargs(grad, w1, w2, gamma):
    """Launcher kwargs for ``kernels.merge_bwd`` as ``lokr_full_merge_bwd`` calls it."""
    dev = grad.device
    if dev.type not in DEVICE_TYPES:
        return {}
    (a, b), (c, d) = w1.shape, w2.shape
    fk = (w1.shape, w2.shape, grad.dtype, w1.dtype, w2.dtype, dev)
    return _merge_kwargs("lokr_full_merge_bwd", "fbwd", fk, int(a), int(b), int(c), int(d), 0, 0,
                         compute_dtype(w1.dtype, w2.dtype), grad.dtype, None, True, dev,
                         lambda kw: kernels.lokr_full_merge_bwd(grad, w1, w2, gamma, **kw),
                         lambda: reference.lokr_full_merge_bwd_native(grad, w1, w2, gamma))


def merge_fwd_kwargs(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    """Launcher kwargs for ``kernels.merge_fwd`` as ``lokr_merge_fwd`` calls it."""
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
                         lambda: reference.lokr_merge_fwd_native(w1a, w1b, w2a, w2b, shape, base, gamma,
                                                                         out_dtype))


def merge_bwd_kwargs(grad, w1a, w1b, w2a, w2b, shape, gamma):
    """Launcher kwargs for ``kernels.merge_bwd`` as ``lokr_merge_bwd`` calls it."""
    dev = grad.device
    if dev.type not in DEVICE_TYPES:
        return {}
    a, b, c, d = (int(s) for s in shape)
    r1, r2 = models.ranks(w1b, w1a, w2b, w2a)
    dts = tuple(None if t is None else t.dtype for t in (w1a, w1b, w2a, w2b))
    fk = (a, b, c, d, r1, r2, dts, grad.dtype, dev)
    return _merge_kwargs("lokr_merge_bwd", "mbwd", fk, a, b, c, d, r1, r2, compute_dtype(*dts), grad.dtype, None,
                         True, dev, lambda kw: kernels.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma, **kw),
                         lambda: reference.lokr_merge_bwd_native(grad, w1a, w1b, w2a, w2b, shape, gamma))


def _bypass_default(default_fn, auto_swap, T, a, b, c, d, compute):
    """The launcher's automatic config (default tiles, the launcher's own contraction order)
    spelled out."""
    swap = auto_swap(a, b, c, d, compute != torch.float32)
    A, B, C, D = (c, d, a, b) if swap else (a, b, c, d)
    return {**as_dict(default_fn(T, A, B, C, D, compute)), "swap": swap}


def bypass_fwd_kwargs(x, w1, w2, gamma, base=None):
    """Launcher kwargs for ``bypass_kernels.bypass_fwd`` (or SENTINEL_EAGER)."""
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
            default = _bypass_default(bypass_kernels.default_bypass_fwd_cfg, bypass_kernels.fwd_swap, T, a, b, c, d,
                                      compute)
        except Exception:
            default = None
        return plan_bypass_fwd(facts(dev), T, a, b, c, d, compute, x.dtype, out, base is not None, default=default)

    return tune.pick(
        "lokr_bypass_fwd", BACKEND, key, plan,
        lambda kw: bypass_kernels.bypass_fwd(x, w1, w2, gamma, base, **kw),
        lambda: reference.lokr_bypass_fwd_native(x, w1, w2, gamma, base),
        device=dev, version=version(), resolve=lambda cfg: {"cfg": bypass_kernels.BypassFwdCfg(**cfg)}, front=(_F["bfwd"], fk), prepare=precompile.precompile)


def bypass_bwd_kwargs(grad, x, w1, w2, gamma):
    """Launcher kwargs for ``bypass_kernels.bypass_bwd`` (or SENTINEL_EAGER)."""
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
            default = _bypass_default(bypass_kernels.default_bypass_bwd_cfg, bypass_kernels.bwd_swap, T, a, b, c, d,
                                      compute)
        except Exception:
            default = None
        return plan_bypass_bwd(facts(dev), T, a, b, c, d, compute, x.dtype, grad.dtype, default=default)

    return tune.pick(
        "lokr_bypass_bwd", BACKEND, key, plan,
        lambda kw: bypass_kernels.bypass_bwd(grad, x, w1, w2, gamma, **kw),
        lambda: reference.lokr_bypass_bwd_native(grad, x, w1, w2, gamma),
        device=dev, version=version(), resolve=lambda cfg: {"cfg": bypass_kernels.BypassBwdCfg(**cfg)}, front=(_F["bbwd"], fk), prepare=precompile.precompile)


KWARGS = {"lokr_full_merge_fwd": full_merge_fwd_kwargs, "lokr_full_merge_bwd": full_merge_bwd_kwargs,
          "lokr_merge_fwd": merge_fwd_kwargs, "lokr_merge_bwd": merge_bwd_kwargs,
          "lokr_bypass_fwd": bypass_fwd_kwargs, "lokr_bypass_bwd": bypass_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"lokr_full_merge_fwd": kernels.lokr_full_merge_fwd,
             "lokr_full_merge_bwd": kernels.lokr_full_merge_bwd, "lokr_merge_fwd": kernels.lokr_merge_fwd,
             "lokr_merge_bwd": kernels.lokr_merge_bwd, "lokr_bypass_fwd": bypass_kernels.bypass_fwd,
             "lokr_bypass_bwd": bypass_kernels.bypass_bwd}
