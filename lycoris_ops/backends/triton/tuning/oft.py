"""Tuned launch configs of the Triton diag-OFT kernels (``kernels/oft.py``): ``oft_fwd`` and
``oft_bwd``. Work model: ``tuner/models/oft.py``. Key: exact K, S, bucketed positions,
channel contiguity, rescale present, dtypes.

The forward launcher's default (``kernels.fwd_cfg``) rebuilds the Cayley factor by the
Neumann series (``cayley.neumann_inverse``; ``neumann``: its registers leave two resident
programs a SM, and the split follows: ``auto_split``); where it fits (``kernels.neumann_fits``)
the shortlist always holds one such config and Gauss-Jordan ones beside it
(``_with_neumann``), decided by timing; past it, Gauss-Jordan only.

Shortlist (``cost.make_shared_plan``): every kernel variant rebuilds the Cayley factors in
registers, so each costs a full compile: at most 4 fused candidates, streamed tiles of at
most ``STREAM_TILE_MAX`` fp32 elements; the backward's candidates share the first one's
channel group (NB), so the chain kernel (its config = NB) compiles once per key.
"""
from __future__ import annotations

import functools

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import cayley, oft as kernels
from lycoris_ops.reference import oft as reference
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import STREAM_TILE_MAX, add_before_eager, esize, make_shared_plan, p2, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import oft as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, cayley, reference)


def _plan(op, dev, K, S, npos, c_contig, bwd, ex, eb, default, n):
    seen = {}
    work, eager = models.model(dev, K, S, npos, c_contig, bwd, ex, eb, auto_split=kernels.auto_split, seen=seen)

    def geometry(c):  # (NB, positions per tile) of the streaming kernel
        bp = c["bwd_block_p"] if bwd else c["block_p"]
        return models.group(K, S, c_contig, c["group"], dev.sm_count, bp, npos, bwd, auto_split=kernels.auto_split)[1], bp

    def compiles_ok(c):  # streamed tiles (x; G and x in the backward) within STREAM_TILE_MAX
        NB, bp = geometry(c)
        return (2 if bwd else 1) * NB * p2(S) * bp <= STREAM_TILE_MAX

    def compiles(c):  # the Triton compilations of a config (backends/triton/kernels/oft.py: constexprs and launch options)
        NB, bp = geometry(c)
        if not bwd:
            return {("fwd", NB, bp, c["num_warps"], c["num_stages"], c["dot_prec"], c.get("neumann", False))}
        # one tile of positions: one program a group, the chain in the streaming program
        chain_in = npos <= bp
        main = ("stream", NB, bp, c["num_warps"], c["num_stages"], c["dot_prec"], c.get("neumann", False), chain_in)
        return {main} if chain_in else {main, ("chain", NB, c.get("chain_warps", 4), c.get("neumann", False))}

    bps = (32, 64, 128, 256)
    cfgs = [dict(block_p=128 if bwd else bp, group=g, split=0, num_warps=w, num_stages=s, dot_prec="tf32x3",
                 bwd_block_p=bp if bwd else 64, chain_warps=4)
            for bp in (bps[:3] if bwd else bps) for g in (0, 32, 64) for w in (4, 8) for s in (1, 2, 3)]
    cfgs = [c for c in cfgs if compiles_ok(c)]
    ranked = rank(cfgs, work, dev)
    seen.clear()
    plan = make_shared_plan(op, ranked, kernels=compiles, structure=(lambda c: geometry(c)[0]) if bwd else None,
                            tile_axes=("bwd_block_p" if bwd else "block_p", "group"), n=n, default=default,
                            default_s=predict(work, default, dev), eager_s=eager)
    plan = with_split16(plan, ex)
    if bwd and ex == 2:
        _with_wide_split16(plan, geometry)
    if not bwd and kernels.neumann_fits(S):
        _with_neumann(plan)
    return plan


def _with_neumann(plan) -> None:
    """The forward: a config with the Cayley factor by ``neumann_inverse`` in the shortlist
    (the launcher's default has it; a plan whose first config lost it to the model gets the
    first config again with it and 3 stages, before eager). Timed, never predicted: the model
    counts the Gauss-Jordan rebuild's flops, not its latency."""
    cands = plan.candidates
    fused = [c for c in cands if isinstance(c, dict)]
    if not fused or any(c.get("neumann") for c in fused):
        return
    add_before_eager(plan, dict(fused[0], neumann=True, num_stages=3))


#: the 16-bit backward's second twin: split16 with 64-row channel groups, 3 stages (measured
#: faster than the default group of 32 at long position counts; the shared-structure
#: shortlist keeps one group, so only this twin offers another)
WIDE_GROUP = 64


def _with_wide_split16(plan, geometry) -> None:
    """A 16-bit backward: the first config again with split16, ``group=WIDE_GROUP`` and 3
    stages, before eager, where that changes the group (two more compiles: the stream and
    chain kernels of the other group). Its tiles are 16-bit: up to twice STREAM_TILE_MAX
    elements (two 64 x 64 tiles at this group)."""
    cands = plan.candidates
    if not cands or not isinstance(cands[0], dict):
        return
    twin = dict(cands[0], dot_prec=kernels.SPLIT16, group=WIDE_GROUP, num_stages=3)
    NB, bp = geometry(twin)
    if NB == geometry(cands[0])[0] or 2 * WIDE_GROUP * bp > 2 * STREAM_TILE_MAX or twin in cands:
        return
    add_before_eager(plan, twin)


def with_split16(plan, ex: int, dot_prec: str = ""):
    """16-bit streams (``ex`` bytes per x element): the plan's first config again with
    ``dot_prec=kernels.SPLIT16`` (three 16-bit dots instead of tf32x3; or the ``dot_prec``
    given), before eager. Timed, never predicted: the model does not separate the dot modes."""
    cands = plan.candidates
    if ex != 2 or not cands or not isinstance(cands[0], dict):
        return plan
    twin = dict(cands[0], dot_prec=dot_prec or kernels.SPLIT16)
    if twin not in cands:
        add_before_eager(plan, twin)
    return plan


def plan_oft_fwd(dev: DeviceFacts, K: int, S: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                 default=None, n: int = 4):
    return _plan("oft_fwd", dev, K, S, npos, c_contig, False, esize(x_dtype), esize(blocks_dtype), default, n)


def plan_oft_bwd(dev: DeviceFacts, K: int, S: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                 default=None, n: int = 4):
    return _plan("oft_bwd", dev, K, S, npos, c_contig, True, esize(x_dtype), esize(blocks_dtype), default, n)


_F_FWD, _F_BWD = tune.Front(), tune.Front()


def _key(blocks, x, rescale, weight, extra):
    npos, c_contig = models.geometry(x, weight)
    K, S = int(blocks.shape[0]), int(blocks.shape[1])
    key = tune.shape_key(x.dtype, tokens={"P": npos}, exact={"K": K, "S": S},
                         flags={"blocks": blocks.dtype, "c_contig": c_contig, "weight": weight,
                                "rescale": rescale is not None, **extra})
    return K, S, npos, c_contig, key


def oft_fwd_kwargs(blocks, x, rescale, cscale, shift, weight):
    """Launcher kwargs for ``kernels.oft_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), x.dtype, blocks.dtype, rescale is None, weight, dev)
    hit = _F_FWD.get(fk)
    if hit is not None:
        return hit
    K, S, npos, c_contig, key = _key(blocks, x, rescale, weight, {})
    return tune.pick(
        "oft_fwd", BACKEND, key,
        lambda: plan_oft_fwd(facts(dev), K, S, npos, c_contig, x.dtype, blocks.dtype, default=as_dict(kernels.fwd_cfg(S))),
        lambda kw: kernels.oft_fwd(blocks, x, rescale, cscale, shift, weight, **kw),
        lambda: reference.oft_fwd_native(blocks, x, rescale, cscale, shift, weight),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.OftCfg(**c)}, front=(_F_FWD, fk), prepare=precompile.precompile)


def oft_bwd_kwargs(grad, blocks, x, rescale, cscale, shift, weight):
    """Launcher kwargs for ``kernels.oft_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), grad.dtype, x.dtype, blocks.dtype, rescale is None, weight, dev)
    hit = _F_BWD.get(fk)
    if hit is not None:
        return hit
    K, S, npos, c_contig, key = _key(blocks, x, rescale, weight, {"g": grad.dtype})
    return tune.pick(
        "oft_bwd", BACKEND, key,
        lambda: plan_oft_bwd(facts(dev), K, S, npos, c_contig, x.dtype, blocks.dtype, default=as_dict(kernels.OftCfg())),
        lambda kw: kernels.oft_bwd(grad, blocks, x, rescale, cscale, shift, weight, **kw),
        lambda: reference.oft_bwd_native(grad, blocks, x, rescale, cscale, shift, weight),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.OftCfg(**c)}, front=(_F_BWD, fk), prepare=precompile.precompile)


KWARGS = {"oft_fwd": oft_fwd_kwargs, "oft_bwd": oft_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"oft_fwd": kernels.oft_fwd, "oft_bwd": kernels.oft_bwd}
