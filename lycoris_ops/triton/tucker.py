"""Triton kernel of ``lora_tucker_fwd`` (OPS.md §2.1.5).

``C[o, i, κ] = Σ_{p,q} a[o, p]·t[p, q, κ]·b[q, i]``; ``Y = γ·C1`` or, with the
second chain, ``Y = (γ·C1)⊙C2``; output (O, I, Kk) in a1's dtype. Written from
the spec and ``reference/lora.py``: the partial product a·t is accumulated in
fp32 and rounded to the compute dtype before ·b (the eager chain's rounding),
the second product accumulates in fp32, γ and the hadamard are fp32, one
rounding at the store. Operands are read in their stored dtype and rounded to
the compute dtype in-kernel; any strides (LoHa passes a transposed "up").

One launch. Program = (O tile, I tile); the a tile (BO, R1) and b tile (R2, BI)
of each chain are loaded once, then for each κ: ``M = round(a·t[:, :, κ])``
(BO, R2) and ``C = M·b`` (BO, BI), stored with stride Kk. M is recomputed per
I tile (R1/BI extra work; a·t is tiny next to the output).

Limit: both padded ranks ``pow2(R, ≥16) <= 128`` (``supported``; the reference
allows R <= 64). fp16 / bf16 / fp32 only.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._common import cdiv, device_guard, dot_dtype, needs_idx64, next_pow2, tl_dtype
from ._fusedkit import compute_dtype, view_key

__all__ = ["TuckerCfg", "MAX_TUCKER_RANK", "supported", "lora_tucker_fwd", "tucker_fwd"]

MAX_TUCKER_RANK = 128


def _p16(n: int) -> int:
    return max(16, next_pow2(n))


def supported(*ranks: int) -> bool:
    """Whether the kernel takes these tucker ranks (t's two leading dims, both chains)."""
    return all(_p16(r) <= MAX_TUCKER_RANK for r in ranks)


@triton.jit
def _load_ab(a_ptr, b_ptr, offs_o, offs_i, mask_o, mask_i, R1, R2, s_ao, s_ap, s_bq, s_bi,
             CD: tl.constexpr, DOT: tl.constexpr, BR1: tl.constexpr, BR2: tl.constexpr):
    """The chain's a tile (BO, BR1) and b tile (BR2, BI), in the dot dtype."""
    offs_p = tl.arange(0, BR1)
    offs_q = tl.arange(0, BR2)
    a = tl.load(a_ptr + offs_o[:, None] * s_ao + offs_p[None, :] * s_ap,
                mask=mask_o[:, None] & (offs_p < R1)[None, :], other=0.0)
    b = tl.load(b_ptr + offs_q[:, None] * s_bq + offs_i[None, :] * s_bi,
                mask=(offs_q < R2)[:, None] & mask_i[None, :], other=0.0)
    return a.to(CD).to(DOT), b.to(CD).to(DOT)


@triton.jit
def _chain(a, b, t_ptr, k, R1, R2, s_tp, s_tq, s_tk,
           CD: tl.constexpr, DOT: tl.constexpr, BR1: tl.constexpr, BR2: tl.constexpr):
    """fp32 (BO, BI) tile of Σ_q round(Σ_p a[o,p]·t[p,q,k])·b[q,i]."""
    offs_p = tl.arange(0, BR1)
    offs_q = tl.arange(0, BR2)
    t = tl.load(t_ptr + offs_p[:, None] * s_tp + offs_q[None, :] * s_tq + k * s_tk,
                mask=(offs_p < R1)[:, None] & (offs_q < R2)[None, :], other=0.0)
    m = tl.dot(a, t.to(CD).to(DOT), input_precision="ieee")
    return tl.dot(m.to(CD).to(DOT), b, input_precision="ieee")


@triton.jit
def _tucker_kernel(
    a1_ptr, t1_ptr, b1_ptr, a2_ptr, t2_ptr, b2_ptr, y_ptr,
    O, I, KK, R1a, R1b, R2a, R2b, gamma,
    s_a1o, s_a1p, s_t1p, s_t1q, s_t1k, s_b1q, s_b1i,
    s_a2o, s_a2p, s_t2p, s_t2q, s_t2k, s_b2q, s_b2i,
    s_yo, s_yi, s_yk,
    TWO: tl.constexpr, CD: tl.constexpr, DOT: tl.constexpr, IDX64: tl.constexpr, GROUP_O: tl.constexpr,
    BO: tl.constexpr, BI: tl.constexpr, BR1A: tl.constexpr, BR1B: tl.constexpr,
    BR2A: tl.constexpr, BR2B: tl.constexpr,
):
    pid = tl.program_id(0)
    n_o = tl.cdiv(O, BO)
    n_i = tl.cdiv(I, BI)
    group = GROUP_O * n_i
    first = (pid // group) * GROUP_O
    gsize = tl.minimum(n_o - first, GROUP_O)
    pid_o = first + (pid % group) % gsize
    pid_i = (pid % group) // gsize
    offs_o = pid_o * BO + tl.arange(0, BO)
    offs_i = pid_i * BI + tl.arange(0, BI)
    if IDX64:
        offs_o = offs_o.to(tl.int64)
        offs_i = offs_i.to(tl.int64)
    mask_o = offs_o < O
    mask_i = offs_i < I
    mask = mask_o[:, None] & mask_i[None, :]
    y_tile = y_ptr + offs_o[:, None] * s_yo + offs_i[None, :] * s_yi
    a1, b1 = _load_ab(a1_ptr, b1_ptr, offs_o, offs_i, mask_o, mask_i, R1a, R1b, s_a1o, s_a1p, s_b1q, s_b1i,
                      CD, DOT, BR1A, BR1B)
    if TWO:
        a2, b2 = _load_ab(a2_ptr, b2_ptr, offs_o, offs_i, mask_o, mask_i, R2a, R2b, s_a2o, s_a2p, s_b2q, s_b2i,
                          CD, DOT, BR2A, BR2B)
    for k in range(0, KK):
        acc = _chain(a1, b1, t1_ptr, k, R1a, R1b, s_t1p, s_t1q, s_t1k, CD, DOT, BR1A, BR1B) * gamma
        if TWO:
            acc = acc * _chain(a2, b2, t2_ptr, k, R2a, R2b, s_t2p, s_t2q, s_t2k, CD, DOT, BR2A, BR2B)
        tl.store(y_tile + k * s_yk, acc.to(y_ptr.dtype.element_ty), mask=mask)


class TuckerCfg(NamedTuple):
    block_o: int = 0
    block_i: int = 0
    group_o: int = 8
    num_warps: int = 0
    num_stages: int = 2


def default_tucker_cfg(O, I, Kk, rmax, two, compute) -> TuckerCfg:
    if compute == torch.float32:  # IEEE fp32 dots (FMA): smaller tiles
        return TuckerCfg(block_o=32, block_i=32 if two or rmax > 64 else 64, num_warps=8)
    rp = _p16(rmax)
    if rp > 64:  # (outside the scope table's R <= 64; two chains spill at rp 128)
        return TuckerCfg(block_o=32, block_i=64, num_warps=8)
    return TuckerCfg(block_o=64, block_i=64 if two else 128, num_warps=8)


@functools.lru_cache(maxsize=4096)
def _plan(O, I, Kk, ranks, views, compute, cfg: TuckerCfg):
    two = len(ranks) == 4
    rmax = max(ranks)
    d = default_tucker_cfg(O, I, Kk, rmax, two, compute)
    bo, bi = cfg.block_o or d.block_o, cfg.block_i or d.block_i
    br = [_p16(r) for r in ranks] + [16, 16]
    meta = dict(TWO=two, CD=tl_dtype(compute), DOT=dot_dtype(compute),
                IDX64=needs_idx64(*[v for v in views if v is not None]), GROUP_O=cfg.group_o,
                BO=bo, BI=bi, BR1A=br[0], BR1B=br[1], BR2A=br[2], BR2B=br[3],
                num_warps=cfg.num_warps or d.num_warps, num_stages=cfg.num_stages)
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
    ranks = (t1.shape[0], t1.shape[1]) + ((t2.shape[0], t2.shape[1]) if two else ())
    grid, meta = _plan(O, I, Kk, ranks, view_key(a1, t1, b1, a2, t2, b2, y), compute, cfg or TuckerCfg())
    if not two:
        a2, t2, b2 = a1, t1, b1
    _tucker_kernel[grid](
        a1, t1, b1, a2, t2, b2, y, O, I, Kk, t1.shape[0], t1.shape[1], t2.shape[0], t2.shape[1], gamma,
        *a1.stride(), *t1.stride(), *b1.stride(), *a2.stride(), *t2.stride(), *b2.stride(), *y.stride(), **meta)
    return y


def lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    """Op-set entry (validated, in-scope arguments)."""
    with device_guard(a1):
        return tucker_fwd(a1, t1, b1, a2, t2, b2, gamma)
