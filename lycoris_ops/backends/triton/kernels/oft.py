"""Triton kernels of diag-OFT (docs/ops.md §2.5): ``oft_fwd`` and ``oft_bwd``.

Written from the math (``reference/oft.py`` is the oracle, same numerics).
Per block k: ``Q_k = cscale·(B_k − B_kᵀ)``, ``M_k = (I − Q_k)⁻¹``, ``R_k = 2M_k − I``
(the Cayley transform), ``F_k = diag(ρ_k)·R_kᵀ − shift·I``, applied to the
S-channel slab of every column (weight=True: x (K·S, L)) or token / position
(weight=False: (T, K·S) channels last, or (N, K·S, *spatial) channels on dim 1).

Geometry: x is seen as (pre, C, post) with C = K·S the rotated axis; the
*positions* are the pre·post (column / token / pixel) indices. A program owns a
*group* of NB consecutive blocks (GP = NB·SP channel rows, SP = S padded to a
power of two, NB chosen so GP >= 16 for ``tl.dot`` — 32 when the channels are
the contiguous axis, for coalescing) and a share of the positions (as many shares
per group as fill one wave of resident programs: ``auto_split``).

Cayley in registers: every program rebuilds the fp32 Cayley factors of its
blocks from the fp32-upcast raw blocks before it streams (``cayley.cayley_m``:
batched Gauss–Jordan, SP serial steps; or, ``neumann`` and the forward's default,
a product series of a few fp32 dots with a computed stopping rule, Gauss–Jordan
only where it does not converge); R is never written to memory and no scratch
holds it. The position loop amortizes the rebuild; the memory idles during it,
which is why the forward's default takes the series (half the rebuild time).

Passes:

``oft_fwd`` — ONE kernel: rebuild F, then stream x once (read) and the output
    once (write): ``Y = F·X`` per (GP × BLOCK_P) tile (fp32 ``tl.dot``), shift
    and rescale folded into F, one rounding at the store.
``oft_bwd`` — TWO kernels:
    1. stream: rebuild F, read G and x once, write gx = Fᵀ·G and accumulate
       ``P = Σ G·Xᵀ`` (dL/dF, fp32) over the program's positions; the partial P
       of each (group, position split) goes to a small fp32 scratch
       (split × groups × GP × GP; deterministic, no atomics).
    2. chain (one program per group, tiny): sum the partials, rebuild M and R,
       ``g_rescale = rowsum(P ⊙ Rᵀ)``, ``gR = (diag(ρ)·P)ᵀ``,
       ``gQ = 2·Mᵀ·gR·Mᵀ``, ``g_blocks = cscale·(gQ − gQᵀ)`` (cscale constant),
       stored in blocks' dtype.

Dots: the streaming dots on fp32 tiles use ``input_precision`` from the config
(default ``"tf32x3"``: tensor cores at ~fp32 accuracy, ~1e-6 relative); the
Cayley algebra uses IEEE fp32. ``dot_prec="split16"`` with 16-bit operands: x
(and G) are exact in their 16-bit dtype, so F is split once per program into
three 16-bit terms and each tile takes three 16-bit dots (``dot_split16``), and
the backward's G·xᵀ one, all exact products with fp32 accumulation, instead of
tf32x3's split of both operands on every tile.

Layout: any strides. Pre and post dims are each collapsed to one strided run;
an x / grad whose pre or post dims do not collapse (rare) is read from a
contiguous copy.

Scope: S <= 64 (SP = pow2(S) <= 64; the series only up to ``NEUMANN_MAX_BLOCK``);
float16 / bfloat16 / float32 operands (fp64 goes to eager).
Calls arrive validated by ``check_oft_*`` and inside ``lycoris_ops.backends.scope`` (the op
set's contract); the launchers do not re-validate.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import (cdiv, collapse_one, device_guard, dot_dtype, fast, needs_idx64, next_pow2, num_sms)
from lycoris_ops.backends.triton.kernels.cayley import cayley_grad, cayley_m

__all__ = ["OftCfg", "FWD_CFG", "oft_fwd", "oft_bwd", "MAX_BLOCK", "positions_view", "auto_split"]

#: largest block size S the kernels take (padded to a power of two)
MAX_BLOCK = 64


# --------------------------------------------------------------------------- kernels

@triton.jit
def pos_offsets(p, POST, s_pre, s_post, MODE: tl.constexpr):
    """Element offsets of flat positions p = pre_index·POST + post_index.
    MODE 0: one axis only (offset p·s_pre, the caller passes the live stride);
    MODE 1: both (div/mod by POST)."""
    if MODE == 0:
        off = p * s_pre
    else:
        off = (p // POST) * s_pre + (p % POST) * s_post
    return off


@triton.jit
def _oft_group(blocks_ptr, sbk, sbp, sbq, rs_ptr, srs, K, S, cscale, g,
               HAS_RESCALE: tl.constexpr, NB: tl.constexpr, SP: tl.constexpr, NEUMANN: tl.constexpr = False):
    """Channel rows of group g and its Cayley factor M (block-diagonal (GP, GP); ``cayley_m``).
    Returns (ch, ch_valid, rho, M, same): ``same`` marks the entries (l, l') of one real block."""
    GP: tl.constexpr = NB * SP
    l = tl.arange(0, GP)
    b = l // SP
    pin = l % SP
    k = g * NB + b
    ch_valid = (pin < S) & (k < K)
    ch = k * S + pin
    n3 = tl.arange(0, NB)[:, None, None]
    p3 = tl.arange(0, SP)[None, :, None]
    q3 = tl.arange(0, SP)[None, None, :]
    k3 = g * NB + n3
    valid = (p3 < S) & (q3 < S) & (k3 < K)
    bb = tl.load(blocks_ptr + k3 * sbk + p3 * sbp + q3 * sbq, mask=valid, other=0.0).to(tl.float32)
    bt = tl.load(blocks_ptr + k3 * sbk + q3 * sbp + p3 * sbq, mask=valid, other=0.0).to(tl.float32)
    m = cayley_m(bb, bt, cscale, valid, NB, SP, NEUMANN)
    if HAS_RESCALE:
        rho = tl.load(rs_ptr + ch * srs, mask=ch_valid, other=1.0).to(tl.float32)
    else:
        rho = tl.full((GP,), 1.0, tl.float32)
    same = (b[:, None] == b[None, :]) & ch_valid[:, None] & ch_valid[None, :]
    return ch, ch_valid, rho, m, same


@triton.jit
def _oft_f(m, rho, shift, GP: tl.constexpr):
    """F = diag(ρ)·Rᵀ − shift·I with Rᵀ = 2Mᵀ − I."""
    l = tl.arange(0, GP)
    eye = tl.where(l[:, None] == l[None, :], 1.0, 0.0)
    return rho[:, None] * (2.0 * tl.trans(m) - eye) - shift * eye


@triton.jit
def split16(f, D: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr):
    """fp32 ``f`` as three terms of the 16-bit dtype D, f ≈ f0 + f1 + f2 (each the rounding
    of what the earlier ones left: 24 significant bits in bf16), as dot operands of dtype
    DOT (D itself; fp32 under the interpreter, whose bf16 dots are wrong: exact). Not
    SPLIT: (f, f, f), unused."""
    if SPLIT:
        t0 = f.to(D)
        r = f - t0.to(tl.float32)
        t1 = r.to(D)
        f2 = (r - t1.to(tl.float32)).to(D).to(DOT)
        f0 = t0.to(DOT)
        f1 = t1.to(DOT)
    else:
        f0 = f
        f1 = f
        f2 = f
    return f0, f1, f2


@triton.jit
def dot_split16(f0, f1, f2, x):
    """``(f0 + f1 + f2)·x`` for a 16-bit x: three 16-bit tensor-core dots, fp32 accumulated,
    smallest term first. Every product of two 16-bit values is exact in fp32, so this is
    the fp32 product F·x to fp32 accumulation (no per-tile split of x: it is exact)."""
    acc = tl.dot(f2, x)
    acc = tl.dot(f1, x, acc)
    return tl.dot(f0, x, acc)


@triton.jit
def hilo(f, DOT: tl.constexpr):
    """fp32 ``f`` as bf16 ``hi + lo`` (16 significant bits; bf16 keeps fp32's range), as dot
    operands of dtype DOT (bf16; fp32 under the interpreter: the same values)."""
    h = f.to(tl.bfloat16)
    lo = (f - h.to(tl.float32)).to(tl.bfloat16)
    return h.to(DOT), lo.to(DOT)


@triton.jit
def dot_x3(ah, al, bh, bl, acc):
    """``acc + (ah + al)·(bh + bl)`` without ``al·bl``: three bf16 tensor-core dots, fp32
    accumulated, small terms first (relative error ~2^-16, against tf32x3's six tf32 dots)."""
    acc = tl.dot(al, bh, acc)
    acc = tl.dot(ah, bl, acc)
    return tl.dot(ah, bh, acc)


@triton.jit
def bwd_dots(gg, x, ft, f0, f1, f2, acc, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, X3: tl.constexpr = False,
             DOT: tl.constexpr = tl.float32):
    """The dots of one backward position tile: ``(Fᵀ·G, acc + G·xᵀ)`` (fp32): split16 (gg and
    x already of the 16-bit dot dtype, f0..f2 the terms of Fᵀ), bf16x3 (X3: fp32 gg and x
    split per tile, f0/f1 the hi/lo of Fᵀ) or fp32 dots."""
    if SPLIT:
        gx = dot_split16(f0, f1, f2, gg)
        acc = tl.dot(gg, tl.trans(x), acc)
    elif X3:
        gh, gl = hilo(gg, DOT)
        xh, xl = hilo(x, DOT)
        gx = dot_x3(f0, f1, gh, gl, tl.zeros(gg.shape, dtype=tl.float32))
        acc = dot_x3(gh, gl, tl.trans(xh), tl.trans(xl), acc)
    else:
        gx = tl.dot(ft, gg, input_precision=DOT_PREC)
        acc = tl.dot(gg, tl.trans(x), acc, input_precision=DOT_PREC)
    return gx, acc


@triton.jit
def bwd_tile(g_ptr, go, x_ptr, xo, mask, ft, f0, f1, f2, acc, SPLIT: tl.constexpr, DOT: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """One position tile of a backward stream (diag-OFT): loads G and x, then ``bwd_dots``."""
    if SPLIT:
        gg = tl.load(g_ptr + go, mask=mask, other=0.0).to(DOT)
        x = tl.load(x_ptr + xo, mask=mask, other=0.0).to(DOT)
    else:
        gg = tl.load(g_ptr + go, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    return bwd_dots(gg, x, ft, f0, f1, f2, acc, SPLIT, DOT_PREC)


@triton.jit
def _oft_fwd_kernel(
    blocks_ptr, sbk, sbp, sbq, rs_ptr, srs,
    x_ptr, sx_pre, sx_c, sx_post, y_ptr, sy_pre, sy_c, sy_post,
    K, S, NPOS, POST, n_tiles, n_split, cscale, shift,
    HAS_RESCALE: tl.constexpr, MODE: tl.constexpr, IDX64: tl.constexpr,
    NB: tl.constexpr, SP: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr = False, DOT: tl.constexpr = tl.float32, NEUMANN: tl.constexpr = False,
):
    """y = F·x per position tile of group g, F rebuilt from the group's blocks first."""
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    ch, ch_valid, rho, m, same = _oft_group(blocks_ptr, sbk, sbp, sbq, rs_ptr, srs, K, S, cscale, g,
                                            HAS_RESCALE, NB, SP, NEUMANN)
    f = _oft_f(m, rho, shift, GP)
    f0, f1, f2 = split16(f, x_ptr.dtype.element_ty, DOT, SPLIT)  # 16-bit x: three terms of F (dot_split16)
    if IDX64:
        ch = ch.to(tl.int64)
    for t in range(tl.program_id(1), n_tiles, n_split):
        p = t * BLOCK_P + tl.arange(0, BLOCK_P)
        if IDX64:
            p = p.to(tl.int64)
        mask = ch_valid[:, None] & (p < NPOS)[None, :]
        xo = ch[:, None] * sx_c + pos_offsets(p, POST, sx_pre, sx_post, MODE)[None, :]
        if SPLIT:
            y = dot_split16(f0, f1, f2, tl.load(x_ptr + xo, mask=mask, other=0.0).to(DOT))
        else:
            x = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
            y = tl.dot(f, x, input_precision=DOT_PREC)
        yo = ch[:, None] * sy_c + pos_offsets(p, POST, sy_pre, sy_post, MODE)[None, :]
        tl.store(y_ptr + yo, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _oft_bwd_stream(
    blocks_ptr, sbk, sbp, sbq, rs_ptr, srs,
    g_ptr, sg_pre, sg_c, sg_post, x_ptr, sx_pre, sx_c, sx_post, gx_ptr, so_pre, so_c, so_post, part_ptr,
    K, S, NPOS, POST, n_tiles, n_split, n_groups, cscale, shift, gb_ptr, gr_ptr,
    HAS_RESCALE: tl.constexpr, MODE: tl.constexpr, IDX64: tl.constexpr,
    NB: tl.constexpr, SP: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr = False, DOT: tl.constexpr = tl.float32, NEUMANN: tl.constexpr = False,
    CHAIN: tl.constexpr = False,
):
    """gx = Fᵀ·G per tile of this program's positions and its partial Σ G·xᵀ (part_ptr).
    ``CHAIN`` (one program a group and one tile: a small call): the partial is the group's
    whole sum, and the program stores g_blocks / g_rescale itself (``_oft_chain_store``)."""
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    sp = tl.program_id(1)
    ch, ch_valid, rho, m, same = _oft_group(blocks_ptr, sbk, sbp, sbq, rs_ptr, srs, K, S, cscale, g,
                                            HAS_RESCALE, NB, SP, NEUMANN)
    ft = tl.trans(_oft_f(m, rho, shift, GP))
    # G and x of one 16-bit dtype: Fᵀ in three terms; the products of G·xᵀ are exact in fp32
    f0, f1, f2 = split16(ft, g_ptr.dtype.element_ty, DOT, SPLIT)
    if IDX64:
        ch = ch.to(tl.int64)
    acc = tl.zeros((GP, GP), dtype=tl.float32)
    for t in range(sp, n_tiles, n_split):
        p = t * BLOCK_P + tl.arange(0, BLOCK_P)
        if IDX64:
            p = p.to(tl.int64)
        mask = ch_valid[:, None] & (p < NPOS)[None, :]
        go = ch[:, None] * sg_c + pos_offsets(p, POST, sg_pre, sg_post, MODE)[None, :]
        xo = ch[:, None] * sx_c + pos_offsets(p, POST, sx_pre, sx_post, MODE)[None, :]
        oo = ch[:, None] * so_c + pos_offsets(p, POST, so_pre, so_post, MODE)[None, :]
        gx, acc = bwd_tile(g_ptr, go, x_ptr, xo, mask, ft, f0, f1, f2, acc, SPLIT, DOT, DOT_PREC)
        tl.store(gx_ptr + oo, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    if CHAIN:
        _oft_chain_store(acc, m, rho, same, ch, ch_valid, gb_ptr, gr_ptr, g, S, cscale, HAS_RESCALE, NB, SP)
    else:
        l = tl.arange(0, GP)
        base = (sp * n_groups + g).to(tl.int64) * (GP * GP)
        tl.store(part_ptr + base + l[:, None] * GP + l[None, :], acc)


@triton.jit
def _oft_chain_store(pp, m, rho, same, ch, ch_valid, gb_ptr, gr_ptr, g, S, cscale,
                     HAS_RESCALE: tl.constexpr, NB: tl.constexpr, SP: tl.constexpr):
    """g_blocks (and g_rescale) of group g from its Σ G·xᵀ (GP, GP fp32): dL/dF_k on the
    diagonal blocks, the rescale's gradient, and the Cayley chain (``cayley_grad``)."""
    GP: tl.constexpr = NB * SP
    l = tl.arange(0, GP)
    pp = tl.where(same, pp, 0.0)                                  # dL/dF_k, block-diagonal
    eye = tl.where(l[:, None] == l[None, :], 1.0, 0.0)
    if HAS_RESCALE:
        rt = 2.0 * tl.trans(m) - eye                              # Rᵀ
        g_rs = tl.sum(pp * rt, axis=1)
        tl.store(gr_ptr + ch, g_rs.to(gr_ptr.dtype.element_ty), mask=ch_valid)
    g_r = tl.trans(rho[:, None] * pp)
    g_b = cayley_grad(g_r, m, cscale)
    b = l // SP
    pin = l % SP
    k = g * NB + b
    go = k[:, None] * (S * S) + pin[:, None] * S + pin[None, :]
    tl.store(gb_ptr + go, g_b.to(gb_ptr.dtype.element_ty), mask=same)


# n_split (the stream's programs per group) follows the config's tile; never specialized, so
# one compiled chain serves every config of a key (a cold key's tuning compiles each variant)
@triton.jit(do_not_specialize=["n_split"])
def _oft_bwd_chain(
    blocks_ptr, sbk, sbp, sbq, rs_ptr, srs, part_ptr, gb_ptr, gr_ptr,
    K, S, n_split, n_groups, cscale,
    HAS_RESCALE: tl.constexpr, NB: tl.constexpr, SP: tl.constexpr, NEUMANN: tl.constexpr = False,
):
    GP: tl.constexpr = NB * SP
    g = tl.program_id(0)
    ch, ch_valid, rho, m, same = _oft_group(blocks_ptr, sbk, sbp, sbq, rs_ptr, srs, K, S, cscale, g,
                                            HAS_RESCALE, NB, SP, NEUMANN)
    l = tl.arange(0, GP)
    pp = tl.zeros((GP, GP), dtype=tl.float32)
    for sp in range(n_split):
        base = (sp * n_groups + g).to(tl.int64) * (GP * GP)
        pp += tl.load(part_ptr + base + l[:, None] * GP + l[None, :])
    _oft_chain_store(pp, m, rho, same, ch, ch_valid, gb_ptr, gr_ptr, g, S, cscale, HAS_RESCALE, NB, SP)


# --------------------------------------------------------------------------- host side

class OftCfg(NamedTuple):
    """Launch parameters: ``block_p`` positions per tile, ``group``: minimum channel
    rows per program (>= 16; 0 = automatic: 32 when the channels are contiguous
    in memory, else 16), ``split``: programs per group along the positions
    (0 = automatic: one wave of resident programs, ``auto_split``), ``dot_prec``:
    input_precision of the streaming fp32 dots, or ``"split16"`` (16-bit operands:
    ``dot_split16``), ``neumann``: the Cayley factor by ``cayley.neumann_inverse`` where
    ‖Q‖ allows (a few dots instead of S serial elimination steps; ``cayley.cayley_m``)."""
    block_p: int = 128
    group: int = 0
    split: int = 0
    num_warps: int = 4
    num_stages: int = 2
    dot_prec: str = "tf32x3"
    bwd_block_p: int = 64
    chain_warps: int = 4
    neumann: bool = False


def default_oft_cfg() -> OftCfg:
    return OftCfg()


#: the forward launcher's default: the Cayley factor by ``neumann_inverse`` (the rebuild every
#: program does before it streams, about half Gauss-Jordan's time), one wave of its two
#: programs per SM (WAVE_NEUMANN), 3 stages, split16 dots at 16 bits (fp32 x: tf32x3);
#: measured faster than the Gauss-Jordan default at the bench shapes
FWD_CFG = OftCfg(num_stages=3, dot_prec="split16", neumann=True)
#: widest padded block the series rebuilds: at 64 its (64, 64) fp32 dots spill registers and
#: compile several times slower than the Gauss-Jordan loop (``bench/ptxas.py oft --block 64``)
NEUMANN_MAX_BLOCK = 32


def neumann_fits(S: int) -> bool:
    """Whether blocks of size S may rebuild their Cayley factor by the series (padded S up to
    ``NEUMANN_MAX_BLOCK``): the launcher's default and the tuner's shortlist both ask."""
    return next_pow2(S) <= NEUMANN_MAX_BLOCK


def fwd_cfg(S: int) -> OftCfg:
    """The forward launcher's default for block size S: ``FWD_CFG``, by Gauss-Jordan where
    the series does not fit (``neumann_fits``)."""
    return FWD_CFG if neumann_fits(S) else FWD_CFG._replace(neumann=False)


def positions_view(t: torch.Tensor, ax: int):
    """``(t_or_copy, pre, post, (s_pre, s_c, s_post))`` of t seen as (pre, C, post).

    Pre dims and post dims must each collapse to one strided run; otherwise a
    contiguous copy is used (documented fallback, rare)."""
    shape, stride = tuple(t.shape), t.stride()
    a = collapse_one(shape[:ax], stride[:ax]) if ax > 0 else (1, 0)
    b = collapse_one(shape[ax + 1:], stride[ax + 1:]) if ax + 1 < len(shape) else (1, 0)
    if a is None or b is None:
        t = t.contiguous()
        return positions_view(t, ax)
    return t, a[0], b[0], (a[1], stride[ax], b[1])


def pos_mode(pre, post, strides):
    """(MODE, s_pre', s_post') of the position enumeration (see ``pos_offsets``)."""
    s_pre, _, s_post = strides
    if post == 1:
        return 0, s_pre, 0
    if pre == 1:
        return 0, s_post, 0
    return 1, s_pre, s_post


@functools.lru_cache(maxsize=4096)
def _plan(K, S, npos, c_contig, n_sm, bwd, cfg: OftCfg):
    SP = next_pow2(S)
    if SP > MAX_BLOCK:
        raise ValueError(f"lycoris triton oft: block size S={S} exceeds the fused limit {MAX_BLOCK}")
    want = cfg.group or (32 if c_contig else 16)
    NB = max(1, max(16, want) // SP)
    n_groups = cdiv(K, NB)
    bp = cfg.bwd_block_p if bwd else cfg.block_p
    n_tiles = cdiv(npos, bp)
    split = max(1, min(cfg.split or auto_split(n_groups, n_sm, bwd, cfg.neumann), n_tiles))
    return NB, SP, n_groups, n_tiles, split, bp


#: resident stream programs per SM (measured, 32-row groups, 16-bit x): the forward's 4, the
#: backward's 3 (its GP x GP accumulator); 2 with ``neumann`` (its fp32 dots of 32x32 tiles:
#: 255 registers a thread, ptxas sm_90)
WAVE_FWD, WAVE_BWD, WAVE_NEUMANN = 4, 3, 2


def auto_split(n_groups: int, n_sm: int, bwd: bool, neumann: bool = False) -> int:
    """Programs per channel group along the positions: as many as fill ONE wave of resident
    programs. Every program first rebuilds its group's Cayley factor with the memory idle,
    so a second, partial wave pays that again (measured slower, forward and backward, with
    and without ``neumann``)."""
    return wave_split(n_groups, n_sm, WAVE_NEUMANN if neumann else (WAVE_BWD if bwd else WAVE_FWD))


def wave_split(n_groups: int, n_sm: int, per_sm: int) -> int:
    """Programs per group such that all groups' programs fit one wave of ``per_sm`` resident
    programs per SM (at least one per group); BOFT's streaming kernels use it too."""
    return max(1, (per_sm * n_sm) // max(1, n_groups))


#: ``dot_prec`` of the 16-bit split (``dot_split16``): taken where the streamed operands are
#: 16-bit (x, and G of x's dtype in the backward); fp32 operands use "tf32x3"
SPLIT16 = "split16"
#: ``dot_prec`` of the 16-bit-output BOFT configs: fp32 scratch operands take three bf16 dots
#: (``dot_x3``, ~2^-16 relative, an order below a 16-bit output's rounding); 16-bit streams
#: take split16
BF16X3 = "bf16x3"
_HALF = (torch.float16, torch.bfloat16)


def dot_mode(dot_prec: str, *streams: torch.Tensor) -> dict:
    """The stream kernels' dot constexprs (DOT_PREC, SPLIT, DOT) for a config's ``dot_prec``
    and the tensors a kernel streams: split16 where they are all of one 16-bit dtype."""
    dt = streams[0].dtype
    if dot_prec in (SPLIT16, BF16X3) and dt in _HALF and all(t.dtype == dt for t in streams):
        return dict(DOT_PREC="tf32x3", SPLIT=True, DOT=dot_dtype(dt))
    if dot_prec == BF16X3:
        return dict(DOT_PREC="tf32x3", SPLIT=False, DOT=dot_dtype(torch.bfloat16), X3=True)
    return dict(DOT_PREC="tf32x3" if dot_prec == SPLIT16 else dot_prec, SPLIT=False, DOT=tl.float32)


def _oft_axis(x, weight):
    return 0 if weight else (1 if x.dim() >= 3 else x.dim() - 1)


def _prep(blocks, x, rescale, weight, cfg, bwd):
    if x.dtype == torch.float64 or blocks.dtype == torch.float64:
        raise ValueError("lycoris triton oft: float64 is not fused (eager only)")
    K, S = blocks.shape[0], blocks.shape[1]
    ax = _oft_axis(x, weight)
    x, pre, post, xs = positions_view(x, ax)
    plan = _plan(K, S, pre * post, xs[1] == 1, num_sms(x.device), bwd, cfg)
    rs = rescale.reshape(-1) if rescale is not None else blocks
    return K, S, ax, x, pre, post, xs, plan, rs


def oft_fwd(blocks, x, rescale, cscale, shift, weight, cfg: Optional[OftCfg] = None):
    """Diag-OFT forward (docs/ops.md §2.5.1, see ``reference.oft.oft_fwd``): one kernel."""
    cfg = cfg or fwd_cfg(int(blocks.shape[-1]))
    K, S, ax, x, pre, post, xs, (NB, SP, n_groups, n_tiles, split, bp), rs = _prep(blocks, x, rescale, weight,
                                                                                  cfg, False)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    ys = (K * S * post, post, 1)
    mode, a, b = pos_mode(pre, post, xs)
    _, ya, yb = pos_mode(pre, post, ys)
    idx64 = needs_idx64((tuple(x.shape), x.stride()), (tuple(y.shape), y.stride()))
    with device_guard(x):
        fast(_oft_fwd_kernel)[(n_groups, split)](
            blocks, *blocks.stride(), rs, rs.stride(0),
            x, a, xs[1], b, y, ya, ys[1], yb,
            K, S, pre * post, post, n_tiles, split, float(cscale), 1.0 if shift else 0.0,
            HAS_RESCALE=rescale is not None, MODE=mode, IDX64=idx64, NB=NB, SP=SP, BLOCK_P=bp,
            **dot_mode(cfg.dot_prec, x), NEUMANN=cfg.neumann,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def oft_bwd(grad, blocks, x, rescale, cscale, shift, weight, cfg: Optional[OftCfg] = None):
    """Diag-OFT backward (docs/ops.md §2.5.2, see ``reference.oft.oft_bwd``): stream + chain kernels.

    Returns gx (x's shape and dtype), g_blocks (blocks' shape and dtype), g_rescale
    ((K·S,) in blocks' dtype, or an empty (0,) tensor when rescale is None)."""
    cfg = cfg or OftCfg()
    K, S, ax, x, pre, post, xs, (NB, SP, n_groups, n_tiles, split, bp), rs = _prep(blocks, x, rescale, weight,
                                                                                  cfg, True)
    dev = x.device
    gx = torch.empty(x.shape, device=dev, dtype=x.dtype)
    g_blocks = torch.empty(blocks.shape, device=dev, dtype=blocks.dtype)
    g_rescale = torch.empty((K * S,) if rescale is not None else (0,), device=dev, dtype=blocks.dtype)
    if K * S == 0:
        return gx, g_blocks, g_rescale
    grad, _, _, gs = positions_view(grad, ax)
    os_ = (K * S * post, post, 1)
    mode, xa, xb = pos_mode(pre, post, xs)
    _, ga, gb = pos_mode(pre, post, gs)
    _, oa, ob = pos_mode(pre, post, os_)
    idx64 = needs_idx64((tuple(x.shape), x.stride()), (tuple(grad.shape), grad.stride()),
                        (tuple(gx.shape), gx.stride()))
    GP = NB * SP
    # a small call (one tile, one program a group): the chain in the streaming program, one launch
    chain_in = split == 1 and n_tiles <= 1
    part = g_blocks if chain_in else torch.empty((split, n_groups, GP, GP), device=dev, dtype=torch.float32)
    with device_guard(x):
        fast(_oft_bwd_stream)[(n_groups, split)](
            blocks, *blocks.stride(), rs, rs.stride(0),
            grad, ga, gs[1], gb, x, xa, xs[1], xb, gx, oa, os_[1], ob, part,
            K, S, pre * post, post, n_tiles, split, n_groups, float(cscale), 1.0 if shift else 0.0,
            g_blocks, g_rescale, HAS_RESCALE=rescale is not None, MODE=mode, IDX64=idx64, NB=NB, SP=SP,
            BLOCK_P=bp, **dot_mode(cfg.dot_prec, grad, x), NEUMANN=cfg.neumann, CHAIN=chain_in,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if not chain_in:
            fast(_oft_bwd_chain)[(n_groups,)](
                blocks, *blocks.stride(), rs, rs.stride(0), part, g_blocks, g_rescale,
                K, S, split, n_groups, float(cscale),
                HAS_RESCALE=rescale is not None, NB=NB, SP=SP, NEUMANN=cfg.neumann, num_warps=cfg.chain_warps)
    return gx, g_blocks, g_rescale
