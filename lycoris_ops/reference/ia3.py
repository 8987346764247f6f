"""IA3 channel scaling (docs/ops.md §2.7): ``ia3_fwd`` and ``ia3_bwd``.

Operands are read in their own dtypes (no pre-cast) and the math is fp32 (fp64
when the promoted dtype is fp64). float16 and bfloat16 never meet in one call
(docs/ops.md §1.3 rule 1): such a call raises instead of promoting to fp32.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast


def _check_common(op, x, w, channel_axis, alpha, gamma):
    C.tensor(op, "x", x)
    C.tensor(op, "w", w)
    C.float_arg(op, "alpha", alpha)
    C.float_arg(op, "gamma", gamma)
    if x.dim() == 0:
        C.fail(op, "x must have at least 1 dim (the channel axis), got a 0-D tensor")
    if isinstance(channel_axis, bool) or not isinstance(channel_axis, int):
        C.fail(op, f"channel_axis must be an int, got {channel_axis!r}")
    ax = C.axis(op, "channel_axis", channel_axis, x.dim())
    ch = x.shape[ax]
    C.expect(w.numel() == ch, op,
             lambda: f"w must have x.shape[{channel_axis}] = {ch} elements (one per channel), "
                     f"got shape {tuple(w.shape)}")
    C.same_device(op, x=x, w=w)
    C.compute_dtype(op, x=x, w=w)  # float16 + bfloat16 -> error
    return ax


@C.cached
def check_ia3_fwd(x, w, channel_axis, alpha, gamma):
    """-> ((x shape, promote_types(x, w)),)."""
    _check_common("ia3_fwd", x, w, channel_axis, alpha, gamma)
    return ((tuple(x.shape), torch.promote_types(x.dtype, w.dtype)),)


@C.cached
def check_ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    """-> ((x shape, x.dtype), (w shape, w.dtype))."""
    op = "ia3_bwd"
    C.tensor(op, "grad", grad)
    _check_common(op, x, w, channel_axis, alpha, gamma)
    C.shape(op, "grad", grad, x.shape, "(x's shape)")
    C.same_device(op, grad=grad, x=x)
    C.compute_dtype(op, grad=grad, x=x, w=w)
    return ((tuple(x.shape), x.dtype), (tuple(w.shape), w.dtype))


def _scale(x, w, ax, alpha, gamma, cdt):
    """(α + γ·w[c]) in cdt, shaped to broadcast along axis ``ax`` of x."""
    wv = w.reshape([x.shape[ax]] + [1] * (x.dim() - 1 - ax)).to(cdt)
    return gamma * wv + alpha


def _cdt(*dtypes):
    return torch.float64 if torch.float64 in dtypes else torch.float32


def ia3_fwd(x, w, channel_axis, alpha, gamma):
    """``y = x ⊙ (α + γ·w[c])``, c the index along ``channel_axis`` of x.

    x: any rank; w: numel = x.shape[channel_axis] (any shape, flattened);
    channel_axis may be negative. y: x's shape, dtype promote_types(x, w);
    fp32 math (fp64 if either is fp64), one rounding at the store.
    """
    check_ia3_fwd(x, w, channel_axis, alpha, gamma)
    ax = channel_axis % x.dim()
    out = torch.promote_types(x.dtype, w.dtype)
    cdt = _cdt(x.dtype, w.dtype)
    y = cast(x, cdt) * _scale(x, w, ax, alpha, gamma, cdt)
    return cast(y, out).contiguous()


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    """Gradients of ``ia3_fwd`` for G = grad (x's shape).

    ``gx = G ⊙ (α + γ·w[c])`` in x's dtype; ``gw[c] = γ·Σ G⊙x`` over every
    index whose channel is c (fp32 accumulation), in w's dtype and shape.
    """
    check_ia3_bwd(grad, x, w, channel_axis, alpha, gamma)
    ax = channel_axis % x.dim()
    cdt = _cdt(x.dtype, w.dtype)
    g = cast(grad, cdt)
    gx = (g * _scale(x, w, ax, alpha, gamma, cdt)).to(x.dtype).contiguous()
    prod = g * cast(x, cdt)
    dims = [d for d in range(x.dim()) if d != ax]
    red = prod.sum(dim=dims) if dims else prod
    gw = (gamma * red).reshape(w.shape).to(w.dtype).contiguous()
    return gx, gw


# --------------------------------------------------------------------------- CUDA step-down

def ia3_fwd_native(x, w, channel_axis, alpha, gamma):
    """The step-down body on CUDA (docs/ops.md §1.5): with x and w of one 16-bit dtype, the
    scale ``α + γ·w`` rounded to it and one 16-bit multiply (the user's ``x * scale``);
    otherwise the exact body."""
    if not (x.dtype == w.dtype and x.dtype in C.HALF_DTYPES):
        return ia3_fwd(x, w, channel_axis, alpha, gamma)
    check_ia3_fwd(x, w, channel_axis, alpha, gamma)
    ax = channel_axis % x.dim()
    return (x * _scale(x, w, ax, alpha, gamma, torch.float32).to(x.dtype)).contiguous()


def ia3_bwd_native(grad, x, w, channel_axis, alpha, gamma):
    """The step-down body of ``ia3_bwd`` (docs/ops.md §1.5): 16-bit products, the per-channel
    sums accumulated in fp32 by the reduction; otherwise the exact body."""
    if not (x.dtype == w.dtype == grad.dtype and x.dtype in C.HALF_DTYPES):
        return ia3_bwd(grad, x, w, channel_axis, alpha, gamma)
    check_ia3_bwd(grad, x, w, channel_axis, alpha, gamma)
    ax = channel_axis % x.dim()
    gx = (grad * _scale(x, w, ax, alpha, gamma, torch.float32).to(x.dtype)).contiguous()
    dims = [d for d in range(x.dim()) if d != ax]
    prod = grad * x
    red = prod.sum(dim=dims, dtype=torch.float32) if dims else prod.float()
    return gx, (gamma * red).reshape(w.shape).to(w.dtype).contiguous()
