"""Tuned launch configs of the Triton LoHa kernels (``kernels/loha.py``): ``loha_bypass_fwd``,
``loha_bypass_bwd``, ``loha_merge_bwd``. Work models: ``tuner/models/loha.py``.

The bypass forward's two strategies (*regen*, *materialize*) are both candidates. The
backward runs gx (T x I, K = O) and GW = Gᵀ·x (O x I, K = T), then the two merge-backward
jobs on GW with ``grad_cfg``. Its shortlist (``cost.make_shared_plan``) varies the gx GEMM
only: GW's tiles (``gw_cfg``) and ``grad_cfg`` are the launcher default's, shared by every
candidate (the model's picks for these two untimed parts, a small GW tile over the long
K = T and a one-split merge backward, were measured slower than the default launch), so a
cold key compiles ΔW's, GW's and the merge-backward kernels once plus one gx GEMM per
candidate. Where cuBLAS can win (16-bit, ``models.VENDOR_MIN_MACS``), a vendor-GEMM twin of
the first config is timed too, never the untimed pick.
"""
from __future__ import annotations

import functools

import torch

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import fusedkit, loha as kernels
from lycoris_ops.reference import loha as reference
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import add_before_eager, esize, make_plan, make_shared_plan, p2, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import loha as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, fusedkit, reference)


def _apply_configs(dev: DeviceFacts, M: int, R: int, tc: bool):
    rp = p2(R, 16)
    strategies = ["materialize"] + (["regen"] if rp <= kernels.MAX_HADA_RANK else [])
    bms = [b for b in (16, 32, 64, 128) if b <= max(16, p2(M))]
    return [dict(block_m=bm, block_n=bn, block_k=bk, group_m=8, strategy=st, regen_max_tiles=2, tile_n=64,
                 tile_k=64, tile_r=32, num_warps=w, num_stages=s)
            for st in strategies for bm in bms for bn in (64, 128) for bk in (32, 64) for w in (4, 8)
            for s in dev.stages if tc or (bm * bn <= 64 * 64)]


def plan_bypass_fwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, out_dtype, has_base: bool,
                    *, default=None, n: int = 5):
    e, ex, eo = esize(compute), esize(x_dtype), esize(out_dtype)
    tc = compute != torch.float32

    def work(c):
        return models.apply_works(dev, c, T, O, I, R, e, ex, eo, has_base, tc, max_regen_rank=kernels.MAX_HADA_RANK)

    eager = models.bypass_fwd_eager(dev, T, I, O, R, e, ex, eo, has_base, tc)
    plan = make_plan("loha_bypass_fwd", rank(_apply_configs(dev, T, R, tc), work, dev),
                     tile_axes=("strategy", "block_m", "block_n", "block_k"), n=n, default=default,
                     default_s=predict(work, default, dev), eager_s=eager)
    if tc and T * O * I >= models.VENDOR_MIN_MACS and plan.candidates and not tune.is_eager(plan.candidates[0]):
        # ΔW by the tile kernel, the T·O·I GEMM by cuBLAS (kernels.bypass_fwd(vendor=True)):
        # timed against eager, never the untimed pick
        add_before_eager(plan, {**plan.candidates[0], "strategy": "materialize", "vendor": True})
    return plan


def _grad_configs(dev: DeviceFacts, tc: bool):
    return [dict(block_m=bm, block_n=bn, split=0, num_warps=w, num_stages=s)
            for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)
            if tc or bm * bn <= 64 * 64]


def plan_merge_bwd(dev: DeviceFacts, O: int, I: int, R: int, compute, g_dtype, *, default=None, n: int = 5):
    e, eg = esize(compute), esize(g_dtype)
    tc = compute != torch.float32

    def work(c):
        return models.grad_works(dev, c, O, I, R, e, eg, tc)

    eager = models.merge_bwd_eager(dev, O, I, R, e, eg, tc)
    plan = make_plan("loha_merge_bwd", rank(_grad_configs(dev, tc), work, dev), tile_axes=("block_m", "block_n"),
                     n=n, default=default, default_s=predict(work, default, dev), eager_s=eager)
    if tc and O * I * R >= models.MERGE_VENDOR_MIN_MACS and plan.candidates and not tune.is_eager(plan.candidates[0]):
        # E1, E2 by one Triton pass, the four contractions by cuBLAS (kernels.merge_bwd(vendor=True)):
        # the fused jobs regenerate P1, P2 twice; timed against eager, never the untimed pick
        add_before_eager(plan, {**plan.candidates[0], "vendor": True})
    return plan


def plan_bypass_bwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, g_dtype, *,
                    default=None, n: int = 5):
    e, ex, eg = esize(compute), esize(x_dtype), esize(g_dtype)
    tc = compute != torch.float32

    def gx_works(c):  # gx (T x I, K = O, ΔWᵀ regenerated or materialized)
        return models.apply_works(dev, c, T, I, O, R, e, eg, ex, False, tc, max_regen_rank=kernels.MAX_HADA_RANK)

    def gw_works(c):  # GW = Gᵀ·x (O x I, K = T, plain)
        return models.apply_works(dev, {**c, "strategy": "materialize"}, O, I, T, 0, e, eg, e, False, tc,
                                  max_regen_rank=kernels.MAX_HADA_RANK, dw_needed=False)

    def grads(c):
        return models.grad_works(dev, c, O, I, R, e, e, tc)

    default = default or {}
    d_cfg, d_grad = default.get("cfg"), default.get("grad_cfg")
    # GW's tiles: one config for every candidate, the launcher's own (the model ranks GW only when
    # there is no default): its pick, a small tile over the long K = T, measured several times
    # slower than the default's, made every candidate lose to eager while the default launch won
    d_gw = default.get("gw_cfg") or (None if d_cfg is None else {**d_cfg, "strategy": "materialize"})
    if d_gw is not None:
        gw_cfg, t_gw = d_gw, predict(gw_works, d_gw, dev) or 0.0
    else:
        w_rank = rank([c for c in _apply_configs(dev, O, R, tc) if c["strategy"] == "materialize"], gw_works, dev)
        gw_cfg, t_gw = (w_rank[0][1], w_rank[0][0]) if w_rank else (None, 0.0)
    # merge backward: the launcher default's too (the model's best, split or not, only without a
    # default): untimed here, and a model pick (one split) was measured costing more than the
    # whole default backward
    if d_grad is not None:
        grad_cfg, t_grad = d_grad, predict(grads, d_grad, dev) or 0.0
    else:
        r_rank = rank([{**c, "split": sp} for c in _grad_configs(dev, tc) for sp in (0, 1)], grads, dev)
        grad_cfg, t_grad = (r_rank[0][1], r_rank[0][0]) if r_rank else (None, 0.0)
    rp = p2(R, 16)
    split_grad = grad_cfg is not None and (grad_cfg.get("split") or 0) != 1
    shared = {("gw",) + tuple(sorted((gw_cfg or {}).items()))}
    if split_grad:  # the two jobs and their reductions; unsplit, both jobs are one pair kernel
        shared |= {("grad", "a"), ("grad", "b"), ("reduce", "a"), ("reduce", "b")}
    else:
        shared.add(("grad_pair",))

    def compiles(c):  # the Triton compilations of a gx config, plus the shared ones
        regen = c["strategy"] == "regen" and rp <= kernels.MAX_HADA_RANK
        out = shared | {("gx", regen, c["block_m"], c["block_n"], c["block_k"], c["group_m"], c["num_warps"],
                         c["num_stages"])}
        if not regen:
            out.add(("tile", c["tile_n"], c["tile_k"], c["tile_r"]))
        return out

    fixed = t_gw + t_grad
    g_rank = [(t + fixed, c) for t, c in rank(_apply_configs(dev, T, R, tc), gx_works, dev)]
    t_d = predict(gx_works, d_cfg, dev)
    eager = models.bypass_bwd_eager(dev, T, I, O, R, e, ex, eg, tc)
    plan = make_shared_plan("loha_bypass_bwd", g_rank, kernels=compiles,
                            tile_axes=("strategy", "block_m", "block_n", "block_k"), n=n, default=d_cfg,
                            default_s=None if t_d is None else t_d + fixed, eager_s=eager)
    plan.candidates = [c if tune.is_eager(c) else {"cfg": c, "grad_cfg": grad_cfg, "gw_cfg": gw_cfg}
                       for c in plan.candidates]
    if tc and T * O * I >= models.VENDOR_MIN_MACS and plan.candidates and not tune.is_eager(plan.candidates[0]):
        # the two T·O·I GEMMs by cuBLAS, the rest fused (kernels.bypass_bwd(vendor=True)): timed
        # against eager, never the untimed pick; its ΔW tile kernel is the first candidate's
        first = plan.candidates[0]
        vendor = {**first, "cfg": {**first["cfg"], "strategy": "materialize"}, "vendor": True}
        add_before_eager(plan, vendor)
        if O * I * R >= models.MERGE_VENDOR_MIN_MACS:  # and the factor gradients by the merge's vendor path
            add_before_eager(plan, {**vendor, "merge_vendor": True})
    return plan


_F_BFWD, _F_BBWD, _F_MBWD = tune.Front(), tune.Front(), tune.Front()


def _bypass_bwd_default(T, O, R, compute):
    """The tiles ``bypass_bwd`` runs with when called without ``cfg``, ``grad_cfg`` and
    ``gw_cfg``, spelled out: gx's (T token rows), GW = Gᵀ·x's (O rows, plain) and the merge
    backward's."""
    return {"cfg": _apply_default(T, R, compute), "grad_cfg": as_dict(kernels.default_grad_cfg(R, compute)),
            "gw_cfg": _spelled(O, R, compute, regen=False)}


def _apply_default(M, R, compute):
    """``ApplyCfg()`` with the launcher's automatic choices spelled out (strategy, tiles)."""
    return _spelled(M, R, compute, bool(kernels._regen(M, R, kernels.ApplyCfg(), compute)))


def _spelled(M, R, compute, regen: bool):
    """The launcher's automatic tiles for M rows and a given strategy, as an explicit config."""
    d = kernels.default_apply_cfg(M, 1, 1, R, compute, regen)
    return as_dict(kernels.ApplyCfg(block_m=d.block_m, block_n=d.block_n, block_k=d.block_k,
                                    strategy="regen" if regen else "materialize", num_warps=d.num_warps,
                                    num_stages=kernels.ApplyCfg().num_stages))


def bypass_fwd_kwargs(x, a1, b1, a2, b2, gamma, base=None):
    """Launcher kwargs for ``kernels.bypass_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, a1.shape, x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype, None if base is None else base.dtype,
          dev)
    hit = _F_BFWD.get(fk)
    if hit is not None:
        return hit
    T, I = (int(s) for s in x.shape)
    O, R = (int(s) for s in a1.shape)
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    out = x.dtype if base is None else base.dtype
    key = tune.shape_key(compute, tokens={"T": T}, exact={"I": I, "O": O, "R": R},
                         flags={"x": x.dtype, "w": a1.dtype, "out": out, "base": base is not None})
    return tune.pick(
        "loha_bypass_fwd", BACKEND, key,
        lambda: plan_bypass_fwd(facts(dev), T, I, O, R, compute, x.dtype, out, base is not None,
                                default=_apply_default(T, R, compute)),
        lambda kw: kernels.bypass_fwd(x, a1, b1, a2, b2, gamma, base, **kw),
        lambda: reference.loha_bypass_fwd_native(x, a1, b1, a2, b2, gamma, base),
        device=dev, version=version(), resolve=lambda c: _vendor_launch(kernels.ApplyCfg, c), front=(_F_BFWD, fk), prepare=precompile.precompile)


def bypass_bwd_kwargs(grad, x, a1, b1, a2, b2, gamma):
    """Launcher kwargs for ``kernels.bypass_bwd`` (``cfg``, ``grad_cfg``, ``gw_cfg``; or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, a1.shape, grad.dtype, x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype, dev)
    hit = _F_BBWD.get(fk)
    if hit is not None:
        return hit
    T, I = (int(s) for s in x.shape)
    O, R = (int(s) for s in a1.shape)
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    key = tune.shape_key(compute, tokens={"T": T}, exact={"I": I, "O": O, "R": R},
                         flags={"x": x.dtype, "g": grad.dtype, "w": a1.dtype})
    default = _bypass_bwd_default(T, O, R, compute)
    return tune.pick(
        "loha_bypass_bwd", BACKEND, key,
        lambda: plan_bypass_bwd(facts(dev), T, I, O, R, compute, x.dtype, grad.dtype, default=default),
        lambda kw: kernels.bypass_bwd(grad, x, a1, b1, a2, b2, gamma, **kw),
        lambda: reference.loha_bypass_bwd_native(grad, x, a1, b1, a2, b2, gamma),
        device=dev, version=version(),
        resolve=lambda c: {"cfg": kernels.ApplyCfg(**c["cfg"]),
                           "grad_cfg": None if c.get("grad_cfg") is None else kernels.GradCfg(**c["grad_cfg"]),
                           "gw_cfg": None if c.get("gw_cfg") is None else kernels.ApplyCfg(**c["gw_cfg"]),
                           **({"vendor": True} if c.get("vendor") else {}),
                           **({"merge_vendor": True} if c.get("merge_vendor") else {})},
        front=(_F_BBWD, fk), prepare=precompile.precompile)


def merge_bwd_kwargs(grad, a1, b1, a2, b2, gamma):
    """Launcher kwargs for ``kernels.merge_bwd`` (or SENTINEL_EAGER)."""
    dev = grad.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (grad.shape, a1.shape, grad.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype, dev)
    hit = _F_MBWD.get(fk)
    if hit is not None:
        return hit
    O, R = (int(s) for s in a1.shape)
    I = int(b1.shape[1])
    compute = compute_dtype(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    key = tune.shape_key(compute, exact={"O": O, "I": I, "R": R}, flags={"g": grad.dtype, "w": a1.dtype})
    return tune.pick(
        "loha_merge_bwd", BACKEND, key,
        lambda: plan_merge_bwd(facts(dev), O, I, R, compute, grad.dtype,
                               default=as_dict(kernels.default_grad_cfg(R, compute))),
        lambda kw: kernels.merge_bwd(grad, a1, b1, a2, b2, gamma, **kw),
        lambda: reference.loha_merge_bwd(grad, a1, b1, a2, b2, gamma),
        device=dev, version=version(), resolve=lambda c: _vendor_launch(kernels.GradCfg, c), front=(_F_MBWD, fk), prepare=precompile.precompile)


def _vendor_launch(cfg_type, c):
    """Launcher kwargs of a candidate of the bypass forward (``ApplyCfg``) or the merge
    backward (``GradCfg``): its config, and ``vendor`` when set."""
    cfg = cfg_type(**{k: v for k, v in c.items() if k != "vendor"})
    return {"cfg": cfg, "vendor": True} if c.get("vendor") else {"cfg": cfg}


KWARGS = {"loha_bypass_fwd": bypass_fwd_kwargs, "loha_bypass_bwd": bypass_bwd_kwargs,
          "loha_merge_bwd": merge_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"loha_bypass_fwd": kernels.bypass_fwd, "loha_bypass_bwd": kernels.bypass_bwd,
             "loha_merge_bwd": kernels.merge_bwd}
