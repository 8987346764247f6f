"""Cost model and tuned launch config of the Triton tucker rebuild
(``lycoris_ops/backends/triton/kernels/tucker.py``): ``lora_tucker_fwd``.

A first kernel builds ``AT = a·t`` (O, R', Kk); then the main kernel's program owns
``block_o`` output rows o (a loop) by ``block_i`` columns i: per o, one dot of
(block_i, R') × (R', KKP) per chain (KKP: Kk padded to a power of two, at least 16),
stored as it is, one contiguous run of ``block_i·Kk`` elements. Write-bound for small
ranks: O·I·Kk outputs; the KKP padding wastes dot work (not bytes); AT is re-read from
L2 once per column tile. Key: exact O, I, Kk and ranks, dtypes.
"""
from __future__ import annotations

import functools
import importlib

import torch

from lycoris_ops.tuner import tune
from lycoris_ops.backends.triton.tuning.glue import as_dict, compute_dtype, rand, reference_module, triton_module
from lycoris_ops.tuner.cost import (Work, cdiv, eager_time, esize, make_plan, p2, predict, rank, tl_shortlist, tl_threads)
from lycoris_ops.tuner.device import DeviceFacts, facts

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)
FAMILY = "tucker"


def _tl():
    return triton_module(FAMILY)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(_tl(), triton_module("fusedkit"))


def plan_tucker_fwd(dev: DeviceFacts, O: int, I: int, Kk: int, ranks, compute, out_dtype, *, default=None,
                    n: int = 5):
    e, eo = esize(compute), esize(out_dtype)
    tc = compute != torch.float32
    two = len(ranks) == 4
    chains = 2 if two else 1
    rps = [p2(r, 16) for r in ranks]
    ra, rb = max(ranks[0::2]), max(rps[1::2])

    def work(c):
        bo, bi, opk = c["block_o"], c["block_i"], c["o_pack"]
        kkp = _tl().pack_width(Kk, opk) / opk  # the dot's columns per output row o
        n_o, n_i = cdiv(O, bo), cdiv(I, bi)
        prep = Work(grid=cdiv(O, 64) * cdiv(rb * kkp, 64), dram=chains * (O * ra + ra * rb * Kk + O * rb * kkp) * e,
                    mma=chains * 2.0 * O * ra * rb * Kk, tc=tc, name="a.t")
        main = Work(grid=n_o * n_i, warps=c["num_warps"], stages=c["num_stages"],
                    acc=chains * bi * kkp, regs=chains * (bi * rb + rb * kkp) // 2,
                    smem=chains * rb * kkp * e,
                    dram=O * I * Kk * eo + chains * (O * rb * kkp * e + rb * I * e * min(n_o, 8)),
                    mma=chains * 2.0 * O * bi * n_i * rb * kkp, tc=tc, inflight=bi * Kk * eo * 2,
                    mma_tile=bi * kkp * rb)
        return [main, prep]

    # fp32 (FMA dots): one row per dot or the packed rows; 16-bit (tensor cores, write-bound): one row
    packs = sorted({1, _tl().o_pack_for(Kk, 32)}) if not tc else [1]
    cfgs = [dict(block_o=bo * opk, block_i=bi, group_o=8, num_warps=w, num_stages=s, o_pack=opk)
            for opk in packs for bo in (4, 8, 16, 32) for bi in (32, 64, 128, 256) for w in (4, 8)
            for s in (1, 2, 3)]
    eager = eager_tucker(dev, O, I, Kk, max(ranks), chains, e, eo, tc)
    return make_plan("lora_tucker_fwd", rank(cfgs, work, dev), tile_axes=("block_o", "block_i", "o_pack"), n=n,
                     default=default, default_s=predict(work, default, dev), eager_s=eager)


def eager_tucker(dev: DeviceFacts, O: int, I: int, Kk: int, R: int, chains: int, e: int, eo: int,
                 tc: bool) -> float:
    """The eager body's time (``reference.lora.lora_tucker_fwd``). One chain: AT = a·t (a GEMM,
    rounded), AT's rows (o, κ) copied out, one GEMM of (O·Kk, R)·(R, I) with γ and the rounding
    in its epilogue, then the (o, κ, i) -> (o, i, κ) copy the contiguous output needs. Two
    chains: each chain's GEMM in fp32 through a permuted view, the product, the cast."""
    core = [(O * R * e + R * R * Kk * e + O * R * Kk * (4 + e), 2.0 * O * R * R * Kk), (2 * O * R * Kk * e, 0)]
    out = O * I * Kk
    if chains == 1:
        return eager_time(dev, core + [(O * R * Kk * e + R * I * e + out * eo, 2.0 * out * R),
                                       (2 * out * eo, 0)], tc=tc)
    chain = core + [(O * R * Kk * e + R * I * e + out * 4, 2.0 * out * R)]
    return eager_time(dev, chain * 2 + [(out * 4 * 3, 0), (out * (4 + 4), 0), (out * (4 + eo), 0)], tc=tc)


# =============================================================================== TileLang model

#: ``backends/tilelang/kernels/tucker.py``'s kernel: output tile (BO rows x BI columns per kernel position)
#: and threads (256 only with 128-row tiles); the corners compile for sm_90a
#: (tests/test_tilelang_lora.py)
TL_SPACE = dict(BO=(64, 128), BI=(32, 64, 128, 256), threads=(128, 256))
TL_N = 3


def _tl_plan(dev: DeviceFacts, a1, t1, b1, a2, t2, b2, gamma, n: int = TL_N):
    """The TileLang shortlist: fixed config first, the model's best, eager. Model: per chain a
    (BO x Rap)·(Rap x Rbp) dot, rounded, then (BO x Rbp)·(Rbp x BI); the output written once,
    the factors read per program from L2. Where the staged tile fits
    (``all_k_fits``), program = (I tile, O tile) over every κ, the (BO, BI·Kk) output tile in
    shared memory; else program = (κ, I tile, O tile) with κ-strided stores (a sector a store)."""
    tl = importlib.import_module("lycoris_ops.backends.tilelang.kernels.tucker")
    two = a2 is not None
    chains = 2 if two else 1
    O, I, Kk = int(a1.shape[0]), int(b1.shape[1]), int(t1.shape[2])
    ranks = [int(t1.shape[0]), int(t1.shape[1])] + ([int(t2.shape[0]), int(t2.shape[1])] if two else [])
    compute = compute_dtype(*(t.dtype for t in (a1, t1, b1, a2, t2, b2) if t is not None))
    e, eo = esize(compute), esize(a1.dtype)
    rpa, rpb = max(p2(r, 16) for r in ranks[0::2]), max(p2(r, 16) for r in ranks[1::2])

    def work(c):
        bo, bi = c["BO"], c["BI"]
        n_o, n_i = cdiv(O, bo), cdiv(I, bi)
        all_k = tl.all_k_fits(bo, bi, Kk, rpa, rpb, chains, e, eo)
        per_chain = chains * (bo * rpa + rpa * rpb + bo * rpb + rpb * bi) * e
        out = O * I * Kk * eo
        return Work(grid=(1 if all_k else Kk) * n_o * n_i, warps=c["threads"] // 32,
                    acc=chains * (bo * bi + bo * rpb),
                    smem=per_chain + (bo * bi * Kk * eo if all_k else 0),
                    # per-κ stores are 2 bytes Kk·2 apart: a 32-byte sector written per element
                    dram=(out if all_k else out // eo * 32)
                    + chains * (O * rpa + rpb * I) * e * (1 if all_k else min(Kk, 8)),
                    mma=chains * 2.0 * Kk * n_o * n_i * (bo * rpa * rpb + bo * rpb * bi), tc=True,
                    mma_tile=bo * bi * rpb, inflight=bo * bi * (Kk if all_k else 1) * eo)

    default = dict(tl.TUCKER)
    cfgs = [dict(BO=bo, BI=bi, threads=t) for bo in TL_SPACE["BO"] for bi in TL_SPACE["BI"]
            for t in tl_threads(TL_SPACE["threads"], bo)]
    eager = eager_tucker(dev, O, I, Kk, max(ranks), chains, e, eo, True)
    return tl_shortlist("lora_tucker_fwd", cfgs, work, dev, default, eager, ("BO", "BI"), n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key); ``backends/tilelang/runner.py``
TILELANG = {"lora_tucker_fwd": (_tl_plan, lambda a1, t1, b1, a2, t2, b2, *a: (
    tuple(a1.shape), tuple(t1.shape), tuple(b1.shape), None if t2 is None else tuple(t2.shape)))}


def launch(op: str, *args, **kw):
    """Run ``op`` (schema arguments) through its Triton launcher with the config keyword
    arguments ``kw`` (``{}``: the launcher's defaults) - what the op-set function does."""
    TL = _tl()
    return {"lora_tucker_fwd": TL.tucker_fwd}[op](*args, **kw)


_FRONT = tune.Front()


def tucker_fwd_kwargs(a1, t1, b1, a2, t2, b2, gamma):
    """Launcher kwargs for ``triton.tucker.tucker_fwd`` (or SENTINEL_EAGER)."""
    dev = a1.device
    if dev.type not in DEVICE_TYPES:
        return {}
    two = a2 is not None
    fk = (a1.shape, t1.shape, b1.shape, None if not two else (t2.shape, a2.dtype, t2.dtype, b2.dtype),
          a1.dtype, t1.dtype, b1.dtype, dev)
    hit = _FRONT.get(fk)
    if hit is not None:
        return hit
    O, I, Kk = int(a1.shape[0]), int(b1.shape[1]), int(t1.shape[2])
    ranks = (int(t1.shape[0]), int(t1.shape[1])) + ((int(t2.shape[0]), int(t2.shape[1])) if two else ())
    compute = compute_dtype(*(t.dtype for t in (a1, t1, b1, a2, t2, b2) if t is not None))
    TL = _tl()
    key = tune.shape_key(compute, exact={"O": O, "I": I, "Kk": Kk, "ranks": ranks}, flags={"out": a1.dtype})
    if TL.one_launch(O, I, Kk, ranks[1::2], compute):
        # one program building its own AT: launch-bound (a few µs of device time), so no tile is
        # worth the second launch a timed pick may bring (a multi-program tile needs AT first)
        _FRONT[fk] = {}
        return {}
    d = TL.default_tucker_cfg(O, I, Kk, max(ranks), two, compute)
    default = as_dict(d)
    return tune.pick(
        "lora_tucker_fwd", BACKEND, key,
        lambda: plan_tucker_fwd(facts(dev), O, I, Kk, ranks, compute, a1.dtype, default=default),
        lambda kw: launch("lora_tucker_fwd", a1, t1, b1, a2, t2, b2, gamma, **kw),
        lambda: reference_module("lora").lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": TL.TuckerCfg(**c)}, front=(_FRONT, fk))


def samples(layer, T: int, dtype, device, gen):
    """A 3x3 conv LoCon tucker rebuild (out x in, rank) for ``tune.warmup``."""
    O, I, r = layer.out_features, layer.in_features, min(layer.rank, 64)
    return [("lora_tucker_fwd", (rand((O, r), dtype, device, gen, 0.1), rand((r, r, 9), dtype, device, gen, 0.1),
                                 rand((r, I), dtype, device, gen, 0.1), None, None, None, 1.0))]


#: op name -> the function giving its launcher kwargs (schema arguments)
KWARGS = {"lora_tucker_fwd": tucker_fwd_kwargs}
