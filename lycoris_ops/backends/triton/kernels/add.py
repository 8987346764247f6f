"""Triton kernel of ``add_scaled`` (docs/ops.md §2.8): ``out = base + γ·delta``.

One pass: each operand is read once in its own dtype (fp32 and 16-bit may mix),
the math is fp32, the result is stored once in base's dtype and shape
(contiguous). delta has base's numel and is read in row-major order of its own
shape (what ``delta.reshape(base.shape)`` reads).

Strides: each operand's view is collapsed to at most three strided dims
(``common.collapse``) and the kernel unravels the flat output index into it, so
transposed / sliced operands are read in place. A view that does not collapse
to three dims (rare: a 4-D+ view with several gaps) is copied contiguous first.

Scope: float16 / bfloat16 / float32 operands (fp64 goes to eager: Triton passes
γ as an fp32 scalar).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lycoris_ops.backends.triton.common import cdiv, collapse, fast, needs_idx64, next_pow2

__all__ = ["AddCfg", "add_scaled", "default_add_cfg"]


@triton.jit
def flat_offset(idx, n1, n2, s0, s1, s2, ND: tl.constexpr):
    """Element offset of row-major index ``idx`` in a strided (n0, n1, n2) view
    of ``ND`` dims: (n0,) with stride s0, (n0, n1) with (s0, s1), or all three."""
    if ND == 1:
        off = idx * s0
    elif ND == 2:
        off = (idx // n1) * s0 + (idx % n1) * s1
    else:
        t = idx // n2
        off = (t // n1) * s0 + (t % n1) * s1 + (idx % n2) * s2
    return off


@triton.jit
def _add_scaled_kernel(
    base_ptr, delta_ptr, out_ptr, N, gamma,
    bn1, bn2, bs0, bs1, bs2, dn1, dn2, ds0, ds1, ds2,
    B_ND: tl.constexpr, D_ND: tl.constexpr, IDX64: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if IDX64:
        offs = offs.to(tl.int64)
    mask = offs < N
    b = tl.load(base_ptr + flat_offset(offs, bn1, bn2, bs0, bs1, bs2, B_ND), mask=mask, other=0.0)
    d = tl.load(delta_ptr + flat_offset(offs, dn1, dn2, ds0, ds1, ds2, D_ND), mask=mask, other=0.0)
    out = b.to(tl.float32) + gamma * d.to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


class AddCfg(NamedTuple):
    block: int = 2048
    num_warps: int = 8


def default_add_cfg(numel: int) -> AddCfg:
    if numel >= 1 << 20:
        return AddCfg(4096, 8)
    return AddCfg(max(128, min(2048, next_pow2(numel))), 4)


def view_args(c):
    """(n1, n2, s0, s1, s2, nd) of a collapsed view (list of (size, stride))."""
    nd = len(c)
    n = [size for size, _ in c] + [1] * (3 - nd)
    s = [st for _, st in c] + [0] * (3 - nd)
    return (n[1], n[2], s[0], s[1], s[2], nd)


@functools.lru_cache(maxsize=4096)
def _plan(numel, bview, dview, cfg: AddCfg):
    bc = collapse(*bview)
    dc = collapse(*dview)
    idx64 = numel > 2**31 - 1 or needs_idx64(bview, dview)
    return (None if bc is None else view_args(bc), None if dc is None else view_args(dc),
            (cdiv(numel, cfg.block),), dict(IDX64=idx64, BLOCK=cfg.block, num_warps=cfg.num_warps))


def add_scaled(base, delta, gamma, cfg: Optional[AddCfg] = None):
    """``base + γ·delta`` in base's shape and dtype (fresh, contiguous)."""
    out = torch.empty(base.shape, device=base.device, dtype=base.dtype)
    numel = out.numel()
    if numel == 0:
        return out
    if cfg is None:
        cfg = default_add_cfg(numel)
    ba, da, grid, meta = _plan(numel, (tuple(base.shape), base.stride()), (tuple(delta.shape), delta.stride()), cfg)
    if ba is None:  # more than three strided runs: read a contiguous copy
        base = base.contiguous()
        ba = view_args(collapse(base.shape, base.stride()))
    if da is None:
        delta = delta.contiguous()
        da = view_args(collapse(delta.shape, delta.stride()))
    fast(_add_scaled_kernel)[grid](base, delta, out, numel, gamma, *ba[:5], *da[:5], B_ND=ba[5], D_ND=da[5], **meta)
    return out
