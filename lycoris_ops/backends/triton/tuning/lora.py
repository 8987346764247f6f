"""Tuned launch configs of the Triton LoRA / LoCon kernels (``kernels/lora.py``):
``lora_bypass_fwd``, ``lora_bypass_bwd``, ``lora_merge_fwd``, ``lora_merge_bwd``.

``plan_<op>(dev, ...)`` scores the candidate tiles with the op's work model
(``tuner/models/lora.py``) and returns a ``Plan``: the best tile shapes (one per shape,
with its best warps / stages), measured anchors, the launcher's fixed default, and
``SENTINEL_EAGER``. ``<op>_kwargs(<schema args>)`` is what the op set calls:
``{"cfg": <Cfg>}`` (keyword arguments of the launcher), or ``SENTINEL_EAGER`` (run the
eager body), or ``{}`` off CUDA (launcher defaults, e.g. under the Triton interpreter).
Its steady state is one dict lookup.
"""
from __future__ import annotations

import functools

import torch

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import lora as kernels
from lycoris_ops.reference import lora as reference
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import esize, make_plan, p2, predict, rank, shortlist
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import lora as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)
WARPS = (4, 8)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, reference)


#: configs measured best at the e2e layer shapes (T=4096, r=32, I/O in 3072..12288;
#: ``bench/sweep_lora.py``) where the model ranked small tiles first: large I/O tiles with
#: deep pipelines stream better than it predicts. Always in the shortlist (when legal on the
#: device), timed like the others.
FWD_ANCHORS = (
    dict(block_t=64, block_i=64, block_o=128, o_split=0, num_warps=4, num_stages=4),
    dict(block_t=32, block_i=256, block_o=256, o_split=1, num_warps=4, num_stages=4),
)
BWD_ANCHORS = (
    dict(block_t=32, block_i=128, block_o=128, i_split=1, num_warps=4, num_stages=4),
    dict(block_t=32, block_i=256, block_o=256, i_split=1, num_warps=4, num_stages=4),
)


def _with_anchors(plan, anchors, work, dev: DeviceFacts):
    """``plan`` with each legal anchor config (the model finds it runnable on ``dev``)
    inserted before ``SENTINEL_EAGER`` when not already there."""
    cands, pred = list(plan.candidates), list(plan.predicted)
    for a in anchors:
        t = None if a in cands else predict(work, a, dev)
        if t is None:
            continue
        at = len(cands) - 1 if cands and tune.is_eager(cands[-1]) else len(cands)
        cands.insert(at, a)
        pred.insert(at, t)
    return tune.Plan(plan.op, cands, pred)


def plan_bypass_fwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, out_dtype,
                    has_base: bool, *, default=None, n: int = 5):
    work, eager = models.bypass_fwd_model(dev, T, I, O, R, compute, x_dtype, out_dtype, has_base)
    bts = [b for b in (16, 32, 64, 128) if b <= max(16, p2(T))]
    cfgs = [dict(block_t=bt, block_i=bi, block_o=bo, o_split=os_, num_warps=w, num_stages=s)
            for bt in bts for bi in (32, 64, 128, 256) for bo in (64, 128, 256) for os_ in (0, 1)
            for w in WARPS for s in dev.stages]
    plan = make_plan("lora_bypass_fwd", rank(cfgs, work, dev), tile_axes=("block_t", "block_i", "block_o"),
                     n=max(2, n - 1 - len(FWD_ANCHORS)), default=default, default_s=predict(work, default, dev),
                     eager_s=eager)
    return _with_anchors(plan, FWD_ANCHORS, work, dev)


def _skinny_configs(dev: DeviceFacts, R: int, tc: bool):
    rp = min(p2(R, 16), 128)
    brs = [0] + [b for b in (32, 64) if b < rp]
    bms = (32, 64, 128) if not tc else (64, 128, 256)
    return [dict(block_m=bm, block_k=bk, block_r=br, split=0, num_warps=w, num_stages=s, reduce_block=1024)
            for bm in bms for bk in (32, 64, 128) for br in brs for w in WARPS for s in dev.stages]


def plan_merge_bwd(dev: DeviceFacts, O: int, I: int, R: int, compute, g_dtype, out_dtype, *, default=None,
                   n: int = 5):
    e, eg, eo = esize(compute), esize(g_dtype), esize(out_dtype)
    tc = compute != torch.float32
    # job A: g_up (O, r) = G·downᵀ (K = I); job B: g_down (I rows) = Gᵀ·up (K = O)
    def work(c):
        return models.skinny_work(dev, c, O, I, I, O, R, eg, e, eo, e, tc)

    ranked = rank(_skinny_configs(dev, R, tc), work, dev)
    return make_plan("lora_merge_bwd", ranked, tile_axes=("block_m", "block_k", "block_r"), n=n,
                     default=default, default_s=predict(work, default, dev),
                     eager_s=models.merge_bwd_eager(dev, O, I, R, e, eg, eo, tc))


def plan_bypass_bwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, g_dtype, *,
                    default=None, n: int = 5):
    tok, red, eager = models.bypass_bwd_model(dev, T, I, O, R, compute, x_dtype, g_dtype)
    tc = compute != torch.float32
    bts = [b for b in (16, 32, 64, 128) if b <= max(16, p2(T))]
    tok_cfgs = [dict(block_t=bt, block_i=bi, block_o=bo, i_split=isp, num_warps=w, num_stages=s)
                for bt in bts for bi in (32, 64, 128, 256) for bo in (32, 64, 128, 256) for isp in (0, 1)
                for w in WARPS for s in dev.stages]
    tok_rank = rank(tok_cfgs, tok, dev)

    def both(c):
        a, b = tok(c), red(c["red"]) if c.get("red") else None
        return None if a is None or b is None else [a] + b

    red_rank = rank(_skinny_configs(dev, R, tc), red, dev)

    toks = shortlist(tok_rank, 3, ("block_t", "block_i", "block_o"))
    reds = shortlist(red_rank, 2, ("block_m", "block_k", "block_r"))
    t_of = {id(c): t for t, c in tok_rank}
    r_of = {id(c): t for t, c in red_rank}
    combos = sorted(((t_of[id(a)] + r_of[id(b)], {**a, "red": b}) for a in toks for b in reds),
                    key=lambda x: x[0])
    plan = make_plan("lora_bypass_bwd", combos, n=max(2, n - 1 - len(BWD_ANCHORS)), default=default,
                     default_s=predict(both, default, dev), eager_s=eager)
    red0 = reds[0] if reds else None
    return _with_anchors(plan, [{**a, "red": red0} for a in BWD_ANCHORS] if red0 else [], both, dev)


def plan_merge_fwd(dev: DeviceFacts, O: int, I: int, R1: int, R2: int, mode: str, compute, out_dtype,
                   base_dtype, *, default=None, n: int = 5):
    work, eager, rmax = models.merge_fwd_model(dev, O, I, R1, R2, mode, compute, out_dtype, base_dtype)
    brs = [b for b in (16, 32, 64) if b <= max(16, p2(rmax))]
    cfgs = [dict(block_o=bo, block_i=bi, block_r=br, num_warps=w, num_stages=s)
            for bo in (32, 64, 128, 256) for bi in (32, 64, 128, 256) for br in brs for w in WARPS
            for s in dev.stages if bo * bi <= 128 * 256]
    return make_plan("lora_merge_fwd", rank(cfgs, work, dev), tile_axes=("block_o", "block_i", "block_r"), n=n,
                     default=default, default_s=predict(work, default, dev), eager_s=eager)


_F_BFWD, _F_BBWD, _F_MFWD, _F_MBWD = tune.Front(), tune.Front(), tune.Front(), tune.Front()
EAGER = tune.SENTINEL_EAGER


def bypass_fwd_kwargs(x, up, down, gamma, base=None):
    """Launcher kwargs for ``kernels.bypass_fwd`` (or SENTINEL_EAGER) for this call."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, up.shape, x.dtype, up.dtype, down.dtype, None if base is None else base.dtype, dev)
    hit = _F_BFWD.get(fk)
    if hit is not None:
        return hit
    T, I = x.shape
    O, R = up.shape
    compute = compute_dtype(x.dtype, up.dtype, down.dtype)
    out_dtype = x.dtype if base is None else base.dtype
    key = tune.shape_key(compute, tokens={"T": T}, exact={"I": I, "O": O, "R": R},
                         flags={"x": x.dtype, "w": up.dtype, "out": out_dtype, "base": base is not None})
    return tune.pick(
        "lora_bypass_fwd", BACKEND, key,
        lambda: plan_bypass_fwd(facts(dev), T, I, O, R, compute, x.dtype, out_dtype, base is not None,
                                default=as_dict(kernels.default_bypass_fwd_cfg(T, I, O, R, compute))),
        lambda kw: kernels.bypass_fwd(x, up, down, gamma, base, **kw),
        lambda: reference.lora_bypass_fwd(x, up, down, gamma, base),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.BypassFwdCfg(**c)}, front=(_F_BFWD, fk), prepare=precompile.precompile)


def _bwd_cfg(c):
    return {"cfg": kernels.BypassBwdCfg(**{**c, "red": kernels.SkinnyCfg(**c["red"]) if c.get("red") else None})}


def bypass_bwd_kwargs(grad, x, up, down, gamma):
    """Launcher kwargs for ``kernels.bypass_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, up.shape, grad.dtype, x.dtype, up.dtype, down.dtype, dev)
    hit = _F_BBWD.get(fk)
    if hit is not None:
        return hit
    T, I = x.shape
    O, R = up.shape
    compute = compute_dtype(x.dtype, up.dtype, down.dtype)
    key = tune.shape_key(compute, tokens={"T": T}, exact={"I": I, "O": O, "R": R},
                         flags={"x": x.dtype, "g": grad.dtype, "w": up.dtype})
    return tune.pick(
        "lora_bypass_bwd", BACKEND, key,
        lambda: plan_bypass_bwd(facts(dev), T, I, O, R, compute, x.dtype, grad.dtype,
                                default=as_dict(kernels.default_bypass_bwd_cfg(T, I, O, R, compute))),
        lambda kw: kernels.bypass_bwd(grad, x, up, down, gamma, **kw),
        lambda: reference.lora_bypass_bwd(grad, x, up, down, gamma),
        device=dev, version=version(), resolve=lambda c: _bwd_cfg(c), front=(_F_BBWD, fk), prepare=precompile.precompile)


def merge_fwd_kwargs(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    """Launcher kwargs for ``kernels.merge_fwd`` (or SENTINEL_EAGER)."""
    dev = a1.device
    if dev.type not in DEVICE_TYPES:
        return {}
    plain = mode == "plain"
    fk = (a1.shape, b1.shape, None if plain or a2 is None else a2.shape, a1.dtype, b1.dtype,
          None if plain or a2 is None else (a2.dtype, b2.dtype), None if base is None else base.dtype, mode,
          out_dtype, dev)
    hit = _F_MFWD.get(fk)
    if hit is not None:
        return hit
    O, R1 = a1.shape
    I = b1.shape[1]
    R2 = 0 if plain else a2.shape[1]
    compute = compute_dtype(a1.dtype, b1.dtype) if plain else compute_dtype(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    out = a1.dtype if out_dtype is None else out_dtype
    key = tune.shape_key(compute, exact={"O": O, "I": I, "R1": R1, "R2": R2},
                         flags={"mode": mode, "out": out, "base": None if base is None else base.dtype})
    return tune.pick(
        "lora_merge_fwd", BACKEND, key,
        lambda: plan_merge_fwd(facts(dev), O, I, R1, R2, mode, compute, out, None if base is None else base.dtype,
                               default=as_dict(kernels.default_merge_fwd_cfg(O, I, max(R1, R2), mode, compute))),
        lambda kw: kernels.merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype, **kw),
        lambda: reference.lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.MergeFwdCfg(**c)}, front=(_F_MFWD, fk), prepare=precompile.precompile)


def merge_bwd_kwargs(grad, up, down, gamma):
    """Launcher kwargs for ``kernels.merge_bwd`` (or SENTINEL_EAGER)."""
    dev = up.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (grad.shape, up.shape, down.shape, grad.dtype, up.dtype, down.dtype, dev)
    hit = _F_MBWD.get(fk)
    if hit is not None:
        return hit
    O, R = up.shape
    I = down.shape[1]
    compute = compute_dtype(up.dtype, down.dtype)
    key = tune.shape_key(compute, exact={"O": O, "I": I, "R": R}, flags={"g": grad.dtype, "w": up.dtype})
    return tune.pick(
        "lora_merge_bwd", BACKEND, key,
        lambda: plan_merge_bwd(facts(dev), O, I, R, compute, grad.dtype, up.dtype,
                               default=as_dict(kernels.default_merge_bwd_cfg(O, I, R, compute))),
        lambda kw: kernels.merge_bwd(grad, up, down, gamma, **kw),
        lambda: reference.lora_merge_bwd(grad, up, down, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.SkinnyCfg(**c)}, front=(_F_MBWD, fk), prepare=precompile.precompile)


# =============================================================================== warmup samples

KWARGS = {"lora_bypass_fwd": bypass_fwd_kwargs, "lora_bypass_bwd": bypass_bwd_kwargs,
          "lora_merge_fwd": merge_fwd_kwargs, "lora_merge_bwd": merge_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"lora_bypass_fwd": kernels.bypass_fwd, "lora_bypass_bwd": kernels.bypass_bwd,
             "lora_merge_fwd": kernels.merge_fwd, "lora_merge_bwd": kernels.merge_bwd}
