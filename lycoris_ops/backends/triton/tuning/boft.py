"""Tuned launch configs of the Triton BOFT kernels (``kernels/boft.py``): ``boft_fwd`` and
``boft_bwd``. Work model: ``tuner/models/boft.py`` (segments of butterfly stages). Key:
exact m, nb, s, bucketed positions, channel contiguity, rescale / diff, dtypes.

Shortlist (``cost.make_shared_plan``): every candidate has the first one's segments
(``max_group``), so the Cayley, group-matrix and chain launches compile once per key and
the candidates differ in the streaming kernels' tiles, warps and stages (streamed tiles of
at most ``STREAM_TILE_MAX`` fp32 elements); one segment: 2 + 5 compiles forward, 3 + 5
backward.
"""
from __future__ import annotations

import functools

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import boft as kernels, cayley, oft as oft_kernels
from lycoris_ops.reference import boft as reference
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import STREAM_TILE_MAX, esize, make_shared_plan, p2, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import boft as models
from lycoris_ops.backends.triton.tuning.oft import with_split16

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, cayley, oft_kernels, reference)


def _plan(op, dev, m, nb, s, npos, c_contig, bwd, ex, eb, default, n):
    SP = 2 * p2(s // 2)
    seen = {}
    work, eager = models.model(dev, m, nb, s, npos, c_contig, bwd, ex, eb, auto_split=kernels.auto_split,
                               chain_warps=kernels.chain_warps, cayley_warps=kernels.CAYLEY_WARPS, seen=seen)

    def structure(c):  # the segments: (stages, group rows) each; they decide every auxiliary launch
        segs = models.segments(m, nb, s, npos, dev.sm_count, c["max_group"], 64, auto_split=kernels.auto_split)[0]
        return tuple((L, GP) for L, GP, _, _ in segs), \
            c.get("chain_warps", 0)

    def compiles_ok(c):  # streamed tiles (x; G and x in the backward) within STREAM_TILE_MAX fp32 elements
        GP = structure(c)[0][0][1]
        lim = STREAM_TILE_MAX
        return (2 * GP * c["bwd_block_p"] <= lim and GP * c["block_p"] <= lim) if bwd else GP * c["block_p"] <= lim

    def compiles(c):  # the Triton compilations of a config (backends/triton/kernels/boft.py: constexprs, dtypes, launch options)
        # the segments at the streaming tile (their splits decide where the chain runs); (L, GP) is
        # the same at any tile: ``structure``'s
        full = models.segments(m, nb, s, npos, dev.sm_count, c["max_group"], c["bwd_block_p"] if bwd else c["block_p"],
                               auto_split=kernels.auto_split)[0]
        segs, cw = tuple((L, GP) for L, GP, _, _ in full), c.get("chain_warps", 0)
        run = (c["num_warps"], c["num_stages"], c["dot_prec"])
        warps = kernels.chain_warps(cw, segs[0][1])
        small = kernels.one_algebra_launch(m * nb, SP, sum(sg[2] for sg in full))
        if small:  # the stage algebra as one program
            out = {("algebra", SP, segs[0][1], warps)}
        else:
            out = {("cayley", SP), ("segmat", segs[0][1], warps)}
        last = len(segs) - 1
        for idx, (L, GP) in enumerate(segs):
            if not bwd:
                out.add(("seg_fwd", GP, idx == 0, idx == last, c["block_p"]) + run)
                continue
            if idx < last:  # the segment inputs, forward passes at block_p
                out.add(("seg_fwd", GP, idx == 0, False, c["block_p"]) + run)
            chain_in = small and full[idx][3] == 1  # the chain inside the streaming program
            out.add(("seg_bwd", GP, idx == 0, idx == last, c["bwd_block_p"], chain_in) + run)
            if not chain_in:
                out.add(("chain", GP, kernels.chain_warps(cw, GP)))
        return out

    bps = (32, 64, 128) if bwd else (32, 64, 128, 256)
    # backward configs: the forward passes (segment inputs) at the streaming tile too, so a
    # backward config with the forward's best tile reuses the forward's compiled kernels
    cfgs = [dict(max_group=g, block_p=bp, bwd_block_p=bp if bwd else 64, split=0, num_warps=w,
                 num_stages=st, dot_prec="tf32x3", chain_warps=0)
            for g in (16, 32, 64) for bp in bps for w in (4, 8) for st in (1, 2, 3)]
    cfgs = [c for c in cfgs if compiles_ok(c)]
    ranked = rank(cfgs, work, dev)
    seen.clear()
    # a 16-bit backward's split16 / bf16x3 twin takes the place of the model's last pick: within COMPILE_BUDGET
    plan = make_shared_plan(op, ranked, kernels=compiles, structure=structure,
                            tile_axes=("bwd_block_p" if bwd else "block_p", "num_warps"),
                            n=n - 1 if bwd and ex == 2 else n, default=default,
                            default_s=predict(work, default, dev), eager_s=eager)
    # x and blocks 16-bit (so y, gx and g_blocks too): bf16x3 on the fp32 scratch, split16 on x
    # and G (oft_kernels.BF16X3); blocks fp32: split16 only (g_blocks keeps fp32 accuracy)
    return with_split16(plan, ex, kernels.BF16X3 if eb == 2 else "")


def plan_boft_fwd(dev: DeviceFacts, m: int, nb: int, s: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                  default=None, n: int = 5):
    return _plan("boft_fwd", dev, m, nb, s, npos, c_contig, False, esize(x_dtype), esize(blocks_dtype), default, n)


def plan_boft_bwd(dev: DeviceFacts, m: int, nb: int, s: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                  default=None, n: int = 5):
    return _plan("boft_bwd", dev, m, nb, s, npos, c_contig, True, esize(x_dtype), esize(blocks_dtype), default, n)


_F_FWD, _F_BWD = tune.Front(), tune.Front()


def boft_fwd_kwargs(blocks, x, axis, cscale, scale, rescale, diff):
    """Launcher kwargs for ``kernels.boft_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), axis, x.dtype, blocks.dtype, rescale is None, diff, dev)
    hit = _F_FWD.get(fk)
    if hit is not None:
        return hit
    m, nb, s, npos, c_contig = models.geometry(blocks, x, axis)
    key = tune.shape_key(x.dtype, tokens={"P": npos}, exact={"m": m, "nb": nb, "s": s},
                         flags={"blocks": blocks.dtype, "c_contig": c_contig, "rescale": rescale is not None,
                                "diff": bool(diff)})
    return tune.pick(
        "boft_fwd", BACKEND, key,
        lambda: plan_boft_fwd(facts(dev), m, nb, s, npos, c_contig, x.dtype, blocks.dtype,
                              default=as_dict(kernels.default_boft_cfg(s))),
        lambda kw: kernels.boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, **kw),
        lambda: reference.boft_fwd_native(blocks, x, axis, cscale, scale, rescale, diff),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.BoftCfg(**c)}, front=(_F_FWD, fk), prepare=precompile.precompile)


def boft_bwd_kwargs(grad, blocks, x, axis, cscale, scale):
    """Launcher kwargs for ``kernels.boft_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), axis, grad.dtype, x.dtype, blocks.dtype, dev)
    hit = _F_BWD.get(fk)
    if hit is not None:
        return hit
    m, nb, s, npos, c_contig = models.geometry(blocks, x, axis)
    key = tune.shape_key(x.dtype, tokens={"P": npos}, exact={"m": m, "nb": nb, "s": s},
                         flags={"blocks": blocks.dtype, "g": grad.dtype, "c_contig": c_contig})
    return tune.pick(
        "boft_bwd", BACKEND, key,
        lambda: plan_boft_bwd(facts(dev), m, nb, s, npos, c_contig, x.dtype, blocks.dtype,
                              default=as_dict(kernels.default_boft_cfg(s))),
        lambda kw: kernels.boft_bwd(grad, blocks, x, axis, cscale, scale, **kw),
        lambda: reference.boft_bwd_native(grad, blocks, x, axis, cscale, scale),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.BoftCfg(**c)}, front=(_F_BWD, fk), prepare=precompile.precompile)


KWARGS = {"boft_fwd": boft_fwd_kwargs, "boft_bwd": boft_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"boft_fwd": kernels.boft_fwd, "boft_bwd": kernels.boft_bwd}
