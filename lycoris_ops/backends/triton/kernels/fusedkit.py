"""Small Triton helpers shared by the LoHa / LoKr / tucker kernels
(``backends/triton/kernels/loha.py``, ``backends/triton/kernels/lokr.py``, ``backends/triton/kernels/tucker.py``).

* ``dot_wide``: ``w·z`` (or ``z·w``) where ``w`` is a compute-dtype operand and
  ``z`` an fp32 intermediate that the spec keeps unrounded (LoKr's two chained
  products). With 16-bit operands it splits ``z = hi + lo`` into two 16-bit
  halves and runs two tensor-core dots (``SPLIT``), which keeps ~16 mantissa
  bits of ``z`` (the fp32 eager chain keeps 24); fp32 (and the interpreter's
  bf16 upcast) runs one IEEE fp32 dot. fp16 caveat: ``hi`` saturates where
  ``|z|`` exceeds the fp16 range (65504), where the eager fp32 chain would not.
* ``_reduce_kernel``: ``out = α·Σ_s part[s]`` for one or two fp32 partial
  matrices (split-K reductions), cast to each output's dtype; ``_reduce_pair_kernel``:
  two such reductions of different shapes in one launch.
* ``_chain_kernel`` (``_mm_tile``): both factor gradients of a factorized side,
  ``P·wbᵀ`` and ``waᵀ·P``, in one launch, where P is an fp32 split-K partial stack
  (summed in-kernel) and the other operand a factor rounded to the compute dtype;
  IEEE fp32 dot; ``_chain_pair_kernel``: both sides' in one launch.

Nothing here allocates or launches on its own; the launchers live with the
kernels that use them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, fast, num_sms, tl_dtype
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype  # noqa: F401  (the launchers' promotion)


def view_key(*ts):
    """Hashable (shape, stride) of each tensor (None for an absent one)."""
    return tuple(None if t is None else (tuple(t.shape), t.stride()) for t in ts)


def split_count(work: int, device: torch.device, max_split: int, per_sm: int = 2) -> int:
    """Splits of a reduction so that ``work·split`` is about ``per_sm`` programs per SM."""
    if work <= 0:
        return 1
    return max(1, min(cdiv(per_sm * num_sms(device), work), max(1, max_split)))


@triton.jit
def dot_wide(w, z, acc, DOT: tl.constexpr, SPLIT: tl.constexpr, Z_LEFT: tl.constexpr):
    """acc + w·z (Z_LEFT: acc + z·w); ``w`` already in the compute dtype, ``z`` fp32."""
    if DOT == tl.float32:
        wd = w.to(tl.float32)
        if Z_LEFT:
            acc = tl.dot(z, wd, acc, input_precision="ieee")
        else:
            acc = tl.dot(wd, z, acc, input_precision="ieee")
    else:
        wd = w.to(DOT)
        hi = z.to(DOT)
        if Z_LEFT:
            acc = tl.dot(hi, wd, acc)
        else:
            acc = tl.dot(wd, hi, acc)
        if SPLIT:
            lo = (z - hi.to(tl.float32)).to(DOT)
            if Z_LEFT:
                acc = tl.dot(lo, wd, acc)
            else:
                acc = tl.dot(wd, lo, acc)
    return acc


# The partial counts (S; SX, SY) are never specialized: they follow the calling kernel's
# tiling, so specializing them (== 1, divisible by 16) would compile one more variant of
# these small kernels per config of the op's main kernel (a cold key's tuning compiles
# every variant).
@triton.jit
def _reduce_tile(
    pid, p_ptr, o1_ptr, o2_ptr, M, N, S, alpha,
    s_ps, s_pj, s_pm, s_pn, s_1m, s_1n, s_2m, s_2n,
    TWO: tl.constexpr, IDX64: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
):
    """Program ``pid``'s BE output elements (row-major over (M, N)) of o1 = α·Σ_s p[s, 0]
    (and o2 = α·Σ_s p[s, 1] under TWO), BS partials added per step."""
    offs_e = pid * BE + tl.arange(0, BE)
    if IDX64:
        offs_e = offs_e.to(tl.int64)
    mask_e = offs_e < M * N
    m = offs_e // N
    n = offs_e % N
    offs_s = tl.arange(0, BS)
    pp = p_ptr + offs_s[:, None] * s_ps + (m * s_pm + n * s_pn)[None, :]
    acc1 = tl.zeros((BS, BE), dtype=tl.float32)
    acc2 = tl.zeros((BS, BE), dtype=tl.float32)
    for s0 in range(0, S, BS):
        mask = ((s0 + offs_s) < S)[:, None] & mask_e[None, :]
        acc1 += tl.load(pp, mask=mask, other=0.0)
        if TWO:
            acc2 += tl.load(pp + s_pj, mask=mask, other=0.0)
        pp += BS * s_ps
    tl.store(o1_ptr + m * s_1m + n * s_1n, (tl.sum(acc1, 0) * alpha).to(o1_ptr.dtype.element_ty), mask=mask_e)
    if TWO:
        tl.store(o2_ptr + m * s_2m + n * s_2n, (tl.sum(acc2, 0) * alpha).to(o2_ptr.dtype.element_ty),
                 mask=mask_e)


@triton.jit(do_not_specialize=["S"])
def _reduce_kernel(
    p_ptr, o1_ptr, o2_ptr, M, N, S, alpha,
    s_ps, s_pj, s_pm, s_pn, s_1m, s_1n, s_2m, s_2n,
    TWO: tl.constexpr, IDX64: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
):
    """o1 = α·Σ_s p[s, 0], o2 = α·Σ_s p[s, 1] (TWO). A program owns BE output elements
    (row-major over (M, N)) and adds BS partials per step: a persistent kernel's partial
    stack is deep (one per program: hundreds) and its outputs few (a factor's gradient),
    so the stack is read in wide [BS, BE] tiles, not one partial at a time."""
    _reduce_tile(tl.program_id(0), p_ptr, o1_ptr, o2_ptr, M, N, S, alpha,
                 s_ps, s_pj, s_pm, s_pn, s_1m, s_1n, s_2m, s_2n, TWO, IDX64, BS, BE)


@triton.jit(do_not_specialize=["S", "T"])
def _reduce_pair_kernel(
    p_ptr, o_ptr, q_ptr, u_ptr, M, N, S, K, L, T, alpha, G1,
    s_ps, s_pm, s_pn, s_om, s_on, s_qs, s_qm, s_qn, s_um, s_un,
    IDX64: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
):
    """Two independent reductions in one launch: o (M, N) = α·Σ_s p[s] by programs
    [0, G1), u (K, L) = α·Σ_t q[t] by the rest: a backward's two weight gradients
    (one launch, not two: host time and a launch ramp on the device)."""
    pid = tl.program_id(0)
    if pid < G1:
        _reduce_tile(pid, p_ptr, o_ptr, o_ptr, M, N, S, alpha,
                     s_ps, 0, s_pm, s_pn, s_om, s_on, s_om, s_on, False, IDX64, BS, BE)
    else:
        _reduce_tile(pid - G1, q_ptr, u_ptr, u_ptr, K, L, T, alpha,
                     s_qs, 0, s_qm, s_qn, s_um, s_un, s_um, s_un, False, IDX64, BS, BE)


def reduce_block(n_out: int, n_sm: int) -> int:
    """Output elements per program of ``reduce_launch`` (the planners model the same)."""
    per_sm = n_out // n_sm
    return max(64, min(512, 1 << max(0, per_sm.bit_length() - 1)))


def reduce_pair_launch(p, o, M, N, S, p_st, o_st, q, u, K, L, T, q_st, u_st, alpha, idx64):
    """o (M, N) = α·Σ_s p[s] and u (K, L) = α·Σ_t q[t] in one launch (``p_st``/``q_st``:
    the partial stacks' (stack, row, column) strides, ``o_st``/``u_st`` the outputs'). The
    tile width follows the larger output; each side gets its own programs."""
    be = reduce_block(max(M * N, K * L), num_sms(p.device))
    g1 = cdiv(M * N, be)
    fast(_reduce_pair_kernel)[(g1 + cdiv(K * L, be),)](
        p, o, q, u, M, N, S, K, L, T, alpha, g1, p_st[0], p_st[1], p_st[2], o_st[0], o_st[1],
        q_st[0], q_st[1], q_st[2], u_st[0], u_st[1], IDX64=idx64, BS=8, BE=be, num_warps=4)


def reduce_launch(part, out1, out2, M, N, S, alpha, ps, pj, pm, pn, o1s, o2s, idx64):
    """out1 (, out2) = α·Σ_s part[s(, j)] with explicit strides (elements). The tile
    width follows the output size only (one compiled variant per shape, whatever the
    calling kernel's config), about one program per SM."""
    be = reduce_block(M * N, num_sms(part.device))
    o2 = out1 if out2 is None else out2
    o2s = o1s if out2 is None else o2s
    fast(_reduce_kernel)[(cdiv(M * N, be),)](
        part, out1, o2, M, N, S, alpha, ps, pj, pm, pn, o1s[0], o1s[1], o2s[0], o2s[1],
        TWO=out2 is not None, IDX64=idx64, BS=8, BE=be, num_warps=4)


@triton.jit
def tile_2d(M, N, IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(offs_m, offs_n, mask_m, mask_n) of program 0-axis id's (BM, BN) output tile, the
    tiles row-major over (cdiv(M, BM), cdiv(N, BN)); int64 offsets under IDX64."""
    pid = tl.program_id(0)
    n_n = tl.cdiv(N, BN)
    offs_m = (pid // n_n) * BM + tl.arange(0, BM)
    offs_n = (pid % n_n) * BN + tl.arange(0, BN)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _operand_tile(ptr, s_s, S, offs, mask, IS_CD: tl.constexpr, CD: tl.constexpr, BA: tl.constexpr,
                  BB: tl.constexpr):
    """Σ_s ptr[s·s_s + offs] of one (BA, BB) tile in fp32, one partial after another: a factor
    (``IS_CD``: rounded to the compute dtype) or an fp32 partial stack, summed unrounded (deep
    stacks are first added by the flat reduce: ``lokr.CHAIN_PRESUM``)."""
    t = tl.zeros((BA, BB), dtype=tl.float32)
    p = ptr + offs
    for _ in range(0, S):
        v = tl.load(p, mask=mask, other=0.0)
        if IS_CD:
            v = v.to(CD)
        t += v.to(tl.float32)
        p += s_s
    return t


@triton.jit
def _mm_tile(
    pid, x_ptr, y_ptr, o_ptr, M, N, K, SX, SY, alpha,
    s_xs, s_xm, s_xk, s_ys, s_yk, s_yn, s_om, s_on,
    X_CD: tl.constexpr, Y_CD: tl.constexpr, CD: tl.constexpr, IDX64: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Tile ``pid`` (row-major over (cdiv(M, BM), cdiv(N, BN))) of o = α·(Σ_s x[s])·(Σ_s y[s])
    in fp32 (IEEE dot); an operand flagged ``*_CD`` is rounded to the compute dtype first
    (a factor), otherwise it is an fp32 partial stack that is summed unrounded."""
    n_n = tl.cdiv(N, BN)
    offs_m = (pid // n_n) * BM + tl.arange(0, BM)
    offs_n = (pid % n_n) * BN + tl.arange(0, BN)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        xt = _operand_tile(x_ptr, s_xs, SX, offs_m[:, None] * s_xm + offs_k[None, :] * s_xk,
                           mask_m[:, None] & mask_k[None, :], X_CD, CD, BM, BK)
        yt = _operand_tile(y_ptr, s_ys, SY, offs_k[:, None] * s_yk + offs_n[None, :] * s_yn,
                           mask_k[:, None] & mask_n[None, :], Y_CD, CD, BK, BN)
        acc = tl.dot(xt, yt, acc, input_precision="ieee")
    tl.store(o_ptr + offs_m[:, None] * s_om + offs_n[None, :] * s_on,
             (acc * alpha).to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _chain_tiles(
    pid, p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, S, TILES_A,
    s_ps, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn,
    CD: tl.constexpr, IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Tile ``pid`` of one side's two factor gradients: of g_wa for pid < TILES_A, else of g_wb."""
    if pid < TILES_A:
        _mm_tile(pid, p_ptr, wb_ptr, ga_ptr, M, R, N, S, 1, 1.0,
                 s_ps, s_pm, s_pn, 0, s_bn, s_br, s_gam, s_gar,
                 False, True, CD, IDX64, BM, BN, BK)
    else:
        _mm_tile(pid - TILES_A, wa_ptr, p_ptr, gb_ptr, R, N, M, 1, S, 1.0,
                 0, s_ar, s_am, s_ps, s_pm, s_pn, s_gbr, s_gbn,
                 True, False, CD, IDX64, BM, BN, BK)


@triton.jit
def _chain_plane(
    p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R,
    s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn,
    CD: tl.constexpr, IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Every tile of one side's two factor gradients from ONE partial plane P (M, N), in the
    calling program, one after the other (a one-program caller: ``lokr._kron_grad_kernel``)."""
    tiles_a = tl.cdiv(M, BM) * tl.cdiv(R, BN)
    for c in range(0, tiles_a + tl.cdiv(R, BM) * tl.cdiv(N, BN)):
        _chain_tiles(c, p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, 1, tiles_a,
                     0, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn, CD, IDX64, BM, BN, BK)


@triton.jit(do_not_specialize=["S"])
def _chain_kernel(
    p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, S, TILES_A,
    s_ps, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn,
    CD: tl.constexpr, IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Both factor gradients of a factorized Kronecker side w = wa·wb from the fp32 partial
    stack P (S, M, N) of dL/dw, in one launch: g_wa = (Σ_s P)·wbᵀ (M, R) on the first
    TILES_A programs, g_wb = waᵀ·(Σ_s P) (R, N) on the rest (one launch, not two: a launch
    is ~5 us of host time on tiny tensors)."""
    _chain_tiles(tl.program_id(0), p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, S, TILES_A,
                 s_ps, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn, CD, IDX64, BM, BN, BK)


@triton.jit(do_not_specialize=["S", "S2"])
def _chain_pair_kernel(
    p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, S, TILES_A,
    s_ps, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn,
    p2_ptr, wa2_ptr, wb2_ptr, ga2_ptr, gb2_ptr, M2, N2, R2, S2, TILES_A2, TILES_1,
    s_ps2, s_pm2, s_pn2, s_am2, s_ar2, s_br2, s_bn2, s_gam2, s_gar2, s_gbr2, s_gbn2,
    CD: tl.constexpr, IDX64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """``_chain_kernel`` for both factorized sides of a LoKr merge backward in one launch:
    the first side's tiles on programs [0, TILES_1), the second's on the rest."""
    pid = tl.program_id(0)
    if pid < TILES_1:
        _chain_tiles(pid, p_ptr, wa_ptr, wb_ptr, ga_ptr, gb_ptr, M, N, R, S, TILES_A,
                     s_ps, s_pm, s_pn, s_am, s_ar, s_br, s_bn, s_gam, s_gar, s_gbr, s_gbn, CD, IDX64, BM, BN, BK)
    else:
        _chain_tiles(pid - TILES_1, p2_ptr, wa2_ptr, wb2_ptr, ga2_ptr, gb2_ptr, M2, N2, R2, S2, TILES_A2,
                     s_ps2, s_pm2, s_pn2, s_am2, s_ar2, s_br2, s_bn2, s_gam2, s_gar2, s_gbr2, s_gbn2,
                     CD, IDX64, BM, BN, BK)


def _chain_args(part, S, M, N, wa, wb, out_a, out_b, bm, bn):
    """(tiles of both gradients, kernel arguments) of one side of ``_chain_kernel``."""
    R = wa.shape[1]
    tiles_a = cdiv(M, bm) * cdiv(R, bn) if out_a.numel() else 0
    tiles_b = cdiv(R, bm) * cdiv(N, bn) if out_b.numel() else 0
    args = (part, wa, wb, out_a, out_b, M, N, R, S, tiles_a, *part.stride(), *wa.stride(), *wb.stride(),
            *(out_a.stride() if out_a.dim() == 2 else (0, 0)), *(out_b.stride() if out_b.dim() == 2 else (0, 0)))
    return tiles_a + tiles_b, args


def chain_launch(part, S, M, N, wa, wb, out_a, out_b, compute, idx64, block=(32, 32, 32)):
    """out_a = (Σ_s part)·wbᵀ (M, R), out_b = waᵀ·(Σ_s part) (R, N), in the outputs' dtypes;
    ``part`` (S, M, N) fp32 with any strides; an empty output is skipped."""
    bm, bn, bk = block
    tiles, args = _chain_args(part, S, M, N, wa, wb, out_a, out_b, bm, bn)
    if tiles == 0:
        return
    fast(_chain_kernel)[(tiles,)](*args, CD=tl_dtype(compute), IDX64=idx64, BM=bm, BN=bn, BK=bk, num_warps=4)


def chain_pair_launch(side1, side2, compute, idx64, block=(32, 32, 32)):
    """``chain_launch`` of two sides, each ``(part, S, M, N, wa, wb, out_a, out_b)``, in one
    launch (a LoKr merge backward with both sides factorized: one launch fewer)."""
    bm, bn, bk = block
    tiles1, args1 = _chain_args(*side1, bm, bn)
    tiles2, args2 = _chain_args(*side2, bm, bn)
    if tiles1 + tiles2 == 0:
        return
    args2 = args2[:10] + (tiles1,) + args2[10:]  # TILES_1 follows the second side's TILES_A
    fast(_chain_pair_kernel)[(tiles1 + tiles2,)](*args1, *args2, CD=tl_dtype(compute), IDX64=idx64,
                                                  BM=bm, BN=bn, BK=bk, num_warps=4)
