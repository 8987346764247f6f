"""Work model of the tucker rebuild (``lora_tucker_fwd``).

A first kernel builds ``AT = a·t`` (O, R', Kk); then the main kernel's program owns
``block_o`` output rows o (a loop) by ``block_i`` columns i: per o, one dot of
(block_i, R') × (R', KKP) per chain (KKP: Kk padded to a power of two, at least 16),
stored as it is, one contiguous run of ``block_i·Kk`` elements. Write-bound for small
ranks: O·I·Kk outputs; the KKP padding wastes dot work (not bytes); AT is re-read from
L2 once per column tile.
"""
from __future__ import annotations

import torch

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize, p2
from lycoris_ops.tuner.device import DeviceFacts


def fwd_work(dev: DeviceFacts, O: int, I: int, Kk: int, ranks, compute, out_dtype, *, pack_width):
    """work(cfg) of ``lora_tucker_fwd`` in the Triton launcher's names; ``pack_width(Kk,
    o_pack)``: the launcher's dot width for ``o_pack`` rows o a dot."""
    e, eo = esize(compute), esize(out_dtype)
    tc = compute != torch.float32
    chains = 2 if len(ranks) == 4 else 1
    rps = [p2(r, 16) for r in ranks]
    ra, rb = max(ranks[0::2]), max(rps[1::2])

    def work(c):
        bo, bi, opk = c["block_o"], c["block_i"], c["o_pack"]
        kkp = pack_width(Kk, opk) / opk  # the dot's columns per output row o
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

    return work


def fwd_eager(dev: DeviceFacts, O: int, I: int, Kk: int, R: int, chains: int, e: int, eo: int,
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
