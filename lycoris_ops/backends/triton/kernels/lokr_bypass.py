"""Triton kernels of the LoKr bypass ops (docs/ops.md §2.3): ``lokr_bypass_fwd``,
``lokr_bypass_bwd`` (the merges: ``lokr.py``; the same Kronecker convention, dtypes and
rounding points).

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

Limits (scope): the forward holds the whole padded inner dim of its contraction order
(b, or d when swapped) and tiles the others: ``pow2(min(b, d), ≥16) <= 128`` (``fwd_swaps``);
the backward keeps every padded factor dim in registers: ``pow2(max(a, b, c, d), ≥16) <= 128``
(``supported_bypass``). fp16 / bf16 / fp32 only
(fp64 goes eager).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, dot_dtype, fast, needs_idx64, next_pow2, num_sms, tl_dtype
from lycoris_ops.backends.triton.kernels.fusedkit import (compute_dtype, dot_wide, reduce_launch, reduce_pair_launch,
                                                          view_key)
from lycoris_ops.tuner.models.lokr import bwd_cost, fwd_cost  # the work model's counts: one formula

__all__ = ["BypassFwdCfg", "BypassBwdCfg", "MAX_BYPASS_DIM", "supported_bypass", "fwd_swaps", "bypass_fwd", "bypass_bwd"]

#: the bypass kernels hold whole (padded) factor dims in registers
MAX_BYPASS_DIM = 128


def _p16(n: int) -> int:
    return max(16, next_pow2(n))


#: with a padded factor dim, the backward's sm_90 build computed a wrong second weight gradient
#: (or faulted) once a G tile held more rows (block_t · padded A) than this, while the
#: interpreter was exact (bench/experiments/lokr_bwd_candidates.py); the plan caps block_t
PADDED_BWD_ROWS = 64


def max_bwd_block_t(A: int, B: int, C: int, D: int) -> int:
    """The largest ``block_t`` the bypass backward takes for kernel dims (A, B, C, D)."""
    if all(n == _p16(n) for n in (A, B, C, D)):
        return 16
    return max(1, PADDED_BWD_ROWS // _p16(A))


def supported_bypass(a: int, b: int, c: int, d: int) -> bool:
    """Whether the fused bypass backward takes w1 (a, b), w2 (c, d)."""
    return _p16(max(a, b, c, d)) <= MAX_BYPASS_DIM


def fwd_swaps(a: int, b: int, c: int, d: int) -> tuple:
    """The contraction orders (``swap`` values) the forward kernel takes: it holds the whole
    padded inner factor dim (b; d when swapped) and tiles or loops the other three."""
    return tuple(sw for sw, held in ((False, b), (True, d)) if _p16(held) <= MAX_BYPASS_DIM)


# =============================================================================== kernels


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
    while bt < max_bwd_block_t(A, B, C, D) and 2 * bt * tiles <= tb and bt < next_pow2(max(T, 1)):
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
    else one; then the tiles spread evenly (two 4-warp programs per SM measured faster than
    one, and 8 warps slower at every setting). The work model takes this rule."""
    if not programs and 0 < elems <= ONE_PROGRAM_ELEMS:
        programs = 1
    progs = max(1, min(programs or (2 if num_warps == 4 else 1) * n_sm, n_tiles))
    per = cdiv(n_tiles, progs)
    return cdiv(n_tiles, per), per


# =============================================================================== launchers


def fwd_swap(a, b, c, d, split) -> bool:
    """The forward's contraction order where the config leaves it open: the cheaper of the
    orders it takes (``fwd_swaps``)."""
    allowed = fwd_swaps(a, b, c, d)
    if not allowed:
        raise ValueError(f"lokr_bypass_fwd: w1 {(a, b)}, w2 {(c, d)}: b or d must be <= {MAX_BYPASS_DIM}")
    swap = fwd_cost(c, d, a, b, split) * 4 < fwd_cost(a, b, c, d, split) * 3
    return swap if swap in allowed else allowed[0]


@functools.lru_cache(maxsize=4096)
def _bypass_fwd_plan(T, a, b, c, d, views, has_base, compute, device, cfg: BypassFwdCfg):
    split = cfg.split and compute != torch.float32
    # None, or an order the kernel cannot hold: the cheaper order it takes
    swap = cfg.swap if cfg.swap in fwd_swaps(a, b, c, d) else fwd_swap(a, b, c, d, split)
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


def bwd_swap(a, b, c, d, split) -> bool:
    """The backward's contraction order where the config leaves it open: the cheaper one."""
    return bwd_cost(c, d, a, b, split) * 4 < bwd_cost(a, b, c, d, split) * 3


@functools.lru_cache(maxsize=4096)
def _bypass_bwd_plan(T, a, b, c, d, views, compute, device, cfg: BypassBwdCfg):
    split = cfg.split and compute != torch.float32
    swap = bwd_swap(a, b, c, d, split) if cfg.swap is None else cfg.swap
    A, B, C, D = (c, d, a, b) if swap else (a, b, c, d)
    dflt = default_bypass_bwd_cfg(T, A, B, C, D, compute)
    bt = min(cfg.block_t or dflt.block_t, max_bwd_block_t(A, B, C, D))
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
