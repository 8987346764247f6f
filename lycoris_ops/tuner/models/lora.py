"""Work models of the LoRA / LoCon kernels (compute dtype size e, padded rank
rp = pow2(r) >= 16):

* bypass fwd: program = (token tile, O range); h = x·downᵀ (bt x rp fp32) is
  recomputed per O range (flops x split); y tile bt x bo; x read once (the O
  ranges of a token tile are adjacent), y (+ base) written once.
* bypass bwd: token kernel (h, q, gx; q recomputed per I range, h by the first
  range only: with ranges, those programs are the critical path) + the skinny
  pair reduction (g_up over O rows, g_down over I rows, K = T, split-K partials).
* merge fwd: an O x I output tile per program, rank loop of block_r; write-bound.
* merge bwd: the skinny pair kernel (G read once per job).
"""
from __future__ import annotations

import torch

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize, gemm_reads, p2
from lycoris_ops.tuner.device import DeviceFacts


def auto_split(work_tiles: int, sm: int, max_split: int) -> int:
    """The launcher's automatic split: enough ranges for two programs an SM."""
    if work_tiles <= 0:
        return 1
    return max(1, min(cdiv(2 * sm, work_tiles), max_split))


def bypass_fwd_model(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, out_dtype,
                     has_base: bool):
    """(work(cfg), eager seconds) of ``lora_bypass_fwd``; cfg in the Triton launcher's names."""
    e, ex, eo = esize(compute), esize(x_dtype), esize(out_dtype)
    rp = p2(R, 16)
    tc = compute != torch.float32

    def work(c):
        bt, bi, bo = c["block_t"], c["block_i"], c["block_o"]
        if not tc and bt * bo > 64 * 64:
            return None  # IEEE fp32 dots run on FMA units: small tiles
        n_t, n_o = cdiv(T, bt), cdiv(O, bo)
        auto = auto_split(n_t, dev.sm_count, n_o)
        if c["o_split"] == 1 and auto == 1:
            return None  # same launch as auto
        split = max(1, min(c["o_split"] or auto, n_o))
        split = cdiv(O, cdiv(n_o, split) * bo)
        dram = T * I * ex + R * I * e + gemm_reads(O * R * e, n_t, dev) + T * O * eo * (2 if has_base else 1)
        return Work(grid=n_t * split, warps=c["num_warps"], stages=c["num_stages"], acc=bt * rp + bt * bo,
                    regs=bt * rp // 2, smem=max(bt * bi + rp * bi, bo * rp) * e, dram=dram,
                    mma=2.0 * T * I * rp * split + 2.0 * T * O * rp, tc=tc, mma_tile=bt * rp * max(bi, bo))

    eager = eager_time(dev, [(T * I * ex + R * I * e + T * R * 4, 2.0 * T * I * R), (T * R * (4 + e), 0),
                             (T * R * e + O * R * e + T * O * 4, 2.0 * T * O * R),
                             (T * O * (4 + eo) + (T * O * eo if has_base else 0), 0)], tc=tc)
    return work, eager


def skinny_work(dev: DeviceFacts, c, MA, KA, MB, KB, R, e_big, e_small, e_out, e, tc):
    """The skinny pair kernel (+ its reduce launch): out[m, r] = Σ_k big[m, k]·small[k, r]
    for two jobs (MA x KA) and (MB x KB)."""
    bm, bk = c["block_m"], c["block_k"]
    br = c["block_r"] or min(p2(R, 16), 128)
    if not tc and bm * br > 64 * 64:
        return None
    tiles_a, tiles_b, r_tiles = cdiv(MA, bm), cdiv(MB, bm), cdiv(R, br)
    kmax = max(KA, KB)
    split = c["split"] or auto_split((tiles_a + tiles_b) * r_tiles, dev.sm_count, max(1, kmax // (4 * bk)))
    split = max(1, min(split, max(1, cdiv(kmax, bk))))
    part = 2.0 * split * (MA + MB) * R * 4 if split > 1 else 0.0
    dram = (gemm_reads(MA * KA * e_big, r_tiles, dev) + gemm_reads(MB * KB * e_big, r_tiles, dev)
            + gemm_reads(KA * R * e_small, tiles_a, dev) + gemm_reads(KB * R * e_small, tiles_b, dev)
            + (MA + MB) * R * e_out + part / 2)
    works = [Work(grid=(tiles_a + tiles_b) * split * r_tiles, warps=c["num_warps"], stages=c["num_stages"],
                  acc=bm * br, smem=(bm * bk + bk * br) * e, dram=dram,
                  mma=2.0 * (MA * KA + MB * KB) * br * r_tiles, tc=tc, mma_tile=bm * bk * br)]
    if split > 1:
        works.append(Work(grid=cdiv((MA + MB) * R, c.get("reduce_block", 1024)), warps=4,
                          dram=part / 2 + (MA + MB) * R * e_out, inflight=4096))
    return works


def merge_bwd_eager(dev: DeviceFacts, O: int, I: int, R: int, e: int, eg: int, eo: int, tc: bool) -> float:
    """Predicted seconds of the eager ``lora_merge_bwd`` (two GEMMs and their casts)."""
    return eager_time(dev, [(O * I * eg + I * R * e + O * R * 4, 2.0 * O * I * R), (O * R * (4 + eo), 0),
                            (O * I * eg + O * R * e + I * R * 4, 2.0 * O * I * R), (I * R * (4 + eo), 0)], tc=tc)


def bypass_bwd_model(dev: DeviceFacts, T: int, I: int, O: int, R: int, compute, x_dtype, g_dtype):
    """(tok(cfg), red(skinny cfg), eager seconds) of ``lora_bypass_bwd``: the token kernel and
    the skinny pair reduction, configs in the Triton launcher's names."""
    e, ex, eg = esize(compute), esize(x_dtype), esize(g_dtype)
    rp = p2(R, 16)
    tc = compute != torch.float32

    def tok(c):
        bt, bi, bo = c["block_t"], c["block_i"], c["block_o"]
        if not tc and bt * bi > 64 * 64:
            return None
        n_t, n_i = cdiv(T, bt), cdiv(I, bi)
        auto = auto_split(n_t, dev.sm_count, n_i)
        if c["i_split"] == 1 and auto == 1:
            return None  # same launch as auto
        split = max(1, min(c["i_split"] or auto, max(n_i, 1)))
        split = max(1, cdiv(I, cdiv(max(n_i, 1), split) * bi))
        # with I ranges, h (a read of the token tile's whole x row) is the first range's
        # alone: those programs are the critical path, as if every range read x
        dram = T * O * eg + T * I * ex * split + T * I * ex + 2 * T * R * e + gemm_reads((O + I) * R * e, n_t, dev)
        return Work(grid=n_t * split, warps=c["num_warps"], stages=c["num_stages"], acc=2 * bt * rp + bt * bi,
                    smem=max(bt * bi + rp * bi, bt * bo + bo * rp) * e, dram=dram,
                    mma=4.0 * T * I * rp + 2.0 * T * O * rp * split, tc=tc, mma_tile=bt * rp * max(bi, bo))

    def red(c):  # g_up (O rows, K = T) and g_down (I rows, K = T)
        return skinny_work(dev, c, O, T, I, T, R, max(eg, ex), e, e, e, tc)

    eager = eager_time(dev, [(T * I * ex + R * I * e, 2.0 * T * I * R), (T * O * eg + O * R * e, 2.0 * T * O * R),
                             (T * R * e + R * I * e + T * I * 4, 2.0 * T * I * R), (T * I * (4 + ex), 0),
                             (T * O * eg + T * R * e, 2.0 * T * O * R), (T * I * ex + T * R * e, 2.0 * T * I * R)],
                       tc=tc)
    return tok, red, eager


def merge_fwd_model(dev: DeviceFacts, O: int, I: int, R1: int, R2: int, mode: str, compute, out_dtype,
                    base_dtype):
    """(work(cfg), eager seconds, the larger rank) of ``lora_merge_fwd``; Triton names."""
    e, eo, eb = esize(compute), esize(out_dtype), esize(base_dtype)
    tc = compute != torch.float32
    two = 1 if mode == "plain" else 2
    rmax = max(R1, R2 if two == 2 else 0)

    def work(c):
        bo, bi, br = c["block_o"], c["block_i"], c["block_r"]
        if not tc and bo * bi > 64 * 64:
            return None
        n_o, n_i = cdiv(O, bo), cdiv(I, bi)
        kr = cdiv(max(rmax, 1), br) * br
        dram = O * I * (eo + eb) + two * (gemm_reads(O * rmax * e, n_i, dev) + gemm_reads(rmax * I * e, n_o, dev))
        return Work(grid=n_o * n_i, warps=c["num_warps"], stages=c["num_stages"], acc=two * bo * bi,
                    smem=two * (bo * br + br * bi) * e, dram=dram, mma=two * 2.0 * O * I * kr, tc=tc,
                    mma_tile=bo * bi * br,
                    inflight=bo * bi * (eo + eb) // 2 + (bo + bi) * br * e)

    eager = eager_time(dev, [(O * rmax * e + rmax * I * e + O * I * 4, two * 2.0 * O * I * rmax)] * two
                       + [(O * I * (4 + 4), 0)] * (two - 1) + [(O * I * (4 + eb + eo), 0)], tc=tc)
    return work, eager, rmax
