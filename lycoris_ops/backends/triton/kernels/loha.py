"""Triton kernels of the LoHa family (OPS.md §2.2): ``loha_merge_bwd``,
``loha_bypass_fwd``, ``loha_bypass_bwd``.

Written from the math of OPS.md §2.2 and the eager bodies of
``reference/loha.py``: ΔW = (a1·b1) ⊙ (a2·b2) with a1, a2 (O, r), b1, b2 (r, I).
Operands are read in their stored dtype and rounded to the compute dtype in
the kernel (no host casts); products accumulate in fp32; the deliberate
roundings are kept: each ΔW tile is rounded to the compute dtype before it
multiplies x (or G), ``E = γ·G ⊙ P`` is rounded before its contraction and
``GW = Gᵀ·x`` is rounded before the merge backward. fp32 dots are IEEE. Any
strides (a transposed operand is just swapped strides); odd sizes masked.

Kernels
-------
``_hada_apply_kernel``: ``Y = α·X·Dᵀ (+ base)``; D (N, K) is either regenerated
    tile by tile inside the K loop (``REGEN``: D = round((A1·B1) ⊙ (A2·B2)), the
    whole padded rank in one dot, never stored) or read from memory.
``_hada_tile_kernel``: materializes ΔW (O, I) in the compute dtype (rank looped).
``_hada_grad_kernel``: for a row block of M, loops over (a split of) N:
    regenerates P1, P2, forms ``E1 = round(γ·G⊙P2)``, ``E2 = round(γ·G⊙P1)`` and
    accumulates ``E1·B1ᵀ``, ``E2·B2ᵀ``. Launched twice: rows = O gives
    (g_a1, g_a2); the transposed problem (rows = I, A := bᵀ, B := aᵀ, G := Gᵀ)
    gives (g_b1ᵀ, g_b2ᵀ). Split-K partials in fp32, one reduce launch per job.

Passes per op
-------------
``loha_bypass_fwd``: ``regen`` (default when the token tiles are few): one
    launch, ΔW never reaches memory. ``materialize`` (many token tiles, or a
    padded rank > 128): ΔW (O, I) built once in the compute dtype (1 launch),
    then a GEMM with γ and base in the epilogue (1 launch) - the regenerating
    kernel repeats the ΔW work per token tile (≈ 2r/BM extra flops). ``vendor``:
    the materialized ΔW, then the eager body's cuBLAS GEMM (γ, base, rounding in
    its epilogue).
``loha_merge_bwd``: 2 launches (g_a job, g_b job), + 1 reduce each when split; or
    (``vendor``) one pass writing E1, E2 (``_hada_e_kernel``) and four torch GEMMs.
``loha_bypass_bwd``: gx = γ·G·ΔW (ΔW regenerated as (b·a)ᵀ tiles, or the
    materialized ΔW: +1 launch), GW = round(Gᵀ·x) (O, I) (1 GEMM launch, the
    only intermediate), then the two merge-backward launches on GW (+ reduces).
    G is read twice (gx, GW), x once. ``vendor``: the two large GEMMs by torch's
    (cuBLAS), ΔW by the tile kernel; ``merge_vendor``: the merge backward's vendor path.

Limits: the regenerating kernels (bypass regen, merge backward) hold the whole
padded rank: ``pow2(r, ≥16) <= 128`` (``supported``); the bypass ops fall back
to ``materialize`` above that by themselves, ``loha_merge_bwd`` and the factor
grads of ``loha_bypass_bwd`` must not be called there. fp16 / bf16 / fp32 only.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, dot_dtype, fast, needs_idx64, next_pow2, tl_dtype
from lycoris_ops.backends.triton.kernels.fusedkit import compute_dtype, reduce_launch, split_count, tile_2d, view_key

__all__ = [
    "ApplyCfg", "GradCfg", "MAX_HADA_RANK", "supported", "bypass_fwd", "bypass_bwd", "merge_bwd",
]

#: the regenerating kernels hold the whole padded rank in registers
MAX_HADA_RANK = 128


def _p16(n: int) -> int:
    return max(16, next_pow2(n))


def supported(rank: int) -> bool:
    """Whether every LoHa op of this set takes rank ``rank`` (the bypass forward
    alone takes any rank, through ``materialize``)."""
    return _p16(rank) <= MAX_HADA_RANK


# =============================================================================== kernels


@triton.jit
def _hada_apply_kernel(
    x_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, base_ptr, y_ptr,
    M, N, K, R, alpha,
    s_xm, s_xk, s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k, s_bm, s_bn, s_ym, s_yn,
    REGEN: tl.constexpr, HAS_BASE: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr,
    IDX64: tl.constexpr, GROUP_M: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    """Y[m, n] = α·Σ_k X[m, k]·D[n, k] (+ base). REGEN: D = round((A1·B1)⊙(A2·B2))
    generated per (BN, BK) tile; else D is read through (a1_ptr, s_a1n, s_a1r)."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    group = GROUP_M * n_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if REGEN:
        offs_r = tl.arange(0, BR)
        mask_r = offs_r < R
        mnr = mask_n[:, None] & mask_r[None, :]
        a1 = tl.load(a1_ptr + offs_n[:, None] * s_a1n + offs_r[None, :] * s_a1r, mask=mnr, other=0.0)
        a2 = tl.load(a2_ptr + offs_n[:, None] * s_a2n + offs_r[None, :] * s_a2r, mask=mnr, other=0.0)
        a1 = a1.to(CD).to(DOT)
        a2 = a2.to(CD).to(DOT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        if IDX64:
            offs_k = offs_k.to(tl.int64)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :] * s_xk,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if REGEN:
            mrk = mask_r[:, None] & mask_k[None, :]
            b1 = tl.load(b1_ptr + offs_r[:, None] * s_b1r + offs_k[None, :] * s_b1k, mask=mrk, other=0.0)
            b2 = tl.load(b2_ptr + offs_r[:, None] * s_b2r + offs_k[None, :] * s_b2k, mask=mrk, other=0.0)
            p1 = tl.dot(a1, b1.to(CD).to(DOT), input_precision="ieee")
            p2 = tl.dot(a2, b2.to(CD).to(DOT), input_precision="ieee")
            dt = (p1 * p2).to(CD).to(DOT)
        else:
            dt = tl.load(a1_ptr + offs_n[:, None] * s_a1n + offs_k[None, :] * s_a1r,
                         mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(CD).to(DOT)
        acc = tl.dot(xt.to(CD).to(DOT), tl.trans(dt), acc, input_precision="ieee")
    acc = acc * alpha
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BASE:
        acc += tl.load(base_ptr + offs_m[:, None] * s_bm + offs_n[None, :] * s_bn,
                       mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _hada_products(a1_ptr, b1_ptr, a2_ptr, b2_ptr, offs_n, offs_k, mask_n, mask_k, R,
                   s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k,
                   CD: tl.constexpr, DOT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """(P1, P2) = (A1·B1, A2·B2) on one (BN, BK) tile, fp32, the rank looped BR at a time."""
    p1 = tl.zeros((BN, BK), dtype=tl.float32)
    p2 = tl.zeros((BN, BK), dtype=tl.float32)
    for r0 in range(0, R, BR):
        offs_r = r0 + tl.arange(0, BR)
        mask_r = offs_r < R
        mnr = mask_n[:, None] & mask_r[None, :]
        mrk = mask_r[:, None] & mask_k[None, :]
        a1 = tl.load(a1_ptr + offs_n[:, None] * s_a1n + offs_r[None, :] * s_a1r, mask=mnr, other=0.0)
        b1 = tl.load(b1_ptr + offs_r[:, None] * s_b1r + offs_k[None, :] * s_b1k, mask=mrk, other=0.0)
        p1 = tl.dot(a1.to(CD).to(DOT), b1.to(CD).to(DOT), p1, input_precision="ieee")
        a2 = tl.load(a2_ptr + offs_n[:, None] * s_a2n + offs_r[None, :] * s_a2r, mask=mnr, other=0.0)
        b2 = tl.load(b2_ptr + offs_r[:, None] * s_b2r + offs_k[None, :] * s_b2k, mask=mrk, other=0.0)
        p2 = tl.dot(a2.to(CD).to(DOT), b2.to(CD).to(DOT), p2, input_precision="ieee")
    return p1, p2


@triton.jit
def _hada_tile_kernel(
    a1_ptr, b1_ptr, a2_ptr, b2_ptr, d_ptr, N, K, R,
    s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k, s_dn, s_dk,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    """D[n, k] = round((A1·B1)[n, k]·(A2·B2)[n, k]) (rank looped)."""
    offs_n, offs_k, mask_n, mask_k = tile_2d(N, K, IDX64, BN, BK)
    p1, p2 = _hada_products(a1_ptr, b1_ptr, a2_ptr, b2_ptr, offs_n, offs_k, mask_n, mask_k, R,
                            s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k, CD, DOT, BN, BK, BR)
    tl.store(d_ptr + offs_n[:, None] * s_dn + offs_k[None, :] * s_dk, (p1 * p2).to(d_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_k[None, :])


@triton.jit
def _hada_e_kernel(
    g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, e1_ptr, e2_ptr, N, K, R, gamma,
    s_gn, s_gk, s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k, s_en, s_ek,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    """E1 = round(γ·G⊙P2), E2 = round(γ·G⊙P1) (N, K) in the compute dtype, P regenerated:
    the merge backward's one pass over G when torch's GEMMs do the four contractions."""
    offs_n, offs_k, mask_n, mask_k = tile_2d(N, K, IDX64, BN, BK)
    p1, p2 = _hada_products(a1_ptr, b1_ptr, a2_ptr, b2_ptr, offs_n, offs_k, mask_n, mask_k, R,
                            s_a1n, s_a1r, s_b1r, s_b1k, s_a2n, s_a2r, s_b2r, s_b2k, CD, DOT, BN, BK, BR)
    mask = mask_n[:, None] & mask_k[None, :]
    g = tl.load(g_ptr + offs_n[:, None] * s_gn + offs_k[None, :] * s_gk, mask=mask, other=0.0)
    gs = g.to(CD).to(tl.float32) * gamma
    eo = offs_n[:, None] * s_en + offs_k[None, :] * s_ek
    tl.store(e1_ptr + eo, (gs * p2).to(e1_ptr.dtype.element_ty), mask=mask)
    tl.store(e2_ptr + eo, (gs * p1).to(e2_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _hada_grad_job(
    pid_m, pid_s, g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, o1_ptr, o2_ptr,
    M, N, R, N_PER, gamma,
    s_gm, s_gn, s_a1m, s_a1r, s_b1r, s_b1n, s_a2m, s_a2r, s_b2r, s_b2n,
    s_o1s, s_o1m, s_o1r, s_o2s, s_o2m, s_o2r,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):
    """Rows ``pid_m``·BM.. of o1[m, r] = Σ_n round(γ·G⊙P2)[m, n]·B1[r, n] and o2 likewise
    with (P1, B2), over the N range of split ``pid_s``; P = A·B regenerated in fp32."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_r = tl.arange(0, BR)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
    mask_m = offs_m < M
    mask_r = offs_r < R
    mmr = mask_m[:, None] & mask_r[None, :]
    a1 = tl.load(a1_ptr + offs_m[:, None] * s_a1m + offs_r[None, :] * s_a1r, mask=mmr, other=0.0)
    a2 = tl.load(a2_ptr + offs_m[:, None] * s_a2m + offs_r[None, :] * s_a2r, mask=mmr, other=0.0)
    a1 = a1.to(CD).to(DOT)
    a2 = a2.to(CD).to(DOT)
    acc1 = tl.zeros((BM, BR), dtype=tl.float32)
    acc2 = tl.zeros((BM, BR), dtype=tl.float32)
    n_lo = pid_s * N_PER
    n_hi = tl.minimum(n_lo + N_PER, N)
    for n0 in range(n_lo, n_hi, BN):
        offs_n = n0 + tl.arange(0, BN)
        if IDX64:
            offs_n = offs_n.to(tl.int64)
        mask_n = offs_n < n_hi
        mrn = mask_r[:, None] & mask_n[None, :]
        b1 = tl.load(b1_ptr + offs_r[:, None] * s_b1r + offs_n[None, :] * s_b1n, mask=mrn, other=0.0)
        b2 = tl.load(b2_ptr + offs_r[:, None] * s_b2r + offs_n[None, :] * s_b2n, mask=mrn, other=0.0)
        b1 = b1.to(CD).to(DOT)
        b2 = b2.to(CD).to(DOT)
        p1 = tl.dot(a1, b1, input_precision="ieee")
        p2 = tl.dot(a2, b2, input_precision="ieee")
        g = tl.load(g_ptr + offs_m[:, None] * s_gm + offs_n[None, :] * s_gn,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        gs = g.to(CD).to(tl.float32) * gamma
        e1 = (gs * p2).to(CD).to(DOT)
        e2 = (gs * p1).to(CD).to(DOT)
        acc1 = tl.dot(e1, tl.trans(b1), acc1, input_precision="ieee")
        acc2 = tl.dot(e2, tl.trans(b2), acc2, input_precision="ieee")
    tl.store(o1_ptr + pid_s * s_o1s + offs_m[:, None] * s_o1m + offs_r[None, :] * s_o1r,
             acc1.to(o1_ptr.dtype.element_ty), mask=mmr)
    tl.store(o2_ptr + pid_s * s_o2s + offs_m[:, None] * s_o2m + offs_r[None, :] * s_o2r,
             acc2.to(o2_ptr.dtype.element_ty), mask=mmr)


@triton.jit
def _hada_grad_kernel(
    g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, o1_ptr, o2_ptr,
    M, N, R, N_PER, gamma,
    s_gm, s_gn, s_a1m, s_a1r, s_b1r, s_b1n, s_a2m, s_a2r, s_b2r, s_b2n,
    s_o1s, s_o1m, s_o1r, s_o2s, s_o2m, s_o2r,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):
    """One merge-backward job (``_hada_grad_job``): a program per BM rows and N split."""
    _hada_grad_job(tl.program_id(0), tl.program_id(1), g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, o1_ptr, o2_ptr,
                   M, N, R, N_PER, gamma, s_gm, s_gn, s_a1m, s_a1r, s_b1r, s_b1n, s_a2m, s_a2r, s_b2r, s_b2n,
                   s_o1s, s_o1m, s_o1r, s_o2s, s_o2m, s_o2r, CD, DOT, IDX64, BM, BN, BR)


@triton.jit
def _hada_grad_pair_kernel(
    g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, ga1_ptr, gb1_ptr, ga2_ptr, gb2_ptr,
    O, I, R, gamma, TILES_A,
    s_go, s_gi, s_a1o, s_a1r, s_b1r, s_b1i, s_a2o, s_a2r, s_b2r, s_b2i,
    s_ga1o, s_ga1r, s_gb1r, s_gb1i, s_ga2o, s_ga2r, s_gb2r, s_gb2i,
    CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):
    """Both merge-backward jobs in one launch, each row band's whole reduction in one
    program (no split): job A (rows o, over i: g_a1, g_a2) on programs [0, TILES_A), job B
    (the transposed problem, rows i, over o: g_b1ᵀ, g_b2ᵀ) on the rest."""
    pid = tl.program_id(0)
    if pid < TILES_A:
        _hada_grad_job(pid, 0, g_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, ga1_ptr, ga2_ptr, O, I, R, I, gamma,
                       s_go, s_gi, s_a1o, s_a1r, s_b1r, s_b1i, s_a2o, s_a2r, s_b2r, s_b2i,
                       0, s_ga1o, s_ga1r, 0, s_ga2o, s_ga2r, CD, DOT, IDX64, BM, BN, BR)
    else:
        _hada_grad_job(pid - TILES_A, 0, g_ptr, b1_ptr, a1_ptr, b2_ptr, a2_ptr, gb1_ptr, gb2_ptr, I, O, R, O, gamma,
                       s_gi, s_go, s_b1i, s_b1r, s_a1r, s_a1o, s_b2i, s_b2r, s_a2r, s_a2o,
                       0, s_gb1i, s_gb1r, 0, s_gb2i, s_gb2r, CD, DOT, IDX64, BM, BN, BR)


@triton.jit
def _bypass_bwd_small_kernel(
    g_ptr, x_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, gx_ptr, ga1_ptr, gb1_ptr, ga2_ptr, gb2_ptr,
    T, O, I, R, gamma,
    s_gt, s_go, s_xt, s_xi, s_a1o, s_a1r, s_b1r, s_b1i, s_a2o, s_a2r, s_b2r, s_b2i, s_gxt, s_gxi,
    s_ga1o, s_ga1r, s_gb1r, s_gb1i, s_ga2o, s_ga2r, s_gb2r, s_gb2i,
    CD: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
    BR: tl.constexpr,
):
    """The whole ``loha_bypass_bwd`` of a small layer (O, I, padded R within one tile) in
    ONE program: P1, P2 and ΔW = round(P1⊙P2) in registers; per token tile gx = γ·G·ΔW
    stored and GW += Gᵀ·x; then GW rounded to the compute dtype, E1 = round(γ·GW⊙P2),
    E2 = round(γ·GW⊙P1) and the four factor gradients (g_a1 = E1·b1ᵀ, g_b1 = a1ᵀ·E1, ...).
    The numerics of the general path (``bypass_bwd``, then ``merge_bwd`` on GW), one launch
    instead of three and no GW buffer: a small call's host time is its launches."""
    offs_o = tl.arange(0, BO)
    offs_i = tl.arange(0, BI)
    offs_r = tl.arange(0, BR)
    mo, mi, mr = offs_o < O, offs_i < I, offs_r < R
    mor = mo[:, None] & mr[None, :]
    mri = mr[:, None] & mi[None, :]
    a1 = tl.load(a1_ptr + offs_o[:, None] * s_a1o + offs_r[None, :] * s_a1r, mask=mor, other=0.0).to(CD).to(DOT)
    a2 = tl.load(a2_ptr + offs_o[:, None] * s_a2o + offs_r[None, :] * s_a2r, mask=mor, other=0.0).to(CD).to(DOT)
    b1 = tl.load(b1_ptr + offs_r[:, None] * s_b1r + offs_i[None, :] * s_b1i, mask=mri, other=0.0).to(CD).to(DOT)
    b2 = tl.load(b2_ptr + offs_r[:, None] * s_b2r + offs_i[None, :] * s_b2i, mask=mri, other=0.0).to(CD).to(DOT)
    p1 = tl.dot(a1, b1, input_precision="ieee")
    p2 = tl.dot(a2, b2, input_precision="ieee")
    dw = (p1 * p2).to(CD).to(DOT)
    gw = tl.zeros((BO, BI), dtype=tl.float32)
    for t0 in range(0, T, BT):
        offs_t = t0 + tl.arange(0, BT)
        mt = offs_t < T
        g = tl.load(g_ptr + offs_t[:, None] * s_gt + offs_o[None, :] * s_go, mask=mt[:, None] & mo[None, :],
                    other=0.0).to(CD).to(DOT)
        x = tl.load(x_ptr + offs_t[:, None] * s_xt + offs_i[None, :] * s_xi, mask=mt[:, None] & mi[None, :],
                    other=0.0).to(CD).to(DOT)
        gx = tl.dot(g, dw, input_precision="ieee") * gamma
        tl.store(gx_ptr + offs_t[:, None] * s_gxt + offs_i[None, :] * s_gxi, gx.to(gx_ptr.dtype.element_ty),
                 mask=mt[:, None] & mi[None, :])
        gw = tl.dot(tl.trans(g), x, gw, input_precision="ieee")
    gs = gw.to(CD).to(tl.float32) * gamma
    e1 = (gs * p2).to(CD).to(DOT)
    e2 = (gs * p1).to(CD).to(DOT)
    tl.store(ga1_ptr + offs_o[:, None] * s_ga1o + offs_r[None, :] * s_ga1r,
             tl.dot(e1, tl.trans(b1), input_precision="ieee").to(ga1_ptr.dtype.element_ty), mask=mor)
    tl.store(ga2_ptr + offs_o[:, None] * s_ga2o + offs_r[None, :] * s_ga2r,
             tl.dot(e2, tl.trans(b2), input_precision="ieee").to(ga2_ptr.dtype.element_ty), mask=mor)
    tl.store(gb1_ptr + offs_r[:, None] * s_gb1r + offs_i[None, :] * s_gb1i,
             tl.dot(tl.trans(a1), e1, input_precision="ieee").to(gb1_ptr.dtype.element_ty), mask=mri)
    tl.store(gb2_ptr + offs_r[:, None] * s_gb2r + offs_i[None, :] * s_gb2i,
             tl.dot(tl.trans(a2), e2, input_precision="ieee").to(gb2_ptr.dtype.element_ty), mask=mri)


# =============================================================================== configs


class ApplyCfg(NamedTuple):
    """Bypass GEMMs (``Y = α·X·Dᵀ``). ``strategy``: "regen" | "materialize" | "" (auto:
    regen while the token tiles are at most ``regen_max_tiles``); ``tile_*``: the
    materializing kernel's tile. 0 = auto for the block sizes."""
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    group_m: int = 8
    strategy: str = ""
    regen_max_tiles: int = 2
    tile_n: int = 64
    tile_k: int = 64
    tile_r: int = 32
    num_warps: int = 0
    num_stages: int = 3


class GradCfg(NamedTuple):
    """Merge-backward jobs: row block ``block_m``, N step ``block_n``, ``split`` of the
    N loop per job (0: auto, about two programs per SM)."""
    block_m: int = 64
    block_n: int = 64
    split: int = 0
    num_warps: int = 4
    num_stages: int = 2


def default_apply_cfg(M: int, N: int, K: int, R: int, compute: torch.dtype, regen: bool) -> ApplyCfg:
    if compute == torch.float32:  # IEEE fp32 dots (FMA): operands in registers, smaller tiles
        if regen:
            return ApplyCfg(block_m=32, block_n=64 if _p16(R) <= 32 else 32, block_k=32, num_warps=8, num_stages=2)
        return ApplyCfg(block_m=32 if M <= 32 else 64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    bm = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 or regen else 128
    return ApplyCfg(block_m=bm, block_n=128 if not regen or _p16(R) <= 64 else 64, block_k=64,
                    num_warps=8 if bm >= 128 or regen else 4)


def default_grad_cfg(R: int, compute: torch.dtype) -> GradCfg:
    rp = _p16(R)
    if compute == torch.float32:
        return GradCfg(block_m=32 if rp <= 64 else 16, block_n=32, num_warps=4 if rp <= 32 else 8)
    if 32 <= rp <= 64:
        # H200, bf16 (RESULTS.md 2026-12-04 14:55–15:12, bench/variants.py loha --phases grad): narrow N
        # steps, 4 warps, 3 stages, split: 0.091 ms at 4096², r64 (the 64x64 8-warp tile: 0.165),
        # 0.048 at 3072², r32 (0.070)
        return GradCfg(block_m=64, block_n=32, num_warps=4, num_stages=3)
    # ptxas (sm_90, bf16): no spills up to rp 64 with these; rp 128 spills a few bytes
    return GradCfg(block_m=64, block_n=64 if rp <= 64 else 32, num_warps=4 if rp <= 16 else 8)


# =============================================================================== launchers


def _apply_meta(M, N, K, R, compute, regen, idx64, has_base, cfg: ApplyCfg):
    d = default_apply_cfg(M, N, K, R, compute, regen)
    bm, bn, bk = cfg.block_m or d.block_m, cfg.block_n or d.block_n, cfg.block_k or d.block_k
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    meta = dict(REGEN=regen, HAS_BASE=has_base, CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=idx64,
                GROUP_M=cfg.group_m, BM=bm, BN=bn, BK=bk, BR=_p16(R) if regen else 16,
                num_warps=cfg.num_warps or d.num_warps, num_stages=cfg.num_stages)
    return grid, meta


def _regen(M, R, cfg: ApplyCfg, compute) -> bool:
    if _p16(R) > MAX_HADA_RANK:
        return False
    if cfg.strategy:
        return cfg.strategy == "regen"
    bm = cfg.block_m or default_apply_cfg(M, 1, 1, R, compute, True).block_m
    return cdiv(M, bm) <= cfg.regen_max_tiles


def _materialize(a1, b1, a2, b2, O, I, R, compute, idx64, cfg: ApplyCfg):
    """ΔW (O, I) in the compute dtype."""
    dw = torch.empty((O, I), device=a1.device, dtype=compute)
    grid = (cdiv(O, cfg.tile_n) * cdiv(I, cfg.tile_k),)
    fast(_hada_tile_kernel)[grid](
        a1, b1, a2, b2, dw, O, I, R, a1.stride(0), a1.stride(1), b1.stride(0), b1.stride(1),
        a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1), dw.stride(0), dw.stride(1),
        CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=idx64,
        BN=cfg.tile_n, BK=cfg.tile_k, BR=cfg.tile_r, num_warps=4, num_stages=2)
    return dw


@functools.lru_cache(maxsize=4096)
def _bypass_fwd_plan(T, O, I, R, views, has_base, compute, device, cfg: ApplyCfg):
    idx64 = needs_idx64(*[v for v in views if v is not None]) or T * O > 2**31 - 1
    regen = _regen(T, R, cfg, compute)
    grid, meta = _apply_meta(T, O, I, R, compute, regen, idx64, has_base, cfg)
    return regen, idx64, grid, meta


def bypass_fwd(x, a1, b1, a2, b2, gamma, base=None, cfg: Optional[ApplyCfg] = None, vendor: bool = False):
    """``Y = γ·x·ΔWᵀ (+ base)``, ΔW = round((a1·b1)⊙(a2·b2)); output (T, O).

    ``vendor``: ΔW materialized by the Triton tile kernel, then the eager body's GEMM (one
    cuBLAS call with γ, the base add and the rounding in its epilogue on CUDA) instead of
    the fused one: where cuBLAS beats the fused GEMM and the eager body's fp32 rebuild of ΔW
    costs more than the tile kernel (a tuner candidate at large shapes)."""
    T, I = x.shape
    O, R = a1.shape
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    out_dtype = x.dtype if base is None else base.dtype
    cfg = cfg or ApplyCfg()
    if vendor and T and O and I and R:
        from lycoris_ops.reference import cast, gemm_epilogue

        idx64 = needs_idx64(*[v for v in view_key(x, a1, b1, a2, b2, base) if v is not None])
        dw = _materialize(a1, b1, a2, b2, O, I, R, compute, idx64, cfg)
        return gemm_epilogue(cast(x, compute), dw.t(), out_dtype, gamma, base, base_in_place=True).contiguous()
    y = torch.empty((T, O), device=x.device, dtype=out_dtype)
    if y.numel() == 0:
        return y
    regen, idx64, grid, meta = _bypass_fwd_plan(
        T, O, I, R, view_key(x, a1, b1, a2, b2, base), base is not None, compute, x.device, cfg)
    bb = y if base is None else base
    if regen:
        f = (a1, b1, a2, b2)
        fs = (a1.stride(0), a1.stride(1), b1.stride(0), b1.stride(1),
              a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1))
    else:
        dw = _materialize(a1, b1, a2, b2, O, I, R, compute, idx64, cfg)
        f = (dw, dw, dw, dw)
        fs = (dw.stride(0), dw.stride(1)) + (0,) * 6
    fast(_hada_apply_kernel)[grid](
        x, *f, bb, y, T, O, I, R, gamma, x.stride(0), x.stride(1), *fs,
        bb.stride(0), bb.stride(1), y.stride(0), y.stride(1), **meta)
    return y


@functools.lru_cache(maxsize=4096)
def _grad_plan(M, N, R, compute, device, idx64, cfg: GradCfg):
    n_m = cdiv(M, cfg.block_m)
    n_steps = cdiv(N, cfg.block_n)
    split = cfg.split or split_count(n_m, device, max(1, n_steps // 2))
    split = max(1, min(split, n_steps))
    n_per = cdiv(n_steps, split) * cfg.block_n
    split = max(1, cdiv(N, n_per))
    meta = dict(CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=idx64, BM=cfg.block_m, BN=cfg.block_n,
                BR=_p16(R), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (n_m, split), n_per, meta


def _grad_job(g, sg, a1, sa1, b1, sb1, a2, sa2, b2, sb2, o1, so1, o2, so2, M, N, R, gamma, compute, idx64, cfg):
    """(o1, o2) (M, R) = (round(γ·G⊙P2)·B1ᵀ, round(γ·G⊙P1)·B2ᵀ); ``s*`` are 2-D strides."""
    grid, n_per, meta = _grad_plan(M, N, R, compute, g.device, idx64, cfg)
    split = grid[1]
    if split == 1:
        p1, p2, ps1, ps2 = o1, o2, (0,) + so1, (0,) + so2
    else:
        part = torch.empty((split, 2, M, R), device=g.device, dtype=torch.float32)
        p1, p2 = part, part[:, 1]
        ps1 = ps2 = (part.stride(0), part.stride(2), part.stride(3))
    fast(_hada_grad_kernel)[grid](
        g, a1, b1, a2, b2, p1, p2, M, N, R, n_per, gamma, *sg, *sa1, *sb1, *sa2, *sb2, *ps1, *ps2, **meta)
    if split > 1:
        reduce_launch(part, o1, o2, M, R, split, 1.0, part.stride(0), part.stride(1), part.stride(2),
                      part.stride(3), so1, so2, idx64)


def _t(s):
    return (s[1], s[0])


@functools.lru_cache(maxsize=4096)
def _merge_bwd_idx64(views):
    return needs_idx64(*views)


#: the E pass's tile (``_hada_e_kernel``): rows, columns, rank step
E_TILE = (64, 64, 32)


def _merge_bwd_vendor(grad, a1, b1, a2, b2, gamma, compute, idx64):
    """E1, E2 from one Triton pass over G (P regenerated), then the four contractions by
    torch's GEMM (cuBLAS on CUDA): ``reference.loha.hada_contractions``, the eager body's."""
    from lycoris_ops.reference.loha import hada_contractions

    O, R = a1.shape
    I = b1.shape[1]
    e1 = torch.empty((O, I), device=grad.device, dtype=compute)
    e2 = torch.empty((O, I), device=grad.device, dtype=compute)
    bn, bk, br = E_TILE
    fast(_hada_e_kernel)[(cdiv(O, bn) * cdiv(I, bk),)](
        grad, a1, b1, a2, b2, e1, e2, O, I, R, gamma, *grad.stride(), *a1.stride(), *b1.stride(),
        *a2.stride(), *b2.stride(), *e1.stride(), CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=idx64,
        BN=bn, BK=bk, BR=min(br, _p16(R)), num_warps=4, num_stages=2)
    return hada_contractions(e1, e2, a1, b1, a2, b2, compute)


def merge_bwd(grad, a1, b1, a2, b2, gamma, compute=None, cfg: Optional[GradCfg] = None, vendor: bool = False):
    """(g_a1, g_b1, g_a2, g_b2) of ``γ·(a1·b1)⊙(a2·b2)``, each in its input's dtype.

    ``vendor``: E1, E2 materialized by one Triton pass and the four contractions by torch's
    GEMM (``_merge_bwd_vendor``; a tuner candidate) instead of the two fused jobs, which
    regenerate P1 and P2 in each."""
    O, R = a1.shape
    I = b1.shape[1]
    if compute is None:
        compute = compute_dtype(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    dev = grad.device
    if vendor and O and I and R:
        return _merge_bwd_vendor(grad, a1, b1, a2, b2, gamma, compute,
                                 _merge_bwd_idx64(view_key(grad, a1, b1, a2, b2)))
    outs = tuple(torch.empty(t.shape, device=dev, dtype=t.dtype) for t in (a1, b1, a2, b2))
    if O == 0 or I == 0 or R == 0:
        return tuple(o.zero_() for o in outs)
    g_a1, g_b1, g_a2, g_b2 = outs
    cfg = cfg or default_grad_cfg(R, compute)
    idx64 = _merge_bwd_idx64(view_key(grad, a1, b1, a2, b2))
    sg = grad.stride()
    sa1, sb1, sa2, sb2 = a1.stride(), b1.stride(), a2.stride(), b2.stride()
    (n_a, split_a), _, meta = _grad_plan(O, I, R, compute, dev, idx64, cfg)
    (n_b, split_b), _, _ = _grad_plan(I, O, R, compute, dev, idx64, cfg)
    if split_a == 1 and split_b == 1:  # neither job splits its reduction: both in one launch
        fast(_hada_grad_pair_kernel)[(n_a + n_b,)](
            grad, a1, b1, a2, b2, g_a1, g_b1, g_a2, g_b2, O, I, R, gamma, n_a, *sg, *sa1, *sb1, *sa2, *sb2,
            *g_a1.stride(), *g_b1.stride(), *g_a2.stride(), *g_b2.stride(), **meta)
        return outs
    # job A: rows O, N = I
    _grad_job(grad, sg, a1, sa1, b1, sb1, a2, sa2, b2, sb2, g_a1, g_a1.stride(), g_a2, g_a2.stride(),
              O, I, R, gamma, compute, idx64, cfg)
    # job B: the transposed problem, rows I: A := bᵀ (I, r), B := aᵀ (r, O), G := Gᵀ
    _grad_job(grad, _t(sg), b1, _t(sb1), a1, _t(sa1), b2, _t(sb2), a2, _t(sa2),
              g_b1, _t(g_b1.stride()), g_b2, _t(g_b2.stride()), I, O, R, gamma, compute, idx64, cfg)
    return outs


@functools.lru_cache(maxsize=4096)
def _bypass_bwd_plan(T, O, I, R, views, compute, device, cfg: ApplyCfg, gw_cfg: Optional[ApplyCfg]):
    idx64 = needs_idx64(*views) or T * O > 2**31 - 1
    regen = _regen(T, R, cfg, compute)
    gx_launch = _apply_meta(T, I, O, R, compute, regen, idx64, False, cfg)
    gw_launch = _apply_meta(O, I, T, R, compute, False, idx64, False, cfg if gw_cfg is None else gw_cfg)
    return idx64, regen, gx_launch, gw_launch


#: ``loha_bypass_bwd`` runs as one program (``_bypass_bwd_small_kernel``) where O and I fit
#: one tile of this width, the padded rank this, and G and x together at most SMALL_ELEMS
SMALL_TILE = 64
SMALL_ELEMS = 1 << 14


def small_bypass_bwd(T: int, O: int, I: int, R: int) -> bool:
    """Whether ``bypass_bwd`` takes the one-program kernel (then cfg and grad_cfg are unused)."""
    return 0 < T * (O + I) <= SMALL_ELEMS and 0 < O <= SMALL_TILE and 0 < I <= SMALL_TILE and 0 < R and \
        _p16(R) <= SMALL_TILE


def _bypass_bwd_small(grad, x, a1, b1, a2, b2, gamma, compute):
    T, I = x.shape
    O = a1.shape[0]
    dev = x.device
    gx = torch.empty((T, I), device=dev, dtype=x.dtype)
    outs = tuple(torch.empty(t.shape, device=dev, dtype=t.dtype) for t in (a1, b1, a2, b2))
    bo, bi, br = max(16, next_pow2(O)), max(16, next_pow2(I)), _p16(a1.shape[1])
    fast(_bypass_bwd_small_kernel)[(1,)](
        grad, x, a1, b1, a2, b2, gx, *outs, T, O, I, a1.shape[1], gamma, *grad.stride(), *x.stride(),
        *a1.stride(), *b1.stride(), *a2.stride(), *b2.stride(), *gx.stride(), *outs[0].stride(), *outs[1].stride(),
        *outs[2].stride(), *outs[3].stride(), CD=tl_dtype(compute), DOT=dot_dtype(compute),
        BT=32 if bo * bi <= 1024 else 16, BO=bo, BI=bi, BR=br, num_warps=4)
    return (gx,) + outs


def bypass_bwd(grad, x, a1, b1, a2, b2, gamma, cfg: Optional[ApplyCfg] = None,
               grad_cfg: Optional[GradCfg] = None, gw_cfg: Optional[ApplyCfg] = None, vendor: bool = False,
               merge_vendor: bool = False, small: Optional[bool] = None):
    """(gx (T, I) in x's dtype, g_a1, g_b1, g_a2, g_b2 in their inputs' dtypes).

    ``cfg``: the gx GEMM (and ΔW materialization); ``gw_cfg``: the GW = Gᵀ·x GEMM's tiles
    (None: ``cfg``'s; its strategy is ignored: GW reads x); ``grad_cfg``: the merge backward.
    ``vendor``: the two large GEMMs (gx = γ·G·ΔW, GW = Gᵀ·x, each T·O·I) by torch's GEMM
    (cuBLAS) exactly as the eager body rounds them, ΔW materialized and the factor gradients
    by the Triton kernels: where cuBLAS beats the fused GEMMs and the eager body's fp32
    elementwise passes cost more than these kernels (a tuner candidate at large shapes).
    ``merge_vendor``: the factor gradients by ``merge_bwd(vendor=True)`` (its four
    contractions by torch's GEMM). ``small``: the one-program kernel (None: where
    ``small_bypass_bwd`` says; True needs O, I and the padded rank within ``SMALL_TILE``)."""
    T, I = x.shape
    O, R = a1.shape
    compute = compute_dtype(x.dtype, a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    dev = x.device
    if small if small is not None else (not vendor and small_bypass_bwd(T, O, I, R)):
        return _bypass_bwd_small(grad, x, a1, b1, a2, b2, gamma, compute)
    if vendor:
        from lycoris_ops.reference import cast, gemm_epilogue, mm_rounded

        g = cast(grad, compute)
        idx64 = needs_idx64(*view_key(grad, x, a1, b1, a2, b2))
        dw = _materialize(a1, b1, a2, b2, O, I, R, compute, idx64, cfg or ApplyCfg())
        gx = gemm_epilogue(g, dw, x.dtype, gamma).contiguous()
        gw = mm_rounded(g.t(), cast(x, compute), compute)
        return (gx,) + merge_bwd(gw, a1, b1, a2, b2, gamma, compute, grad_cfg, vendor=merge_vendor)
    gx = torch.empty((T, I), device=dev, dtype=x.dtype)
    gw = torch.empty((O, I), device=dev, dtype=compute)
    idx64, regen, (grid, meta), (grid_w, meta_w) = _bypass_bwd_plan(
        T, O, I, R, view_key(grad, x, a1, b1, a2, b2), compute, dev, cfg or ApplyCfg(), gw_cfg)
    if gx.numel():
        if O == 0:
            gx.zero_()
        else:
            # gx[t, i] = γ·Σ_o G[t, o]·ΔW[o, i]: D := ΔWᵀ (I, O), regenerated as round((b1ᵀ·a1ᵀ)⊙(b2ᵀ·a2ᵀ))
            if regen:
                f = (b1, a1, b2, a2)
                fs = _t(b1.stride()) + _t(a1.stride()) + _t(b2.stride()) + _t(a2.stride())
            else:
                dw = _materialize(a1, b1, a2, b2, O, I, R, compute, idx64, cfg or ApplyCfg())
                f = (dw, dw, dw, dw)
                fs = _t(dw.stride()) + (0,) * 6
            fast(_hada_apply_kernel)[grid](
                grad, *f, gx, gx, T, I, O, R, gamma, grad.stride(0), grad.stride(1), *fs,
                0, 0, gx.stride(0), gx.stride(1), **meta)
    # GW = round(Gᵀ·x) (O, I): X := Gᵀ (O, T), D := xᵀ (I, T)
    if gw.numel():
        fast(_hada_apply_kernel)[grid_w](
            grad, x, x, x, x, gw, gw, O, I, T, R, 1.0, grad.stride(1), grad.stride(0),
            x.stride(1), x.stride(0), 0, 0, 0, 0, 0, 0, 0, 0, gw.stride(0), gw.stride(1), **meta_w)
    return (gx,) + merge_bwd(gw, a1, b1, a2, b2, gamma, compute, grad_cfg, vendor=merge_vendor)
