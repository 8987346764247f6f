"""Cost models and tuned launch configs of the Triton diag-OFT kernels
(``lycoris_ops/triton/oft.py``): ``oft_fwd`` and ``oft_bwd``.

A program owns a group of NB blocks (GP = NB·pow2(S) channel rows, at least
16, ``group`` rows when set) and a share of the positions (``split`` programs
per group): it rebuilds its Cayley factors in fp32 registers (batched
Gauss–Jordan, ~4·S³ flops per block, repeated per program), then streams
``block_p`` positions per tile with one GP x GP x block_p dot (tf32x3 on fp32
tiles: counted as 3 tensor-core passes). The backward also accumulates
P = Σ G·Xᵀ (a second dot per tile) into fp32 partials, then a tiny chain launch.

Model: x (and G) read once, y (gx) written once; registers = the GP x block_p
tile + the GP x GP factor. Key: exact K, S, bucketed positions, channel
contiguity, rescale present, dtypes.

Shortlist (``cost.make_shared_plan``): every kernel variant rebuilds the Cayley
factors in registers, so each costs a full compile (0.5-1 s, sm_90): at most 4
fused candidates, streamed tiles of at most ``STREAM_TILE_MAX`` fp32 elements;
the backward's candidates share the first one's channel group (NB), so the
chain kernel (its config = NB) compiles once per key: 1 + 4 compiles.
"""
from __future__ import annotations

import functools

from . import tune
from ._glue import as_dict, rand, reference_module, triton_module
from .cost import STREAM_TILE_MAX, Work, cdiv, eager_time, esize, make_shared_plan, p2, predict, rank
from .device import DeviceFacts, facts

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)
FAMILY = "oft"


def _tl():
    return triton_module(FAMILY)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(_tl(), triton_module("_cayley"))


def _group(K, S, c_contig, group, sm, bp, npos):
    SP = p2(S)
    want = group or (32 if c_contig else 16)
    NB = max(1, max(16, want) // SP)
    n_groups = cdiv(K, NB)
    n_tiles = cdiv(npos, bp)
    split = max(1, min(cdiv(4 * sm, max(1, n_groups)), n_tiles))
    return SP, NB, NB * SP, n_groups, n_tiles, split


def _sector(run_bytes):
    return max(1.0, 32.0 / max(run_bytes, 1))


def _plan(op, dev, K, S, npos, c_contig, bwd, ex, eb, default, n):
    C = K * S
    seen = {}

    def work(c):
        bp = c["bwd_block_p"] if bwd else c["block_p"]
        SP, NB, GP, n_groups, n_tiles, split = _group(K, S, c_contig, c["group"], dev.sm_count, bp, npos)
        sig = (NB, bp, c["num_warps"], c["num_stages"])
        if seen.setdefault(sig, id(c)) != id(c):
            return None
        grid = n_groups * split
        sector = _sector((GP if c_contig else bp) * ex)
        streams = 3 if bwd else 2  # x, y (+ G)
        cay = grid * NB * 4.0 * SP ** 3
        dots = (2 if bwd else 1) * 3 * 2.0 * GP * GP * n_tiles * bp * n_groups
        works = [Work(grid=grid, warps=c["num_warps"], stages=c["num_stages"],
                      acc=GP * bp * (2 if bwd else 1) + GP * GP * (2 if bwd else 1),
                      smem=GP * bp * ex * (2 if bwd else 1), dram=npos * C * ex * streams * sector
                      + grid * NB * S * S * eb + (split * n_groups * GP * GP * 4 if bwd else 0),
                      mma=dots, fma=cay)]
        if bwd:
            works.append(Work(grid=n_groups, warps=c.get("chain_warps", 4), acc=3 * GP * GP,
                              dram=split * n_groups * GP * GP * 4 + 2 * C * S * eb, fma=n_groups * NB * 8.0 * SP ** 3,
                              inflight=GP * GP * 4))
        return works

    def geometry(c):  # (NB, positions per tile) of the streaming kernel
        bp = c["bwd_block_p"] if bwd else c["block_p"]
        return _group(K, S, c_contig, c["group"], dev.sm_count, bp, npos)[1], bp

    def compiles_ok(c):  # streamed tiles (x; G and x in the backward) within STREAM_TILE_MAX
        NB, bp = geometry(c)
        return (2 if bwd else 1) * NB * p2(S) * bp <= STREAM_TILE_MAX

    def kernels(c):  # the Triton compilations of a config (triton/oft.py: constexprs and launch options)
        NB, bp = geometry(c)
        main = ("stream" if bwd else "fwd", NB, bp, c["num_warps"], c["num_stages"], c["dot_prec"])
        return {main, ("chain", NB, c.get("chain_warps", 4))} if bwd else {main}

    bps = (32, 64, 128, 256)
    cfgs = [dict(block_p=128 if bwd else bp, group=g, split=0, num_warps=w, num_stages=s, dot_prec="tf32x3",
                 bwd_block_p=bp if bwd else 64, chain_warps=4)
            for bp in (bps[:3] if bwd else bps) for g in (0, 32, 64) for w in (4, 8) for s in (1, 2, 3)]
    cfgs = [c for c in cfgs if compiles_ok(c)]
    steps = [(K * S * S * (eb + 4), 0), (K * S * S * 4 * 4, K * 4.0 * S ** 3), (npos * C * (ex + 4), 0),
             (npos * C * 4 * 2, 2.0 * npos * C * S), (npos * C * (4 + ex), 0)]
    if bwd:
        steps = steps * 2
    ranked = rank(cfgs, work, dev)
    seen.clear()
    return make_shared_plan(op, ranked, kernels=kernels, structure=(lambda c: geometry(c)[0]) if bwd else None,
                            tile_axes=("bwd_block_p" if bwd else "block_p", "group"), n=n, default=default,
                            default_s=predict(work, default, dev), eager_s=eager_time(dev, steps, tc=False))


def plan_oft_fwd(dev: DeviceFacts, K: int, S: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                 default=None, n: int = 4):
    return _plan("oft_fwd", dev, K, S, npos, c_contig, False, esize(x_dtype), esize(blocks_dtype), default, n)


def plan_oft_bwd(dev: DeviceFacts, K: int, S: int, npos: int, c_contig: bool, x_dtype, blocks_dtype, *,
                 default=None, n: int = 4):
    return _plan("oft_bwd", dev, K, S, npos, c_contig, True, esize(x_dtype), esize(blocks_dtype), default, n)


def geometry(x, weight: bool):
    """(npos, c_contig) of x around its rotated axis (see triton/oft.py)."""
    ax = 0 if weight else (1 if x.dim() >= 3 else x.dim() - 1)
    npos = 1
    for i, s in enumerate(x.shape):
        if i != ax:
            npos *= int(s)
    return npos, x.stride(ax) == 1


def launch(op: str, *args, **kw):
    """Run ``op`` (schema arguments) through its Triton launcher with the config keyword
    arguments ``kw`` (``{}``: the launcher's defaults) - what the op-set function does."""
    TL = _tl()
    return {"oft_fwd": TL.oft_fwd, "oft_bwd": TL.oft_bwd}[op](*args, **kw)


_F_FWD, _F_BWD = tune.Front(), tune.Front()


def _key(blocks, x, rescale, weight, extra):
    npos, c_contig = geometry(x, weight)
    K, S = int(blocks.shape[0]), int(blocks.shape[1])
    key = tune.shape_key(x.dtype, tokens={"P": npos}, exact={"K": K, "S": S},
                         flags={"blocks": blocks.dtype, "c_contig": c_contig, "weight": weight,
                                "rescale": rescale is not None, **extra})
    return K, S, npos, c_contig, key


def oft_fwd_kwargs(blocks, x, rescale, cscale, shift, weight):
    """Launcher kwargs for ``triton.oft.oft_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), x.dtype, blocks.dtype, rescale is None, weight, dev)
    hit = _F_FWD.get(fk)
    if hit is not None:
        return hit
    K, S, npos, c_contig, key = _key(blocks, x, rescale, weight, {})
    TL = _tl()
    return tune.pick(
        "oft_fwd", BACKEND, key,
        lambda: plan_oft_fwd(facts(dev), K, S, npos, c_contig, x.dtype, blocks.dtype, default=as_dict(TL.OftCfg())),
        lambda kw: launch("oft_fwd", blocks, x, rescale, cscale, shift, weight, **kw),
        lambda: reference_module(FAMILY).oft_fwd(blocks, x, rescale, cscale, shift, weight),
        device=dev, version=version(), resolve=lambda c: {"cfg": TL.OftCfg(**c)}, front=(_F_FWD, fk))


def oft_bwd_kwargs(grad, blocks, x, rescale, cscale, shift, weight):
    """Launcher kwargs for ``triton.oft.oft_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (blocks.shape, x.shape, x.stride(), grad.dtype, x.dtype, blocks.dtype, rescale is None, weight, dev)
    hit = _F_BWD.get(fk)
    if hit is not None:
        return hit
    K, S, npos, c_contig, key = _key(blocks, x, rescale, weight, {"g": grad.dtype})
    TL = _tl()
    return tune.pick(
        "oft_bwd", BACKEND, key,
        lambda: plan_oft_bwd(facts(dev), K, S, npos, c_contig, x.dtype, blocks.dtype, default=as_dict(TL.OftCfg())),
        lambda kw: launch("oft_bwd", grad, blocks, x, rescale, cscale, shift, weight, **kw),
        lambda: reference_module(FAMILY).oft_bwd(grad, blocks, x, rescale, cscale, shift, weight),
        device=dev, version=version(), resolve=lambda c: {"cfg": TL.OftCfg(**c)}, front=(_F_BWD, fk))


def samples(layer, T: int, dtype, device, gen):
    """Diag-OFT (block size 16 when it divides the features, else 8/4) on a linear layer's
    input (T x in) for ``tune.warmup``."""
    I = layer.in_features
    S = next((s for s in (16, 8, 4, 2) if I % s == 0), None)
    if S is None:
        return []
    blocks = rand((I // S, S, S), dtype, device, gen, 0.01)
    x = rand((T, I), dtype, device, gen)
    return [("oft_fwd", (blocks, x, None, 1.0, False, False)),
            ("oft_bwd", (rand((T, I), dtype, device, gen), blocks, x, None, 1.0, False, False))]


#: op name -> the function giving its launcher kwargs (schema arguments)
KWARGS = {"oft_fwd": oft_fwd_kwargs, "oft_bwd": oft_bwd_kwargs}
