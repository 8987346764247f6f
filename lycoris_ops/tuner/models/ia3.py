"""Work models of the IA3 kernels (``ia3_fwd``, ``ia3_bwd``).

x is seen as a (M, N) matrix: channels last -> (tokens, C); channels on another axis ->
(A·C, B) rows of one channel each. A program owns a ``block_m x block_n`` tile (the
backward reduces its tile along the reduced direction, fp32 partials per ``split`` + one
column-sum launch when split). Memory-bound: DRAM bytes = the operands once (+ partials),
a program keeps its tile in flight; rows narrower than a 32-byte sector waste the rest
of it.
"""
from __future__ import annotations

import torch

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize, p2
from lycoris_ops.tuner.device import DeviceFacts


def geometry(shape, channel_axis: int):
    """(M, N, C, ch_rows) of x seen as the kernels' matrix."""
    ax = channel_axis % len(shape)
    A = 1
    for s in shape[:ax]:
        A *= int(s)
    B = 1
    for s in shape[ax + 1:]:
        B *= int(s)
    C = int(shape[ax])
    ch_rows = B != 1  # B = 0 (empty trailing dims): rows, so M·N = 0 and nothing launches
    return (A * C, B, C, True) if ch_rows else (A, C, C, False)


def _sector(bn, N, e):
    run = min(bn, N) * e
    return max(1.0, 32.0 / max(run, 1))


def fwd_model(dev: DeviceFacts, M: int, N: int, C: int, x_dtype, w_dtype):
    """(work(cfg), eager seconds) of ``ia3_fwd``; cfg in the Triton launcher's names."""
    ex, ew = esize(x_dtype), esize(w_dtype)
    eo = esize(torch.promote_types(x_dtype, w_dtype))

    def work(c):
        bm, bn, w = c["block_m"], c["block_n"], c["num_warps"]
        if bm * bn < 32 * w or bm * bn > 64 * 32 * w:
            return None
        return Work(grid=cdiv(M, bm) * cdiv(N, bn), warps=w, regs=2 * bm * bn,
                    dram=M * N * (ex + eo) * _sector(bn, N, ex) + C * ew, inflight=bm * bn * ex)

    return work, eager_time(dev, [(C * (ew + 4), 0), (M * N * (ex + 4), 0), (M * N * (4 + eo), 0)])


def bwd_model(dev: DeviceFacts, M: int, N: int, C: int, ch_rows: bool, x_dtype, w_dtype, g_dtype):
    """(work(cfg), eager seconds) of ``ia3_bwd``; cfg in the Triton launcher's names."""
    ex, ew, eg = esize(x_dtype), esize(w_dtype), esize(g_dtype)
    A = M // max(C, 1) if ch_rows else M

    def work(c):
        bm, bn, w = c["block_m"], c["block_n"], c["num_warps"]
        if bm * bn < 32 * w or bm * bn > 64 * 32 * w:
            return None
        if ch_rows:
            tiles, steps = cdiv(M, bm), cdiv(N, bn)
        else:
            tiles, steps = cdiv(N, bn), cdiv(M, bm)
        split = max(1, min(cdiv(2 * dev.sm_count, max(tiles, 1)), steps // 2))
        direct = split == 1 and (A == 1 or not ch_rows)
        k_rows = split * A if ch_rows else split
        part = 0 if direct else k_rows * C * 4
        works = [Work(grid=tiles * split, warps=w, regs=3 * bm * bn,
                      dram=M * N * (eg + 2 * ex) * _sector(bn, N, ex) + C * ew + part, inflight=bm * bn * (eg + ex))]
        if not direct:
            works.append(Work(grid=cdiv(C, min(p2(C), 256)), warps=4, dram=part + C * ew, inflight=4096))
        return works

    return work, eager_time(dev, [(C * (ew + 4), 0), (M * N * (eg + 4), 0), (M * N * (4 + 4 + ex), 0),
                                  (M * N * (eg + ex + 8), 0), (M * N * (4 + 4), 0), (C * (4 + ew), 0)])
