"""Triton kernels of IA3 (docs/ops.md §2.7): ``ia3_fwd`` and ``ia3_bwd``.

x (any rank) is viewed as (A, C, B): A = the dims before ``channel_axis``,
C = the channel dim, B = the dims after it; the outer and the inner dims must
each collapse to one strided run (``common.collapse_one``), else that operand
is copied contiguous first (rare). Two tilings of the logical matrix:

* channel on the columns (B = 1, e.g. linear activations with axis -1, the
  in-feature axis of a linear weight): a (rows = A) x (cols = C) tile, w loaded
  once per column tile;
* channel on the rows (B > 1: conv layouts, out-feature axis): a
  (rows = A·C) x (cols = B) tile, w[row % C] per row.

Operands are read in their own dtypes (fp32 and 16-bit may mix), the math is
fp32, each output is rounded once. Passes:

``ia3_fwd`` - one kernel: ``y = x·(α + γ·w[c])``, one read of x (and of w per
    tile), one write of y (dtype ``promote_types(x, w)``).
``ia3_bwd`` - one kernel writes ``gx = G·(α + γ·w[c])`` (x's dtype) and reduces
    ``Σ G·x`` per channel in fp32 in the same pass (G and x read once). When one
    program covers a whole channel reduction it stores ``gw = γ·Σ`` directly (w's
    dtype); otherwise it stores fp32 partials and a tiny column-sum kernel
    finishes ``gw`` (deterministic, no atomics).

Scope: float16 / bfloat16 / float32 (fp64 goes to eager: α and γ reach Triton
as fp32 scalars).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, collapse_one, fast, needs_idx64, next_pow2, num_sms

__all__ = ["Ia3Cfg", "ia3_fwd", "ia3_bwd", "default_ia3_fwd_cfg", "default_ia3_bwd_cfg"]


@triton.jit
def _row_offsets(rows, C, s_a, s_c, ROWS_FLAT: tl.constexpr):
    """Element offset of logical row ``rows`` = a·C + c of an (A, C, ·) view."""
    if ROWS_FLAT:
        off = rows * s_c
    else:
        off = (rows // C) * s_a + (rows % C) * s_c
    return off


@triton.jit
def _ia3_fwd_kernel(
    x_ptr, w_ptr, y_ptr, M, N, C, alpha, gamma, s_xa, s_xc, s_xb, s_w,
    CH_ROWS: tl.constexpr, X_FLAT: tl.constexpr, IDX64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if IDX64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    mask_m = rows < M
    mask_n = cols < N
    mask = mask_m[:, None] & mask_n[None, :]
    if CH_ROWS:  # rows = a·C + c, cols = b
        wv = tl.load(w_ptr + (rows % C) * s_w, mask=mask_m, other=0.0).to(tl.float32)
        scale = (gamma * wv + alpha)[:, None]
        xoff = _row_offsets(rows, C, s_xa, s_xc, X_FLAT)[:, None] + cols[None, :] * s_xb
    else:  # rows = a, cols = c
        wv = tl.load(w_ptr + cols * s_w, mask=mask_n, other=0.0).to(tl.float32)
        scale = (gamma * wv + alpha)[None, :]
        xoff = rows[:, None] * s_xa + cols[None, :] * s_xc
    x = tl.load(x_ptr + xoff, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], (x * scale).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ia3_bwd_kernel(
    g_ptr, x_ptr, w_ptr, gx_ptr, part_ptr, gw_ptr, M, N, C, alpha, gamma,
    s_ga, s_gc, s_gb, s_xa, s_xc, s_xb, s_w, SPAN,
    CH_ROWS: tl.constexpr, G_FLAT: tl.constexpr, X_FLAT: tl.constexpr, DIRECT: tl.constexpr,
    IDX64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """gx = G·(α + γ·w[c]) and per-channel Σ G·x over this program's span.

    CH_ROWS: program = (row tile, column span); partial per row -> part[split, M].
    else:    program = (column tile, row span); partial per column -> part[split, N].
    """
    split = tl.program_id(1)
    if IDX64:
        split = split.to(tl.int64)
    if CH_ROWS:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        if IDX64:
            rows = rows.to(tl.int64)
        mask_m = rows < M
        wv = tl.load(w_ptr + (rows % C) * s_w, mask=mask_m, other=0.0).to(tl.float32)
        scale = (gamma * wv + alpha)[:, None]
        grow = _row_offsets(rows, C, s_ga, s_gc, G_FLAT)
        xrow = _row_offsets(rows, C, s_xa, s_xc, X_FLAT)
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        lo = split * SPAN
        hi = tl.minimum(lo + SPAN, N)
        for c0 in range(lo, hi, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            if IDX64:
                cols = cols.to(tl.int64)
            mask = mask_m[:, None] & (cols < hi)[None, :]
            g = tl.load(g_ptr + grow[:, None] + cols[None, :] * s_gb, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + xrow[:, None] + cols[None, :] * s_xb, mask=mask, other=0.0).to(tl.float32)
            tl.store(gx_ptr + rows[:, None] * N + cols[None, :], (g * scale).to(gx_ptr.dtype.element_ty), mask=mask)
            acc += tl.sum(g * x, axis=1)
        if DIRECT:  # A == 1 and one span: row == channel
            tl.store(gw_ptr + rows, (acc * gamma).to(gw_ptr.dtype.element_ty), mask=mask_m)
        else:
            tl.store(part_ptr + split * M + rows, acc, mask=mask_m)
    else:
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if IDX64:
            cols = cols.to(tl.int64)
        mask_n = cols < N
        wv = tl.load(w_ptr + cols * s_w, mask=mask_n, other=0.0).to(tl.float32)
        scale = (gamma * wv + alpha)[None, :]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        lo = split * SPAN
        hi = tl.minimum(lo + SPAN, M)
        for r0 in range(lo, hi, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            if IDX64:
                rows = rows.to(tl.int64)
            mask = (rows < hi)[:, None] & mask_n[None, :]
            g = tl.load(g_ptr + rows[:, None] * s_ga + cols[None, :] * s_gc, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * s_xa + cols[None, :] * s_xc, mask=mask, other=0.0).to(tl.float32)
            tl.store(gx_ptr + rows[:, None] * N + cols[None, :], (g * scale).to(gx_ptr.dtype.element_ty), mask=mask)
            acc += tl.sum(g * x, axis=0)
        if DIRECT:
            tl.store(gw_ptr + cols, (acc * gamma).to(gw_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.store(part_ptr + split * N + cols, acc, mask=mask_n)


@triton.jit
def _colsum_kernel(part_ptr, gw_ptr, K, C, gamma, IDX64: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """gw[c] = γ·Σ_k part[k, c] (part fp32 (K, C) contiguous), stored in gw's dtype."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < C
    acc = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if IDX64:
            ks = ks.to(tl.int64)
        acc += tl.load(part_ptr + ks[:, None] * C + cols[None, :], mask=(ks < K)[:, None] & mask_c[None, :],
                       other=0.0)
    tl.store(gw_ptr + cols, (tl.sum(acc, axis=0) * gamma).to(gw_ptr.dtype.element_ty), mask=mask_c)


class Ia3Cfg(NamedTuple):
    """``block_m`` x ``block_n`` tile of the logical (rows, cols) matrix;
    ``split`` (bwd only) = ranges along the reduced direction (0 = auto)."""
    block_m: int = 32
    block_n: int = 128
    split: int = 0
    num_warps: int = 4


def _abc(shape, stride, ax):
    """(A, s_a), (C, s_c), (B, s_b) of the (A, C, B) view, or None if the outer
    or inner dims are not one strided run."""
    outer = collapse_one(shape[:ax], stride[:ax])
    inner = collapse_one(shape[ax + 1:], stride[ax + 1:])
    if outer is None or inner is None:
        return None
    return outer, (shape[ax], stride[ax]), inner


def _tile(M, N, cap_n, elems):
    bn = min(next_pow2(N), cap_n)
    bm = max(1, min(next_pow2(M), elems // bn))
    return bm, bn


def default_ia3_fwd_cfg(M: int, N: int) -> Ia3Cfg:
    bm, bn = _tile(M, N, 256, 4096)
    return Ia3Cfg(bm, bn, 0, 4)


def default_ia3_bwd_cfg(M: int, N: int, ch_rows: bool) -> Ia3Cfg:
    if ch_rows:  # each program reduces whole rows along N
        bm, bn = _tile(M, N, 256, 2048)
    else:  # each program reduces its columns down the rows
        bn = min(next_pow2(N), 128)
        bm = max(1, min(next_pow2(M), 2048 // bn))
    return Ia3Cfg(bm, bn, 0, 4)


def _geometry(x_shape, ax):
    A = 1
    for n in x_shape[:ax]:
        A *= n
    B = 1
    for n in x_shape[ax + 1:]:
        B *= n
    C = x_shape[ax]
    ch_rows = B != 1  # B = 0 (empty trailing dims): rows, so M·N = 0 and nothing launches
    M, N = (A * C, B) if ch_rows else (A, C)
    return A, C, B, ch_rows, M, N


def _operand_args(view, C):
    """(s_a, s_c, s_b, rows_flat) of one operand's (A, C, B) view."""
    (A, s_a), (_, s_c), (_, s_b) = view
    return s_a, s_c, s_b, A == 1 or s_a == C * s_c


def _w_stride(w_shape, w_stride):
    one = collapse_one(w_shape, w_stride)
    return None if one is None else one[1]


@functools.lru_cache(maxsize=4096)
def _fwd_plan(xs, xst, ws, wst, xdt, wdt, ax, cfg):
    """-> (out dtype, x args or None (copy x), s_w or None (copy w), grid, M, N, C, meta)."""
    ax = ax % len(xs)
    out = torch.promote_types(xdt, wdt)
    xv = _abc(xs, xst, ax)
    s_w = _w_stride(ws, wst)
    A, C, B, ch_rows, M, N = _geometry(xs, ax)
    if xv is None or s_w is None or M * N == 0:
        return out, None if xv is None else _operand_args(xv, C), s_w, None, M, N, C, None
    cfg = cfg or default_ia3_fwd_cfg(M, N)
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    meta = dict(CH_ROWS=ch_rows, IDX64=needs_idx64((xs, xst)) or M * N > 2**31 - 1,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    return out, _operand_args(xv, C), s_w, grid, M, N, C, meta


@functools.lru_cache(maxsize=4096)
def _bwd_plan(gst, xs, xst, ws, wst, ax, device, cfg):
    """-> (g args, x args, s_w (None: copy that operand), M, N, C, span, k_rows,
    grid, meta, direct, rgrid, rmeta); grid None when there is nothing to launch."""
    ax = ax % len(xs)
    gv, xv = _abc(xs, gst, ax), _abc(xs, xst, ax)
    s_w = _w_stride(ws, wst)
    A, C, B, ch_rows, M, N = _geometry(xs, ax)
    g_args = None if gv is None else _operand_args(gv, C)
    x_args = None if xv is None else _operand_args(xv, C)
    if g_args is None or x_args is None or s_w is None or M * N == 0:
        return g_args, x_args, s_w, M, N, C, 0, 0, None, None, False, None, None
    cfg = cfg or default_ia3_bwd_cfg(M, N, ch_rows)
    bm, bn = cfg.block_m, cfg.block_n
    if ch_rows:
        tiles, steps, along, blk = cdiv(M, bm), cdiv(N, bn), N, bn
    else:
        tiles, steps, along, blk = cdiv(N, bn), cdiv(M, bm), M, bm
    split = cfg.split or max(1, min(cdiv(2 * num_sms(device), max(tiles, 1)), steps // 2))
    split = max(1, min(split, max(steps, 1)))
    span = cdiv(cdiv(along, split), blk) * blk
    split = max(1, cdiv(along, span))
    direct = split == 1 and (A == 1 or not ch_rows)
    # partials: ch_rows -> (split, A, C) = (split·A, C); else (split, C)
    k_rows = split * A if ch_rows else split
    idx64 = (needs_idx64((xs, xst), (xs, gst)) or M * N > 2**31 - 1 or k_rows * C > 2**31 - 1)
    grid = (tiles, split)
    meta = dict(CH_ROWS=ch_rows, DIRECT=direct, IDX64=idx64, BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg.num_warps)
    bc = min(next_pow2(C), 256)
    bk = max(1, min(next_pow2(k_rows), 4096 // bc))
    rgrid = (cdiv(C, bc),)
    rmeta = dict(IDX64=idx64, BLOCK_K=bk, BLOCK_C=bc, num_warps=4)
    return g_args, x_args, s_w, M, N, C, span, k_rows, grid, meta, direct, rgrid, rmeta


def ia3_fwd(x, w, channel_axis, alpha, gamma, cfg: Optional[Ia3Cfg] = None):
    """``y = x·(α + γ·w[c])``; x's shape, dtype ``promote_types(x, w)``, contiguous."""
    out, x_args, s_w, grid, M, N, C, meta = _fwd_plan(x.shape, x.stride(), w.shape, w.stride(), x.dtype, w.dtype,
                                                      channel_axis, cfg)
    y = torch.empty(x.shape, device=x.device, dtype=out)
    if M * N == 0:
        return y
    if x_args is None or s_w is None:  # rare layouts: read contiguous copies
        return ia3_fwd(x.contiguous() if x_args is None else x, w.contiguous() if s_w is None else w,
                       channel_axis, alpha, gamma, cfg)
    s_xa, s_xc, s_xb, x_flat = x_args
    fast(_ia3_fwd_kernel)[grid](x, w, y, M, N, C, alpha, gamma, s_xa, s_xc, s_xb, s_w, X_FLAT=x_flat, **meta)
    return y


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma, cfg: Optional[Ia3Cfg] = None):
    """``gx = G·(α + γ·w[c])`` (x's dtype) and ``gw[c] = γ·Σ G·x`` (w's dtype and shape)."""
    (g_args, x_args, s_w, M, N, C, span, k_rows, grid, meta, direct, rgrid,
     rmeta) = _bwd_plan(grad.stride(), x.shape, x.stride(), w.shape, w.stride(), channel_axis, x.device, cfg)
    if M * N == 0:
        return torch.empty(x.shape, device=x.device, dtype=x.dtype), torch.zeros(w.shape, device=w.device,
                                                                                 dtype=w.dtype)
    if grid is None:  # rare layouts: read contiguous copies
        return ia3_bwd(grad.contiguous() if g_args is None else grad, x.contiguous() if x_args is None else x,
                       w.contiguous() if s_w is None else w, channel_axis, alpha, gamma, cfg)
    gx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    gw = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    s_xa, s_xc, s_xb, x_flat = x_args
    s_ga, s_gc, s_gb, g_flat = g_args
    part = gw if direct else torch.empty((k_rows, C), device=x.device, dtype=torch.float32)
    fast(_ia3_bwd_kernel)[grid](grad, x, w, gx, part, gw, M, N, C, alpha, gamma,
                          s_ga, s_gc, s_gb, s_xa, s_xc, s_xb, s_w, span,
                          G_FLAT=g_flat, X_FLAT=x_flat, **meta)
    if not direct:
        fast(_colsum_kernel)[rgrid](part, gw, k_rows, C, gamma, **rmeta)
    return gx, gw
