"""Work models of the LoHa kernels (ΔW = (a1·b1)⊙(a2·b2)).

Bypass (``Y = γ·x·ΔWᵀ``) has two whole-op strategies: *regen* (ΔW tiles regenerated
inside the GEMM's K loop, two bn x bk x rp dots per step, repeated for every token
tile: extra flops 4·O·I·rp per token tile) and *materialize* (ΔW built once, 4·O·I·rp
flops and O·I written, then a plain GEMM reading it). The GEMM is scored with a grouped
tile order (operands re-read once per 8 tiles when they exceed half of L2).

Merge backward (per job, rows M over N): regenerate P1, P2 tiles and form the two E·Bᵀ
products: 8·M·N·rp flops per job, G read once per job.
"""
from __future__ import annotations

import dataclasses

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, gemm_reads, p2
from lycoris_ops.tuner.device import DeviceFacts

#: a vendor-GEMM (cuBLAS) candidate from this many multiply-adds per large GEMM (T·O·I): where
#: the big GEMMs are long enough for cuBLAS to beat the fused ones (the tuner then times it)
VENDOR_MIN_MACS = 1 << 32
#: the merge backward's vendor-GEMM candidate from this many multiply-adds per contraction (O·I·R)
MERGE_VENDOR_MIN_MACS = 1 << 26


def apply_works(dev: DeviceFacts, c, M, N, K, R, e, ex, eo, has_base, tc, *, max_regen_rank: int,
                dw_needed=True):
    """The GEMM Y (M x N) = X (M x K)·Dᵀ with D (N x K) = ΔW regenerated or materialized
    (regen only up to the launcher's ``max_regen_rank`` padded rank)."""
    rp = p2(R, 16)
    bm, bn, bk = c["block_m"], c["block_n"], c["block_k"]
    n_m, n_n = cdiv(M, bm), cdiv(N, bn)
    regen = c["strategy"] == "regen" and rp <= max_regen_rank
    works = []
    if not regen and dw_needed:
        works.append(Work(grid=cdiv(N, c["tile_n"]) * cdiv(K, c["tile_k"]), warps=4, stages=2,
                          acc=3 * c["tile_n"] * c["tile_k"], smem=2 * (c["tile_n"] + c["tile_k"]) * c["tile_r"] * e,
                          dram=N * K * e + 2 * (N + K) * R * e, mma=4.0 * N * K * max(R, 16), tc=tc))
    dram = gemm_reads(M * K * ex, n_n, dev) + M * N * eo * (2 if has_base else 1)
    mma = 2.0 * M * N * K
    if regen:
        dram += 2 * (N + K) * R * e
        mma += n_m * 4.0 * N * K * rp
        acc, smem = bm * bn + 2 * bn * bk, (bm * bk + 2 * (bn * rp + rp * bk)) * e
    else:
        dram += gemm_reads(N * K * e, n_m, dev)
        acc, smem = bm * bn, (bm + bn) * bk * e
    works.append(Work(grid=n_m * n_n, warps=c["num_warps"], stages=c["num_stages"], acc=acc, smem=smem, dram=dram,
                      mma=mma, tc=tc, mma_tile=bm * bn * bk))
    return works


def bypass_fwd_eager(dev: DeviceFacts, T, I, O, R, e, ex, eo, has_base, tc) -> float:
    """Predicted seconds of the eager ``loha_bypass_fwd`` (ΔW built, then one GEMM)."""
    return eager_time(dev, [(2 * (O + I) * R * e + O * I * 4, 2.0 * O * I * R)] * 2 + [(O * I * 12, 0),
                      (O * I * (4 + e), 0), (T * I * ex + O * I * e + T * O * 4, 2.0 * T * O * I),
                      (T * O * (4 + eo) * (2 if has_base else 1), 0)], tc=tc)


def grad_works(dev: DeviceFacts, c, O, I, R, e, eg, tc):
    """The merge backward's two jobs (g over rows O, then over rows I), split-K partials and
    their reductions; unsplit, both jobs are one launch (the pair kernel)."""
    rp = p2(R, 16)
    works = []
    for M, N in ((O, I), (I, O)):
        bm, bn = c["block_m"], c["block_n"]
        n_m, steps = cdiv(M, bm), cdiv(N, bn)
        split = c.get("split") or max(1, min(cdiv(2 * dev.sm_count, n_m), max(1, steps // 2)))
        split = max(1, min(split, steps))
        part = 2 * split * M * R * 4 if split > 1 else 0
        works.append(Work(grid=n_m * split, warps=c["num_warps"], stages=c["num_stages"],
                          acc=2 * bm * rp + 3 * bm * bn, smem=(bm * bn * eg + 2 * rp * bn * e),
                          dram=M * N * eg + gemm_reads(2 * (M + N) * R * e, n_m, dev) + part + 2 * M * R * e,
                          mma=8.0 * M * N * rp, tc=tc, mma_tile=bm * bn * rp))
        if split > 1:
            works.append(Work(grid=cdiv(M * R, 32 * 64), warps=4, dram=part + 2 * M * R * e, inflight=8192))
    if len(works) == 2:  # neither job splits: one launch (the pair kernel)
        a, b = works
        works = [dataclasses.replace(a, grid=a.grid + b.grid, dram=a.dram + b.dram, mma=a.mma + b.mma)]
    return works


def merge_bwd_eager(dev: DeviceFacts, O, I, R, e, eg, tc) -> float:
    """Predicted seconds of the eager ``loha_merge_bwd``."""
    return eager_time(dev, [((O + I) * R * e + O * I * 4, 2.0 * O * I * R)] * 2 + [(O * I * (eg + 12), 0)] * 4
                      + [(O * I * e + I * R * e + O * R * 4, 2.0 * O * I * R)] * 4, tc=tc)


def bypass_bwd_eager(dev: DeviceFacts, T, I, O, R, e, ex, eg, tc) -> float:
    """Predicted seconds of the eager ``loha_bypass_bwd`` (ΔW, gx, GW = Gᵀ·x, the factor
    gradients)."""
    return eager_time(dev, [(2 * (O + I) * R * e + O * I * 4, 2.0 * O * I * R)] * 2 + [(O * I * 12, 0)] * 6
                      + [(T * O * eg + O * I * e + T * I * 4, 2.0 * T * O * I),
                         (T * O * eg + T * I * ex + O * I * 4, 2.0 * T * O * I)]
                      + [(O * I * e + I * R * e + O * R * 4, 2.0 * O * I * R)] * 4, tc=tc)
