"""Triton kernel of ``lora_tucker_fwd`` (OPS.md §2.1.5).

``C[o, i, κ] = Σ_{p,q} a[o, p]·t[p, q, κ]·b[q, i]``; ``Y = γ·C1`` or, with the
second chain, ``Y = (γ·C1)⊙C2``; output (O, I, Kk) in a1's dtype. Written from
the spec and ``reference/lora.py``: the partial product ``AT = a·t`` (O, R', Kk)
is accumulated in fp32 and rounded to the compute dtype (the eager chain's
rounding), the second product accumulates in fp32, γ and the hadamard are fp32,
one rounding at the store.

The output is written once, coalesced, and with no re-layout: a program owns ``BO``
output rows o (a loop) and ``BI`` columns i, and per o computes the (BI, KKP) tile
``Σ_q bᵀ[i, q]·AT[o, q, κ]`` (κ padded to a dot's width ``KKP``, at least 16): its
accumulator is (i, κ)-major, exactly the order of y's contiguous run of row o, so
it is stored as it is. (Two earlier designs: a tile per κ stored with stride Kk
wrote 2-byte elements Kk apart, 34× its memory floor on an H200; rows (o, κ) by
columns i, re-laid out in registers to (o, i, κ), cost 1.4× eager torch's einsum at
4096×4096×9, r64.)

``AT`` (O·R'·Kk elements, a fraction of the output) is one small kernel launch
before (``_core_kernel``: a GEMM over the columns (q, κ) of t, fp32 accumulated and
stored in the compute dtype; a small call, one main program and at most
``CORE_FUSE_TILES`` core tiles, builds it in that program first: one launch); its operands keep any strides (LoHa passes a
transposed "up"). AT is stored zero-padded to the main kernel's dot shape
(O, R' → pow2, Kk → KKP): each o's operand is then one aligned contiguous block,
read with vector loads and no masks (with Kk = 9 unpadded, those loads were
2-byte gathers of 9-element runs, re-read by every column tile).

Packed rows (``o_pack``, the fp32 default): an IEEE fp32 dot runs on FMA units, so
its padded columns are paid work (Kk 9 in 16: 1.78× the products). ``o_pack`` rows o
then share one dot, side by side in its columns (3 × 9 in 32: 1.19×); AT is stored in
that packed order, and each row's part of the accumulator is still its (i, κ) run.
Measured on the H200 (fp32), packing is worth a tile, not more: the best packed and
unpacked tiles are within 8% of each other (``default_tucker_cfg``); at 16 bits (tensor
cores, write-bound) packing lost 2-3× and is not used. A Triton kernel
rather than torch's GEMM: then the whole op is Triton launches, which the C++ CUDA
kernel replays (csrc/launch.cpp) without Python.

Limit: padded ranks ``pow2(R, ≥16) <= 128`` (``supported``; the scope table
allows R <= 64). fp16 / bf16 / fp32 only.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, dot_dtype, fast, needs_idx64, next_pow2, tl_dtype
from lycoris_ops.backends.triton.kernels.fusedkit import compute_dtype, view_key

__all__ = ["TuckerCfg", "MAX_TUCKER_RANK", "supported", "tucker_fwd"]

MAX_TUCKER_RANK = 128


def _p16(n: int) -> int:
    return max(16, next_pow2(n))


def supported(*ranks: int) -> bool:
    """Whether the kernel takes these tucker ranks (t's two leading dims, both chains)."""
    return all(_p16(r) <= MAX_TUCKER_RANK for r in ranks)


@triton.jit
def _core_kernel(a_ptr, t_ptr, at_ptr, O, R, RB, KK,
                 s_ao, s_ap, s_tp, s_tq, s_tk,
                 CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
                 BO: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BRB: tl.constexpr, KKP: tl.constexpr,
                 OPK: tl.constexpr, NP: tl.constexpr):
    """AT = a·t, tile (program 0, program 1) of ``_core_tile``."""
    _core_tile(a_ptr, t_ptr, at_ptr, O, R, RB, KK, s_ao, s_ap, s_tp, s_tq, s_tk, tl.program_id(0),
               tl.program_id(1), CD, DOT, IDX64, BO, BN, BR, BRB, KKP, OPK, NP)


@triton.jit
def _core_tile(a_ptr, t_ptr, at_ptr, O, R, RB, KK, s_ao, s_ap, s_tp, s_tq, s_tk, pid_o, pid_n,
               CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr,
               BO: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BRB: tl.constexpr, KKP: tl.constexpr,
               OPK: tl.constexpr, NP: tl.constexpr):
    """AT[o, q, κ] = Σ_p a[o, p]·t[p, q, κ] over a (BO, BN) tile of rows o and columns
    n = (q, κ) (κ < KKP); one dot over all R ranks (BR = R padded), fp32 accumulated,
    rounded once to at's dtype (the compute dtype: reference ``tucker_core``'s rounding).
    Stored packed (``core_buffer``): row o at column (o mod OPK)·Kk + κ of pack o // OPK's
    (BRB, NP) block; the pack's last o also writes the zeros of the columns past OPK·Kk,
    and rows o past O up to the last pack write zeros (a and t are loaded as 0 there)."""
    offs_o = pid_o * BO + tl.arange(0, BO)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if IDX64:
        offs_o = offs_o.to(tl.int64)
    offs_p = tl.arange(0, BR)
    q = offs_n // KKP
    k = offs_n % KKP
    mask_o = offs_o < O
    mask_p = offs_p < R
    a = tl.load(a_ptr + offs_o[:, None] * s_ao + offs_p[None, :] * s_ap,
                mask=mask_o[:, None] & mask_p[None, :], other=0.0)
    t = tl.load(t_ptr + offs_p[:, None] * s_tp + q[None, :] * s_tq + k[None, :] * s_tk,
                mask=mask_p[:, None] & ((q < RB) & (k < KK))[None, :], other=0.0)
    acc = tl.dot(a.to(CD).to(DOT), t.to(CD).to(DOT), input_precision="ieee")
    if OPK == 1:
        dst = offs_o[:, None] * (BRB * NP) + offs_n[None, :]
        keep = mask_o[:, None] & (offs_n < BRB * KKP)[None, :]
    else:
        slot = offs_o % OPK
        dst = (offs_o // OPK)[:, None] * (BRB * NP) + q[None, :] * NP + (slot * KK)[:, None] + k[None, :]
        width = tl.where(slot == OPK - 1, NP - (OPK - 1) * KK, KK)  # the last slot: through the zero tail
        keep = ((offs_o < tl.cdiv(O, OPK) * OPK)[:, None] & (q < BRB)[None, :]
                & (k[None, :] < width[:, None]))
    tl.store(at_ptr + dst, acc.to(at_ptr.dtype.element_ty), mask=keep)


#: the core kernel's tile: rows o, columns (q, κ)
CORE_BO, CORE_BN = 64, 64
CORE_BO_C: tl.constexpr = tl.constexpr(CORE_BO)
CORE_BN_C: tl.constexpr = tl.constexpr(CORE_BN)
#: most core tiles (all chains) that a one-program call builds itself before its output
CORE_FUSE_TILES = 8


def core_buffer(a, t, compute, o_pack: int):
    """``AT = a·t``'s zero-padded (ceil(O / o_pack), BRB, NP) buffer in the compute dtype (BRB =
    R' padded to a dot width; NP = ``pack_width(Kk, o_pack)``), empty, with the core grid and
    the core tile's κ width: pack P's block holds rows o = P·o_pack + j side by side, row j's κ
    at column j·Kk + κ, zeros after the last (``_core_tile`` writes all of it). The main kernel
    reads a pack's (BRB, NP) operand as one aligned, unmasked block. o_pack 1: one row per
    block, κ padded."""
    O, (R, RB, KK) = a.shape[0], t.shape
    grid, kkc = core_grid(O, RB, KK, o_pack)
    at = torch.empty((cdiv(O, o_pack), _p16(RB), pack_width(KK, o_pack)), device=a.device, dtype=compute)
    return at, grid, kkc


def core_grid(O: int, RB: int, KK: int, o_pack: int):
    """``_core_kernel``'s grid for one chain (rows o, columns (q, κ)) and its tile's κ width."""
    brb, n_p = _p16(RB), pack_width(KK, o_pack)
    # the core tile's columns (q, κ): κ spans Kk and, for the last row of a pack, the zero tail
    kkc = next_pow2(max(KK, n_p - (o_pack - 1) * KK))
    return (cdiv(cdiv(O, o_pack) * o_pack, CORE_BO), cdiv(brb * kkc, CORE_BN)), kkc


def core_launch(a, t, at, grid, kkc, o_pack, compute):
    """AT = a·t into ``core_buffer``'s buffer: one launch of ``_core_kernel``."""
    Kk = t.shape[2]
    fast(_core_kernel)[grid](a, t, at, a.shape[0], t.shape[0], t.shape[1], Kk, *a.stride(), *t.stride(),
                             CD=tl_dtype(compute), DOT=dot_dtype(compute), IDX64=needs_idx64(*view_key(a, t, at)),
                             BO=CORE_BO, BN=CORE_BN, BR=_p16(t.shape[0]), BRB=_p16(t.shape[1]), KKP=kkc,
                             OPK=o_pack, NP=pack_width(Kk, o_pack), num_warps=4)


@triton.jit
def _at_tile(at_ptr, pack, valid, BR: tl.constexpr, NP: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr):
    """One pack of the AT buffer as a (BR, NP) dot operand: one contiguous block."""
    offs = tl.arange(0, BR)[:, None] * NP + tl.arange(0, NP)[None, :]
    at = tl.load(at_ptr + pack * (BR * NP) + offs, mask=valid, other=0.0)
    return at.to(CD).to(DOT)


@triton.jit
def _tucker_kernel(
    at1_ptr, b1_ptr, at2_ptr, b2_ptr, y_ptr,
    O, I, KK, R1, R2, gamma,
    s_b1q, s_b1i, s_b2q, s_b2i,
    s_yo, s_yi, s_yk,
    a1_ptr, t1_ptr, a2_ptr, t2_ptr, RA1, RA2,
    s_a1o, s_a1p, s_t1p, s_t1q, s_t1k, s_a2o, s_a2p, s_t2p, s_t2q, s_t2k,
    TWO: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr, GROUP_O: tl.constexpr,
    BO: tl.constexpr, OPK: tl.constexpr, NP: tl.constexpr, BI: tl.constexpr, BR1: tl.constexpr,
    BR2: tl.constexpr, CORE: tl.constexpr = False, CBR1: tl.constexpr = 16, CBR2: tl.constexpr = 16,
    KKC: tl.constexpr = 16,
):
    """BO output rows o (a loop over packs of OPK rows) x BI columns i: per pack, one
    (BI, BR) x (BR, NP) dot per chain gives Y[o, i, κ] = γ·Σ_q bᵀ[i, q]·AT[o, q, κ] for
    the pack's rows side by side (column j·Kk + κ: row j, position κ). Each row's part
    of the accumulator is (i, κ)-major, the order of y's (I, Kk) run of that row, so it is
    stored as it is: no re-layout, and the bᵀ tiles are loaded once per program.
    ``CORE`` (a one-program grid: a small call): the program first builds AT itself, every
    ``_core_tile`` of each chain (a and t: CBR1 / CBR2 their padded ranks, KKC the core tile's
    κ width), then a barrier: the op is one launch."""
    if CORE:
        n_rows = tl.cdiv(tl.cdiv(O, OPK) * OPK, CORE_BO_C)
        for po in range(0, n_rows):
            for pn in range(0, tl.cdiv(BR1 * KKC, CORE_BN_C)):
                _core_tile(a1_ptr, t1_ptr, at1_ptr, O, RA1, R1, KK, s_a1o, s_a1p, s_t1p, s_t1q, s_t1k, po, pn,
                           CD, DOT, IDX64, CORE_BO_C, CORE_BN_C, CBR1, BR1, KKC, OPK, NP)
            if TWO:
                for pn in range(0, tl.cdiv(BR2 * KKC, CORE_BN_C)):
                    _core_tile(a2_ptr, t2_ptr, at2_ptr, O, RA2, R2, KK, s_a2o, s_a2p, s_t2p, s_t2q, s_t2k, po,
                               pn, CD, DOT, IDX64, CORE_BO_C, CORE_BN_C, CBR2, BR2, KKC, OPK, NP)
        tl.debug_barrier()  # AT as this program stored it, visible to all of its threads
    pid = tl.program_id(0)
    n_o = tl.cdiv(O, BO)
    n_i = tl.cdiv(I, BI)
    group = GROUP_O * n_i
    first = (pid // group) * GROUP_O
    gsize = tl.minimum(n_o - first, GROUP_O)
    pid_o = first + (pid % group) % gsize
    pid_i = (pid % group) // gsize
    offs_i = pid_i * BI + tl.arange(0, BI)
    if IDX64:
        offs_i = offs_i.to(tl.int64)
    mask_i = offs_i < I
    cols = tl.arange(0, NP)
    if OPK == 1:
        row_of = cols * 0
        kappa = cols
    else:
        row_of = cols // KK
        kappa = cols % KK
    mask_c = cols < OPK * KK
    q1 = tl.arange(0, BR1)
    mq1 = q1 < R1
    bt1 = tl.load(b1_ptr + offs_i[:, None] * s_b1i + q1[None, :] * s_b1q,
                  mask=mask_i[:, None] & mq1[None, :], other=0.0).to(CD).to(DOT)
    q2 = tl.arange(0, BR2)
    mq2 = q2 < R2
    if TWO:
        bt2 = tl.load(b2_ptr + offs_i[:, None] * s_b2i + q2[None, :] * s_b2q,
                      mask=mask_i[:, None] & mq2[None, :], other=0.0).to(CD).to(DOT)
    y_tile = y_ptr + offs_i[:, None] * s_yi + (row_of * s_yo + kappa * s_yk)[None, :]
    mask_y = mask_i[:, None] & mask_c[None, :]
    p0 = pid_o * (BO // OPK)
    if IDX64:
        p0 = p0.to(tl.int64)
    for pp in range(0, BO // OPK):
        pack = p0 + pp
        o = pack * OPK
        valid = o < O
        acc = tl.dot(bt1, _at_tile(at1_ptr, pack, valid, BR1, NP, CD, DOT), input_precision="ieee") * gamma
        if TWO:
            acc = acc * tl.dot(bt2, _at_tile(at2_ptr, pack, valid, BR2, NP, CD, DOT), input_precision="ieee")
        tl.store(y_tile + o * s_yo, acc.to(y_ptr.dtype.element_ty), mask=mask_y & ((o + row_of) < O)[None, :])


class TuckerCfg(NamedTuple):
    block_o: int = 0   # output rows o per program (a loop; each pack of o_pack rows one dot per chain)
    block_i: int = 0
    group_o: int = 8
    num_warps: int = 0
    num_stages: int = 0  # 0: the default config's
    o_pack: int = 0    # output rows side by side in one dot's columns (0: the default's; block_o rounds up to it)


def o_pack_for(Kk: int, max_width: int) -> int:
    """The rows o per dot that waste the fewest padded columns with the dot at most
    ``max_width`` wide (ties: fewer rows): Kk 9 -> 3 in 32 columns (16 for one row)."""
    widest = max(max_width, pack_width(Kk, 1))
    fits = [k for k in range(1, max(1, max_width // max(1, Kk)) + 1) if pack_width(Kk, k) <= widest]
    # k·Kk of pack_width(Kk, k) columns used: a ratio of a power of two, so exact as a float
    return max(fits, key=lambda k: (k * Kk / pack_width(Kk, k), -k))


def pack_width(Kk: int, o_pack: int) -> int:
    """The dot's columns for o_pack rows of Kk positions: a power of two, at least 16."""
    return max(16, next_pow2(max(1, o_pack * Kk)))


@functools.lru_cache(maxsize=1024)
def default_tucker_cfg(O, I, Kk, rmax, two, compute) -> TuckerCfg:
    if compute == torch.float32:
        # IEEE fp32 dots (FMA), rows packed. H200, bench/variants.py tucker fp32 (2026-12-04 18:28):
        # packed 16(->18)x32 0.328 ms at 3072² r32 and 0.952 at 4096² r64, against 0.395 / 1.260
        # for the unpacked 16x64 default before; the best unpacked tiles were 8x256 (0.303 / 1.207)
        # and 16x128 (0.327 / 1.016). The tuner times both kinds.
        return TuckerCfg(block_o=16, block_i=32, num_warps=4, num_stages=2, o_pack=o_pack_for(Kk, 32))
    if two or _p16(rmax) > 64:
        return TuckerCfg(block_o=16, block_i=64, num_warps=4, num_stages=2, o_pack=1)
    # H200, bench/variants.py tucker (2026-12-01 11:07): 32x128 at 3 stages 0.233 ms at
    # 4096x4096x9 r64 bf16 and 0.108 at 3072 r32, against 0.263 / 0.117 at 2 stages and
    # einsum's 0.251 / 0.148
    return TuckerCfg(block_o=32, block_i=128, num_warps=4, num_stages=3, o_pack=1)


def _tiles(O, I, Kk, ranks, compute, cfg: TuckerCfg):
    """(default cfg, o_pack, block_o, block_i) of a call: ``cfg``'s fields over the default."""
    d = default_tucker_cfg(O, I, Kk, max(ranks), len(ranks) == 2, compute)
    opk = cfg.o_pack or d.o_pack
    return d, opk, cdiv(cfg.block_o or d.block_o, opk) * opk, cfg.block_i or d.block_i


def one_launch(O: int, I: int, Kk: int, ranks, compute, cfg: TuckerCfg = TuckerCfg()) -> bool:
    """True when a call (``ranks``: each chain's R' = t.shape[1]) is one main program that
    builds its own AT first: at most ``CORE_FUSE_TILES`` core tiles over its chains."""
    _, opk, bo, bi = _tiles(O, I, Kk, ranks, compute, cfg)
    return (cdiv(O, bo) * cdiv(I, bi) == 1
            and sum(math.prod(core_grid(O, rb, Kk, opk)[0]) for rb in ranks) <= CORE_FUSE_TILES)


@functools.lru_cache(maxsize=4096)
def _plan(O, I, Kk, ranks, views, compute, cfg: TuckerCfg):
    two = len(ranks) == 2
    d, opk, bo, bi = _tiles(O, I, Kk, ranks, compute, cfg)
    br = [_p16(r) for r in ranks] + [16]
    meta = dict(TWO=two, CD=tl_dtype(compute), DOT=dot_dtype(compute),
                IDX64=needs_idx64(*[v for v in views if v is not None]), GROUP_O=cfg.group_o,
                BO=bo, OPK=opk, NP=pack_width(Kk, opk), BI=bi, BR1=br[0], BR2=br[1],
                num_warps=cfg.num_warps or d.num_warps, num_stages=cfg.num_stages or d.num_stages)
    return (cdiv(O, bo) * cdiv(I, bi),), meta


def tucker_fwd(a1, t1, b1, a2, t2, b2, gamma, cfg: Optional[TuckerCfg] = None):
    O = a1.shape[0]
    I = b1.shape[1]
    Kk = t1.shape[2]
    two = a2 is not None
    compute = compute_dtype(*(t.dtype for t in (a1, t1, b1, a2, t2, b2) if t is not None))
    y = torch.empty((O, I, Kk), device=a1.device, dtype=a1.dtype)
    if y.numel() == 0:
        return y
    ranks = (t1.shape[1],) + ((t2.shape[1],) if two else ())
    cfg = cfg or TuckerCfg()
    opk = _tiles(O, I, Kk, ranks, compute, cfg)[1]
    at1, cgrid, kkc = core_buffer(a1, t1, compute, opk)
    at2 = core_buffer(a2, t2, compute, opk)[0] if two else at1
    grid, meta = _plan(O, I, Kk, ranks, view_key(at1, b1, at2 if two else at1, b2 if two else b1, y), compute, cfg)
    # a one-program call with few core tiles builds AT in its own program: one launch
    fused = one_launch(O, I, Kk, ranks, compute, cfg)
    if not fused:
        for a, t, at in ((a1, t1, at1),) + (((a2, t2, at2),) if two else ()):
            core_launch(a, t, at, cgrid, kkc, opk, compute)
    c2 = (a2, t2) if two else (a1, t1)
    fast(_tucker_kernel)[grid](
        at1, b1, at2, b2 if two else b1, y, O, I, Kk, t1.shape[1], t2.shape[1] if two else t1.shape[1], gamma,
        *b1.stride(), *(b2 if two else b1).stride(), *y.stride(),
        a1, t1, c2[0], c2[1], t1.shape[0], c2[1].shape[0], *a1.stride(), *t1.stride(), *c2[0].stride(),
        *c2[1].stride(), **meta,
        **(dict(CORE=True, CBR1=_p16(t1.shape[0]), CBR2=_p16(c2[1].shape[0]), KKC=kkc) if fused else {}))
    return y
