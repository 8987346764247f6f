"""Triton kernels of BOFT (docs/ops.md §2.6): ``boft_fwd`` and ``boft_bwd``.

Written from the math (``reference/boft.py`` is the oracle, same numerics: all
fp32, one rounding at the store). Stage i (κ_i = 2^i·s/2) applies
``F_{i,β} = scale·R_{i,β} + (1 − scale)·I`` (R, not Rᵀ) to the blocks of the
π_i-permuted channels; ``y = u^m ⊙ rescale − diff·x``.

Channel groups. Stage i mixes only two things of a channel index c: its low part
``c mod s/2`` and the bit of weight κ_i. A run of consecutive stages
``[a, a+L)`` therefore maps every *group* of ``gs = (s/2)·2^L`` channels
``base(g) + low + tb·κ_a`` (low < s/2, tb < 2^L) onto itself, and its action on
a group is one dense gs×gs matrix ``J = E_{a+L−1}···E_a``.

Stage algebra, computed once per call in two small launches (the streaming
kernels only load its result, so their compile stays small):
  * ``_boft_cayley``: M = (I − Q)⁻¹ of every block of every stage by batched
    Gauss–Jordan (``cayley.py``) into an fp32 scratch (m, nb, SP, SP) — the only
    copy of the elimination code; its compile depends on SP alone.
  * ``_boft_segmat``: per segment and group, each stage matrix E_t in the
    group's local channel basis is *gathered* from that scratch by index math
    (the 0/1 permutation is applied to the indices, no permutation dots), and
    ``J = E_{a+L−1}···E_a`` (IEEE dots, J starts as E_a) is stored to an fp32
    scratch of group matrices.
  Where both are small (``one_algebra_launch``: every factor in one Cayley batch, at
  most ``ALGEBRA_ONE_GROUPS`` groups), ``_boft_algebra`` runs the two as ONE program
  (the factors, a barrier, the groups in turn): such calls are host-bound, so one
  launch fewer counts.
A streaming program owns one group and a share of the positions: it loads J and
applies it with one ``tl.dot`` per tile. R itself is never materialized.

Segments. The m stages are cut into segments of at most ``L_max`` stages, the
largest L with ``2^L·pow2(s/2) <= max_group`` (default 32 channels per group;
a single stage is always one segment: a group of 2·pow2(s/2) rows). When ``2^(m−1)·s`` fits
(``L_max >= m``) the whole butterfly is ONE segment.

Passes (after the stage-algebra launches):

``boft_fwd``
  * one segment: ONE kernel — x read once, y written once, rescale and diff
    folded into the group matrix (``W = diag(ρ)·J − diff·I``).
  * n segments: n kernels; between them fp32 scratch (two buffers in turn), the
    last segment applies rescale and reads x again for diff.
``boft_bwd`` (the plain chain, no rescale / diff; docs/ops.md §2.6.2) — no replay of
  stage prefixes: with one segment, ONE streaming kernel reads G and x once,
  writes ``gx = Jᵀ·G`` and accumulates ``Pg = Σ G·Xᵀ`` (gs×gs per group, fp32
  partials per position split); then ONE tiny chain kernel per group sums the
  partials and, per stage, forms ``P_i = (E_{i+1}ᵀ···E_{m−1}ᵀ)·Pg·(E_{i−1}···E_0)ᵀ``
  (exactly ``Σ g^{i+1}·(u^i)ᵀ``), ``gR = scale·P`` on the stage's blocks and the
  Cayley chain (``gQ = 2Mᵀ·gR·Mᵀ``, ``gB = cscale·(gQ − gQᵀ)``), all in the
  group's local basis (E and M gathered as above), storing g_blocks in blocks'
  dtype. With n segments: n − 1 forward kernels keep the segment inputs (fp32
  scratch, computed once, at the forward's ``block_p``), then per segment from
  the last: one streaming kernel (gx of the segment into an fp32 g scratch, in
  place) and one chain kernel — 3n + 1 launches, each stage applied once forward
  and once backward.

Compile cost: the stage/segment indices (a, L) and the split are runtime
integers never specialized (``do_not_specialize``), so one compiled kernel
serves every segment of a call; the IEEE (GP, GP) algebra runs with about 16
matrix elements per thread (``chain_warps`` = 0: GP²/512 warps, 4 to 8),
which keeps its unrolled FMA dots, and their compile, small.

Dots: streaming dots use ``input_precision`` from the config (default
``"tf32x3"``, ~fp32 accuracy); the stage algebra uses IEEE fp32. ``dot_prec=
"split16"``: where a streaming kernel's operands are x and G themselves (16-bit:
the first segment's forward; the backward of a one-segment butterfly), the group
matrix is split into three 16-bit terms (``oft.dot_split16``); fp32 scratch
operands keep tf32x3. ``dot_prec="bf16x3"`` (16-bit x only): the same split16 on
16-bit streams, and on fp32 scratch three bf16 dots of hi/lo splits (``oft.dot_x3``:
~2^-16 relative, an order below a 16-bit output's rounding; half of tf32x3's
tensor-core work; measured faster at the bench shapes). Triton's own
``input_precision="bf16x3"`` makes the same three dots; written out here so that it
runs, and is tested, under the interpreter and on Triton versions without it.

Packed scratch: every fp32 buffer between segments (forward, the backward's kept
segment inputs and its gradient) is written by its producer in the *consumer's*
layout: one row per position, the consumer's groups one after the other, each its
GP local slots (l = tb·HP + low) in order. The consumer then reads a group's tile
as contiguous runs masked along positions only, so its loads vectorize; the
producer scatters (``_packed_slot``). With x's own channel order, a group's
channels are runs of s/2 (12 at s = 24) κ apart: masked gathers that Triton issues
element by element.

Tile orientation: (GP, BLOCK_P), y = J·u (``_stream_offsets``).

Layout: x is seen as (pre, C, post) around the channel axis (axis 0: weight;
last: channels last; other: (N, C, *spatial)); any strides, pre and post dims
each collapsed to one strided run (else a contiguous copy).

Scope: s <= 64 (2·pow2(s/2) <= 64: past 32 a group is one stage's block, so every stage is a
segment); any m (segmented); float16 / bfloat16 / float32 (fp64 goes to eager).
Calls arrive validated by ``check_boft_*`` and inside ``lycoris_ops.backends.scope`` (the op
set's contract); the launchers do not re-validate.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, device_guard, fast, needs_idx64, next_pow2, num_sms
from lycoris_ops.backends.triton.kernels.cayley import batched_inverse, skew_system
from lycoris_ops.backends.triton.kernels.oft import (BF16X3, _HALF, bwd_dots, dot_mode, dot_split16, dot_x3, hilo, pos_mode, pos_offsets, positions_view, split16, wave_split)
from lycoris_ops.tuner.cost import STREAM_TILE_MAX

__all__ = ["BoftCfg", "boft_fwd", "boft_bwd", "MAX_BLOCK"]

#: largest block size s the kernels take (padded to a power of two): the stage algebra and the
#: chain hold (64, 64) fp32 matrices in registers; a 128-row group would not fit them
MAX_BLOCK = 64
#: register elements of one ``_boft_cayley`` program (NBB = this / SP² blocks at a time)
CAYLEY_ELEMS = 2048
#: warps of a ``_boft_cayley`` program. Its Gauss–Jordan steps are serial, and each step's row and
#: column extractions are reductions: across warps they go through shared memory and a barrier
CAYLEY_WARPS = 4
#: most group matrices (all segments) that the one-program stage algebra builds in turn
ALGEBRA_ONE_GROUPS = 8


# --------------------------------------------------------------------------- kernels
#
# Compile cost (sm_90) is the design constraint here: the Gauss–Jordan Cayley
# inverse is the one big piece of code, so it lives in ONE small kernel
# (``_boft_cayley``: its only specialization is SP and the blocks' dtype, shared by
# every config, forward and backward); the other kernels only load its result.
# Stage/segment indices (a, L) and the split are runtime integers that are never
# specialized (``do_not_specialize``): Triton would otherwise compile a separate
# variant for a == 1 (a constant) and a == 0 (divisible by 16).

_NOSPEC = ["a", "L", "n_split", "a2", "L2", "gp2"]


@triton.jit
def _group_base(g, a, L, half):
    hi = g >> a
    mid = g & ((1 << a) - 1)
    return hi * (half << (a + L)) + mid * half


@triton.jit
def _group_channels(base, a, L, half, HP: tl.constexpr, GP: tl.constexpr):
    """Channels of the group's local basis l = tb·HP + low, and their validity."""
    l = tl.arange(0, GP)
    tb = l // HP
    low = l % HP
    valid = (low < half) & (tb < (1 << L))
    return base + low + tb * (half << a), valid


@triton.jit
def _cayley_blocks(blocks_ptr, sb0, sb1, sb2, sb3, m_ptr, j, n_blk, nb, s, cscale, NBB: tl.constexpr,
                   SP: tl.constexpr):
    """M = (I − Q)⁻¹ (fp32, SP×SP, identity padding) of the NBB blocks j = i·nb + β (of all
    stages; j >= n_blk masked), stored to the (m, nb, SP, SP) scratch."""
    i = j // nb
    beta = j % nb
    j3 = j[:, None, None]
    p3 = tl.arange(0, SP)[None, :, None]
    q3 = tl.arange(0, SP)[None, None, :]
    valid3 = (j3 < n_blk) & (p3 < s) & (q3 < s)
    boff = (i * sb0 + beta * sb1)[:, None, None]
    bb = tl.load(blocks_ptr + boff + p3 * sb2 + q3 * sb3, mask=valid3, other=0.0).to(tl.float32)
    bt = tl.load(blocks_ptr + boff + q3 * sb2 + p3 * sb3, mask=valid3, other=0.0).to(tl.float32)
    m = batched_inverse(skew_system(bb, bt, cscale, valid3, NBB, SP), s, NBB, SP)  # s steps: SP pads
    tl.store(m_ptr + (j3 * SP + p3) * SP + q3, m, mask=(j3 < n_blk) & (p3 < SP) & (q3 < SP))


@triton.jit(do_not_specialize=["n_blk"])
def _boft_cayley(blocks_ptr, sb0, sb1, sb2, sb3, m_ptr, n_blk, nb, s, cscale,
                 NBB: tl.constexpr, SP: tl.constexpr):
    """The Cayley scratch, NBB consecutive blocks a program (``_cayley_blocks``)."""
    _cayley_blocks(blocks_ptr, sb0, sb1, sb2, sb3, m_ptr, tl.program_id(0) * NBB + tl.arange(0, NBB), n_blk, nb,
                   s, cscale, NBB, SP)


@triton.jit
def _stage_map(nb, r, a, L, half, base, HP: tl.constexpr, SP: tl.constexpr, GP: tl.constexpr):
    """Stage i = a + r seen from the group's local basis l = tb·HP + low.

    Per l: the row ``(i·nb + β)·SP + pp`` of its block row in the Cayley scratch,
    its block within the group (bidx: tb without bit r), its position in the block
    (pp = 2·low + bit r of tb), its global block β, and whether l is a real channel.
    """
    i = a + r
    l = tl.arange(0, GP)
    tb = l // HP
    low = l % HP
    valid = (low < half) & (tb < (1 << L))
    bidx = ((tb >> (r + 1)) << r) | (tb & ((1 << r) - 1))
    pp = 2 * low + ((tb >> r) & 1)
    kap_i = half << i
    c = base + low + tb * (half << a)
    beta = (c // (2 * kap_i)) * (1 << i) + (c % kap_i) // half
    return (i * nb + beta) * SP + pp, bidx, pp, beta, valid


@triton.jit
def _stage_mat(m_ptr, nb, r, a, L, half, base, scale, TRANS,
               HP: tl.constexpr, SP: tl.constexpr, GP: tl.constexpr):
    """Stage a + r on one group, in its local basis (GP, GP) fp32: E = F on the real
    channels (F = scale·R + (1 − scale)·I = 2·scale·M + (1 − 2·scale)·I per block), 0
    elsewhere - gathered from the Cayley scratch by index math (no permutation dots);
    Eᵀ where ``TRANS`` (a runtime flag)."""
    row, bidx, pp, beta, valid = _stage_map(nb, r, a, L, half, base, HP, SP, GP)
    same = (bidx[:, None] == bidx[None, :]) & valid[:, None] & valid[None, :]
    off = tl.where(TRANS, row[None, :] * SP + pp[:, None], row[:, None] * SP + pp[None, :])
    m = tl.load(m_ptr + off, mask=same, other=0.0)
    l = tl.arange(0, GP)
    eye = tl.where(l[:, None] == l[None, :], 1.0, 0.0)
    return tl.where(same, (2.0 * scale) * m + (1.0 - 2.0 * scale) * eye, 0.0)


@triton.jit
def _segment_matrix(m_ptr, j_ptr, nb, m_st, LMAX, G_FULL, half, scale, g, seg,
                    HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr):
    """J = E_{a+L−1}···E_a (local basis, fp32 GP×GP) of group g of segment seg
    (a = seg·LMAX, L = min(LMAX, m − a)), stored at slot seg·G_FULL + g."""
    GP: tl.constexpr = NB * SP
    a = seg * LMAX
    L = tl.minimum(LMAX, m_st - a)
    n_groups = nb * (2 * half) // (half << L)
    if g < n_groups:
        base = _group_base(g, a, L, half)
        e = tl.arange(0, GP)
        j = _stage_mat(m_ptr, nb, 0, a, L, half, base, scale, False, HP, SP, GP)
        for t in range(1, L):
            j = tl.dot(_stage_mat(m_ptr, nb, t, a, L, half, base, scale, False, HP, SP, GP), j,
                       input_precision="ieee")
        off = (seg * G_FULL + g).to(tl.int64) * (GP * GP)
        tl.store(j_ptr + off + e[:, None] * GP + e[None, :], j)


@triton.jit(do_not_specialize=["m_st", "LMAX", "G_FULL"])
def _boft_segmat(m_ptr, j_ptr, nb, m_st, LMAX, G_FULL, half, scale,
                 HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr):
    """The group matrices (``_segment_matrix``): program (g, seg)."""
    _segment_matrix(m_ptr, j_ptr, nb, m_st, LMAX, G_FULL, half, scale, tl.program_id(0), tl.program_id(1),
                    HP, SP, NB)


@triton.jit(do_not_specialize=["n_blk", "m_st", "LMAX", "G_FULL", "n_segs"])
def _boft_algebra(blocks_ptr, sb0, sb1, sb2, sb3, m_ptr, j_ptr, n_blk, nb, s, cscale,
                  m_st, LMAX, G_FULL, n_segs, half, scale,
                  NBB: tl.constexpr, HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr):
    """Both stage-algebra launches in ONE program, where the whole algebra is small
    (``one_algebra_launch``: a host-bound call saves a launch): every block's Cayley
    factor in one batch, then every segment's group matrices one after the other. The
    barrier makes the factors this program stored visible to all of its threads."""
    _cayley_blocks(blocks_ptr, sb0, sb1, sb2, sb3, m_ptr, tl.arange(0, NBB), n_blk, nb, s, cscale, NBB, SP)
    tl.debug_barrier()
    for seg in range(n_segs):
        L = tl.minimum(LMAX, m_st - seg * LMAX)
        for g in range(nb * (2 * half) // (half << L)):
            _segment_matrix(m_ptr, j_ptr, nb, m_st, LMAX, G_FULL, half, scale, g, seg, HP, SP, NB)


@triton.jit
def _packed_slot(ch, half, a2, L2, gp2, TBS: tl.constexpr):
    """Where channel ch lives in segment (a2, L2)'s packed scratch: group g2's run of gp2
    slots, local index l2 = tb·TBS + low (TBS = HP: the inverse of ``_group_channels``; dense:
    TBS = s/2, no pad slots)."""
    j = ch // half
    low = ch - j * half
    g2 = ((j >> (a2 + L2)) << a2) | (j & ((1 << a2) - 1))
    return g2 * gp2 + ((j >> a2) & ((1 << L2) - 1)) * TBS + low


@triton.jit
def _stream_offsets(c_off, p, POST, s_pre, s_post, MODE: tl.constexpr, PACKED: tl.constexpr):
    """Element offsets of a group's (GP, BLOCK_P) tile: a (pre, C, post) tensor (c_off =
    ch·s_c), or a packed scratch (c_off = the slot, positions s_pre apart)."""
    if PACKED:
        pos = p * s_pre
    else:
        pos = pos_offsets(p, POST, s_pre, s_post, MODE)
    return c_off[:, None] + pos[None, :]


@triton.jit
def _load_stream(ptr, off, ch_valid, pm, TO: tl.constexpr, PACKED: tl.constexpr):
    """A (GP, BLOCK_P) tile as TO. Packed: contiguous runs masked along positions only (so the
    loads vectorize), the never-written pad slots then zeroed."""
    if PACKED:
        v = tl.load(ptr + off, mask=pm[None, :], other=0.0)
        v = tl.where(ch_valid[:, None], v, 0.0)
    else:
        v = tl.load(ptr + off, mask=ch_valid[:, None] & pm[None, :], other=0.0)
    return v.to(TO)


@triton.jit
def _apply(u, w, w0, w1, w2, SPLIT: tl.constexpr, X3: tl.constexpr, DOT: tl.constexpr, DOT_PREC: tl.constexpr,
           SHIFT: tl.constexpr = False):
    """The group matrix on a tile: W·u (GP, BLOCK_P); w0..w2 its split16 terms (SPLIT: 16-bit
    u) or hi/lo (X3: fp32 u, split here). ``SHIFT`` (X3): w0, w1 are the hi/lo of W − I, and
    W·u = u + (W − I)·u, u exact in the accumulator: the split's error (~2^-16 of |u|) then
    scales with ‖W − I‖, which keeps a small rotation's Δ = W·u − x accurate (without it the
    error is 2^-16 of |x| however small Δ)."""
    if SPLIT:
        y = dot_split16(w0, w1, w2, u)
    elif X3:
        uh, ul = hilo(u, DOT)
        acc = u if SHIFT else tl.zeros(u.shape, dtype=tl.float32)
        y = dot_x3(w0, w1, uh, ul, acc)
    else:
        y = tl.dot(w, u, input_precision=DOT_PREC)
    return y


@triton.jit
def _channel_offsets(g, ch, s_c, half, a2, L2, gp2, gw, HP: tl.constexpr, GP: tl.constexpr, PACKED: tl.constexpr,
                     OWN: tl.constexpr, HALF: tl.constexpr = 0):
    """Per local channel: its offset in a (pre, C, post) tensor (ch·s_c), or its slot in a
    packed scratch: this group's own run (OWN: the segment's input), or the slot in the
    next segment's layout (a2, L2, gp2) for an output.

    ``HALF`` > 0 (= s/2; ``BoftCfg.dense``): the scratch has no pad slots, a group's run is
    gw = s/2·2^L slots, l = tb·HP + low at tb·HALF + low. Its own run is read in HP-wide
    pieces that overlap by HP − HALF (the pad lanes read the next piece's slots; zeroed
    after the load), each contiguous and 16-byte aligned where gw and HALF allow."""
    if PACKED:
        if OWN:
            if HALF > 0:
                l = tl.arange(0, GP)
                off = g * gw + (l // HP) * HALF + l % HP
            else:
                off = g * GP + tl.arange(0, GP)
        else:
            off = _packed_slot(ch, half, a2, L2, gp2, HALF if HALF > 0 else HP)
    else:
        off = ch * s_c
    return off


@triton.jit(do_not_specialize=_NOSPEC)
def _boft_seg_fwd(
    j_ptr, sjg, sjr, rs_ptr, srs,
    u_ptr, su_pre, su_c, su_post, y_ptr, sy_pre, sy_c, sy_post, x0_ptr, s0_pre, s0_c, s0_post,
    NPOS, POST, n_tiles, n_split, a, L, half, a2, L2, gp2, gw,
    HAS_RESCALE: tl.constexpr, DIFF_FOLD: tl.constexpr, DIFF_LOAD: tl.constexpr,
    MODE: tl.constexpr, IDX64: tl.constexpr,
    HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr = False, DOT: tl.constexpr = tl.float32, X3: tl.constexpr = False,
    IN_PACKED: tl.constexpr = False, OUT_PACKED: tl.constexpr = False, HALF: tl.constexpr = 0,
):
    """One segment on group g: y = J·u per position tile. u is x (pre, C, post) or the packed scratch the
    previous segment wrote in this segment's layout; y is the output or the packed scratch
    in the next segment's layout (a2, L2, gp2)."""
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    base = _group_base(g, a, L, half)
    e = tl.arange(0, GP)
    w = tl.load(j_ptr + g * sjg + e[:, None] * sjr + e[None, :])
    ch, ch_valid = _group_channels(base, a, L, half, HP, GP)
    if HAS_RESCALE:  # diag(ρ)·J
        rho = tl.load(rs_ptr + ch * srs, mask=ch_valid, other=1.0).to(tl.float32)
        w = rho[:, None] * w
    if DIFF_FOLD:
        w = w - tl.where(e[:, None] == e[None, :], 1.0, 0.0)
    w0, w1, w2 = split16(w, u_ptr.dtype.element_ty, DOT, SPLIT)  # 16-bit u (x itself): oft.dot_split16
    # fp32 u: bf16 hi/lo of the matrix once, of u per tile (oft.dot_x3); of W − I (``_apply``'s
    # SHIFT) unless diff is folded in (W − I already)
    SHIFT: tl.constexpr = X3 and not DIFF_FOLD
    if X3:
        if SHIFT:
            w0, w1 = hilo(w - tl.where(e[:, None] == e[None, :], 1.0, 0.0), DOT)
        else:
            w0, w1 = hilo(w, DOT)
    if IDX64:
        ch = ch.to(tl.int64)
    u_c = _channel_offsets(g, ch, su_c, half, a2, L2, gp2, gw, HP, GP, IN_PACKED, True, HALF)
    y_c = _channel_offsets(g, ch, sy_c, half, a2, L2, gp2, gw, HP, GP, OUT_PACKED, False, HALF)
    if IDX64:
        u_c = u_c.to(tl.int64)
        y_c = y_c.to(tl.int64)
    for t in range(tl.program_id(1), n_tiles, n_split):
        p = t * BLOCK_P + tl.arange(0, BLOCK_P)
        if IDX64:
            p = p.to(tl.int64)
        pm = p < NPOS
        uo = _stream_offsets(u_c, p, POST, su_pre, su_post, MODE, IN_PACKED)
        y = _apply(_load_stream(u_ptr, uo, ch_valid, pm, DOT if SPLIT else tl.float32, IN_PACKED),
                   w, w0, w1, w2, SPLIT, X3, DOT, DOT_PREC, SHIFT)
        mask = ch_valid[:, None] & pm[None, :]
        if DIFF_LOAD:
            xo = ch[:, None] * s0_c + pos_offsets(p, POST, s0_pre, s0_post, MODE)[None, :]
            y -= tl.load(x0_ptr + xo, mask=mask, other=0.0).to(tl.float32)
        yo = _stream_offsets(y_c, p, POST, sy_pre, sy_post, MODE, OUT_PACKED)
        tl.store(y_ptr + yo, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_NOSPEC)
def _boft_seg_bwd(
    j_ptr, sjg, sjr,
    g_ptr, sg_pre, sg_c, sg_post, u_ptr, su_pre, su_c, su_post, gx_ptr, so_pre, so_c, so_post, part_ptr,
    NPOS, POST, n_tiles, n_split, n_groups, a, L, half, a2, L2, gp2, gw, m_ptr, gb_ptr, nb, cscale, scale,
    MODE: tl.constexpr, IDX64: tl.constexpr,
    HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr = False, DOT: tl.constexpr = tl.float32, X3: tl.constexpr = False,
    G_PACKED: tl.constexpr = False, U_PACKED: tl.constexpr = False, OUT_PACKED: tl.constexpr = False,
    CHAIN: tl.constexpr = False, HALF: tl.constexpr = 0,
):
    """One segment's backward on group g: gx = Jᵀ·G per tile and the
    partial Σ G·uᵀ of this program's positions. G and u: user tensors or packed scratch in
    this segment's layout; gx: the user's gx or packed scratch in the previous segment's
    layout (a2, L2, gp2).
    ``CHAIN`` (one program a group, n_split 1): the partial is the group's whole Pg, and the
    program runs its chain (``_group_chain``: g_blocks from M at m_ptr) instead of storing it."""
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    sp = tl.program_id(1)
    base = _group_base(g, a, L, half)
    e = tl.arange(0, GP)
    jm = tl.load(j_ptr + g * sjg + e[None, :] * sjr + e[:, None])  # Jᵀ
    # G and u of one 16-bit dtype (one segment: grad and x): oft.dot_split16, exact G·uᵀ products
    j0, j1, j2 = split16(jm, g_ptr.dtype.element_ty, DOT, SPLIT)
    if X3:  # an fp32 stream: bf16 hi/lo of the matrix once (oft.dot_x3)
        j0, j1 = hilo(jm, DOT)
    ch, ch_valid = _group_channels(base, a, L, half, HP, GP)
    if IDX64:
        ch = ch.to(tl.int64)
    g_c = _channel_offsets(g, ch, sg_c, half, a2, L2, gp2, gw, HP, GP, G_PACKED, True, HALF)
    u_c = _channel_offsets(g, ch, su_c, half, a2, L2, gp2, gw, HP, GP, U_PACKED, True, HALF)
    o_c = _channel_offsets(g, ch, so_c, half, a2, L2, gp2, gw, HP, GP, OUT_PACKED, False, HALF)
    if IDX64:
        g_c = g_c.to(tl.int64)
        u_c = u_c.to(tl.int64)
        o_c = o_c.to(tl.int64)
    acc = tl.zeros((GP, GP), dtype=tl.float32)
    for t in range(sp, n_tiles, n_split):
        p = t * BLOCK_P + tl.arange(0, BLOCK_P)
        if IDX64:
            p = p.to(tl.int64)
        pm = p < NPOS
        go = _stream_offsets(g_c, p, POST, sg_pre, sg_post, MODE, G_PACKED)
        uo = _stream_offsets(u_c, p, POST, su_pre, su_post, MODE, U_PACKED)
        gg = _load_stream(g_ptr, go, ch_valid, pm, DOT if SPLIT else tl.float32, G_PACKED)
        uu = _load_stream(u_ptr, uo, ch_valid, pm, DOT if SPLIT else tl.float32, U_PACKED)
        gx, acc = bwd_dots(gg, uu, jm, j0, j1, j2, acc, SPLIT, DOT_PREC, X3, DOT)  # diag-OFT's tile dots
        oo = _stream_offsets(o_c, p, POST, so_pre, so_post, MODE, OUT_PACKED)
        tl.store(gx_ptr + oo, gx.to(gx_ptr.dtype.element_ty), mask=ch_valid[:, None] & pm[None, :])
    if CHAIN:
        _group_chain(m_ptr, acc, gb_ptr, nb, g, a, L, half, cscale, scale, 0, L, HP, SP, GP)
    else:
        off = (sp * n_groups + g).to(tl.int64) * (GP * GP)
        tl.store(part_ptr + off + e[:, None] * GP + e[None, :], acc)


@triton.jit
def _group_chain(m_ptr, pg, gb_ptr, nb, g, a, L, half, cscale, scale, t_lo, t_hi,
                 HP: tl.constexpr, SP: tl.constexpr, GP: tl.constexpr):
    """g_blocks of the segment's stages t_lo <= t < t_hi on group g from its Pg = Σ G·uᵀ
    (GP, GP fp32), all in the group's local basis.

    Per stage t: P_t = ST·Pg·Preᵀ (Pre = E_{t−1}···E_0, ST = E_{t+1}ᵀ···E_{L−1}ᵀ), then
    gR = scale·P_t on the blocks and the Cayley chain gQ = 2·Mᵀ·gR·Mᵀ,
    gB = cscale·(gQ − gQᵀ) with the gathered M. Every product is one step X ← A·B of
    a single loop (one dot in the code: the compile stays small): steps k < t
    multiply by E_kᵀ on the right, the next L−1−t by E_rᵀ on the left (r from L−1
    down to t+1), the last two by Mᵀ on the left, then on the right (with gR masked
    in between)."""
    base = _group_base(g, a, L, half)
    s = 2 * half
    for t in range(t_lo, t_hi):
        row, bidx, pp, beta, valid = _stage_map(nb, t, a, L, half, base, HP, SP, GP)
        same = (bidx[:, None] == bidx[None, :]) & valid[:, None] & valid[None, :]
        mt = tl.load(m_ptr + row[None, :] * SP + pp[:, None], mask=same, other=0.0)  # Mᵀ of stage t
        x = pg
        for k in range(L + 1):
            right = k < t
            r = tl.where(right, k, L - 1 - (k - t))
            if k == L - 1:
                x = tl.where(same, scale * x, 0.0)  # gR
            if k < L - 1:
                f = _stage_mat(m_ptr, nb, r, a, L, half, base, scale, True, HP, SP, GP)
            else:
                f = mt
            right = right | (k == L)
            x = tl.dot(tl.where(right, x, f), tl.where(right, f, x), input_precision="ieee")
        g_b = cscale * (2.0 * x - tl.trans(2.0 * x))
        go = (((a + t) * nb + beta[:, None]).to(tl.int64) * s + pp[:, None]) * s + pp[None, :]
        tl.store(gb_ptr + go, g_b.to(gb_ptr.dtype.element_ty), mask=same)


@triton.jit(do_not_specialize=_NOSPEC)
def _boft_chain(
    m_ptr, part_ptr, gb_ptr,
    nb, n_split, n_groups, a, L, half, cscale, scale,
    HP: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr,
):
    """g_blocks of one group's stage (``_group_chain``; program (g, t): the stages' chains are
    independent, and one program's dots are a serial chain) from the sum of its split partials."""
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    t = tl.program_id(1)
    e = tl.arange(0, GP)
    pg = tl.zeros((GP, GP), dtype=tl.float32)
    for sp in range(n_split):
        off = (sp * n_groups + g).to(tl.int64) * (GP * GP)
        pg += tl.load(part_ptr + off + e[:, None] * GP + e[None, :])
    _group_chain(m_ptr, pg, gb_ptr, nb, g, a, L, half, cscale, scale, t, t + 1, HP, SP, GP)


# --------------------------------------------------------------------------- host side

class BoftCfg(NamedTuple):
    """Launch parameters: ``max_group``: largest channel group a segment may use
    (decides how many stages are fused; a single stage always runs),
    ``block_p``/``bwd_block_p``: positions per tile, ``split``: programs per group
    along the positions (0 = automatic: one wave, ``auto_split``), ``dot_prec``: input_precision of
    the streaming fp32 dots, or ``"split16"`` / ``"bf16x3"`` (see the module docstring),
    ``chain_warps``: warps of the group-matrix and chain launches (0 = automatic: GP²/512,
    4 to 8), ``dense``: packed scratch without pad slots where s/2 is not a power of two (rows
    of C slots, not n_groups·GP: 3/4 of the bytes at s = 24; ``_channel_offsets``; measured
    faster at the bench shapes, a tie where there are no pad slots)."""
    max_group: int = 32
    block_p: int = 128
    bwd_block_p: int = 64
    split: int = 0
    num_warps: int = 4
    num_stages: int = 2
    dot_prec: str = "tf32x3"
    chain_warps: int = 0
    dense: bool = True


def default_boft_cfg(s: int) -> BoftCfg:
    """The launcher's default for block size s: ``BoftCfg``'s tiles, shrunk where a one-stage
    group (2·pow2(s/2) rows: 64 past s = 32) would stream more than the tuner's
    ``STREAM_TILE_MAX`` fp32 elements (the backward streams two tiles)."""
    rows, dflt = 2 * next_pow2(s // 2), BoftCfg()
    return dflt._replace(block_p=min(dflt.block_p, STREAM_TILE_MAX // rows),
                         bwd_block_p=min(dflt.bwd_block_p, STREAM_TILE_MAX // (2 * rows)))


def chain_warps(requested: int, GP: int) -> int:
    """Warps of the (GP, GP) IEEE stage-algebra launches (``requested``: a config's
    ``chain_warps``, 0 = auto): about 16 matrix elements per thread, 4 to 8 warps (at
    GP = 64, 8 warps measured about twice as fast as 16). The work model takes this rule."""
    return requested or max(4, min(8, GP * GP // 512))


#: resident streaming programs per SM that the automatic split aims at (``auto_split``)
WAVE = 3


def auto_split(n_groups: int, n_sm: int) -> int:
    """Programs per channel group along the positions: one wave of about ``WAVE`` resident
    programs per SM (measured faster than a 4-per-SM wave at the bench shapes, forward and
    backward)."""
    return wave_split(n_groups, n_sm, WAVE)


class _Seg(NamedTuple):
    a: int
    L: int
    NB: int
    n_groups: int
    split: int


@functools.lru_cache(maxsize=4096)
def _plan(m, nb, s, npos, n_sm, bwd, cfg: BoftCfg):
    half = s // 2
    HP = next_pow2(half)
    SP = 2 * HP
    if SP > MAX_BLOCK:
        raise ValueError(f"lycoris triton boft: block size s={s} exceeds the fused limit {MAX_BLOCK}")
    lmax = 1
    while (1 << (lmax + 1)) * HP <= cfg.max_group:
        lmax += 1
    bp = cfg.bwd_block_p if bwd else cfg.block_p
    n_tiles = cdiv(npos, bp)
    C = nb * s
    segs = []
    a = 0
    while a < m:
        L = min(lmax, m - a)
        GP = max(16, (1 << L) * HP)
        n_groups = C // (half << L)
        split = cfg.split or auto_split(n_groups, n_sm)
        segs.append(_Seg(a, L, GP // SP, n_groups, max(1, min(split, n_tiles))))
        a += L
    return HP, SP, bp, n_tiles, tuple(segs)


def _prep(blocks, x, axis, cfg, bwd):
    if x.dtype == torch.float64 or blocks.dtype == torch.float64:
        raise ValueError("lycoris triton boft: float64 is not fused (eager only)")
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    ax = axis % x.dim()
    x, pre, post, xs = positions_view(x, ax)
    return m, nb, s, ax, x, pre, post, xs, _plan(m, nb, s, pre * post, num_sms(x.device), bwd, cfg)


def one_algebra_launch(n_blk: int, SP: int, n_groups_total: int) -> bool:
    """Whether the stage algebra runs as one program (``_boft_algebra``): all Cayley
    factors fit one ``_boft_cayley`` program's batch and at most ``ALGEBRA_ONE_GROUPS``
    group matrices are built one after the other. Such calls are host-bound (docs/ops.md's
    host budget: 2× one ``torch.add``), so one launch fewer counts."""
    return next_pow2(n_blk) * SP * SP <= CAYLEY_ELEMS and n_groups_total <= ALGEBRA_ONE_GROUPS


def _stage_algebra(blocks, cscale, scale, HP, SP, segs, warps):
    """(M, J, G0): the Cayley factors of every block of every stage, (m, nb, SP, SP) fp32, and
    the group matrices of every segment, (slots, GP0, GP0) fp32 (segment idx's groups at slots
    idx·G0 + g; GP0, G0: the first (largest) segment's group size and count; a shorter last
    segment uses the top-left corner of its slots). Two launches (``_boft_cayley``: NBB blocks
    a program; ``_boft_segmat``: a program a group), or one (``one_algebra_launch``)."""
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    n_blk = m * nb
    mbuf = torch.empty((m, nb, SP, SP), device=blocks.device, dtype=torch.float32)
    NB = segs[0].NB
    GP = NB * SP
    g_full = segs[0].n_groups
    jbuf = torch.empty(((len(segs) - 1) * g_full + segs[-1].n_groups, GP, GP), device=blocks.device,
                       dtype=torch.float32)
    if one_algebra_launch(n_blk, SP, sum(sg.n_groups for sg in segs)):
        fast(_boft_algebra)[(1,)](blocks, *blocks.stride(), mbuf, jbuf, n_blk, nb, s, float(cscale), m, segs[0].L,
                                  g_full, len(segs), s // 2, float(scale), NBB=next_pow2(n_blk), HP=HP, SP=SP,
                                  NB=NB, num_warps=warps)
        return mbuf, jbuf, g_full
    nbb = max(1, CAYLEY_ELEMS // (SP * SP))
    fast(_boft_cayley)[(cdiv(n_blk, nbb),)](blocks, *blocks.stride(), mbuf, n_blk, nb, s, float(cscale),
                                      NBB=nbb, SP=SP, num_warps=CAYLEY_WARPS)
    fast(_boft_segmat)[(max(sg.n_groups for sg in segs), len(segs))](
        mbuf, jbuf, nb, m, segs[0].L, g_full, s // 2, float(scale), HP=HP, SP=SP, NB=NB, num_warps=warps)
    return mbuf, jbuf, g_full


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, cfg: Optional[BoftCfg] = None):
    """BOFT butterfly (docs/ops.md §2.6.1, see ``reference.boft.boft_fwd``): the Cayley factors and the
    group matrices (two small launches), then one streaming kernel per segment (one in all when
    ``2^(m−1)·s`` fits a group)."""
    cfg = cfg or default_boft_cfg(int(blocks.shape[2]))
    m, nb, s, ax, x, pre, post, xs, (HP, SP, bp, n_tiles, segs) = _prep(blocks, x, axis, cfg, False)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    prec = _dot_prec(cfg, x)
    C = nb * s
    npos = pre * post
    ys = (C * post, post, 1)
    mode, xa, xb = pos_mode(pre, post, xs)
    _, ya, yb = pos_mode(pre, post, ys)
    dense = s // 2 if cfg.dense else 0
    gps, widths = _packed_widths(segs, SP, dense)
    idx64 = needs_idx64((tuple(x.shape), x.stride()), (tuple(y.shape), y.stride()),
                        ((npos * max(widths) + _scratch_extra(segs, SP, dense),), (1,)))
    common = dict(MODE=mode, IDX64=idx64, HP=HP, SP=SP, BLOCK_P=bp, HALF=dense, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    # between segments: packed fp32 scratch in the consumer's layout, two buffers in turn
    bufs = [_scratch(npos, max(widths[1:]), SP, segs, dense, x.device) for _ in range(min(2, len(segs) - 1))]
    with device_guard(x):
        mbuf, jbuf, g_full = _stage_algebra(blocks, cscale, scale, HP, SP, segs,
                                            chain_warps(cfg.chain_warps, segs[0].NB * SP))
        rs, srs = (rescale.reshape(-1), rescale.reshape(-1).stride(0)) if rescale is not None else (jbuf, 0)
        GPJ = jbuf.shape[-1]
        for idx, sg in enumerate(segs):
            first, last = idx == 0, idx == len(segs) - 1
            src = (x, xa, xs[1], xb) if first else (bufs[(idx - 1) % len(bufs)], widths[idx], 0, 0)
            dst = (y, ya, ys[1], yb) if last else (bufs[idx % len(bufs)], widths[idx + 1], 0, 0)
            nxt = (0, 0, 0) if last else (segs[idx + 1].a, segs[idx + 1].L, gps[idx + 1])
            fast(_boft_seg_fwd)[(sg.n_groups, sg.split)](
                jbuf[idx * g_full:], GPJ * GPJ, GPJ, *((rs, srs) if last else (jbuf, 0)), *src, *dst,
                x, xa, xs[1], xb,
                npos, post, n_tiles, sg.split, sg.a, sg.L, s // 2, *nxt, gps[idx],
                HAS_RESCALE=last and rescale is not None, DIFF_FOLD=first and last and diff,
                DIFF_LOAD=(not first) and last and diff, NB=sg.NB, IN_PACKED=not first, OUT_PACKED=not last,
                **dot_mode(prec, src[0]), **common)
    return y


def _dot_prec(cfg, x):
    """The config's dot precision; bf16x3 only for a 16-bit x (its ~2^-16 error is below a
    16-bit output's rounding, not an fp32 one's): tf32x3 for fp32."""
    return cfg.dot_prec if cfg.dot_prec != BF16X3 or x.dtype in _HALF else "tf32x3"


@functools.lru_cache(maxsize=4096)
def _packed_widths(segs, SP, half: int = 0):
    """Per segment: its group width in slots and the row width (n_groups·that) of its packed
    input scratch (one row per position): GP (pad slots of a group are never written), or
    dense (``half`` = s/2 > 0) s/2·2^L, rows of C slots. Cached with ``_plan``'s segments: the
    launchers ask on every call."""
    gps = tuple((half << sg.L) if half else sg.NB * SP for sg in segs)
    return gps, tuple(sg.n_groups * gp for sg, gp in zip(segs, gps))


def _scratch_extra(segs, SP: int, half: int) -> int:
    """Slots past a dense scratch's last row (2·GP): a group's own-run pieces read up to GP + HP
    slots past its end (``_channel_offsets``); none for the padded one."""
    return 2 * max(sg.NB for sg in segs) * SP if half else 0


def _scratch(npos: int, width: int, SP: int, segs, half: int, device) -> torch.Tensor:
    """A packed fp32 scratch of ``npos`` rows of ``width`` slots (and ``_scratch_extra``)."""
    return torch.empty(npos * width + _scratch_extra(segs, SP, half), device=device, dtype=torch.float32)


def _buf_strides(pre, C, post, mode):
    """(s_pre', s_c, s_post') of a contiguous (pre, C, post) buffer for ``pos_offsets``."""
    _, a, b = pos_mode(pre, post, (C * post, post, 1))
    return a, post, b


def boft_bwd(grad, blocks, x, axis, cscale, scale, cfg: Optional[BoftCfg] = None):
    """Gradients of the plain chain (docs/ops.md §2.6.2, see ``reference.boft.boft_bwd``).

    Returns gx (x's shape and dtype) and g_blocks (blocks' shape and dtype)."""
    cfg = cfg or default_boft_cfg(int(blocks.shape[2]))
    m, nb, s, ax, x, pre, post, xs, (HP, SP, bp, n_tiles, segs) = _prep(blocks, x, axis, cfg, True)
    dev = x.device
    gx = torch.empty(x.shape, device=dev, dtype=x.dtype)
    g_blocks = torch.empty(blocks.shape, device=dev, dtype=blocks.dtype)
    if blocks.numel() == 0:
        return gx, g_blocks
    prec = _dot_prec(cfg, x)
    C = nb * s
    npos = pre * post
    grad, _, _, gs = positions_view(grad, ax)
    mode, xa, xb = pos_mode(pre, post, xs)
    _, ga, gb = pos_mode(pre, post, gs)
    os_ = _buf_strides(pre, C, post, mode)  # gx: contiguous (pre, C, post)
    half = s // 2
    dense = half if cfg.dense else 0
    gps, widths = _packed_widths(segs, SP, dense)
    idx64 = needs_idx64((tuple(x.shape), x.stride()), (tuple(grad.shape), grad.stride()),
                        (tuple(gx.shape), gx.stride()),
                        ((npos * max(widths) + _scratch_extra(segs, SP, dense),), (1,)))
    common = dict(MODE=mode, IDX64=idx64, HP=HP, SP=SP, HALF=dense, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    # small (the stage algebra in one program): a segment split in one program a group also
    # runs its chain in the streaming kernel, so a tiny backward is two launches
    small = one_algebra_launch(m * nb, SP, sum(sg.n_groups for sg in segs))
    with device_guard(x):
        mbuf, jbuf, g_full = _stage_algebra(blocks, cscale, scale, HP, SP, segs,
                                            chain_warps(cfg.chain_warps, segs[0].NB * SP))
        GPJ = jbuf.shape[-1]
        # segment inputs (computed once; x itself for the first segment), by the forward's
        # streaming kernel at block_p (the same compiled kernels as boft_fwd's passes), each
        # packed in its segment's layout
        _, _, fbp, f_tiles, fsegs = _plan(m, nb, s, npos, num_sms(x.device), False, cfg)
        inputs = [(x, xa, xs[1], xb)]
        for idx, sg in enumerate(fsegs[:-1]):
            buf = _scratch(npos, widths[idx + 1], SP, segs, dense, dev)
            fast(_boft_seg_fwd)[(sg.n_groups, sg.split)](
                jbuf[idx * g_full:], GPJ * GPJ, GPJ, jbuf, 0, *inputs[-1], buf, widths[idx + 1], 0, 0,
                x, xa, xs[1], xb, npos, post, f_tiles, sg.split, sg.a, sg.L, half,
                fsegs[idx + 1].a, fsegs[idx + 1].L, gps[idx + 1], gps[idx],
                HAS_RESCALE=False, DIFF_FOLD=False, DIFF_LOAD=False, NB=sg.NB, BLOCK_P=fbp,
                IN_PACKED=idx > 0, OUT_PACKED=True, **dot_mode(prec, inputs[-1][0]), **common)
            inputs.append((buf, widths[idx + 1], 0, 0))
        g_in = (grad, ga, gs[1], gb)
        last = len(segs) - 1
        # the gradient between segments: packed in the previous segment's layout, two buffers in turn
        gbufs = [_scratch(npos, max(widths[:-1]), SP, segs, dense, dev) for _ in range(min(2, last))]
        for idx in range(last, -1, -1):
            sg = segs[idx]
            GP = sg.NB * SP  # the tile width (gps: the scratch group width, smaller when dense)
            if idx == 0:
                out, prev = (gx,) + os_, (0, 0, 0)
            else:
                out, prev = (gbufs[idx % len(gbufs)], widths[idx - 1], 0, 0), (segs[idx - 1].a, segs[idx - 1].L,
                                                                              gps[idx - 1])
            # a small call with one program a group: its chain runs in the streaming program
            chain_in = small and sg.split == 1
            part = g_blocks if chain_in else torch.empty((sg.split, sg.n_groups, GP, GP), device=dev,
                                                         dtype=torch.float32)
            fast(_boft_seg_bwd)[(sg.n_groups, sg.split)](
                jbuf[idx * g_full:], GPJ * GPJ, GPJ, *g_in, *inputs[idx], *out, part,
                npos, post, n_tiles, sg.split, sg.n_groups, sg.a, sg.L, half, *prev, gps[idx],
                mbuf, g_blocks, nb, float(cscale), float(scale), NB=sg.NB, BLOCK_P=bp,
                G_PACKED=idx < last, U_PACKED=idx > 0, OUT_PACKED=idx > 0, CHAIN=chain_in,
                **dot_mode(prec, g_in[0], inputs[idx][0]), **common)
            if not chain_in:
                fast(_boft_chain)[(sg.n_groups, sg.L)](
                    mbuf, part, g_blocks, nb, sg.split, sg.n_groups, sg.a, sg.L, half,
                    float(cscale), float(scale), HP=HP, SP=SP, NB=sg.NB, num_warps=chain_warps(cfg.chain_warps, GP))
            g_in = out
    return gx, g_blocks
