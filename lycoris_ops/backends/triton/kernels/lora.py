"""Triton kernels of the LoRA / LoCon family (docs/ops.md §2.1): ``lora_bypass_fwd``,
``lora_bypass_bwd``, ``lora_merge_fwd`` (plain / hada / sum), ``lora_merge_bwd``.

Written from the math of docs/ops.md §2.1 and the eager bodies in
``reference/lora.py`` (same dtypes, same rounding points):

* operands are read in their stored dtype and rounded to the compute dtype
  (``CD``) inside the kernel, which is exactly what the eager ``.to(c)`` does, so
  the host never casts or copies;
* every product accumulates in fp32; γ, the hadamard product and the base add
  are done in fp32 and rounded once at the store (into the output's dtype);
* fp32 dots use ``input_precision="ieee"`` (no TF32), as the spec demands;
* strides are passed for every operand (non-contiguous x / G / factors are
  read in place); odd sizes are handled by masks;
* ``tl.dot`` needs every dim >= 16, so the rank is padded (masked) to a power
  of two >= 16.

Passes (launches) per op:

``lora_bypass_fwd`` - one kernel. Program = (token tile, range of O), a 1-D
    grid with the O ranges of a token tile adjacent (they share its x tile in
    L2). It accumulates ``h = x·downᵀ`` (BLOCK_T x R_pad, fp32) over I, rounds it
    to the compute dtype and keeps it in registers, then walks its O range tile
    by tile: ``Y = γ·h·upᵀ (+ base)``, one store per tile. x is read once per O
    range (``o_split`` ranges; 1 when the token tiles alone fill the GPU), base
    once, Y written once. Limit: R_pad <= 128 (h lives in registers).

``lora_bypass_bwd`` - two kernels, three when the token reduction is split.
    1. token kernel, program = (token tile, range of I): ``h = x·downᵀ`` (the
       first I range only) and ``q = G·up``, rounded to the compute dtype and
       stored to a (2, T, r) workspace (the only intermediate that reaches
       memory), then ``gx = γ·q·down`` over its I range. Reads x once and G once
       per I range (``i_split``, 1 when the token tiles alone fill the GPU).
    2. skinny pair kernel (``g_up = γ·Gᵀ·h`` and ``g_down = γ·qᵀ·x`` in one
       launch): program = (output row tile of one of the two jobs, token split,
       rank tile). Reads G and x a second time (each once).
    3. when the token loop is split (small outputs, many tokens): fp32 partials
       [split, O·r + r·I] and one tiny reduce kernel (sum, γ, cast to each
       gradient's dtype). Deterministic: no atomics.
    Limit: R_pad <= 128.

``lora_merge_fwd`` - one kernel, program = (O tile, I tile); the rank loop is
    tiled (no rank limit); mode plain / hada / sum in the epilogue, base add,
    store in ``out_dtype``.

``lora_merge_bwd`` - the same skinny pair kernel: ``g_up = γ·G·downᵀ``
    (reduction over I) and ``g_down = γ·upᵀ·G`` (reduction over O) in one launch,
    split-K partials in fp32 + the reduce kernel when split. G is read twice
    (once per job); the rank is tiled (no rank limit).

Tile sizes, warps and stages are explicit ``*Cfg`` parameters of each
launcher (``cfg=None`` takes ``default_*_cfg``); launch metadata is cached per
(shapes, strides, dtypes, device, cfg).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends import scope as _scope
from lycoris_ops.backends.triton.common import cdiv, dot_dtype, fast, needs_idx64, num_sms, pad_rank, tl_dtype
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype  # noqa: F401  (the launchers' promotion)

__all__ = [
    "BypassFwdCfg", "BypassBwdCfg", "MergeFwdCfg", "SkinnyCfg", "MAX_BYPASS_RANK",
    "bypass_fwd", "bypass_bwd", "merge_fwd", "merge_bwd",
    "default_bypass_fwd_cfg", "default_bypass_bwd_cfg", "default_merge_fwd_cfg", "default_merge_bwd_cfg",
    "supported_bypass", "compute_dtype",
]

#: the bypass kernels keep a (BLOCK_T x R_pad) fp32 tile of h / q in registers: the
#: padded-rank cap lives in the shared scope table
MAX_BYPASS_RANK = _scope.limit("lora_bypass_fwd", "rank", "triton")

_MODES = {"plain": 0, "hada": 1, "sum": 2}


def supported_bypass(rank: int) -> bool:
    return pad_rank(rank) <= MAX_BYPASS_RANK


# =============================================================================== kernels


@triton.jit
def _tile_times_factor(a_ptr, s_at, s_ak, f_ptr, s_fk, s_fr, offs_t, mask_t, offs_r, mask_r, k_lo, K,
                       CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Σ_{k in [k_lo, K)} a[t, k]·f[k, r] for one row tile, fp32 (operands rounded to the
    compute dtype): h = x·downᵀ and q = G·up (all of K), a skinny job's K range."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if IDX64:
            offs_k = offs_k.to(tl.int64)
        mask_k = offs_k < K
        at = tl.load(a_ptr + offs_t[:, None] * s_at + offs_k[None, :] * s_ak,
                     mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        ft = tl.load(f_ptr + offs_k[:, None] * s_fk + offs_r[None, :] * s_fr,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = tl.dot(at.to(CD).to(DOT), ft.to(CD).to(DOT), acc, input_precision="ieee")
    return acc


@triton.jit
def _bypass_fwd_kernel(
    x_ptr, up_ptr, down_ptr, base_ptr, y_ptr,
    T, I, O, R, gamma,
    s_xt, s_xi, s_uo, s_ur, s_dr, s_di, s_bt, s_bo, s_yt, s_yo,
    O_PER_PROG, O_SPLIT,
    HAS_BASE: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Y[t, o] = γ·Σ_r round_CD(Σ_i x[t,i]·down[r,i])·up[o,r] (+ base[t, o]).

    1-D grid, the O ranges of one token tile adjacent (they share the x tile in L2).
    """
    pid = tl.program_id(0)
    pid_t = pid // O_SPLIT
    pid_o = pid % O_SPLIT
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    if IDX64:
        offs_t = offs_t.to(tl.int64)
    mask_t = offs_t < T
    mask_r = offs_r < R

    # h = x · downᵀ over the whole I (fp32), then rounded to the compute dtype
    h = _tile_times_factor(x_ptr, s_xt, s_xi, down_ptr, s_di, s_dr, offs_t, mask_t, offs_r, mask_r, 0, I,
                           CD, DOT, IDX64, BLOCK_T, BLOCK_I, BLOCK_R)
    hd = h.to(CD).to(DOT)

    # Y = γ · h · upᵀ (+ base), one O tile at a time
    o_lo = pid_o * O_PER_PROG
    o_hi = tl.minimum(o_lo + O_PER_PROG, O)
    for o0 in range(o_lo, o_hi, BLOCK_O):
        offs_o = o0 + tl.arange(0, BLOCK_O)
        if IDX64:
            offs_o = offs_o.to(tl.int64)
        mask_o = offs_o < o_hi
        ut = tl.load(up_ptr + offs_r[:, None] * s_ur + offs_o[None, :] * s_uo,
                     mask=mask_r[:, None] & mask_o[None, :], other=0.0)
        acc = tl.dot(hd, ut.to(CD).to(DOT), input_precision="ieee") * gamma
        mask = mask_t[:, None] & mask_o[None, :]
        if HAS_BASE:
            b = tl.load(base_ptr + offs_t[:, None] * s_bt + offs_o[None, :] * s_bo, mask=mask, other=0.0)
            acc = acc + b.to(tl.float32)
        tl.store(y_ptr + offs_t[:, None] * s_yt + offs_o[None, :] * s_yo,
                 acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bypass_bwd_tok_kernel(
    g_ptr, x_ptr, up_ptr, down_ptr, gx_ptr, h_ptr, q_ptr,
    T, I, O, R, gamma,
    s_gt, s_go, s_xt, s_xi, s_uo, s_ur, s_dr, s_di, s_gxt, s_gxi,
    I_PER_PROG, I_SPLIT,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
    FUSE_GW: tl.constexpr = False,
):
    """Per token tile: h = round(x·downᵀ), q = round(G·up) -> workspace (T, R);
    gx = γ·q·down over this program's I range (1-D grid, I ranges adjacent).

    FUSE_GW (the grid is this one program: every token and every column): the weight
    gradients too, from h and q in registers, ``h_ptr``/``q_ptr`` then being g_up (O, R)
    and g_down (R, I): g_down = γ·qᵀ·x in the gx loop, g_up = γ·Gᵀ·h in a second pass over
    O. One launch and no workspace (a tiny call's host time is its launches and buffers)."""
    pid = tl.program_id(0)
    pid_t = pid // I_SPLIT
    pid_i = pid % I_SPLIT
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    if IDX64:
        offs_t = offs_t.to(tl.int64)
    mask_t = offs_t < T
    mask_r = offs_r < R
    mask_tr = mask_t[:, None] & mask_r[None, :]

    h = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    if pid_i == 0:  # h is needed by g_up only: one program per token tile stores it
        h = _tile_times_factor(x_ptr, s_xt, s_xi, down_ptr, s_di, s_dr, offs_t, mask_t, offs_r, mask_r, 0, I,
                               CD, DOT, IDX64, BLOCK_T, BLOCK_I, BLOCK_R)
        if not FUSE_GW:
            tl.store(h_ptr + offs_t[:, None] * R + offs_r[None, :], h.to(CD), mask=mask_tr)

    q = _tile_times_factor(g_ptr, s_gt, s_go, up_ptr, s_uo, s_ur, offs_t, mask_t, offs_r, mask_r, 0, O,
                           CD, DOT, IDX64, BLOCK_T, BLOCK_O, BLOCK_R)
    qc = q.to(CD)
    if pid_i == 0 and not FUSE_GW:
        tl.store(q_ptr + offs_t[:, None] * R + offs_r[None, :], qc, mask=mask_tr)
    qd = qc.to(DOT)

    i_lo = pid_i * I_PER_PROG
    i_hi = tl.minimum(i_lo + I_PER_PROG, I)
    for i0 in range(i_lo, i_hi, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        if IDX64:
            offs_i = offs_i.to(tl.int64)
        mask_i = offs_i < i_hi
        dt = tl.load(down_ptr + offs_r[:, None] * s_dr + offs_i[None, :] * s_di,
                     mask=mask_r[:, None] & mask_i[None, :], other=0.0)
        acc = tl.dot(qd, dt.to(CD).to(DOT), input_precision="ieee") * gamma
        tl.store(gx_ptr + offs_t[:, None] * s_gxt + offs_i[None, :] * s_gxi,
                 acc.to(gx_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_i[None, :])
        if FUSE_GW:  # g_down[r, i] = γ·Σ_t q[t, r]·x[t, i]
            xt = tl.load(x_ptr + offs_t[:, None] * s_xt + offs_i[None, :] * s_xi,
                         mask=mask_t[:, None] & mask_i[None, :], other=0.0)
            gd = tl.dot(tl.trans(qd), xt.to(CD).to(DOT), input_precision="ieee") * gamma
            tl.store(q_ptr + offs_r[:, None] * I + offs_i[None, :], gd.to(q_ptr.dtype.element_ty),
                     mask=mask_r[:, None] & mask_i[None, :])
    if FUSE_GW:  # g_up[o, r] = γ·Σ_t G[t, o]·h[t, r]
        hd = h.to(CD).to(DOT)
        for o0 in range(0, O, BLOCK_O):
            offs_o = o0 + tl.arange(0, BLOCK_O)
            if IDX64:
                offs_o = offs_o.to(tl.int64)
            mask_o = offs_o < O
            gt = tl.load(g_ptr + offs_t[:, None] * s_gt + offs_o[None, :] * s_go,
                         mask=mask_t[:, None] & mask_o[None, :], other=0.0)
            gu = tl.dot(tl.trans(gt.to(CD).to(DOT)), hd, input_precision="ieee") * gamma
            tl.store(h_ptr + offs_o[:, None] * R + offs_r[None, :], gu.to(h_ptr.dtype.element_ty),
                     mask=mask_o[:, None] & mask_r[None, :])


@triton.jit
def _skinny_job(
    big_ptr, small_ptr, out_ptr, part_ptr, part_off,
    M, K, R, k_lo, k_hi, pid_m, pid_r, gamma,
    s_bm, s_bk, s_sk, s_sr, s_om, s_or,
    DIRECT: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """acc[m, r] = Σ_{k in [k_lo, k_hi)} big[m, k]·small[k, r]; stores γ·acc into
    out (DIRECT) or the raw fp32 acc into part[part_off + m·R + r]."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
    mask_m = offs_m < M
    mask_r = offs_r < R
    acc = _tile_times_factor(big_ptr, s_bm, s_bk, small_ptr, s_sk, s_sr, offs_m, mask_m, offs_r, mask_r,
                             k_lo, k_hi, CD, DOT, IDX64, BLOCK_M, BLOCK_K, BLOCK_R)
    mask = mask_m[:, None] & mask_r[None, :]
    if DIRECT:
        tl.store(out_ptr + offs_m[:, None] * s_om + offs_r[None, :] * s_or,
                 (acc * gamma).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + part_off + offs_m[:, None] * R + offs_r[None, :], acc, mask=mask)


@triton.jit
def _skinny_pair_kernel(
    a_big, a_small, a_out, MA, KA, sa_bm, sa_bk, sa_sk, sa_sr, sa_om, sa_or, KA_SPLIT, TILES_A,
    b_big, b_small, b_out, MB, KB, sb_bm, sb_bk, sb_sk, sb_sr, sb_om, sb_or, KB_SPLIT,
    part_ptr, PART_STRIDE, R, gamma,
    DIRECT: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Two skinny products out[m, r] = Σ_k big[m, k]·small[k, r] in one launch.

    Axis 0 enumerates the row tiles of job A then those of job B, axis 1 the
    K split, axis 2 the rank tile. Partials: part[split, MA·R + MB·R] (fp32).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_r = tl.program_id(2)
    if IDX64:
        split = split.to(tl.int64)
    if pid < TILES_A:
        k_lo = split * KA_SPLIT
        _skinny_job(a_big, a_small, a_out, part_ptr, split * PART_STRIDE,
                    MA, KA, R, k_lo, tl.minimum(k_lo + KA_SPLIT, KA), pid, pid_r, gamma,
                    sa_bm, sa_bk, sa_sk, sa_sr, sa_om, sa_or,
                    DIRECT, CD, DOT, IDX64, BLOCK_M, BLOCK_K, BLOCK_R)
    else:
        k_lo = split * KB_SPLIT
        _skinny_job(b_big, b_small, b_out, part_ptr, split * PART_STRIDE + MA * R,
                    MB, KB, R, k_lo, tl.minimum(k_lo + KB_SPLIT, KB), pid - TILES_A, pid_r, gamma,
                    sb_bm, sb_bk, sb_sk, sb_sr, sb_om, sb_or,
                    DIRECT, CD, DOT, IDX64, BLOCK_M, BLOCK_K, BLOCK_R)


@triton.jit
def _pair_reduce_kernel(
    part_ptr, a_out, b_out, MA, MB, R, NSPLIT, PART_STRIDE, gamma,
    sa_om, sa_or, sb_om, sb_or,
    IDX64: tl.constexpr, BLOCK: tl.constexpr,
):
    """out = γ·Σ_split part[split, :], scattered to the two outputs (own dtypes)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if IDX64:
        offs = offs.to(tl.int64)
    n_a = MA * R
    mask = offs < n_a + MB * R
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = part_ptr + offs
    for _ in range(0, NSPLIT):  # pointer increments: no split * stride product to overflow
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += PART_STRIDE
    acc = acc * gamma
    m = offs // R
    r = offs % R
    in_a = offs < n_a
    tl.store(a_out + m * sa_om + r * sa_or, acc.to(a_out.dtype.element_ty), mask=mask & in_a)
    tl.store(b_out + (m - MA) * sb_om + r * sb_or, acc.to(b_out.dtype.element_ty), mask=mask & (offs >= n_a))


@triton.jit
def _lowrank_tile(a_ptr, b_ptr, offs_o, offs_i, mask_o, mask_i, R, s_ao, s_ar, s_br, s_bi,
                  CD: tl.constexpr, DOT: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """fp32 tile of a·b: Σ_r a[o, r]·b[r, i] over the whole rank, BLOCK_R at a time."""
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        a = tl.load(a_ptr + offs_o[:, None] * s_ao + offs_r[None, :] * s_ar,
                    mask=mask_o[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + offs_r[:, None] * s_br + offs_i[None, :] * s_bi,
                    mask=mask_r[:, None] & mask_i[None, :], other=0.0)
        acc = tl.dot(a.to(CD).to(DOT), b.to(CD).to(DOT), acc, input_precision="ieee")
    return acc


@triton.jit
def _merge_fwd_kernel(
    a1_ptr, b1_ptr, a2_ptr, b2_ptr, base_ptr, y_ptr,
    O, I, R1, R2, gamma,
    s_a1o, s_a1r, s_b1r, s_b1i, s_a2o, s_a2r, s_b2r, s_b2i, s_bo, s_bi, s_yo, s_yi,
    MODE: tl.constexpr, HAS_BASE: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr,
    IDX64: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Y = γ·P1 (plain), γ·P1⊙P2 (hada), γ·(P1 + P2) (sum), + base; P = a·b."""
    pid_o = tl.program_id(0)
    pid_i = tl.program_id(1)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    if IDX64:
        offs_o = offs_o.to(tl.int64)
        offs_i = offs_i.to(tl.int64)
    mask_o = offs_o < O
    mask_i = offs_i < I
    acc = _lowrank_tile(a1_ptr, b1_ptr, offs_o, offs_i, mask_o, mask_i, R1, s_a1o, s_a1r, s_b1r, s_b1i,
                        CD, DOT, BLOCK_O, BLOCK_I, BLOCK_R)
    if MODE == 1:
        acc = acc * _lowrank_tile(a2_ptr, b2_ptr, offs_o, offs_i, mask_o, mask_i, R2, s_a2o, s_a2r,
                                  s_b2r, s_b2i, CD, DOT, BLOCK_O, BLOCK_I, BLOCK_R)
    if MODE == 2:
        acc = acc + _lowrank_tile(a2_ptr, b2_ptr, offs_o, offs_i, mask_o, mask_i, R2, s_a2o, s_a2r,
                                  s_b2r, s_b2i, CD, DOT, BLOCK_O, BLOCK_I, BLOCK_R)
    acc = acc * gamma
    mask = mask_o[:, None] & mask_i[None, :]
    if HAS_BASE:
        b = tl.load(base_ptr + offs_o[:, None] * s_bo + offs_i[None, :] * s_bi, mask=mask, other=0.0)
        acc = acc + b.to(tl.float32)
    tl.store(y_ptr + offs_o[:, None] * s_yo + offs_i[None, :] * s_yi, acc.to(y_ptr.dtype.element_ty), mask=mask)


# =============================================================================== configs


class BypassFwdCfg(NamedTuple):
    """Tiles of ``lora_bypass_fwd``. ``o_split`` = number of O ranges per token
    tile (0: enough to fill the GPU)."""
    block_t: int = 64
    block_i: int = 64
    block_o: int = 128
    o_split: int = 0
    num_warps: int = 4
    num_stages: int = 3


class BypassBwdCfg(NamedTuple):
    """Tiles of ``lora_bypass_bwd``: the token kernel (``block_t/i/o``, ``i_split``
    I ranges per token tile, 0 = auto) and the reduction (``red``)."""
    block_t: int = 64
    block_i: int = 64
    block_o: int = 64
    i_split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    red: "SkinnyCfg" = None


class MergeFwdCfg(NamedTuple):
    block_o: int = 128
    block_i: int = 128
    block_r: int = 32
    num_warps: int = 8
    num_stages: int = 3


class SkinnyCfg(NamedTuple):
    """Tiles of the skinny pair kernel (out[m, r] = Σ_k big[m, k]·small[k, r]).
    ``split`` = K splits (0 = enough to fill the GPU; 1 = no partials);
    ``block_r`` 0 = the padded rank (capped at 128)."""
    block_m: int = 128
    block_k: int = 64
    block_r: int = 0
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    reduce_block: int = 1024


def default_bypass_fwd_cfg(T: int, I: int, O: int, R: int, compute: torch.dtype) -> BypassFwdCfg:
    rp = pad_rank(R)
    bt = 16 if T <= 16 else 32 if T <= 32 else 64
    if compute == torch.float32:  # IEEE fp32 dots run on FMA units: smaller tiles
        return BypassFwdCfg(block_t=min(bt, 32), block_i=32, block_o=64, num_warps=4, num_stages=2)
    return BypassFwdCfg(block_t=bt, block_i=64, block_o=128 if rp <= 64 else 64,
                        num_warps=4 if rp <= 64 else 8, num_stages=3)


def default_skinny_cfg(R: int, compute: torch.dtype) -> SkinnyCfg:
    rp = min(pad_rank(R), 128)
    if compute == torch.float32:
        return SkinnyCfg(block_m=64, block_k=32, block_r=rp, num_warps=4, num_stages=2)
    return SkinnyCfg(block_m=128, block_k=64, block_r=rp, num_warps=4 if rp <= 64 else 8, num_stages=3)


def default_bypass_bwd_cfg(T: int, I: int, O: int, R: int, compute: torch.dtype) -> BypassBwdCfg:
    rp = pad_rank(R)
    bt = 16 if T <= 16 else 32 if T <= 32 else 64
    red = default_skinny_cfg(R, compute)
    if compute == torch.float32:
        return BypassBwdCfg(block_t=min(bt, 32), block_i=32, block_o=32, num_warps=4, num_stages=2, red=red)
    return BypassBwdCfg(block_t=bt, block_i=64, block_o=64, num_warps=4 if rp <= 64 else 8,
                        num_stages=3, red=red)


def default_merge_fwd_cfg(O: int, I: int, R: int, mode: str, compute: torch.dtype) -> MergeFwdCfg:
    br = min(pad_rank(R), 64)
    if compute == torch.float32:
        return MergeFwdCfg(block_o=64, block_i=64, block_r=min(br, 32), num_warps=4, num_stages=2)
    return MergeFwdCfg(block_o=128, block_i=128, block_r=br, num_warps=8, num_stages=3)


def default_merge_bwd_cfg(O: int, I: int, R: int, compute: torch.dtype) -> SkinnyCfg:
    return default_skinny_cfg(R, compute)


def _auto_split(work_tiles: int, device: torch.device, max_split: int) -> int:
    """Ranges per tile so that the grid has about two programs per SM."""
    if work_tiles <= 0:
        return 1
    want = cdiv(2 * num_sms(device), work_tiles)
    return max(1, min(want, max_split))


# =============================================================================== plans
# A plan is everything a launch needs apart from the data pointers, the strides
# and γ: output specs, grids, constexprs. It is cached per (shapes, strides,
# dtypes, device, cfg) - the key is built from torch.Size / stride tuples and
# dtypes as they come, so a repeated call costs one dict lookup on the host.


def _skinny_plan(MA, KA, MB, KB, R, views, compute, device, cfg: SkinnyCfg):
    br = cfg.block_r or min(pad_rank(R), 128)
    tiles_a = cdiv(MA, cfg.block_m)
    tiles_b = cdiv(MB, cfg.block_m)
    r_tiles = cdiv(R, br)
    kmax = max(KA, KB)
    if cfg.split:
        split = cfg.split
    else:  # at least 4 K steps per split
        split = _auto_split((tiles_a + tiles_b) * r_tiles, device, max(1, kmax // (4 * cfg.block_k)))
    split = max(1, min(split, max(1, cdiv(kmax, cfg.block_k))))
    ka_split = cdiv(cdiv(KA, split), cfg.block_k) * cfg.block_k if KA else 0
    kb_split = cdiv(cdiv(KB, split), cfg.block_k) * cfg.block_k if KB else 0
    part_stride = (MA + MB) * R
    idx64 = needs_idx64(*views) or split * part_stride > 2**31 - 1
    grid = (tiles_a + tiles_b, split, r_tiles)
    meta = dict(DIRECT=split == 1, CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=idx64,
                BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=br,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    rgrid = (cdiv(part_stride, cfg.reduce_block),)
    rmeta = dict(IDX64=idx64, BLOCK=cfg.reduce_block)
    return grid, meta, split, ka_split, kb_split, tiles_a, part_stride, rgrid, rmeta


def _launch_skinny(plan, a, b, R, gamma, device):
    """a, b = (big, small, out, M, K, (s_bm, s_bk), (s_sk, s_sr), (s_om, s_or)) per job."""
    grid, meta, split, ka_split, kb_split, tiles_a, part_stride, rgrid, rmeta = plan
    if 0 in grid:
        return
    a_big, a_small, a_out, MA, KA, sa_b, sa_s, sa_o = a
    b_big, b_small, b_out, MB, KB, sb_b, sb_s, sb_o = b
    part = a_out if split == 1 else torch.empty(split * part_stride, device=device, dtype=torch.float32)
    fast(_skinny_pair_kernel)[grid](
        a_big, a_small, a_out, MA, KA, sa_b[0], sa_b[1], sa_s[0], sa_s[1], sa_o[0], sa_o[1], ka_split, tiles_a,
        b_big, b_small, b_out, MB, KB, sb_b[0], sb_b[1], sb_s[0], sb_s[1], sb_o[0], sb_o[1], kb_split,
        part, part_stride, R, gamma, **meta)
    if split > 1:
        fast(_pair_reduce_kernel)[rgrid](part, a_out, b_out, MA, MB, R, split, part_stride, gamma,
                                   sa_o[0], sa_o[1], sb_o[0], sb_o[1], **rmeta)


@functools.lru_cache(maxsize=4096)
def _bypass_fwd_plan(xs, xst, us, ust, dst, xdt, udt, ddt, bspec, device, cfg):
    T, I = xs
    O, R = us
    compute = compute_dtype(xdt, udt, ddt)
    out = ((T, O), xdt if bspec is None else bspec[0])
    if T == 0 or O == 0:
        return out, None, (None, None), None
    cfg = cfg or default_bypass_fwd_cfg(T, I, O, R, compute)
    n_t = cdiv(T, cfg.block_t)
    n_o = cdiv(O, cfg.block_o)
    split = cfg.o_split or _auto_split(n_t, device, n_o)
    split = max(1, min(split, n_o))
    o_per = cdiv(n_o, split) * cfg.block_o
    split = cdiv(O, o_per)
    views = [(xs, xst), (us, ust), ((R, I), dst)] + ([((T, O), bspec[1])] if bspec is not None else [])
    meta = dict(HAS_BASE=bspec is not None, CD=tl_dtype(compute), DOT=dot_dtype(compute),
                IDX64=needs_idx64(*views), BLOCK_T=cfg.block_t, BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o,
                BLOCK_R=pad_rank(R), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # the launch's size/stride arguments after gamma, from the key (y is fresh: strides (O, 1))
    bst = (O, 1) if bspec is None else bspec[1]
    args = ((T, I, O, R), (*xst, *ust, *dst, *bst, O, 1, o_per, split))
    return out, (n_t * split,), args, meta


@functools.lru_cache(maxsize=4096)
def _bypass_bwd_plan(gst, xs, xst, us, ust, dst, xdt, udt, ddt, device, cfg):
    T, I = xs
    O, R = us
    compute = compute_dtype(xdt, udt, ddt)
    cfg = cfg or default_bypass_bwd_cfg(T, I, O, R, compute)
    n_t = cdiv(T, cfg.block_t)
    n_i = cdiv(I, cfg.block_i)
    split = cfg.i_split or _auto_split(n_t, device, n_i)
    split = max(1, min(split, max(n_i, 1)))
    i_per = cdiv(max(n_i, 1), split) * cfg.block_i
    split = max(1, cdiv(I, i_per))
    views = [((T, O), gst), (xs, xst), (us, ust), ((R, I), dst)]
    meta = dict(CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=needs_idx64(*views),
                BLOCK_T=cfg.block_t, BLOCK_I=cfg.block_i, BLOCK_O=cfg.block_o, BLOCK_R=pad_rank(R),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # reductions over tokens: job A g_up[o, r] = Σ_t G[t, o]·h[t, r] (M = O),
    #                         job B g_down[r, i] = Σ_t x[t, i]·q[t, r] (M = I)
    red = _skinny_plan(O, T, I, T, R, views, compute, device, cfg.red or default_skinny_cfg(R, compute))
    grid = (n_t * split,) if T > 0 else None
    return compute, grid, (i_per, split), meta, red


@functools.lru_cache(maxsize=4096)
def _merge_fwd_plan(a1s, b1s, r2, a1dt, b1dt, a2dt, b2dt, mode, bstride, out_dtype, device, cfg):
    O, R1 = a1s
    I = b1s[1]
    plain = mode == "plain"
    compute = compute_dtype(a1dt, b1dt) if plain else compute_dtype(a1dt, b1dt, a2dt, b2dt)
    out = ((O, I), a1dt if out_dtype is None else out_dtype)
    if O == 0 or I == 0:
        return out, None, None
    R2 = 0 if plain else r2
    cfg = cfg or default_merge_fwd_cfg(O, I, max(R1, R2), mode, compute)
    views = [((O, I), (I, 1))] + ([((O, I), bstride)] if bstride is not None else [])
    meta = dict(MODE=_MODES[mode], HAS_BASE=bstride is not None, CD=tl_dtype(compute), DOT=dot_dtype(compute),
                IDX64=needs_idx64(*views), BLOCK_O=cfg.block_o, BLOCK_I=cfg.block_i, BLOCK_R=cfg.block_r,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, (cdiv(O, cfg.block_o), cdiv(I, cfg.block_i)), meta


@functools.lru_cache(maxsize=4096)
def _merge_bwd_plan(gst, us, ust, ds, dst, udt, ddt, device, cfg):
    O, R = us
    I = ds[1]
    compute = compute_dtype(udt, ddt)
    cfg = cfg or default_merge_bwd_cfg(O, I, R, compute)
    views = [((O, I), gst), (us, ust), (ds, dst)]
    return _skinny_plan(O, I, I, O, R, views, compute, device, cfg)


# =============================================================================== launchers


def bypass_fwd(x, up, down, gamma, base=None, cfg: Optional[BypassFwdCfg] = None):
    """``Y = γ·round(x·downᵀ)·upᵀ (+ base)`` (see ``reference.lora.lora_bypass_fwd``).

    x (T, I), up (O, r), down (r, I), base (T, O) optional; any strides.
    Output (T, O) contiguous in base's dtype (x's when no base). Needs padded
    rank <= 128.
    """
    device = x.device
    out, grid, (sizes, args), meta = _bypass_fwd_plan(
        x.shape, x.stride(), up.shape, up.stride(), down.stride(), x.dtype, up.dtype, down.dtype,
        None if base is None else (base.dtype, base.stride()), device, cfg)
    y = torch.empty(out[0], device=device, dtype=out[1])
    if grid is None:
        return y
    # sizes and strides come from the cached plan: the call only adds gamma
    fast(_bypass_fwd_kernel)[grid](x, up, down, y if base is None else base, y, *sizes, gamma, *args, **meta)
    return y


def bypass_bwd(grad, x, up, down, gamma, cfg: Optional[BypassBwdCfg] = None):
    """``(gx, g_up, g_down)`` of the bypass (see ``reference.lora.lora_bypass_bwd``).

    grad (T, O), x (T, I), up (O, r), down (r, I); each gradient in its own
    input's dtype. Needs padded rank <= 128.
    """
    T, I = x.shape
    O, R = up.shape
    dev = x.device
    gx = torch.empty((T, I), device=dev, dtype=x.dtype)
    g_up = torch.empty((O, R), device=dev, dtype=up.dtype)
    g_down = torch.empty((R, I), device=dev, dtype=down.dtype)
    if R == 0:
        return gx.zero_(), g_up, g_down
    gst, xst = grad.stride(), x.stride()  # read once: each stride() call is host time
    compute, grid, i_per, meta, red = _bypass_bwd_plan(
        gst, x.shape, xst, up.shape, up.stride(), down.stride(),
        x.dtype, up.dtype, down.dtype, dev, cfg)
    if grid == (1,):  # one program covers every token and column: the weight gradients in the same launch
        # (g_up, g_down are the fresh contiguous outputs above: the kernel stores them by row)
        fast(_bypass_bwd_tok_kernel)[grid](
            grad, x, up, down, gx, g_up, g_down, T, I, O, R, gamma,
            *gst, *xst, *up.stride(), *down.stride(), *gx.stride(), *i_per, FUSE_GW=True, **meta)
        return gx, g_up, g_down
    ws = torch.empty((2, T, R), device=dev, dtype=compute)  # h, q (rounded to the compute dtype)
    h, q = ws[0], ws[1]
    if grid is not None:
        fast(_bypass_bwd_tok_kernel)[grid](
            grad, x, up, down, gx, h, q, T, I, O, R, gamma,
            *gst, *xst, *up.stride(), *down.stride(), *gx.stride(), *i_per, **meta)
    # g_up[o, r] = γ Σ_t G[t, o]·h[t, r];  g_down[r, i] = γ Σ_t x[t, i]·q[t, r]
    _launch_skinny(
        red,
        (grad, h, g_up, O, T, (gst[1], gst[0]), (R, 1), (R, 1)),
        (x, q, g_down, I, T, (xst[1], xst[0]), (R, 1), (1, I)),
        R, gamma, dev)
    return gx, g_up, g_down


def merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None, cfg: Optional[MergeFwdCfg] = None):
    """``lora_merge_fwd`` (see ``reference.lora.lora_merge_fwd``): γ·a1·b1 (plain),
    γ·(a1·b1)⊙(a2·b2) (hada), γ·(a1·b1 + a2·b2) (sum), + base; (O, I) in
    ``out_dtype`` (default a1's dtype). No rank limit."""
    if mode == "plain":
        a2 = b2 = None
    out, grid, meta = _merge_fwd_plan(
        a1.shape, b1.shape, None if a2 is None else a2.shape[1], a1.dtype, b1.dtype,
        None if a2 is None else a2.dtype, None if b2 is None else b2.dtype, mode,
        None if base is None else base.stride(), out_dtype, a1.device, cfg)
    y = torch.empty(out[0], device=a1.device, dtype=out[1])
    if grid is None:
        return y
    if a2 is None:
        a2, b2 = a1, b1
    bb = y if base is None else base
    fast(_merge_fwd_kernel)[grid](
        a1, b1, a2, b2, bb, y, a1.shape[0], b1.shape[1], a1.shape[1], a2.shape[1], gamma,
        a1.stride(0), a1.stride(1), b1.stride(0), b1.stride(1), a2.stride(0), a2.stride(1),
        b2.stride(0), b2.stride(1), bb.stride(0), bb.stride(1), y.stride(0), y.stride(1), **meta)
    return y


def merge_bwd(grad, up, down, gamma, cfg: Optional[SkinnyCfg] = None):
    """``(g_up, g_down) = (γ·G·downᵀ, γ·upᵀ·G)`` (see ``reference.lora.lora_merge_bwd``),
    each in its own input's dtype. No rank limit (the rank is tiled)."""
    O, R = up.shape
    I = down.shape[1]
    dev = up.device
    g_up = torch.empty((O, R), device=dev, dtype=up.dtype)
    g_down = torch.empty((R, I), device=dev, dtype=down.dtype)
    plan = _merge_bwd_plan(grad.stride(), up.shape, up.stride(), down.shape, down.stride(),
                           up.dtype, down.dtype, dev, cfg)
    # g_up[o, r] = γ Σ_i G[o, i]·down[r, i];  g_down[r, i] = γ Σ_o G[o, i]·up[o, r]
    gs0, gs1 = grad.stride()
    _launch_skinny(
        plan,
        (grad, down, g_up, O, I, (gs0, gs1), (down.stride(1), down.stride(0)), (R, 1)),
        (grad, up, g_down, I, O, (gs1, gs0), (up.stride(0), up.stride(1)), (1, I)),
        R, gamma, dev)
    return g_up, g_down
