"""Triton kernels of DoRA (OPS.md §2.4): ``dora_fwd`` and ``dora_bwd``.

Written from the math (``reference/dora.py`` is the oracle, same numerics):
``M = w + delta`` is read in-kernel (each operand in its own dtype, summed in
fp32) and never stored; ε = ``finfo(dscale.dtype).eps``; norms are fp32; y and
g_M are rounded once into w's dtype, g_dscale into dscale's dtype.

Geometry: a *norm vector* r is a row of M (row_axis 0) or a column (row_axis 1);
the kernels see M as (R, NC) — R norm vectors of NC elements — through two
strides per operand (``stride_r``, ``stride_c``), so both axes and any strided
w / delta / grad are read in place. For row_axis 1 on a row-major weight the
norm vectors are the contiguous axis: tiles are then wide in r and short in c
(the reduction walks down the rows of memory), which keeps the loads coalesced.

Passes:

``dora_fwd``
  * resident (a tile of BR whole norm vectors fits in registers,
    BR·pow2(NC) <= ``resident_max``): ONE kernel — load M once, ‖M_r‖, scale,
    store y and norms. W (+delta) read once, y written once.
  * streamed: TWO kernels. (1) sum of squares per norm vector, the reduction
    split over ``split`` programs per r-tile when that fills the GPU (fp32
    partials (split, R), deterministic, no atomics); (2) scale pass: every
    program re-reduces its r-tile's partials (split <= 64 floats each), the
    first column program writes norms, every program writes its y tile.
``dora_bwd`` (``ρ_r = Σ G⊙M``, ``g_dscale = mult·ρ/n``,
``g_M = s·G − mult·dscale·ρ/(n²·‖M‖)·M`` with ‖M‖ recomputed exactly in the
same pass as ρ; n comes from ``norms``; a zero vector gives a zero term):
  * resident: ONE kernel (G and M tiles both in registers).
  * streamed: TWO kernels — (ρ, ‖M‖²) partials, then the g_M pass.

Scope: float16 / bfloat16 / float32 operands (fp64 goes to eager: mult and ε
are passed as fp32 scalars). No size limit (the streamed variant takes any NC).
Calls arrive validated by ``check_dora_*`` and inside ``lycoris_ops.backends.scope`` (the op
set's contract); the launchers do not re-validate.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, device_guard, fast, needs_idx64, next_pow2, num_sms

__all__ = ["DoraCfg", "dora_fwd", "dora_bwd", "default_dora_cfg"]


# --------------------------------------------------------------------------- kernels

@triton.jit
def _load_m(w_ptr, d_ptr, r, c, sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA: tl.constexpr):
    m = tl.load(w_ptr + r * sw_r + c * sw_c, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        m += tl.load(d_ptr + r * sd_r + c * sd_c, mask=mask, other=0.0).to(tl.float32)
    return m


@triton.jit
def _rows(pid, R, BR: tl.constexpr, IDX64: tl.constexpr):
    r = pid * BR + tl.arange(0, BR)
    if IDX64:
        r = r.to(tl.int64)
    return r


@triton.jit
def _dora_fwd_resident(
    w_ptr, d_ptr, ds_ptr, y_ptr, n_ptr,
    R, NC, sw_r, sw_c, sd_r, sd_c, sds, sy_r, sy_c,
    mult, eps,
    HAS_DELTA: tl.constexpr, IDX64: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    r = _rows(tl.program_id(0), R, BR, IDX64)
    c = tl.arange(0, BC)
    rmask = r < R
    mask = rmask[:, None] & (c[None, :] < NC)
    m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
    n = tl.sqrt_rn(tl.sum(m * m, axis=1)) + eps
    ds = tl.load(ds_ptr + r * sds, mask=rmask, other=0.0).to(tl.float32)
    s = mult * (tl.div_rn(ds, n) - 1.0) + 1.0
    y = m * s[:, None]
    tl.store(y_ptr + r[:, None] * sy_r + c[None, :] * sy_c, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(n_ptr + r, n, mask=rmask)


@triton.jit
def _dora_sumsq(
    w_ptr, d_ptr, part_ptr, n_ptr,
    R, NC, sw_r, sw_c, sd_r, sd_c, chunks_per_split, eps,
    HAS_DELTA: tl.constexpr, FINAL: tl.constexpr, IDX64: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):
    """Pass 1 of the streamed forward: Σ M² over this program's column range.
    FINAL (one split): write norms directly; else fp32 partials [split, R]."""
    r = _rows(tl.program_id(0), R, BR, IDX64)
    sp = tl.program_id(1)
    rmask = r < R
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    c0 = sp * chunks_per_split * BC
    for i in range(chunks_per_split):
        c = c0 + i * BC + tl.arange(0, BC)
        if IDX64:
            c = c.to(tl.int64)
        mask = rmask[:, None] & (c[None, :] < NC)
        m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
        acc += m * m
    ss = tl.sum(acc, axis=1)
    if FINAL:
        tl.store(n_ptr + r, tl.sqrt_rn(ss) + eps, mask=rmask)
    else:
        tl.store(part_ptr + sp * R + r, ss, mask=rmask)


@triton.jit
def _reduce_parts(part_ptr, r, rmask, R, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr):
    """Σ over the SPLIT fp32 partials of rows r (a (SPLIT_P, BR) tile)."""
    sp = tl.arange(0, SPLIT_P)
    v = tl.load(part_ptr + sp[:, None] * R + r[None, :], mask=(sp[:, None] < SPLIT) & rmask[None, :], other=0.0)
    return tl.sum(v, axis=0)


@triton.jit
def _dora_scale(
    w_ptr, d_ptr, ds_ptr, y_ptr, n_ptr, part_ptr,
    R, NC, sw_r, sw_c, sd_r, sd_c, sds, sy_r, sy_c,
    mult, eps,
    HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr, IDX64: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):
    """Pass 2 of the streamed forward: y = s·M for one (r, c) tile."""
    r = _rows(tl.program_id(0), R, BR, IDX64)
    pc = tl.program_id(1)
    rmask = r < R
    if SPLIT == 1:
        n = tl.load(n_ptr + r, mask=rmask, other=1.0)
    else:
        n = tl.sqrt_rn(_reduce_parts(part_ptr, r, rmask, R, SPLIT, SPLIT_P)) + eps
        tl.store(n_ptr + r, n, mask=rmask & (pc == 0))
    ds = tl.load(ds_ptr + r * sds, mask=rmask, other=0.0).to(tl.float32)
    s = mult * (tl.div_rn(ds, n) - 1.0) + 1.0
    c = pc * BC + tl.arange(0, BC)
    if IDX64:
        c = c.to(tl.int64)
    mask = rmask[:, None] & (c[None, :] < NC)
    m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
    y = m * s[:, None]
    tl.store(y_ptr + r[:, None] * sy_r + c[None, :] * sy_c, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_coefs(rho, ss, n, ds, mult):
    """(s, coef, g_dscale) per norm vector: coef = mult·ds·ρ / (n²·‖M‖), 0 if ‖M‖ = 0."""
    mn = tl.sqrt_rn(ss)
    mn = tl.where(mn > 0.0, mn, 1.0)
    s = mult * (tl.div_rn(ds, n) - 1.0) + 1.0
    coef = (mult * ds * rho) / (n * n * mn)
    return s, coef, mult * rho / n


@triton.jit
def _dora_bwd_resident(
    g_ptr, w_ptr, d_ptr, ds_ptr, n_ptr, gm_ptr, gd_ptr,
    R, NC, sg_r, sg_c, sw_r, sw_c, sd_r, sd_c, sds, sn, so_r, so_c,
    mult,
    HAS_DELTA: tl.constexpr, IDX64: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    r = _rows(tl.program_id(0), R, BR, IDX64)
    c = tl.arange(0, BC)
    rmask = r < R
    mask = rmask[:, None] & (c[None, :] < NC)
    m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
    g = tl.load(g_ptr + r[:, None] * sg_r + c[None, :] * sg_c, mask=mask, other=0.0).to(tl.float32)
    rho = tl.sum(g * m, axis=1)
    ss = tl.sum(m * m, axis=1)
    n = tl.load(n_ptr + r * sn, mask=rmask, other=1.0).to(tl.float32)
    ds = tl.load(ds_ptr + r * sds, mask=rmask, other=0.0).to(tl.float32)
    s, coef, gd = _bwd_coefs(rho, ss, n, ds, mult)
    gm = s[:, None] * g - coef[:, None] * m
    tl.store(gm_ptr + r[:, None] * so_r + c[None, :] * so_c, gm.to(gm_ptr.dtype.element_ty), mask=mask)
    tl.store(gd_ptr + r, gd.to(gd_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _dora_bwd_reduce(
    g_ptr, w_ptr, d_ptr, part_ptr,
    R, NC, sg_r, sg_c, sw_r, sw_c, sd_r, sd_c, chunks_per_split, n_split,
    HAS_DELTA: tl.constexpr, IDX64: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):
    """Pass 1 of the streamed backward: partial ρ and Σ M² -> part[0|1, split, R]."""
    r = _rows(tl.program_id(0), R, BR, IDX64)
    sp = tl.program_id(1)
    rmask = r < R
    acc_rho = tl.zeros((BR, BC), dtype=tl.float32)
    acc_ss = tl.zeros((BR, BC), dtype=tl.float32)
    c0 = sp * chunks_per_split * BC
    for i in range(chunks_per_split):
        c = c0 + i * BC + tl.arange(0, BC)
        if IDX64:
            c = c.to(tl.int64)
        mask = rmask[:, None] & (c[None, :] < NC)
        m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
        g = tl.load(g_ptr + r[:, None] * sg_r + c[None, :] * sg_c, mask=mask, other=0.0).to(tl.float32)
        acc_rho += g * m
        acc_ss += m * m
    tl.store(part_ptr + sp * R + r, tl.sum(acc_rho, axis=1), mask=rmask)
    tl.store(part_ptr + (n_split + sp) * R + r, tl.sum(acc_ss, axis=1), mask=rmask)


@triton.jit
def _dora_bwd_apply(
    g_ptr, w_ptr, d_ptr, ds_ptr, n_ptr, gm_ptr, gd_ptr, part_ptr,
    R, NC, sg_r, sg_c, sw_r, sw_c, sd_r, sd_c, sds, sn, so_r, so_c,
    mult,
    HAS_DELTA: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr, IDX64: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr,
):
    """Pass 2 of the streamed backward: g_M tile; column program 0 writes g_dscale."""
    r = _rows(tl.program_id(0), R, BR, IDX64)
    pc = tl.program_id(1)
    rmask = r < R
    rho = _reduce_parts(part_ptr, r, rmask, R, SPLIT, SPLIT_P)
    ss = _reduce_parts(part_ptr + SPLIT * R, r, rmask, R, SPLIT, SPLIT_P)
    n = tl.load(n_ptr + r * sn, mask=rmask, other=1.0).to(tl.float32)
    ds = tl.load(ds_ptr + r * sds, mask=rmask, other=0.0).to(tl.float32)
    s, coef, gd = _bwd_coefs(rho, ss, n, ds, mult)
    tl.store(gd_ptr + r, gd.to(gd_ptr.dtype.element_ty), mask=rmask & (pc == 0))
    c = pc * BC + tl.arange(0, BC)
    if IDX64:
        c = c.to(tl.int64)
    mask = rmask[:, None] & (c[None, :] < NC)
    m = _load_m(w_ptr, d_ptr, r[:, None], c[None, :], sw_r, sw_c, sd_r, sd_c, mask, HAS_DELTA)
    g = tl.load(g_ptr + r[:, None] * sg_r + c[None, :] * sg_c, mask=mask, other=0.0).to(tl.float32)
    gm = s[:, None] * g - coef[:, None] * m
    tl.store(gm_ptr + r[:, None] * so_r + c[None, :] * so_c, gm.to(gm_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- planning

class DoraCfg(NamedTuple):
    """Launch parameters. ``resident_max``: largest fp32 register tile (BR·pow2(NC))
    of the one-pass variant (0 forces two passes); ``br``/``bc``: tile of the
    streamed passes (0: automatic, by which axis is contiguous); ``split``: column
    splits of the streamed reduction (0: automatic, to fill the GPU)."""
    resident_max: int = 16384
    br: int = 0
    bc: int = 0
    split: int = 0
    num_warps: int = 8
    num_stages: int = 2


def default_dora_cfg() -> DoraCfg:
    return DoraCfg()


MAX_SPLIT = 64


@functools.lru_cache(maxsize=4096)
def _plan(R, NC, r_contig, bwd, n_sm, cfg: DoraCfg):
    """(mode, BR, BC, split, chunks_per_split). mode 'res' or 'str'."""
    bc_res = max(16, next_pow2(NC))
    budget = cfg.resident_max // (2 if bwd else 1)
    if r_contig:  # norm vectors lie along the contiguous axis: wide r tiles
        br_res = max(32, min(128, budget // bc_res))
    else:
        br_res = max(1, min(64, budget // bc_res, next_pow2(R)))
    fits = br_res * bc_res <= budget
    if fits and (cdiv(R, br_res) >= n_sm or R * NC <= 4 * budget):
        return ("res", br_res, bc_res, 1, 1)
    if r_contig:
        br, bc = (cfg.br or 128), (cfg.bc or 32)
    else:
        br, bc = (cfg.br or 4), (cfg.bc or 512)
    n_chunks = max(1, cdiv(NC, bc))
    n_rt = cdiv(R, br)
    split = cfg.split or max(1, min(MAX_SPLIT, n_chunks, cdiv(2 * n_sm, n_rt)))
    cps = cdiv(n_chunks, split)
    split = cdiv(n_chunks, cps)
    return ("str", br, bc, split, cps)


def _geom(t, row_axis):
    """(stride_r, stride_c) of a 2-D operand seen as (norm vector, element)."""
    s0, s1 = t.stride()
    return (s0, s1) if row_axis == 0 else (s1, s0)


def _common(w, dscale, row_axis, delta, cfg, bwd, *others):
    if w.dtype == torch.float64:
        raise ValueError("lycoris triton dora: float64 is not fused (eager only)")
    R, NC = (w.shape[0], w.shape[1]) if row_axis == 0 else (w.shape[1], w.shape[0])
    sw = _geom(w, row_axis)
    sd = _geom(delta, row_axis) if delta is not None else (0, 0)
    r_contig = sw[0] == 1 and sw[1] != 1
    plan = _plan(R, NC, r_contig, bwd, num_sms(w.device), cfg or DoraCfg())
    views = [(tuple(t.shape), t.stride()) for t in (w, delta, *others) if t is not None]
    return R, NC, sw, sd, plan, needs_idx64(*views)


# --------------------------------------------------------------------------- launchers

def dora_fwd(w, dscale, mult, row_axis, delta=None, cfg: Optional[DoraCfg] = None):
    """``(y, norms)`` of OPS.md §2.4.1 (see ``reference.dora.dora_fwd``).

    w, delta: (R0, R1) any strides; dscale: w.shape[row_axis] elements. One pass
    when a tile of whole norm vectors fits in registers, else two."""
    cfg = cfg or DoraCfg()
    R, NC, sw, sd, (mode, BR, BC, split, cps), idx64 = _common(w, dscale, row_axis, delta, cfg, False)
    y = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    norms = torch.empty((R,), device=w.device, dtype=torch.float32)
    if R == 0:
        return y, norms
    ds = dscale.reshape(-1)
    sy = (y.stride(0), y.stride(1)) if row_axis == 0 else (y.stride(1), y.stride(0))
    eps = float(torch.finfo(dscale.dtype).eps)
    d = delta if delta is not None else w
    with device_guard(w):
        if mode == "res":
            fast(_dora_fwd_resident)[(cdiv(R, BR),)](
                w, d, ds, y, norms, R, NC, *sw, *sd, ds.stride(0), *sy, float(mult), eps,
                HAS_DELTA=delta is not None, IDX64=idx64, BR=BR, BC=BC,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            return y, norms
        part = norms if split == 1 else torch.empty((split, R), device=w.device, dtype=torch.float32)
        fast(_dora_sumsq)[(cdiv(R, BR), split)](
            w, d, part, norms, R, NC, *sw, *sd, cps, eps,
            HAS_DELTA=delta is not None, FINAL=split == 1, IDX64=idx64, BR=BR, BC=BC,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        fast(_dora_scale)[(cdiv(R, BR), max(1, cdiv(NC, BC)))](
            w, d, ds, y, norms, part, R, NC, *sw, *sd, ds.stride(0), *sy, float(mult), eps,
            HAS_DELTA=delta is not None, SPLIT=split, SPLIT_P=next_pow2(split), IDX64=idx64, BR=BR, BC=BC,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y, norms


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None, cfg: Optional[DoraCfg] = None):
    """``(g_M, g_dscale)`` of OPS.md §2.4.2 (exact derivative, see ``reference.dora.dora_bwd``).

    One pass when G and M tiles of whole norm vectors fit in registers, else two."""
    cfg = cfg or DoraCfg()
    R, NC, sw, sd, (mode, BR, BC, split, cps), idx64 = _common(w, dscale, row_axis, delta, cfg, True, grad)
    gm = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    gd = torch.empty((R,), device=w.device, dtype=dscale.dtype)
    if R == 0:
        return gm, gd
    ds = dscale.reshape(-1)
    sg = _geom(grad, row_axis)
    so = (gm.stride(0), gm.stride(1)) if row_axis == 0 else (gm.stride(1), gm.stride(0))
    d = delta if delta is not None else w
    with device_guard(w):
        if mode == "res":
            fast(_dora_bwd_resident)[(cdiv(R, BR),)](
                grad, w, d, ds, norms, gm, gd, R, NC, *sg, *sw, *sd, ds.stride(0), norms.stride(0), *so,
                float(mult), HAS_DELTA=delta is not None, IDX64=idx64, BR=BR, BC=BC,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            return gm, gd
        part = torch.empty((2, split, R), device=w.device, dtype=torch.float32)
        fast(_dora_bwd_reduce)[(cdiv(R, BR), split)](
            grad, w, d, part, R, NC, *sg, *sw, *sd, cps, split,
            HAS_DELTA=delta is not None, IDX64=idx64, BR=BR, BC=BC,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        fast(_dora_bwd_apply)[(cdiv(R, BR), max(1, cdiv(NC, BC)))](
            grad, w, d, ds, norms, gm, gd, part, R, NC, *sg, *sw, *sd, ds.stride(0), norms.stride(0), *so,
            float(mult), HAS_DELTA=delta is not None, SPLIT=split, SPLIT_P=next_pow2(split), IDX64=idx64,
            BR=BR, BC=BC, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return gm, gd
