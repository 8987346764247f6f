"""Work models of the LoKr kernels (ΔW = w1 ⊗ w2, w1 (a, b), w2 (c, d)).

Merges: program = a (block_m x block_n) tile of the *tile* factor (w2, or w1 with
``swap``) times a range of entries of the *loop* factor; write-bound: a·b·c·d outputs.
The stores of one tile are contiguous runs of the tile's column count when w2 is tiled,
single elements (stride d) when w1 is: runs shorter than a 32-byte sector cost a whole
sector. Backward: the same program layout reading G, plus fp32 partials and reduce /
chain launches.

Bypass forward: program = (block_t tokens, block_c of c): Z = X·w2ᵀ (bt·pow2(b) x bc,
fp32, hi/lo 16-bit dots) then Y = γ·w1·Z per block_a of a; ``swap`` runs the transposed
contraction. Bypass backward: persistent programs over token tiles, one pass (gx, g_w1,
g_w2) or two (``passes``), fp32 partials per program + reduce launches.
"""
from __future__ import annotations

import torch

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize, gemm_reads, p2
from lycoris_ops.tuner.device import DeviceFacts

#: fp32 register tile per program of the bypass forward (docs/ops.md §4.4)
REG_TILE = 16384
#: fp32 elements a bypass-backward program may keep live
BWD_LIVE = 32768


def p16(n):
    return p2(n, 16)


def ranks(w1b, w1a, w2b, w2a):
    """(r1, r2) of a factored call (0: that side is a whole factor)."""
    return (0 if w1b is None else int(w1a.shape[1])), (0 if w2b is None else int(w2a.shape[1]))


# =============================================================================== merges

def merge_geometry(a, b, c, d, swap):
    return (a, b, c, d) if swap else (c, d, a, b)  # M1, N1 (tile), M2, N2 (loop)


def merge_works(dev, cfg, a, b, c, d, r1, r2, e, eo, eb, grad):
    swap = cfg["swap"]
    M1, N1, M2, N2 = merge_geometry(a, b, c, d, swap)
    rt, rl = (r1, r2) if swap else (r2, r1)  # tile side rank, loop side rank (0: whole)
    bm, bn = cfg["block_m"], cfg["block_n"]
    n_tiles = cdiv(M1, bm) * cdiv(N1, bn)
    E = M2 * N2
    split = max(1, min(cdiv(4 * dev.sm_count, n_tiles), E))
    split = cdiv(E, cdiv(E, split))
    run = (min(bn, N1) if not swap else 1) * (eo if not grad else e)
    sector = max(1.0, 32.0 / run)
    out_bytes = a * b * c * d * (eo + eb)
    gen = 2.0 * M1 * N1 * rt * split + 2.0 * E * rl * n_tiles
    works = [Work(grid=n_tiles * split, warps=cfg["num_warps"], stages=cfg["num_stages"], acc=bm * bn * (2 if grad
                  else 1), smem=(bm + bn) * cfg["block_r"] * e if rt else 0, dram=out_bytes * sector
                  + (M1 * max(rt, 1) + max(rt, 1) * N1) * e * split + E * e, mma=gen, fma=a * b * c * d * 2.0,
                  inflight=bm * bn * (eo + eb))]
    if grad:
        parts = (split * M1 * N1 if (rt or split > 1) else 0) + (n_tiles * E if (rl or n_tiles > 1) else 0)
        works[0].dram += parts * 4
        if parts:
            works.append(Work(grid=cdiv(M1 * N1 + E, 2048), warps=4, dram=parts * 4 + (M1 * N1 + E) * e,
                              mma=2.0 * (M1 * N1 * rt + E * rl), inflight=8192, launches=2 if (rt or rl) else 1))
    return works


def merge_eager(dev, a, b, c, d, r1, r2, compute, eo, eb, grad):
    """Predicted seconds of the eager merge (sides, kron, scale and base; the backward's two
    contractions and factor chains)."""
    e = esize(compute)
    O, I = a * c, b * d
    steps = [((a + b) * max(r1, 1) * e + a * b * 4, 2.0 * a * b * r1), ((c + d) * max(r2, 1) * e + c * d * 4,
                                                                         2.0 * c * d * r2),
             (O * I * 4 + (a * b + c * d) * 4, 0), (O * I * (4 + eo + eb), 0)]
    if grad:
        steps += [(O * I * (eo + 4) * 2, 2.0 * O * I)] * 2 + [((a * b + c * d) * 8, 0)] * 4
    return eager_time(dev, steps, tc=compute != torch.float32)


# =============================================================================== bypass

def fwd_cost(a, b, c, d, split):
    """Multiply-adds per token of the bypass forward (``split``: hi/lo pairs)."""
    return b * c * (d + (2 if split else 1) * a)


def fwd_model(dev: DeviceFacts, T: int, a: int, b: int, c: int, d: int, compute, x_dtype, out_dtype,
              has_base: bool):
    """(work of a config, eager seconds) of ``lokr_bypass_fwd``."""
    e, ex, eo = esize(compute), esize(x_dtype), esize(out_dtype)
    tc = compute != torch.float32
    split = compute != torch.float32

    def work(cfg):
        A, B, C, D = (c, d, a, b) if cfg["swap"] else (a, b, c, d)
        bt, bc, bd, ba = cfg["block_t"], cfg["block_c"], cfg["block_d"], cfg["block_a"]
        BB = p16(B)
        if BB > 128 or bc > max(16, min(128, p16(C))) or bd > p16(D) or ba > p16(A) or bt * BB * bc > REG_TILE:
            return None
        n_t, n_c = cdiv(T, bt), cdiv(C, bc)
        mma = T * 2.0 * fwd_cost(A, B, C, D, split and cfg.get("split", True))
        return Work(grid=n_t * n_c, warps=cfg["num_warps"], stages=cfg["num_stages"],
                    acc=bt * BB * bc + bt * ba * bc, smem=(bt * BB * bd * ex + bd * bc * e),
                    dram=gemm_reads(T * b * d * ex, n_c, dev) + T * a * c * eo * (2 if has_base else 1)
                    + (a * b + c * d) * e, mma=mma, tc=tc)

    steps = [(T * b * d * ex + c * d * e + T * b * c * 4, 2.0 * T * b * c * d), (T * b * c * 8, 0),
             (T * b * c * 4 + a * b * 4 + T * a * c * 4, 2.0 * T * a * b * c), (T * a * c * (4 + eo), 0)]
    return work, eager_time(dev, steps, tc=tc)


def bwd_cost(a, b, c, d, split):
    """Multiply-adds per token of the bypass backward (``split``: hi/lo pairs)."""
    k = 2 if split else 1
    return a * c * d + k * b * a * d + k * a * d * b + a * b * d + k * c * a * d


def reduce_pair_work(n_partials: int, n_outs, dev: DeviceFacts, out_size: int, reduce_block) -> Work:
    """Two reductions of ``n_partials`` fp32 partials in one grid, the tile width
    (``reduce_block(n_out, sm_count)``: the launcher's) the larger output's; 8 partial rows
    of that width in flight a step."""
    be = reduce_block(max(n_outs), dev.sm_count)
    return Work(grid=sum(cdiv(n, be) for n in n_outs), warps=4,
                dram=sum(n_partials * n * 4 + n * out_size for n in n_outs), inflight=8 * be * 4, name="reduce")


def bwd_live(bt, ba, bb, bc, bd, passes, hi_lo=True):
    """fp32 elements a bypass-backward program keeps in registers."""
    k = 2 if hi_lo else 1  # H and P (BD wide) held as hi/lo pairs
    tiles = bt * (ba * bc + k * ba * bd + k * bb * bd)
    return tiles + (ba * bb + bc * bd if passes == 1 else max(ba * bb, bc * bd))


def bwd_model(dev: DeviceFacts, T: int, a: int, b: int, c: int, d: int, compute, x_dtype, g_dtype, *, grid,
              reduce_block):
    """(work of a config, eager seconds) of ``lokr_bypass_bwd``. ``work(cfg, live)``: ``live``
    the fp32 elements a program keeps in registers (None: the Triton kernel's, at most BWD_LIVE).
    The launcher's rules: ``grid(programs, num_warps, sm_count, n_tiles, elems) -> (programs,
    tiles each)``, ``reduce_block`` (``reduce_pair_work``)."""
    e, ex, eg = esize(compute), esize(x_dtype), esize(g_dtype)
    tc = compute != torch.float32
    split = compute != torch.float32

    def work(cfg, live=None):
        A, B, C, D = (c, d, a, b) if cfg["swap"] else (a, b, c, d)
        bt, passes = cfg["block_t"], cfg["passes"]
        hi_lo = split and cfg.get("split", True)
        if live is None:
            live = bwd_live(bt, p16(A), p16(B), p16(C), p16(D), passes, hi_lo)
            if live > BWD_LIVE:
                return None
        n_tiles = cdiv(T, bt)
        progs = grid(cfg.get("programs", 0), cfg["num_warps"], dev.sm_count, n_tiles, T * (A * C + B * D))[0]
        part = progs * (A * B + C * D) * 4 if progs > 1 else 0
        works = [Work(grid=progs, warps=cfg["num_warps"], stages=cfg["num_stages"], acc=live,
                      dram=(T * a * c * eg + T * b * d * ex) * passes + T * b * d * ex + part,
                      mma=T * 2.0 * bwd_cost(A, B, C, D, hi_lo) * (1.1 if passes > 1 else 1.0), tc=tc,
                      launches=passes, inflight=bt * (p16(A) * p16(C) * eg + p16(B) * p16(D) * ex))]
        if part:  # both gradients' partial stacks: one launch
            works.append(reduce_pair_work(progs, (A * B, C * D), dev, e, reduce_block))
        return works

    O, I = a * c, b * d
    steps = [(T * O * eg + c * d * e + T * a * d * 4, 2.0 * T * O * d)] * 4 + [(T * (O + I) * 8, 0)] * 3 \
        + [(T * I * (4 + ex), 0)]
    return work, eager_time(dev, steps, tc=tc)
