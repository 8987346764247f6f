"""TileLang tuning spaces of the LoRA / LoCon kernels (``backends/tilelang/kernels/lora.py``):
``lora_bypass_fwd``, ``lora_bypass_bwd``, ``lora_merge_fwd``, ``lora_merge_bwd``, scored by the
Triton kernels' work models (``tuner/models/lora.py``) with the names mapped."""
from __future__ import annotations

import torch

from lycoris_ops.backends.tilelang.kernels import lora as kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner.cost import (add_before_eager, add_second, esize, p2, predict, rank, smem_fits, tl_shortlist,
                                    tl_stages, tl_threads)
from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.models import lora as models

#: threads per program: one or two warpgroups (sm_90's WGMMA issues per 128 threads; two only
#: with 128-row tiles, one warpgroup per 64 rows)
TL_THREADS = (128, 256)
#: The skinny kernel's and the backward token kernel's spaces stay at their fixed stages and
#: threads: TileLang's lowering rejects 3 stages over the skinny kernel's runtime K-loop length
#: ("Downcast from tirx.Sub to ir.IntImm") and the token kernel with 128-row tiles and 256
#: threads ("Not a canonical GMMA_MN layout"). Every corner of every space below compiles for
#: sm_90a (tests/tilelang/test_tilelang_lora.py: test_tile_space_corners_*).
TL_SKINNY = dict(BM=(64,), BK=(32, 64), stages=(2,), threads=(128,))
#: ``merge_bwd_pair_kernel``'s space (a static K loop: deeper pipelines lower; 128-wide K steps
#: and 3-4 stages measured fastest)
TL_PAIR = dict(BM=(64,), BK=(64, 128), stages=(2, 3, 4), threads=(128,))
TL_TOKEN = dict(BT=(64,), BI=(64, 128, 256), BK=(32, 64), stages=(2,), threads=(0,))
#: the bypass forward's space (threads 256 only with 128-row tiles: ``cost.tl_threads``; stages
#: also within the device's pipeline depths)
TL_BYPASS_FWD = dict(BT=(64, 128), BO=(64, 128, 256), BK=(32, 64, 128), stages=(2, 3, 4), threads=TL_THREADS)
#: ``merge_stream_kernel``'s row tile, column stripe, stages, threads (256-wide stripes, 128-row
#: tiles and 3 stages measured slower)
TL_MERGE_STREAM = dict(BM=(64,), BN=(64, 128), stages=(2,), threads=(128,))


def tl_plan_bypass_fwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, out_dtype,
                       has_base: bool, *, n: int = TL_N):
    """``bypass_fwd_kernel``'s shortlist: (BT token rows, BO output columns, BK reduction step,
    stages, threads), the Triton model with its names mapped (BK = block_i, one O range split
    as the launcher's ``_per``); configs whose shared memory (the staged output and base tiles
    included) does not fit are left out. Second: the fixed config with the x·downᵀ loop at the
    device's deepest pipeline (the model picks tiles, not depths), where that depth differs
    from the fixed config's: on devices with cp.async (depths up to 4) the fixed config runs 4
    itself and no twin is added; without it the twin runs the fixed tile at 2."""
    work, eager = models.bypass_fwd_model(dev, T, I, O, R, compute, x_dtype, out_dtype, has_base)
    e, eo = esize(compute), esize(out_dtype)
    rp = p2(R, 16)

    def tl_work(c):
        bt, bo, bk = c["BT"], c["BO"], c["BK"]
        smem = (c["stages"] * (bt + rp) * bk + bt * rp + 2 * bo * rp) * e
        smem += bt * bo * (eo + (eo if has_base else 0))  # the staged output and base tiles
        if not smem_fits(dev, smem):  # every buffer (TileLang may overlap those that never live together)
            return None
        return work(dict(block_t=c["BT"], block_i=c["BK"], block_o=c["BO"], o_split=0,
                         num_warps=c["threads"] // 32, num_stages=c["stages"]))

    sp = TL_BYPASS_FWD
    cfgs = [dict(BT=bt, BO=bo, BK=bk, stages=s, threads=th) for bt in sp["BT"] for bo in sp["BO"]
            for bk in sp["BK"] for s in tl_stages(dev, sp["stages"]) for th in tl_threads(sp["threads"], bt)]
    fixed = dict(kernels.BYPASS_FWD)
    plan = tl_shortlist("lora_bypass_fwd", cfgs, tl_work, dev, fixed, eager, ("BT", "BO", "BK"), n)
    deep = {**fixed, "stages": max(tl_stages(dev, sp["stages"]))}
    if deep not in plan.candidates and tl_work(deep) is not None:
        add_second(plan, deep, predict(tl_work, deep, dev))
    return plan


def tl_plan_bypass_bwd(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, g_dtype, *,
                       n: int = TL_N):
    """``bypass_bwd``'s shortlist: the token kernel (BT, BI, BK, stages, threads) with the skinny
    pair's best (sBM, sBK) for the tokens."""
    tok, red, eager = models.bypass_bwd_model(dev, T, I, O, R, compute, x_dtype, g_dtype)
    rp = p2(R, 16)

    def tl_red(c):
        return red(dict(block_m=c["sBM"], block_k=c["sBK"], block_r=0, split=0, num_warps=4, num_stages=2,
                        reduce_block=1024))

    def tl_work(c):
        threads = c["threads"] or (256 if rp >= 128 else 128)
        a = tok(dict(block_t=c["BT"], block_i=c["BI"], block_o=c["BK"], i_split=0, num_warps=threads // 32,
                     num_stages=c["stages"]))
        b = tl_red(c)
        return None if a is None or b is None else [a] + b

    reds = rank([dict(sBM=bm, sBK=bk) for bm in TL_SKINNY["BM"] for bk in TL_SKINNY["BK"]], tl_red, dev)
    red0 = reds[0][1] if reds else dict(sBM=64, sBK=64)
    cfgs = [dict(BT=bt, BI=bi, BK=bk, stages=s, threads=th, **red0) for bt in TL_TOKEN["BT"] for bi in TL_TOKEN["BI"]
            for bk in TL_TOKEN["BK"] for s in TL_TOKEN["stages"] for th in TL_TOKEN["threads"]]
    return tl_shortlist("lora_bypass_bwd", cfgs, tl_work, dev, dict(kernels.BYPASS_BWD), eager, ("BT", "BI", "BK"), n)


def tl_plan_merge_fwd(dev: DeviceFacts, O: int, I: int, R1: int, R2: int, mode: str, compute, out_dtype,
                      base_dtype, *, n: int = TL_N):
    """The merge's shortlist: ``merge_stream_kernel``'s fixed config, the stream configs whose
    shared memory fits (``stream_smem``; scored as a GEMM tile of the whole rank), then
    ``gemm_kernel``'s fixed config (a config with ``BK`` runs it), timed against them."""
    work, eager, rmax = models.merge_fwd_model(dev, O, I, R1, R2, mode, compute, out_dtype, base_dtype)
    kcap = max(16, p2(rmax))
    e, eo = esize(compute), esize(out_dtype)
    eb = esize(base_dtype)
    chains = 1 if mode == "plain" else 2

    def stream_work(c):
        if not smem_fits(dev, kernels.stream_smem(c["BM"], c["BN"], c["stages"], R1, R2 if chains == 2 else None, e,
                                                  eb if base_dtype is not None else 0, eo)):
            return None
        return work(dict(block_o=c["BM"], block_i=c["BN"], block_r=kcap, num_warps=c["threads"] // 32,
                         num_stages=c["stages"]))

    sp = TL_MERGE_STREAM
    cfgs = [dict(BM=bm, BN=bn, stages=st, threads=th) for bm in sp["BM"] for bn in sp["BN"] for st in sp["stages"]
            for th in sp["threads"]]
    plan = tl_shortlist("lora_merge_fwd", cfgs, stream_work, dev, dict(kernels.MERGE_STREAM), eager, ("BM", "BN"), n)
    add_before_eager(plan, dict(kernels.MERGE_FWD))
    return plan


def tl_plan_merge_bwd(dev: DeviceFacts, O: int, I: int, R: int, compute, g_dtype, out_dtype, *, n: int = TL_N):
    """``merge_bwd``'s shortlist for the pair G·downᵀ, Gᵀ·up (one launch, a program per row band,
    no split): (BM rows, BK reduction step, stages, threads), the pair tiles whose shared memory
    fits (``pair_smem``), ranked by the skinny model without a split."""
    e, eg, eo = esize(compute), esize(g_dtype), esize(out_dtype)
    tc = compute != torch.float32

    def tl_work(c):
        if not smem_fits(dev, kernels.pair_smem(c["BM"], c["BK"], c["stages"], R, e)):
            return None
        return models.skinny_work(dev, dict(block_m=c["BM"], block_k=c["BK"], block_r=0, split=0,
                                            num_warps=c["threads"] // 32, num_stages=c["stages"], reduce_block=1024),
                                  O, I, I, O, R, eg, e, eo, e, tc)

    sp = TL_PAIR
    cfgs = [dict(BM=bm, BK=bk, stages=s, threads=th) for bm in sp["BM"] for bk in sp["BK"]
            for s in tl_stages(dev, sp["stages"]) for th in sp["threads"]]
    return tl_shortlist("lora_merge_bwd", cfgs, tl_work, dev, dict(kernels.MERGE_BWD),
                        models.merge_bwd_eager(dev, O, I, R, e, eg, eo, tc), ("BM", "BK"), n)


def _bypass_fwd_tl(dev, x, up, down, gamma, base=None):
    T, I = x.shape
    O, R = up.shape
    return tl_plan_bypass_fwd(dev, T, I, O, R, compute_dtype(x.dtype, up.dtype, down.dtype), x.dtype,
                              x.dtype if base is None else base.dtype, base is not None)


def _bypass_bwd_tl(dev, grad, x, up, down, gamma):
    T, I = x.shape
    O, R = up.shape
    return tl_plan_bypass_bwd(dev, T, I, O, R, compute_dtype(x.dtype, up.dtype, down.dtype), x.dtype, grad.dtype)


def _merge_fwd_tl(dev, a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    plain = mode == "plain"
    compute = compute_dtype(a1.dtype, b1.dtype) if plain else compute_dtype(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    return tl_plan_merge_fwd(dev, a1.shape[0], b1.shape[1], a1.shape[1], 0 if plain else a2.shape[1], mode, compute,
                             a1.dtype if out_dtype is None else out_dtype, None if base is None else base.dtype)


def _merge_bwd_tl(dev, grad, up, down, gamma):
    return tl_plan_merge_bwd(dev, up.shape[0], down.shape[1], up.shape[1], compute_dtype(up.dtype, down.dtype),
                             grad.dtype, up.dtype)


#: op -> the quick twin of a deferred cold key's first config (``runner.quick_twin``): the same
#: tiles with the O loop serial (``pipe_o`` off) and the x·downᵀ loop 2 deep, which builds in
#: about half the fixed config's time
TL_QUICK = {"lora_bypass_fwd": lambda cfg: {**(cfg or {}), "pipe_o": False, "stages": 2}}

#: op -> (the TileLang shortlist of a call: f(DeviceFacts, *schema args) -> Plan, the exact
#: sizes its tuning key adds: f(*schema args) -> tuple)
TILELANG = {
    "lora_bypass_fwd": (_bypass_fwd_tl, lambda x, up, down, *a: (x.shape[1], up.shape[0], up.shape[1])),
    "lora_bypass_bwd": (_bypass_bwd_tl, lambda g, x, up, down, *a: (x.shape[1], up.shape[0], up.shape[1])),
    "lora_merge_fwd": (_merge_fwd_tl, lambda a1, b1, a2, b2, *a: (tuple(a1.shape), tuple(b1.shape),
                                                                  None if a2 is None else tuple(a2.shape))),
    "lora_merge_bwd": (_merge_bwd_tl, lambda g, up, down, *a: (tuple(up.shape), tuple(down.shape))),
}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"lora_bypass_fwd": kernels.bypass_fwd, "lora_bypass_bwd": kernels.bypass_bwd,
             "lora_merge_fwd": kernels.merge_fwd, "lora_merge_bwd": kernels.merge_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels,)
