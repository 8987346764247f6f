"""BOFT (docs/ops.md §2.6): an m-stage butterfly of block-diagonal Cayley rotations
along one channel axis, with a module multiplier folded into every stage, an
optional per-channel rescale after the last stage and an optional difference.

Numerics: everything (Cayley, stages, epilogues) in float32 — float64 when every
tensor operand is float64 (gradcheck) — rounded once to x's dtype.

Stage geometry (§2.6.1), implemented literally with index tensors built from the
static sizes: with ``κ_i = 2^i·s/2``, position p of stage i holds channel
``π_i(p) = ⌊p/2κ_i⌋·2κ_i + (p mod 2)·κ_i + ⌊(p mod 2κ_i)/2⌋``; positions are cut
into nb blocks of s and ``u^{i+1}[π_i(β·s+p)] = Σ_q F_{i,β}[p,q]·u^i[π_i(β·s+q)]``
with ``F = scale·R + (1 − scale)·I`` (BOFT applies R; diag-OFT applies Rᵀ).
"""
from __future__ import annotations

from typing import Optional

import torch

from lycoris_ops.reference import checks as _checks
from lycoris_ops.reference import cast
from lycoris_ops.reference.oft import cayley, cayley_backward, channel_view, token_dtype, work_dtype

__all__ = ["check_boft_fwd", "boft_fwd", "check_boft_bwd", "boft_bwd", "boft_fwd_native", "boft_bwd_native",
           "stage_permutation"]


def stage_permutation(i: int, s: int, C: int, device=None):
    """``(perm, inv)`` of stage i: ``perm[p] = π_i(p)`` (position → channel) and its
    inverse ``inv[c]`` (channel → position), int64 tensors of length C."""
    k = (s // 2) * (1 << i)  # κ_i
    two_k = 2 * k
    p = torch.arange(C, device=device)
    perm = (p // two_k) * two_k + (p % 2) * k + (p % two_k) // 2
    # channel c = g·2κ + h·κ + j  <->  position g·2κ + 2j + h
    c = p
    inv = (c // two_k) * two_k + 2 * ((c % two_k) % k) + (c % two_k) // k
    return perm, inv


def _to_blocks(u: torch.Tensor, i: int, s: int) -> torch.Tensor:
    """``u.index_select(1, perm_i).reshape(pre, nb, s, post)`` as a reshape/transpose: position
    g·2κ + 2j + h holds channel g·2κ + h·κ + j. Static strides, so a compiled graph folds the
    shuffle into its copies instead of a gather by an index tensor."""
    pre, C, post = u.shape
    k = (s // 2) << i
    return u.reshape(pre, C // (2 * k), 2, k, post).transpose(2, 3).reshape(pre, C // s, s, post)


def _from_blocks(w: torch.Tensor, i: int) -> torch.Tensor:
    """The inverse of ``_to_blocks``: (pre, nb, s, post) blocks back to (pre, C, post) channels."""
    pre, nb, s, post = w.shape
    C, k = nb * s, (s // 2) << i
    return w.reshape(pre, C // (2 * k), k, 2, post).transpose(2, 3).reshape(pre, C, post)


def _check_common(op, blocks, x, axis, cscale, scale, rescale=None, grad=None):
    _checks.tensor(op, "blocks", blocks, 4, "(m, nb, s, s)")
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    _checks.size(op, "blocks.shape[3] (s, blocks must be (m, nb, s, s))", blocks.shape[3], s)
    _checks.expect(m >= 1, op, lambda: f"blocks must have m >= 1 stages (blocks.shape[0]), got {m}")
    _checks.expect(s >= 2, op, lambda: f"blocks block size s (blocks.shape[2]) must be even and >= 2, got {s}")
    _checks.expect(s % 2 == 0, op, lambda: f"blocks block size s (blocks.shape[2]) must be even, got {s}")
    _checks.float_arg(op, "cscale", cscale)
    _checks.float_arg(op, "scale", scale)
    _checks.tensor(op, "x", x)
    if x.dim() < 1:
        _checks.fail(op, "x must have at least 1 dim (the channel axis), got a 0-D tensor")
    if isinstance(axis, bool) or not isinstance(axis, int):
        _checks.fail(op, f"axis must be an int, got {type(axis).__name__}")
    ax = _checks.axis(op, "axis", axis, x.dim())
    _checks.size(op, lambda: f"x.shape[{axis}] (the channel axis, C = nb*s)", x.shape[ax], nb * s)
    stride = (1 << (m - 1)) if isinstance(m, int) else 2 ** (m - 1)
    _checks.expect(nb % stride == 0, op,
                   lambda: f"blocks: 2^(m-1)*s = {stride * s} must divide C = nb*s = {nb * s} "
                           f"(m={m} stages need nb={nb} to be a multiple of 2^(m-1))")
    if rescale is not None:
        _checks.tensor(op, "rescale", rescale)
        rs = tuple(rescale.shape)
        _checks.expect(rescale.numel() == nb * s, op,
                       lambda: f"rescale must have C = nb*s = {nb * s} elements, got shape {rs}")
    if grad is not None:
        _checks.tensor(op, "grad", grad)
        if grad.dim() != x.dim():
            _checks.fail(op, f"grad must have the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
        for d in range(x.dim()):  # per-dim size checks: closures over ints only (dynamo fullgraph)
            _checks.size(op, f"grad.shape[{d}] (the shape of x)", grad.shape[d], x.shape[d])
    _checks.same_device(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    _checks.compute_dtype(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    return m, nb, s, ax


@_checks.cached
def check_boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    """Output spec of ``boft_fwd``: one tensor of x's shape and dtype."""
    if not isinstance(diff, bool):
        _checks.fail("boft_fwd", f"diff must be a bool, got {type(diff).__name__}")
    _check_common("boft_fwd", blocks, x, axis, cscale, scale, rescale)
    return ((tuple(x.shape), x.dtype),)


@_checks.cached
def check_boft_bwd(grad, blocks, x, axis, cscale, scale):
    """Output spec of ``boft_bwd``: gx (x's shape and dtype), g_blocks (blocks' shape and dtype)."""
    _checks.tensor("boft_bwd", "grad", grad)  # required here (_check_common's None means "no grad")
    _check_common("boft_bwd", blocks, x, axis, cscale, scale, grad=grad)
    return ((tuple(x.shape), x.dtype), (tuple(blocks.shape), blocks.dtype))


def _geometry(blocks, x, axis):
    """``(m, nb, s, channel axis)`` of a checked call."""
    return blocks.shape[0], blocks.shape[1], blocks.shape[2], axis % x.dim()


def _stage_matrices(blocks, cscale, scale, dt):
    r, m_inv = cayley(blocks, cscale, dt)
    if scale != 1.0:
        eye = torch.eye(r.shape[-1], dtype=dt, device=r.device)
        f = scale * r + (1.0 - scale) * eye
    else:
        f = r
    return f, m_inv


def boft_fwd(blocks: torch.Tensor, x: torch.Tensor, axis: int, cscale: float, scale: float,
             rescale: Optional[torch.Tensor], diff: bool, *, native: bool = False) -> torch.Tensor:
    """BOFT butterfly (docs/ops.md §2.6.1).

    blocks (m, nb, s, s), s even; x with C = nb·s channels on ``axis`` (0: weight
    (C, rest…); −1 / last: channels last; 1: (N, C, *spatial)); rescale C elements
    or None. ``u⁰ = x``; stage i applies ``F_{i,β} = scale·R_{i,β} + (1 − scale)·I``
    to each block of the π_i-permuted channels; ``y = u^m ⊙ rescale − diff·x``.
    Returns x's shape and dtype; computed in float32 (float64 if all operands are).
    """
    check_boft_fwd(blocks, x, axis, cscale, scale, rescale, diff)
    m, nb, s, ax = _geometry(blocks, x, axis)
    dt = work_dtype(blocks, x, rescale)
    C = nb * s
    f, _ = _stage_matrices(blocks, cscale, scale, dt)
    td = token_dtype(x, dt, native)
    f = cast(f, td)
    x0 = channel_view(x, ax).to(td)
    u = x0
    for i in range(m):
        u = _from_blocks(torch.einsum("bpq,nbqt->nbpt", f[i], _to_blocks(u, i, s)), i)
    if rescale is not None:
        u = u * rescale.reshape(1, C, 1).to(td)
    if diff:
        u = u - x0
    return u.reshape(x.shape).to(x.dtype).contiguous()


def boft_bwd(grad: torch.Tensor, blocks: torch.Tensor, x: torch.Tensor, axis: int, cscale: float,
             scale: float, *, native: bool = False):
    """Gradients of the plain chain ``u^m(x)`` (no rescale, no diff; docs/ops.md §2.6.2).

    One forward pass keeps the m stage inputs (in the permuted block basis); then
    for i = m−1 … 0: ``P_{i,β} = Σ g_β·(u^i_β)ᵀ``, ``g ← F_{i,β}ᵀ·g``, ``gR = scale·P``,
    Cayley chain (cscale constant). Returns gx (x's shape and dtype) and g_blocks
    (m, nb, s, s) in blocks' dtype; G is cast to float32 (float64 if all operands are).
    """
    check_boft_bwd(grad, blocks, x, axis, cscale, scale)
    m, nb, s, ax = _geometry(blocks, x, axis)
    dt = work_dtype(grad, blocks, x)
    f, m_inv = _stage_matrices(blocks, cscale, scale, dt)
    td = token_dtype(x, dt, native)
    f_t = cast(f, td)
    u = channel_view(x, ax).to(td)
    stage_inputs = []
    for i in range(m):
        v = _to_blocks(u, i, s)
        stage_inputs.append(v)
        if i + 1 < m:
            u = _from_blocks(torch.einsum("bpq,nbqt->nbpt", f_t[i], v), i)
    g = channel_view(grad, ax).to(td)
    g_r = []  # stage m-1 first (appended: torch 2.11's Dynamo cannot trace a list's item store)
    for i in reversed(range(m)):
        gw = _to_blocks(g, i, s)
        g_r.append(scale * torch.einsum("nbpt,nbqt->bpq", gw, stage_inputs[i]).to(dt))
        g = _from_blocks(torch.einsum("bpq,nbpt->nbqt", f_t[i], gw), i)
    g_blocks = cayley_backward(torch.stack(g_r[::-1]), m_inv, cscale)
    return g.reshape(x.shape).to(x.dtype).contiguous(), cast(g_blocks, blocks.dtype).contiguous()


def boft_fwd_native(blocks, x, axis, cscale, scale, rescale, diff):
    """The step-down body on CUDA (docs/ops.md §1.5): the Cayley transforms in fp32, every
    stage's rotation of x in x's 16-bit dtype with fp32 accumulation (rounded per stage)."""
    return boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, native=True)


def boft_bwd_native(grad, blocks, x, axis, cscale, scale):
    """The step-down body of ``boft_bwd`` (docs/ops.md §1.5): the stage products in x's
    16-bit dtype with fp32 accumulation, the Cayley chain in fp32."""
    return boft_bwd(grad, blocks, x, axis, cscale, scale, native=True)
