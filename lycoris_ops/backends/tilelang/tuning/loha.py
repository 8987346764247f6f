"""TileLang tuning spaces of LoHa (``backends/tilelang/kernels/loha.py``): ``loha_bypass_fwd``,
``loha_bypass_bwd``, ``loha_merge_bwd``."""
from __future__ import annotations

from lycoris_ops.backends.tilelang.kernels import loha as kernels, lora as lora_kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.cost import (Work, add_second, cdiv, eager_time, esize, gemm_reads, p2, smem_fits, tl_shortlist,
                                    tl_stages, tl_threads)
from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.models import loha as models

#: the bypass ops' large GEMM of the materialized path (x·ΔWᵀ, G·ΔW; ``lora.gemm_kernel``,
#: dynamic token rows; 256 threads only with 128-row tiles) and the merge backward's gradient
#: kernels (BO x BI); the corners compile for sm_90a (tests/tilelang/test_tilelang_loha.py)
TL_GEMM = dict(BM=(64, 128), BN=(64, 128, 256), BK=(32, 64), stages=(2, 3), threads=(128, 256))
TL_GRADS = dict(BO=(32, 64, 128), BI=(32, 64, 128))
#: ``hada_grad_pair_kernel``'s band width, K step and pipeline depth; the configs whose shared
#: memory fits (``grads_pair_smem``). One stage measured slower, three the same as two, K steps
#: of 64 faster than the band's 32: fewer candidates, fewer cold builds. A candidate inherits
#: the fixed config's keys it lacks, so the space names BK
TL_GRADS_PAIR = dict(BM=(32, 64), BK=(64,), stages=(2,))


def _tl_gemm_plan(op, dev: DeviceFacts, M: int, N: int, K: int, e: int, eo: int, eager: float, n: int):
    """The shortlist of a (M x N, K) GEMM tile: operands re-read once per tile row / column
    beyond what L2 keeps (``gemm_reads``), the output written once."""
    def work(c):
        bm, bn, bk = c["BM"], c["BN"], c["BK"]
        return Work(grid=cdiv(M, bm) * cdiv(N, bn), warps=c["threads"] // 32, stages=c["stages"], acc=bm * bn,
                    smem=(bm + bn) * bk * e, dram=gemm_reads(M * K * e, cdiv(N, bn), dev)
                    + gemm_reads(N * K * e, cdiv(M, bm), dev) + M * N * eo, mma=2.0 * M * N * K, tc=True,
                    mma_tile=bm * bn * bk)

    sp = TL_GEMM
    default = dict(kernels.APPLY_GEMM)
    cfgs = [dict(BM=bm, BN=bn, BK=bk, stages=s, threads=t) for bm in sp["BM"] for bn in sp["BN"] for bk in sp["BK"]
            for s in tl_stages(dev, sp["stages"]) for t in tl_threads(sp["threads"], bm)]
    return tl_shortlist(op, cfgs, work, dev, default, eager, ("BM", "BN", "BK"), n)


def _tl_vendor_twin(plan, macs: int):
    """``plan`` with its fixed config's ``vendor`` form second (the kernels' T·O·I GEMMs by
    cuBLAS) from models.VENDOR_MIN_MACS multiply-adds a GEMM, as the Triton shortlists: the
    model does not rank cuBLAS, so the tuner times it (second: tried even when a cold key's
    TileLang compiles overrun the tune budget; it compiles nothing the first does not)."""
    if macs >= models.VENDOR_MIN_MACS and plan.candidates and not tune.is_eager(plan.candidates[0]):
        add_second(plan, {**plan.candidates[0], "vendor": True}, plan.predicted[0])
    return plan


def _tl_bypass_fwd(dev, x, a1, b1, a2, b2, gamma, base=None, n: int = TL_N):
    T, I = x.shape
    O, R = a1.shape
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    e = esize(compute)
    eo = esize(x.dtype if base is None else base.dtype)
    eager = eager_time(dev, [(O * R * e * 2 + R * I * e * 2, 4.0 * O * I * R), (O * I * 12, 0),
                             (T * I * e + O * I * e + T * O * 4, 2.0 * T * O * I), (T * O * (4 + eo), 0)])
    return _tl_vendor_twin(_tl_gemm_plan("loha_bypass_fwd", dev, T, O, I, e, eo, eager, n), T * O * I)


def _tl_bypass_bwd(dev, grad, x, a1, b1, a2, b2, gamma, n: int = TL_N):
    T, I = x.shape
    O, R = a1.shape
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    e = esize(compute)
    eager = eager_time(dev, [(O * R * e * 2 + R * I * e * 2, 4.0 * O * I * R), (O * I * 12, 0),
                             (T * O * e + O * I * e + T * I * 4, 2.0 * T * O * I),
                             (T * O * e + T * I * e + O * I * 4, 2.0 * T * O * I), (O * I * 4 * 6, 8.0 * O * I * R)])
    return _tl_vendor_twin(_tl_gemm_plan("loha_bypass_bwd", dev, T, I, O, e, esize(x.dtype), eager, n), T * O * I)


def _tl_merge_bwd(dev, grad, a1, b1, a2, b2, gamma, n: int = TL_N):
    """The gradient kernels' tile: per job G read once per program row, the two P tiles
    regenerated (2 dots over the padded rank) and the E·B product (1 dot). The pair form
    (``pair_form``: the gradient's size): both jobs in one launch, a program per band, no split."""
    O, R = a1.shape
    I = b1.shape[1]
    compute = compute_dtype(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    e, eg = esize(compute), esize(grad.dtype)
    rp = p2(R, 16)
    eager = eager_time(dev, [(O * R * e * 2 + R * I * e * 2, 4.0 * O * I * R), (O * I * (eg + 12), 0),
                             (O * I * 4 * 2 + I * R * e * 2, 4.0 * O * I * R), (O * I * 4 * 2 + O * R * e * 2, 4.0 * O * I * R)])
    if kernels.pair_form(O, I):
        def pair_work(c):
            bm, st, bk = c["BM"], c["stages"], c.get("BK", c["BM"])
            if not smem_fits(dev, kernels.grads_pair_smem(bm, st, R, e, bk)):
                return None
            return Work(grid=cdiv(O, bm) + cdiv(I, bm), warps=8 if rp >= 128 else 4, stages=st,
                        acc=2 * bm * rp + 2 * bm * bm, smem=(bm * bm + 2 * bm * rp) * e,
                        dram=2 * O * I * eg + 4 * (O + I) * R * e, mma=3 * 2.0 * 2 * 2 * O * I * rp, tc=True,
                        mma_tile=bm * bm * rp)

        cfgs = [dict(BM=bm, BK=bk, stages=st) for bm in TL_GRADS_PAIR["BM"] for bk in TL_GRADS_PAIR["BK"]
                for st in TL_GRADS_PAIR["stages"]]
        return tl_shortlist("loha_merge_bwd", cfgs, pair_work, dev, dict(kernels.GRADS_PAIR), eager, ("BM",), n)

    def work(c):
        bo, bi = c["BO"], c["BI"]
        warps = 8 if rp >= 128 else 4
        return [Work(grid=cdiv(O, bo) * max(1, cdiv(2 * dev.sm_count, cdiv(O, bo))), warps=warps, acc=2 * bo * rp + 2 * bo * bi,
                     smem=(bo * bi + 2 * (bo + bi) * rp) * e, dram=O * I * eg + gemm_reads(2 * R * I * e, cdiv(O, bo), dev),
                     mma=3 * 2.0 * 2 * O * I * rp, tc=True, mma_tile=bo * bi * rp),
                Work(grid=cdiv(I, bi) * max(1, cdiv(2 * dev.sm_count, cdiv(I, bi))), warps=warps,
                     acc=2 * bi * rp + 2 * bo * bi, smem=(bo * bi + 2 * (bo + bi) * rp) * e,
                     dram=O * I * eg + gemm_reads(2 * O * R * e, cdiv(I, bi), dev), mma=3 * 2.0 * 2 * O * I * rp,
                     tc=True, mma_tile=bo * bi * rp)]

    cfgs = [dict(BO=bo, BI=bi) for bo in TL_GRADS["BO"] for bi in TL_GRADS["BI"]]
    return tl_shortlist("loha_merge_bwd", cfgs, work, dev, dict(kernels.GRADS), eager, ("BO", "BI"), n)


def _weights(a1, b1, a2, b2):
    return (tuple(a1.shape), tuple(b1.shape), tuple(a2.shape), tuple(b2.shape))


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {
    "loha_bypass_fwd": (_tl_bypass_fwd, lambda x, a1, b1, a2, b2, *a: _weights(a1, b1, a2, b2)),
    "loha_bypass_bwd": (_tl_bypass_bwd, lambda g, x, a1, b1, a2, b2, *a: _weights(a1, b1, a2, b2)),
    "loha_merge_bwd": (_tl_merge_bwd, lambda g, a1, b1, a2, b2, *a: _weights(a1, b1, a2, b2)),
}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"loha_bypass_fwd": kernels.bypass_fwd, "loha_bypass_bwd": kernels.bypass_bwd,
             "loha_merge_bwd": kernels.merge_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels, lora_kernels)
