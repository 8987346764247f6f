"""Triton kernels of the LoKr family (OPS.md §2.3): ``lokr_full_merge_fwd``,
``lokr_full_merge_bwd``, ``lokr_merge_fwd``, ``lokr_merge_bwd``,
``lokr_bypass_fwd``, ``lokr_bypass_bwd``.

Written from the math of OPS.md §2.3 and the eager bodies of
``reference/lokr.py`` (same dtypes, same rounding points). Kronecker
convention: ``kron(w1, w2)[u·c + i, v·d + j] = w1[u, v]·w2[i, j]``, w1 (a, b),
w2 (c, d). Operands are read in their stored dtype and rounded to the compute
dtype in-kernel; every product accumulates in fp32 and intermediates that the
eager body keeps in fp32 stay fp32 (see ``_fusedkit.dot_wide``); γ and base
are applied in fp32, one rounding at the store. Any strides; odd sizes masked.

Passes (launches) per op
------------------------
``lokr_full_merge_fwd`` / ``lokr_merge_fwd`` - one kernel. The output is the
    4-D view Y4[u, i, v, j]. Program = (tile of the "tile" factor, range of
    entries of the "loop" factor). By default the tile factor is w2 (rows i,
    columns j: contiguous stores) and the loop factor w1. The program builds its
    fp32 tile once (loaded, or ``w2a·w2b`` generated in-kernel over the rank in
    chunks), then for each loop entry (u, v) computes the scalar w1[u, v]
    (loaded, or the fp32 dot ``w1a[u, :]·w1b[:, v]``) and stores
    ``(w1[u,v]·tile)·γ (+ base)``. Nothing is rounded before the Kronecker
    multiply. ``swap=True`` exchanges the roles (tile w1, loop over w2).
``lokr_full_merge_bwd`` / ``lokr_merge_bwd`` - one pass over G with the same
    program layout: per loop entry the G tile is loaded once and gives both
    ``g_L[u, v] += Σ G⊙tile`` (a scalar partial per tile program) and
    ``g_T += G·L[u, v]`` (a tile accumulator per split). fp32 partials are
    stored only when a reduction across programs is needed. Then a flat reduce
    (many programs) sums a whole side's partials into its gradient, and a
    factored side's into one fp32 plane when its stack is ``CHAIN_PRESUM`` deep
    and the plane at least ``PRESUM_MIN_PLANE`` elements (two such reductions
    share one launch); a factored side's gradients are the chained fp32 products
    ``g_wa = (Σ g_w)·wbᵀ``, ``g_wb = waᵀ·(Σ g_w)`` (both sides' in one launch; a
    stack not presummed is summed in that kernel). 1 to 3 launches.
``lokr_bypass_fwd`` - one kernel. Program = (BT tokens, block of c). Never
    builds kron(w1, w2): ``Z = X·w2ᵀ`` with X the (BT·b, d) token tile (rows
    (t, v)) accumulated over d in fp32, Z permuted in registers to (b, BT·c),
    then ``Y = γ·w1·Z (+ base)`` for each block of a. Z is not rounded (16-bit:
    hi/lo split dot). ``swap=True`` runs the transposed problem
    ``Y_tᵀ = w2·X_tᵀ·w1ᵀ`` (the other contraction order) through the same
    kernel by exchanging strides; the launcher picks the cheaper order.
``lokr_bypass_bwd`` - one pass over x and G (``passes=1``): persistent programs
    walk token tiles (axis 0) for one chunk of d (axis 1); per tile
    ``H = G_t·w2[:, chunk]`` (fp32), ``gX_t[:, chunk] = γ·w1ᵀ·H`` (stored),
    ``g_w1 += H·X_t[:, chunk]ᵀ``, ``P = w1·X_t[:, chunk]`` and
    ``g_w2[:, chunk] += G_tᵀ·P`` - every product splits over d, so x is read once
    and G once per d chunk (once when d fits one chunk). The fp32 g_w1 / g_w2
    partials (one per program) are summed by one reduce launch each (none with a
    single program). ``passes=2`` / ``3`` split (gx, g_w1) and g_w2 (or all three)
    into separate launches to relieve registers (G and x read 2-3 times).

Limits (scope): the bypass kernels keep whole padded factor dims in registers:
``pow2(max(a, b, c, d), ≥16) <= 128`` (``supported_bypass``); the merges have
no limit (ranks are looped). fp16 / bf16 / fp32 only (fp64 goes eager).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import (cdiv, dot_dtype, fast, needs_idx64, next_pow2, num_sms, tl_dtype)
from lycoris_ops.backends.triton.kernels.fusedkit import (_chain_plane, chain_launch, chain_pair_launch, compute_dtype, dot_wide, reduce_launch, reduce_pair_launch, split_count, tile_2d, view_key)

__all__ = [
    "MergeCfg", "BypassFwdCfg", "BypassBwdCfg", "MAX_BYPASS_DIM", "supported_bypass",
    "lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd", "merge_fwd", "merge_bwd", "bypass_fwd", "bypass_bwd",
]

#: the bypass kernels hold whole (padded) factor dims in registers
MAX_BYPASS_DIM = 128


def _p16(n: int) -> int:
    return max(16, next_pow2(n))


def supported_bypass(a: int, b: int, c: int, d: int) -> bool:
    """Whether the fused bypass kernels take w1 (a, b), w2 (c, d)."""
    return _p16(max(a, b, c, d)) <= MAX_BYPASS_DIM


# =============================================================================== kernels


@triton.jit
def _side_tile(ta_ptr, tb_ptr, offs_m, offs_n, mask_m, mask_n, R, s_am, s_ar, s_br, s_bn,
               FACT: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """fp32 tile of a Kronecker side: ta[m, n] (whole) or Σ_r ta[m, r]·tb[r, n]."""
    if FACT:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for r0 in range(0, R, BR):
            offs_r = r0 + tl.arange(0, BR)
            mask_r = offs_r < R
            a = tl.load(ta_ptr + offs_m[:, None] * s_am + offs_r[None, :] * s_ar,
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            b = tl.load(tb_ptr + offs_r[:, None] * s_br + offs_n[None, :] * s_bn,
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a.to(CD).to(DOT), b.to(CD).to(DOT), acc, input_precision="ieee")
    else:
        t = tl.load(ta_ptr + offs_m[:, None] * s_am + offs_n[None, :] * s_ar,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        acc = t.to(CD).to(tl.float32)
    return acc


@triton.jit
def _side_entry(la_ptr, lb_ptr, em, en, R, s_am, s_ar, s_br, s_bn,
                FACT: tl.constexpr, CD: tl.constexpr, BR: tl.constexpr):
    """fp32 scalar entry [em, en] of a Kronecker side (whole or la·lb)."""
    if FACT:
        s = tl.zeros((BR,), dtype=tl.float32)
        for r0 in range(0, R, BR):
            offs_r = r0 + tl.arange(0, BR)
            mask_r = offs_r < R
            a = tl.load(la_ptr + em * s_am + offs_r * s_ar, mask=mask_r, other=0.0)
            b = tl.load(lb_ptr + offs_r * s_br + en * s_bn, mask=mask_r, other=0.0)
            s += a.to(CD).to(tl.float32) * b.to(CD).to(tl.float32)
        v = tl.sum(s, axis=0)
    else:
        v = tl.load(la_ptr + em * s_am + en * s_ar).to(CD).to(tl.float32)
    return v


@triton.jit
def _loop_entry(la_ptr, lb_ptr, e, N2, R, s_am, s_ar, s_br, s_bn,
                FACT: tl.constexpr, CD: tl.constexpr, IDX64: tl.constexpr, BR: tl.constexpr):
    """(row, column, fp32 value) of the loop side's flat entry e (row-major over N2 columns)."""
    em = e // N2
    en = e % N2
    if IDX64:
        em = em.to(tl.int64)
        en = en.to(tl.int64)
    return em, en, _side_entry(la_ptr, lb_ptr, em, en, R, s_am, s_ar, s_br, s_bn, FACT, CD, BR)


@triton.jit
def _kron_merge_kernel(
    ta_ptr, tb_ptr, la_ptr, lb_ptr, base_ptr, out_ptr,
    M1, N1, RT, M2, N2, RL, E_PER, gamma,
    s_tam, s_tar, s_tbr, s_tbn, s_lam, s_lar, s_lbr, s_lbn,
    s_om, s_on, s_oM, s_oN, s_bm, s_bn, s_bM, s_bN,
    FACT_T: tl.constexpr, FACT_L: tl.constexpr, HAS_BASE: tl.constexpr,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BRL: tl.constexpr,
):
    """out[(M, m), (N, n)] = (L[M, N]·T[m, n])·γ (+ base); T tile fixed per program."""
    pid_s = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = tile_2d(M1, N1, IDX64, BM, BN)
    mask = mask_m[:, None] & mask_n[None, :]
    tile = _side_tile(ta_ptr, tb_ptr, offs_m, offs_n, mask_m, mask_n, RT, s_tam, s_tar, s_tbr, s_tbn,
                      FACT_T, CD, DOT, BM, BN, BR)
    o_tile = out_ptr + offs_m[:, None] * s_om + offs_n[None, :] * s_on
    b_tile = base_ptr + offs_m[:, None] * s_bm + offs_n[None, :] * s_bn
    e_lo = pid_s * E_PER
    e_hi = tl.minimum(e_lo + E_PER, M2 * N2)
    for e in range(e_lo, e_hi):
        em, en, s = _loop_entry(la_ptr, lb_ptr, e, N2, RL, s_lam, s_lar, s_lbr, s_lbn, FACT_L, CD, IDX64, BRL)
        val = tile * s * gamma
        if HAS_BASE:
            val += tl.load(b_tile + em * s_bM + en * s_bN, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_tile + em * s_oM + en * s_oN, val.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kron_grad_kernel(
    g_ptr, ta_ptr, tb_ptr, la_ptr, lb_ptr, pt_ptr, pl_ptr,
    M1, N1, RT, M2, N2, RL, E_PER, gamma,
    s_tam, s_tar, s_tbr, s_tbn, s_lam, s_lar, s_lbr, s_lbn,
    s_gm, s_gn, s_gM, s_gN, s_pts, s_ptm, s_ptn, s_pls, s_plm, s_pln,
    gta_ptr, gtb_ptr, gla_ptr, glb_ptr, s_gtam, s_gtar, s_gtbr, s_gtbn, s_glam, s_glar, s_glbr, s_glbn,
    FACT_T: tl.constexpr, FACT_L: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BRL: tl.constexpr,
    CHAIN: tl.constexpr = False, CBM: tl.constexpr = 16, CBN: tl.constexpr = 16, CBK: tl.constexpr = 32,
):
    """One read of G: g_L[M, N] = γ·Σ_{m,n} G·T (per tile program) and
    g_T[m, n] = γ·Σ_{M,N} G·L[M, N] (per split program). ``CHAIN`` (a one-program grid,
    ``merge_bwd``'s small calls): after a barrier the same program runs each factorized side's
    chain (``_fusedkit._chain_plane``: g_wa = P·wbᵀ into g*a, g_wb = waᵀ·P into g*b) on the
    one partial plane it stored, so the backward is one launch. The chain reuses the kernel's
    own factor and partial arguments: csrc/launch.cpp replays at most 64 parameters a launch."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m, offs_n, mask_m, mask_n = tile_2d(M1, N1, IDX64, BM, BN)
    mask = mask_m[:, None] & mask_n[None, :]
    tile = _side_tile(ta_ptr, tb_ptr, offs_m, offs_n, mask_m, mask_n, RT, s_tam, s_tar, s_tbr, s_tbn,
                      FACT_T, CD, DOT, BM, BN, BR)
    g_tile = g_ptr + offs_m[:, None] * s_gm + offs_n[None, :] * s_gn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    e_lo = pid_s * E_PER
    e_hi = tl.minimum(e_lo + E_PER, M2 * N2)
    for e in range(e_lo, e_hi):
        em, en, s = _loop_entry(la_ptr, lb_ptr, e, N2, RL, s_lam, s_lar, s_lbr, s_lbn, FACT_L, CD, IDX64, BRL)
        g = tl.load(g_tile + em * s_gM + en * s_gN, mask=mask, other=0.0).to(CD).to(tl.float32)
        acc += g * s
        gl = tl.sum(tl.sum(g * tile, axis=1), axis=0) * gamma
        tl.store(pl_ptr + pid * s_pls + em * s_plm + en * s_pln, gl.to(pl_ptr.dtype.element_ty))
    acc = acc * gamma
    tl.store(pt_ptr + pid_s * s_pts + offs_m[:, None] * s_ptm + offs_n[None, :] * s_ptn,
             acc.to(pt_ptr.dtype.element_ty), mask=mask)
    if CHAIN:
        tl.debug_barrier()  # the partials this program stored, visible to all of its threads
        if FACT_T:
            _chain_plane(pt_ptr, ta_ptr, tb_ptr, gta_ptr, gtb_ptr, M1, N1, RT, s_ptm, s_ptn, s_tam, s_tar,
                         s_tbr, s_tbn, s_gtam, s_gtar, s_gtbr, s_gtbn, CD, IDX64, CBM, CBN, CBK)
        if FACT_L:
            _chain_plane(pl_ptr, la_ptr, lb_ptr, gla_ptr, glb_ptr, M2, N2, RL, s_plm, s_pln, s_lam, s_lar,
                         s_lbr, s_lbn, s_glam, s_glar, s_glbr, s_glbn, CD, IDX64, CBM, CBN, CBK)


@triton.jit
def _bypass_fwd_kernel(
    x_ptr, w1_ptr, w2_ptr, base_ptr, y_ptr,
    T, A, B, C, D, gamma,
    s_xt, s_xv, s_xj, s_1u, s_1v, s_2i, s_2j, s_bt, s_bu, s_bi, s_yt, s_yu, s_yi,
    HAS_BASE: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr,
    IDX64: tl.constexpr, BT: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr,
    BC: tl.constexpr, BA: tl.constexpr,
):
    """Y[t, u, i] = γ·Σ_v w1[u, v]·(Σ_j x[t, v, j]·w2[i, j]) (+ base[t, u, i])."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    # rows of the token tile: (t, v), t-major
    r = tl.arange(0, BT * BB)
    rt = pid_t * BT + r // BB
    rv = r % BB
    if IDX64:
        rt = rt.to(tl.int64)
    mask_r = (rt < T) & (rv < B)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    z = tl.zeros((BT * BB, BC), dtype=tl.float32)
    for j0 in range(0, D, BD):
        offs_j = j0 + tl.arange(0, BD)
        mask_j = offs_j < D
        xt = tl.load(x_ptr + rt[:, None] * s_xt + rv[:, None] * s_xv + offs_j[None, :] * s_xj,
                     mask=mask_r[:, None] & mask_j[None, :], other=0.0)
        w2t = tl.load(w2_ptr + offs_j[:, None] * s_2j + offs_c[None, :] * s_2i,
                      mask=mask_j[:, None] & mask_c[None, :], other=0.0)
        z = tl.dot(xt.to(CD).to(DOT), w2t.to(CD).to(DOT), z, input_precision="ieee")
    # (t, v) x i  ->  v x (t, i)
    zp = tl.reshape(tl.permute(tl.reshape(z, (BT, BB, BC)), (1, 0, 2)), (BB, BT * BC))
    q = tl.arange(0, BT * BC)
    qt = pid_t * BT + q // BC
    qi = pid_c * BC + q % BC
    if IDX64:
        qt = qt.to(tl.int64)
    mask_q = (qt < T) & (qi < C)
    offs_v = tl.arange(0, BB)
    mask_v = offs_v < B
    for u0 in range(0, A, BA):
        offs_u = u0 + tl.arange(0, BA)
        mask_u = offs_u < A
        w1t = tl.load(w1_ptr + offs_u[:, None] * s_1u + offs_v[None, :] * s_1v,
                      mask=mask_u[:, None] & mask_v[None, :], other=0.0)
        acc = tl.zeros((BA, BT * BC), dtype=tl.float32)
        acc = dot_wide(w1t.to(CD), zp, acc, DOT, SPLIT, False)
        acc = acc * gamma
        mask = mask_u[:, None] & mask_q[None, :]
        if HAS_BASE:
            bt = tl.load(base_ptr + qt[None, :] * s_bt + offs_u[:, None] * s_bu + qi[None, :] * s_bi,
                         mask=mask, other=0.0)
            acc += bt.to(tl.float32)
        tl.store(y_ptr + qt[None, :] * s_yt + offs_u[:, None] * s_yu + qi[None, :] * s_yi,
                 acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bypass_bwd_kernel(
    g_ptr, x_ptr, w1_ptr, w2_ptr, gx_ptr, p1_ptr, p2_ptr,
    T, A, B, C, D, gamma, TILES_PER_PROG,
    s_gt, s_gu, s_gi, s_xt, s_xv, s_xj, s_1u, s_1v, s_2i, s_2j, s_ot, s_ov, s_oj,
    s_p1s, s_p1u, s_p1v, s_p2s, s_p2i, s_p2j,
    DO_GX: tl.constexpr, DO_GW1: tl.constexpr, DO_GW2: tl.constexpr,
    CD: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr, IDX64: tl.constexpr,
    BT: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
):
    """Per token tile and d chunk (axis 1, BD columns of d): H = G_t·w2[:, chunk],
    gX_t[:, chunk] = γ·w1ᵀ·H, g_w1 += H·X_t[:, chunk]ᵀ, P = w1·X_t[:, chunk],
    g_w2[:, chunk] += G_tᵀ·P (sums over this program's token tiles; γ applied at
    the store). Every product decomposes over the d chunks; g_w1 partials are
    indexed (chunk, program)."""
    pid = tl.program_id(0)
    pid_j = tl.program_id(1)
    offs_u = tl.arange(0, BA)
    offs_v = tl.arange(0, BB)
    offs_i = tl.arange(0, BC)
    offs_j = pid_j * BD + tl.arange(0, BD)
    mu = offs_u < A
    mv = offs_v < B
    mi = offs_i < C
    mj = offs_j < D
    w1 = tl.load(w1_ptr + offs_u[:, None] * s_1u + offs_v[None, :] * s_1v,
                 mask=mu[:, None] & mv[None, :], other=0.0).to(CD)
    w2 = tl.load(w2_ptr + offs_i[:, None] * s_2i + offs_j[None, :] * s_2j,
                 mask=mi[:, None] & mj[None, :], other=0.0).to(CD).to(DOT)
    acc1 = tl.zeros((BA, BB), dtype=tl.float32)
    acc2 = tl.zeros((BC, BD), dtype=tl.float32)
    # rows (t, u) of the G tile; columns (t, j) of the X / H tiles
    ra = tl.arange(0, BT * BA)
    ra_t = ra // BA
    ra_u = ra % BA
    cq = tl.arange(0, BT * BD)
    cq_t = cq // BD
    cq_j = pid_j * BD + cq % BD
    n_tiles = tl.cdiv(T, BT)
    t_lo = pid * TILES_PER_PROG
    t_hi = tl.minimum(t_lo + TILES_PER_PROG, n_tiles)
    for tile in range(t_lo, t_hi):
        tg = tile * BT + ra_t
        tq = tile * BT + cq_t
        if IDX64:
            tg = tg.to(tl.int64)
            tq = tq.to(tl.int64)
        mg = (tg < T) & (ra_u < A)
        mq = (tq < T) & (cq_j < D)
        gt = tl.load(g_ptr + tg[:, None] * s_gt + ra_u[:, None] * s_gu + offs_i[None, :] * s_gi,
                     mask=mg[:, None] & mi[None, :], other=0.0).to(CD).to(DOT)   # (BT·BA, BC)
        if DO_GX or DO_GW1:
            h = tl.dot(gt, w2, input_precision="ieee")                             # (BT·BA, BD) fp32
            hp = tl.reshape(tl.permute(tl.reshape(h, (BT, BA, BD)), (1, 0, 2)), (BA, BT * BD))
        if DO_GX:
            gx = tl.zeros((BB, BT * BD), dtype=tl.float32)
            gx = dot_wide(tl.trans(w1), hp, gx, DOT, SPLIT, False) * gamma
            tl.store(gx_ptr + tq[None, :] * s_ot + offs_v[:, None] * s_ov + cq_j[None, :] * s_oj,
                     gx.to(gx_ptr.dtype.element_ty), mask=mv[:, None] & mq[None, :])
        if DO_GW1 or DO_GW2:
            xv = tl.load(x_ptr + tq[None, :] * s_xt + offs_v[:, None] * s_xv + cq_j[None, :] * s_xj,
                         mask=mv[:, None] & mq[None, :], other=0.0).to(CD)            # (BB, BT·BD)
        if DO_GW1:
            acc1 = dot_wide(tl.trans(xv), hp, acc1, DOT, SPLIT, True)
        if DO_GW2:
            p = tl.dot(w1.to(DOT), xv.to(DOT), input_precision="ieee")             # (BA, BT·BD) fp32
            pp = tl.reshape(tl.permute(tl.reshape(p, (BA, BT, BD)), (1, 0, 2)), (BT * BA, BD))
            acc2 = dot_wide(tl.trans(gt), pp, acc2, DOT, SPLIT, False)
    if DO_GW1:
        slot = pid_j * tl.num_programs(0) + pid
        tl.store(p1_ptr + slot * s_p1s + offs_u[:, None] * s_p1u + offs_v[None, :] * s_p1v,
                 (acc1 * gamma).to(p1_ptr.dtype.element_ty), mask=mu[:, None] & mv[None, :])
    if DO_GW2:
        tl.store(p2_ptr + pid * s_p2s + offs_i[:, None] * s_p2i + offs_j[None, :] * s_p2j,
                 (acc2 * gamma).to(p2_ptr.dtype.element_ty), mask=mi[:, None] & mj[None, :])


# =============================================================================== configs


class MergeCfg(NamedTuple):
    """Kronecker merge / merge-backward tiling. ``split``: programs along the loop
    factor's entries (0: auto); ``swap``: tile w1 and loop over w2 (None: auto)."""
    block_m: int = 32
    block_n: int = 64
    block_r: int = 32
    block_rl: int = 32
    split: int = 0
    swap: Optional[bool] = None
    num_warps: int = 4
    num_stages: int = 1


class BypassFwdCfg(NamedTuple):
    """``block_t`` tokens per program, ``block_d`` d chunk, ``block_c`` c per program,
    ``block_a`` a chunk, ``num_warps`` (0: auto each); ``split``: hi/lo 16-bit dot for the
    unrounded fp32 intermediate; ``swap``: contraction order (None: cheaper)."""
    block_t: int = 0
    block_d: int = 0
    block_c: int = 0
    block_a: int = 0
    split: bool = True
    swap: Optional[bool] = None
    num_warps: int = 0
    num_stages: int = 2


class BypassBwdCfg(NamedTuple):
    """``passes``: 1 (gx, g_w1, g_w2 in one read of G and x), 2 ((gx, g_w1) then
    g_w2) or 3 (one launch each); ``block_d``: d chunk per program (grid axis 1; G is
    read once per chunk); ``programs``: persistent programs (0: auto, ``bwd_grid``);
    ``split`` (16-bit compute): the fp32 intermediates H = G_t·w2 and P = w1·X_t enter
    their second dots as hi/lo 16-bit pairs (unrounded); False rounds them to 16 bits, as
    eager does (5 dots a token tile instead of 8)."""
    block_t: int = 0
    block_d: int = 0
    passes: int = 0
    programs: int = 0
    split: bool = True
    swap: Optional[bool] = None
    num_warps: int = 0
    num_stages: int = 2


def default_merge_cfg(M1: int, N1: int, M2: int, N2: int, compute: torch.dtype) -> MergeCfg:
    bn = min(128, max(16, next_pow2(N1)))
    bm = min(max(16, next_pow2(M1)), max(16, 4096 // bn))
    return MergeCfg(block_m=bm, block_n=bn, num_warps=4 if bm * bn <= 4096 else 8)


def default_bypass_fwd_cfg(T, A, B, C, D, compute) -> BypassFwdCfg:
    """Register model (ptxas -v, sm_90, no spills): Z (BT·BB, BC) plus the output
    tile (BA, BT·BC) <= 32768 fp32 elements at 8 warps (16384 at 4) for 16-bit
    dots; IEEE fp32 dots run on FMA units and hold their operands in registers:
    8192 at 8 warps with smaller chunks."""
    f32 = compute == torch.float32
    budget = 8192 if f32 else 32768
    bb = _p16(B)
    bc = min(_p16(C), 64 if f32 else 128)
    ba = min(_p16(A), 32 if f32 else 64)
    while bc > 16 and bc * (bb + ba) > budget:
        bc //= 2
    bt = 1
    while bt < 16 and 2 * bt * bc * (bb + ba) <= budget and bt < next_pow2(max(T, 1)):
        bt *= 2
    return BypassFwdCfg(block_t=bt, block_d=min(_p16(D), 32 if f32 else 64), block_c=bc, block_a=ba,
                        num_warps=8 if f32 or bt * bc * (bb + ba) > 16384 else 4)


def _bwd_tiles(ba, bb, bc, bd):
    """fp32-equivalent live elements per token of the bwd kernel's tiles."""
    return ba * bc + 2 * ba * bd + 2 * bb * bd


def default_bypass_bwd_cfg(T, A, B, C, D, compute) -> BypassBwdCfg:
    """Register model (ptxas -v, sm_90): one pass (G and x read once; G once per d
    chunk) with the widest d chunk whose tiles plus both accumulators stay within
    32768 fp32 elements (8192 for IEEE fp32 dots); else 2 passes (3 for fp32) with
    64-wide (32) chunks. More tokens per program while the per-token tiles stay
    <= 12288 (4096). 16-bit dots: 4 warps (28672 such elements, 64x64 factors, took
    248 registers a thread, no spill; see ``bwd_grid`` for 8); fp32: 8."""
    f32 = compute == torch.float32
    budget, tb = (8192, 4096) if f32 else (32768, 12288)
    ba, bb, bc = _p16(A), _p16(B), _p16(C)
    bd = _p16(D)
    while bd > 16 and _bwd_tiles(ba, bb, bc, bd) + ba * bb + bc * bd > budget:
        bd //= 2
    if _bwd_tiles(ba, bb, bc, bd) + ba * bb + bc * bd <= budget:
        passes = 1
    else:
        passes, bd = (3, min(_p16(D), 32)) if f32 else (2, min(_p16(D), 64))
    tiles = _bwd_tiles(ba, bb, bc, bd)
    bt = 1
    while bt < 16 and 2 * bt * tiles <= tb and bt < next_pow2(max(T, 1)):
        bt *= 2
    return BypassBwdCfg(block_t=bt, block_d=bd, passes=passes, num_warps=8 if f32 else 4)


#: a bypass backward of at most this many elements of G and x together (T·(a·c + b·d)) runs
#: as one program by default: its weight gradients are then stored directly, so the call is
#: one launch with no partial buffers (a tiny call's host time is its launches and buffers;
#: the one program's device time stays under that)
ONE_PROGRAM_ELEMS = 1 << 13


def bwd_grid(programs: int, num_warps: int, n_sm: int, n_tiles: int, elems: int = 0):
    """(persistent programs, token tiles each) of the bypass backward; ``programs`` 0:
    one where the problem has at most ``ONE_PROGRAM_ELEMS`` elements (``elems``), else two
    per SM at 4 warps (at most 255 registers a thread: two fit one SM's register file),
    else one; then the tiles spread evenly. H200, bf16, 64x64 factors, one pass
    (bench/variants.py lokr, RESULTS 2026-12-01 15:30-16:00): two 4-warp programs per SM
    took 0.39 ms at 32768 tokens against 0.61 with one and 1.15 with one 8-warp program
    (8 warps: 1.5-3x slower at every tokens/stages/programs setting). plans/lokr models
    this grid."""
    if not programs and 0 < elems <= ONE_PROGRAM_ELEMS:
        programs = 1
    progs = max(1, min(programs or (2 if num_warps == 4 else 1) * n_sm, n_tiles))
    per = cdiv(n_tiles, progs)
    return cdiv(n_tiles, per), per


# =============================================================================== merges


def _side_args(wa, wb):
    """(ta, tb, rank, s_am, s_ar, s_br, s_bn, FACT) of a Kronecker side."""
    if wb is None:
        return wa, wa, 0, wa.stride(0), wa.stride(1), 0, 0, False
    return wa, wb, wa.shape[1], wa.stride(0), wa.stride(1), wb.stride(0), wb.stride(1), True


def _swap_default(a, b, c, d):
    # tile the inner factor (w2: contiguous stores) unless it is much smaller than w1
    return c * d * 8 < a * b and d < 16


@functools.lru_cache(maxsize=4096)
def _merge_plan(a, b, c, d, views, has_base, fact1, fact2, compute, device, cfg: MergeCfg, grad: bool,
                presum: int = 0, min_plane: int = 0):
    swap = _swap_default(a, b, c, d) if cfg.swap is None else cfg.swap
    if swap:
        M1, N1, M2, N2, fact_t, fact_l = a, b, c, d, fact1, fact2
    else:
        M1, N1, M2, N2, fact_t, fact_l = c, d, a, b, fact2, fact1
    n_tiles = cdiv(M1, cfg.block_m) * cdiv(N1, cfg.block_n)
    E = M2 * N2
    split = cfg.split or split_count(n_tiles, device, E, per_sm=4)
    split = max(1, min(split, E))
    if grad and not cfg.split:
        split = max(1, min(split, _grad_split_cap(E, fact_t, M1, N1, presum, min_plane)))
    e_per = cdiv(E, split)
    split = cdiv(E, e_per)
    meta = dict(FACT_T=fact_t, FACT_L=fact_l, CD=tl_dtype(compute), DOT=dot_dtype(compute),
                IDX64=needs_idx64(*[v for v in views if v is not None]),
                BM=cfg.block_m, BN=cfg.block_n, BR=cfg.block_r, BRL=cfg.block_rl,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not grad:
        meta["HAS_BASE"] = has_base
    return swap, (n_tiles, split), M1, N1, M2, N2, e_per, meta


def merge_fwd(w1a, w1b, w2a, w2b, a, b, c, d, base, gamma, out_dtype, cfg: Optional[MergeCfg] = None):
    """``γ·kron(w1, w2) (+ base)``, w1 = w1a(·w1b), w2 = w2a(·w2b); output (a·c, b·d)."""
    compute = compute_dtype(w1a.dtype, None if w1b is None else w1b.dtype, w2a.dtype,
                            None if w2b is None else w2b.dtype)
    out = torch.empty((a * c, b * d), device=w2a.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    if cfg is None:
        cfg = default_merge_cfg(c, d, a, b, compute)
    views = view_key(w1a, w1b, w2a, w2b, base, out)
    swap, grid, M1, N1, M2, N2, e_per, meta = _merge_plan(
        a, b, c, d, views, base is not None, w1b is not None, w2b is not None, compute, out.device, cfg, False)
    s0, s1 = out.stride()
    bb = out if base is None else base
    q0, q1 = bb.stride()
    if swap:
        t, l = _side_args(w1a, w1b), _side_args(w2a, w2b)
        so, sb = (c * s0, d * s1, s0, s1), (c * q0, d * q1, q0, q1)
    else:
        t, l = _side_args(w2a, w2b), _side_args(w1a, w1b)
        so, sb = (s0, s1, c * s0, d * s1), (q0, q1, c * q0, d * q1)
    fast(_kron_merge_kernel)[grid](
        t[0], t[1], l[0], l[1], bb, out, M1, N1, t[2], M2, N2, l[2], e_per, gamma,
        t[3], t[4], t[5], t[6], l[3], l[4], l[5], l[6], *so, *sb, **meta)
    return out


#: the factor-gradient chain's tile (rows, columns, K step) after the Kronecker-gradient kernel
#: (``_fusedkit.chain_launch``); a module constant so ``bench/variants.py lokr_merge`` can time others
CHAIN_BLOCK = (16, 16, 32)
#: most chain tiles (CHAIN_BLOCK outputs) that a one-program gradient kernel runs itself, after
#: its pass (``merge_bwd``: a small call is host-bound, and a launch costs ~3.5 µs of host time)
CHAIN_FUSE_TILES = 8
#: a merge backward's G of at most this many elements is one pass of one program per tile (no
#: split of the loop entries): such a call is host-bound, and the chains then fuse into it
SMALL_GRAD_PASS = 1 << 16


def _chain_fuses(programs: int, n_reduces: int, chain_dims) -> bool:
    """Whether ``merge_bwd``'s factor chains run inside its gradient kernel (``CHAIN``): one
    program, no reduce launch, factorized sides (M, N, rank) of at most ``CHAIN_FUSE_TILES``
    chain tiles in all (g_wa: M x R, g_wb: R x N, in CHAIN_BLOCK tiles)."""
    bm, bn = CHAIN_BLOCK[:2]
    tiles = sum(cdiv(M, bm) * cdiv(R, bn) + cdiv(R, bm) * cdiv(N, bn) for M, N, R in chain_dims)
    return programs == 1 and n_reduces == 0 and bool(chain_dims) and tiles <= CHAIN_FUSE_TILES
#: a partial stack at least this deep is first added into one fp32 plane by a flat reduce (many
#: programs), so the chain's few tile programs read one plane instead of S (0: never). H200, bf16,
#: 3072² with w2 = (256, 32)·(32, 256): chain 32x32x32 over 9 partials 0.066 ms, 16x16x32 0.051,
#: presum + 16x16x32 0.046, and with 16 partials 0.038 (bench/RESULTS.md, 2026-12-04 16:25–16:45)
CHAIN_PRESUM = 2
#: ... and only a plane of at least this many elements: below it the chain's programs are few
#: anyway and the extra launch is host time (a tiny call is launch bound)
PRESUM_MIN_PLANE = 128 * 128


def _presums(S, M, N, presum=None, min_plane=None):
    """Whether a factorized side's (S, M, N) partial stack is presummed before its chain
    (``presum`` / ``min_plane``: default ``CHAIN_PRESUM`` / ``PRESUM_MIN_PLANE``)."""
    presum = CHAIN_PRESUM if presum is None else presum
    min_plane = PRESUM_MIN_PLANE if min_plane is None else min_plane
    return bool(presum) and S >= presum and M * N >= min_plane


def _grad_split_cap(E, fact_t, M1, N1, presum=None, min_plane=None):
    """Most splits of the gradient kernel's E loop entries: its fp32 tile partials (split·M1·N1)
    stay below ~1/8 of a 16-bit G; ~1/4 where a flat reduce reads them (the tile side presummed),
    not the chain's few tile programs. A small G (at most ``SMALL_GRAD_PASS`` elements): one,
    so a one-tile call is one program, which runs its chains itself (``_chain_fuses``)."""
    if E * M1 * N1 <= SMALL_GRAD_PASS:
        return 1
    return E // (8 if fact_t and _presums(2, M1, N1, presum, min_plane) else 16)


def merge_bwd(grad, w1a, w1b, w2a, w2b, a, b, c, d, gamma, cfg: Optional[MergeCfg] = None):
    """(g_w1a, g_w1b, g_w2a, g_w2b) of ``γ·kron(w1, w2)``; an absent b factor gives an
    empty (0,) tensor in its a partner's dtype."""
    compute = compute_dtype(w1a.dtype, None if w1b is None else w1b.dtype, w2a.dtype,
                            None if w2b is None else w2b.dtype)
    dev = grad.device
    g1a = torch.empty(w1a.shape, device=dev, dtype=w1a.dtype)
    g1b = torch.empty((0,) if w1b is None else w1b.shape, device=dev, dtype=(w1a if w1b is None else w1b).dtype)
    g2a = torch.empty(w2a.shape, device=dev, dtype=w2a.dtype)
    g2b = torch.empty((0,) if w2b is None else w2b.shape, device=dev, dtype=(w2a if w2b is None else w2b).dtype)
    if grad.numel() == 0:
        for g in (g1a, g1b, g2a, g2b):
            g.zero_()
        return g1a, g1b, g2a, g2b
    if cfg is None:
        cfg = default_merge_cfg(c, d, a, b, compute)
    views = view_key(grad, w1a, w1b, w2a, w2b)
    swap, grid, M1, N1, M2, N2, e_per, meta = _merge_plan(
        a, b, c, d, views, False, w1b is not None, w2b is not None, compute, dev, cfg, True,
        CHAIN_PRESUM, PRESUM_MIN_PLANE)  # the cache key carries the presum rule
    n_tiles, split = grid
    s0, s1 = grad.stride()
    if swap:
        (ta, tb), (la, lb) = (w1a, w1b), (w2a, w2b)
        (gta, gtb), (gla, glb) = (g1a, g1b), (g2a, g2b)
        sg = (c * s0, d * s1, s0, s1)
    else:
        (ta, tb), (la, lb) = (w2a, w2b), (w1a, w1b)
        (gta, gtb), (gla, glb) = (g2a, g2b), (g1a, g1b)
        sg = (s0, s1, c * s0, d * s1)
    t, l = _side_args(ta, tb), _side_args(la, lb)
    idx64 = meta["IDX64"]
    # tile side: direct store when whole and not split, else fp32 partials (split, M1, N1)
    if tb is None and split == 1:
        pt, pts = gta, (0,) + gta.stride()
    else:
        pt = torch.empty((split, M1, N1), device=dev, dtype=torch.float32)
        pts = pt.stride()
    if lb is None and n_tiles == 1:
        pl, pls = gla, (0,) + gla.stride()
    else:
        pl = torch.empty((n_tiles, M2, N2), device=dev, dtype=torch.float32)
        pls = pl.stride()
    sides = [(part, S, M, N, wa, wb, ga, gb) for part, S, M, N, wa, wb, ga, gb, direct in (
        (pt, split, M1, N1, ta, tb, gta, gtb, pt is gta), (pl, n_tiles, M2, N2, la, lb, gla, glb, pl is gla))
        if not direct]
    # flat reduces: a whole side's gradient, and a factorized side's stack added into one fp32
    # plane first where it is CHAIN_PRESUM deep (two of them share one launch)
    reduces, chains = [], []
    for part, S, M, N, wa, wb, ga, gb in sides:
        if wb is None:
            reduces.append((part, ga, M, N, S))
        elif _presums(S, M, N):
            plane = torch.empty((1, M, N), device=dev, dtype=torch.float32)
            reduces.append((part, plane[0], M, N, S))
            chains.append((plane, 1, M, N, wa, wb, ga, gb))
        else:
            chains.append((part, S, M, N, wa, wb, ga, gb))
    # one program, nothing to reduce, a few chain tiles: the chains run in the gradient kernel
    fused = _chain_fuses(n_tiles * split, len(reduces), [(M, N, wa.shape[1]) for _, _, M, N, wa, *_ in chains])

    def strides(g):  # a factor gradient's (row, column) strides; an absent one is never written
        return g.stride() if g.dim() == 2 else (0, 0)

    fast(_kron_grad_kernel)[grid](
        grad, t[0], t[1], l[0], l[1], pt, pl, M1, N1, t[2], M2, N2, l[2], e_per, gamma,
        t[3], t[4], t[5], t[6], l[3], l[4], l[5], l[6], *sg, *pts, *pls,
        gta, gtb, gla, glb, *strides(gta), *strides(gtb), *strides(gla), *strides(glb),
        **meta, **(dict(CHAIN=True, CBM=CHAIN_BLOCK[0], CBN=CHAIN_BLOCK[1], CBK=CHAIN_BLOCK[2]) if fused else {}))
    if fused:
        return g1a, g1b, g2a, g2b
    if len(reduces) == 2:
        (p, o, M, N, S), (q, u, K, L, T) = reduces
        reduce_pair_launch(p, o, M, N, S, p.stride(), o.stride(), q, u, K, L, T, q.stride(), u.stride(), 1.0, idx64)
    elif reduces:
        part, out, M, N, S = reduces[0]
        ps = part.stride()
        reduce_launch(part, out, None, M, N, S, 1.0, ps[0], 0, ps[1], ps[2], out.stride(), None, idx64)
    if len(chains) == 2:  # both factorized: one launch
        chain_pair_launch(chains[0], chains[1], compute, idx64, CHAIN_BLOCK)
    elif chains:
        chain_launch(*chains[0], compute, idx64, CHAIN_BLOCK)
    return g1a, g1b, g2a, g2b


# =============================================================================== bypass


def _fwd_cost(a, b, c, d, split):
    return b * c * (d + (2 if split else 1) * a)


@functools.lru_cache(maxsize=4096)
def _bypass_fwd_plan(T, a, b, c, d, views, has_base, compute, device, cfg: BypassFwdCfg):
    split = cfg.split and compute != torch.float32
    if cfg.swap is None:
        swap = _fwd_cost(c, d, a, b, split) * 4 < _fwd_cost(a, b, c, d, split) * 3
    else:
        swap = cfg.swap
    A, B, C, D = (c, d, a, b) if swap else (a, b, c, d)
    dflt = default_bypass_fwd_cfg(T, A, B, C, D, compute)
    bt = cfg.block_t or dflt.block_t
    bc = cfg.block_c or dflt.block_c
    meta = dict(HAS_BASE=has_base, CD=tl_dtype(compute), DOT=dot_dtype(compute), SPLIT=split,
                IDX64=needs_idx64(*[v for v in views if v is not None]) or T * a * c > 2**31 - 1,
                BT=bt, BB=_p16(B), BD=cfg.block_d or dflt.block_d, BC=bc, BA=cfg.block_a or dflt.block_a,
                num_warps=cfg.num_warps or dflt.num_warps, num_stages=cfg.num_stages)
    grid = (cdiv(T, bt), cdiv(C, bc))
    return swap, (A, B, C, D), grid, meta


def _x3(t, n_mid, n_in, swap):
    """(s_t, s_mid, s_in) of a (T, n_mid·n_in) matrix viewed (T, n_mid, n_in), or
    its per-token transpose (T, n_in, n_mid) when ``swap``."""
    s0, s1 = t.stride()
    return (s0, s1, n_in * s1) if swap else (s0, n_in * s1, s1)


def bypass_fwd(x, w1, w2, gamma, base=None, cfg: Optional[BypassFwdCfg] = None):
    """``Y[t] = γ·vec(w1·X_t·w2ᵀ) (+ base)``, X_t = x[t] as (b, d); output (T, a·c)."""
    T = x.shape[0]
    a, b = w1.shape
    c, d = w2.shape
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    y = torch.empty((T, a * c), device=x.device, dtype=x.dtype if base is None else base.dtype)
    if y.numel() == 0:
        return y
    if b * d == 0:
        return y.copy_(base) if base is not None else y.zero_()
    swap, (A, B, C, D), grid, meta = _bypass_fwd_plan(
        T, a, b, c, d, view_key(x, w1, w2, base), base is not None, compute, x.device, cfg or BypassFwdCfg())
    bb = y if base is None else base
    if swap:
        w1_, w2_ = w2, w1
    else:
        w1_, w2_ = w1, w2
    sx = _x3(x, b, d, swap)
    sb = _x3(bb, a, c, swap)
    sy = _x3(y, a, c, swap)
    fast(_bypass_fwd_kernel)[grid](
        x, w1_, w2_, bb, y, T, A, B, C, D, gamma, *sx, w1_.stride(0), w1_.stride(1),
        w2_.stride(0), w2_.stride(1), *sb, *sy, **meta)
    return y


def _bwd_cost(a, b, c, d, split):
    k = 2 if split else 1
    return a * c * d + k * b * a * d + k * a * d * b + a * b * d + k * c * a * d


@functools.lru_cache(maxsize=4096)
def _bypass_bwd_plan(T, a, b, c, d, views, compute, device, cfg: BypassBwdCfg):
    split = cfg.split and compute != torch.float32
    if cfg.swap is None:
        swap = _bwd_cost(c, d, a, b, split) * 4 < _bwd_cost(a, b, c, d, split) * 3
    else:
        swap = cfg.swap
    A, B, C, D = (c, d, a, b) if swap else (a, b, c, d)
    dflt = default_bypass_bwd_cfg(T, A, B, C, D, compute)
    bt = cfg.block_t or dflt.block_t
    passes = cfg.passes or dflt.passes
    bd = cfg.block_d or dflt.block_d
    n_tiles = cdiv(T, bt)
    nw = cfg.num_warps or dflt.num_warps
    progs, per = bwd_grid(cfg.programs, nw, num_sms(device), n_tiles, T * (A * C + B * D))
    meta = dict(CD=tl_dtype(compute), DOT=dot_dtype(compute), SPLIT=split,
                IDX64=needs_idx64(*views) or progs * max(A * B * cdiv(D, bd), C * D) > 2**31 - 1,
                BT=bt, BA=_p16(A), BB=_p16(B), BC=_p16(C), BD=bd, num_warps=nw, num_stages=cfg.num_stages)
    flags = {1: [(True, True, True)], 2: [(True, True, False), (False, False, True)],
             3: [(True, False, False), (False, True, False), (False, False, True)]}[passes]
    return swap, (A, B, C, D), (progs, cdiv(D, bd)), per, flags, meta


def bypass_bwd(grad, x, w1, w2, gamma, cfg: Optional[BypassBwdCfg] = None):
    """(gx (T, b·d) in x's dtype, g_w1 (a, b) in w1's, g_w2 (c, d) in w2's)."""
    T = x.shape[0]
    a, b = w1.shape
    c, d = w2.shape
    dev = x.device
    compute = compute_dtype(x.dtype, w1.dtype, w2.dtype)
    gx = torch.empty((T, b * d), device=dev, dtype=x.dtype)
    g1 = torch.empty((a, b), device=dev, dtype=w1.dtype)
    g2 = torch.empty((c, d), device=dev, dtype=w2.dtype)
    if T == 0 or gx.numel() + g1.numel() + g2.numel() == 0 or a * c == 0 or b * d == 0:
        return gx.zero_(), g1.zero_(), g2.zero_()
    swap, (A, B, C, D), grid, per, flags, meta = _bypass_bwd_plan(
        T, a, b, c, d, view_key(grad, x, w1, w2), compute, dev, cfg or BypassBwdCfg())
    progs, n_j = grid
    if swap:
        w1_, w2_, o1, o2 = w2, w1, g2, g1
    else:
        w1_, w2_, o1, o2 = w1, w2, g1, g2
    sg = _x3(grad, a, c, swap)
    sx = _x3(x, b, d, swap)
    so = _x3(gx, b, d, swap)
    # g_w1 partials per (d chunk, program), g_w2 partials per program (chunks are disjoint columns)
    n1 = progs * n_j
    if n1 == 1:
        p1, s1 = o1, (0,) + o1.stride()
    else:
        p1 = torch.empty((n1, A, B), device=dev, dtype=torch.float32)
        s1 = p1.stride()
    if progs == 1:
        p2, s2 = o2, (0,) + o2.stride()
    else:
        p2 = torch.empty((progs, C, D), device=dev, dtype=torch.float32)
        s2 = p2.stride()
    for do_gx, do_g1, do_g2 in flags:
        fast(_bypass_bwd_kernel)[grid](
            grad, x, w1_, w2_, gx, p1, p2, T, A, B, C, D, gamma, per, *sg, *sx,
            w1_.stride(0), w1_.stride(1), w2_.stride(0), w2_.stride(1), *so, *s1, *s2,
            DO_GX=do_gx, DO_GW1=do_g1, DO_GW2=do_g2, **meta)
    if n1 > 1 and progs > 1:  # both weight gradients' partial stacks in one launch
        reduce_pair_launch(p1, o1, A, B, n1, s1, o1.stride(), p2, o2, C, D, progs, s2, o2.stride(), 1.0,
                           meta["IDX64"])
    elif n1 > 1:
        reduce_launch(p1, o1, None, A, B, n1, 1.0, s1[0], 0, s1[1], s1[2], o1.stride(), None, meta["IDX64"])
    elif progs > 1:
        reduce_launch(p2, o2, None, C, D, progs, 1.0, s2[0], 0, s2[1], s2[2], o2.stride(), None, meta["IDX64"])
    return gx, g1, g2


# =============================================================================== the merges in schema arguments
# The launchers of the four merge ops: their schema arguments, then the launch config.


def lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None, cfg: Optional[MergeCfg] = None):
    a, b = w1.shape
    c, d = w2.shape
    return merge_fwd(w1, None, w2, None, a, b, c, d, base, gamma, w2.dtype if out_dtype is None else out_dtype, cfg)


def lokr_full_merge_bwd(grad, w1, w2, gamma, cfg: Optional[MergeCfg] = None):
    a, b = w1.shape
    c, d = w2.shape
    g1, _, g2, _ = merge_bwd(grad, w1, None, w2, None, a, b, c, d, gamma, cfg)
    return g1, g2


def lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None, cfg: Optional[MergeCfg] = None):
    a, b, c, d = (int(s) for s in shape)
    return merge_fwd(w1a, w1b, w2a, w2b, a, b, c, d, base, gamma, w2a.dtype if out_dtype is None else out_dtype, cfg)


def lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma, cfg: Optional[MergeCfg] = None):
    a, b, c, d = (int(s) for s in shape)
    return merge_bwd(grad, w1a, w1b, w2a, w2b, a, b, c, d, gamma, cfg)
