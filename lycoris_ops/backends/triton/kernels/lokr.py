"""Triton kernels of the LoKr merges (docs/ops.md §2.3): ``lokr_full_merge_fwd``,
``lokr_full_merge_bwd``, ``lokr_merge_fwd``, ``lokr_merge_bwd`` (the bypass ops:
``lokr_bypass.py``).

Written from the math of docs/ops.md §2.3 and the eager bodies of
``reference/lokr.py`` (same dtypes, same rounding points). Kronecker
convention: ``kron(w1, w2)[u·c + i, v·d + j] = w1[u, v]·w2[i, j]``, w1 (a, b),
w2 (c, d). Operands are read in their stored dtype and rounded to the compute
dtype in-kernel; every product accumulates in fp32 and intermediates that the
eager body keeps in fp32 stay fp32 (see ``fusedkit.dot_wide``); γ and base
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
``lokr_bypass_fwd`` / ``lokr_bypass_bwd``: ``lokr_bypass.py``.

The merges have no size limit (ranks are looped). fp16 / bf16 / fp32 only (fp64 goes eager).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, dot_dtype, fast, needs_idx64, next_pow2, tl_dtype
from lycoris_ops.backends.triton.kernels.fusedkit import (_chain_plane, chain_launch, chain_pair_launch, compute_dtype, reduce_launch, reduce_pair_launch, split_count, tile_2d, view_key)

__all__ = ["MergeCfg", "lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd", "merge_fwd",
           "merge_bwd"]


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
    chain (``fusedkit._chain_plane``: g_wa = P·wbᵀ into g*a, g_wb = waᵀ·P into g*b) on the
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


def default_merge_cfg(M1: int, N1: int, M2: int, N2: int, compute: torch.dtype) -> MergeCfg:
    bn = min(128, max(16, next_pow2(N1)))
    bm = min(max(16, next_pow2(M1)), max(16, 4096 // bn))
    return MergeCfg(block_m=bm, block_n=bn, num_warps=4 if bm * bn <= 4096 else 8)


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
#: (``fusedkit.chain_launch``)
CHAIN_BLOCK = (16, 16, 32)
#: most chain tiles (CHAIN_BLOCK outputs) that a one-program gradient kernel runs itself, after
#: its pass (``merge_bwd``: a small call is host-bound, so one launch fewer counts)
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
#: programs), so the chain's few tile programs read one plane instead of S (0: never; measured
#: faster than a smaller chain tile alone on factored merges)
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
