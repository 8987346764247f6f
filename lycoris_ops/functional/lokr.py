"""LoKr entry points (docs/ops.md §3.3): weight merge, linear bypass, conv bypass.

Layout of the factors (LyCORIS's):

- side 1: ``w1`` (a, b) whole, or ``w1a`` (a, r1) with ``w1b`` (r1, b);
- side 2: ``w2`` (c, d) whole — or (c, d, *kernel) for a conv —, or ``w2a``
  (c, r2) with ``w2b`` (r2, d) / (r2, d, *kernel), or a tucker conv side:
  ``t2`` (r2, r2, *kernel), ``w2a`` (r2, c), ``w2b`` (r2, d) with
  ``w2[p, q, *k] = Σ_ij t2[i, j, *k]·w2a[i, p]·w2b[j, q]``.

The result is ``ΔW = scale·kron(w1, w2)`` of shape (a·c, b·d[, *kernel]) where
w1 is broadcast over the kernel axes, i.e. ΔW[u·c+i, v·d+j, *k] = w1[u,v]·w2[i,j,*k].

Scale: every entry point applies the ``scale`` the caller passes, unchanged (the
LoKr module's own scale). ``lokr_scale`` gives LyCORIS's functional-API
convention, gamma / rank for a factored side — but plain gamma when both sides
are whole (lycoris-lora's is gamma / gamma there: gamma ignored, 0 raises).

Dtypes: the factors (and x for the bypass) promote to one compute dtype
(docs/ops.md §1.3: a 16-bit operand wins; fp16 with bf16 is an error). A merge returns
the compute dtype; a bypass returns x's dtype. ``base`` (the original weight for
a merge, the base layer's output for a bypass) is folded into the op when
``promote_types(base.dtype, compute) == base.dtype`` (then the result has
base's dtype), else added afterwards with torch's promotion.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from lycoris_ops.reference import checks as C

lycoris = torch.ops.lycoris

__all__ = ["lokr_scale", "lokr_weight", "lokr_merge", "lokr_bypass", "lokr_bypass_conv", "tucker_w2"]


def lokr_scale(gamma: float, w1b: Optional[torch.Tensor] = None, w2b: Optional[torch.Tensor] = None) -> float:
    """lokr_scale(gamma, w1b=None, w2b=None) -> float

    LyCORIS's functional-API scale: ``gamma / rank`` where rank is the row
    count of w1b when side 1 is factored, else of w2b when side 2 is factored
    (the same as w1a's / w2a's rank). When both sides are whole the scale is
    ``gamma`` itself (lycoris-lora divides gamma by gamma there).
    """
    if w1b is not None:
        return float(gamma) / w1b.shape[0]
    if w2b is not None:
        return float(gamma) / w2b.shape[0]
    return float(gamma)


# ---------------------------------------------------------------------------
# helpers


def _side1(fn, w1, w1a, w1b):
    if w1 is not None:
        if w1a is not None or w1b is not None:
            C.fail(fn, "give either w1 or (w1a, w1b), not both")
        C.tensor(fn, "w1", w1, 2, "(a, b)")
        return w1, None
    if w1a is None or w1b is None:
        C.fail(fn, "side 1 needs w1, or both w1a and w1b")
    C.tensor(fn, "w1a", w1a, 2, "(a, r1)")
    C.tensor(fn, "w1b", w1b, 2, "(r1, b)")
    return w1a, w1b


def _check_side2(fn, w2, w2a, w2b, t2):
    if w2 is not None:
        if w2a is not None or w2b is not None or t2 is not None:
            C.fail(fn, "give either w2 or (w2a, w2b[, t2]), not both")
        C.tensor(fn, "w2", w2)
        if w2.dim() < 2:
            C.fail(fn, f"w2 must be (c, d) or (c, d, *kernel), got {tuple(w2.shape)}")
        return
    if w2a is None or w2b is None:
        C.fail(fn, "side 2 needs w2, or both w2a and w2b (and t2 for tucker)")
    if t2 is not None:
        C.tensor(fn, "t2", t2)
        C.tensor(fn, "w2a", w2a, 2, "(r2, c) (tucker)")
        C.tensor(fn, "w2b", w2b, 2, "(r2, d) (tucker)")
        if t2.dim() < 3:
            C.fail(fn, f"t2 must be (r2, r2, *kernel), got {tuple(t2.shape)}")
        if t2.shape[0] != w2a.shape[0] or t2.shape[1] != w2b.shape[0]:
            C.fail(fn, f"t2 must be (r2, r2, *kernel) with r2 = w2a.shape[0] = w2b.shape[0], got t2 "
                       f"{tuple(t2.shape)}, w2a {tuple(w2a.shape)}, w2b {tuple(w2b.shape)}")
        return
    C.tensor(fn, "w2a", w2a)
    C.tensor(fn, "w2b", w2b)
    if w2b.dim() < 2:
        C.fail(fn, f"w2b must be (r2, d) or (r2, d, *kernel), got {tuple(w2b.shape)}")
    if w2a.dim() < 2 or any(s != 1 for s in w2a.shape[2:]):
        C.fail(fn, f"w2a must be (c, r2), got {tuple(w2a.shape)}")


def tucker_w2(t2, w2a, w2b, cd):
    """A tucker conv side as the whole w2: ``w2[p, q, *k] = Σ_ij t2[i, j, *k]·w2a[i, p]·w2b[j, q]``
    (eager, in the dtype ``cd``)."""
    return torch.einsum("ij...,ip,jq->pq...", t2.to(cd), w2a.to(cd), w2b.to(cd))


def _same_shape(fn, name, t, expected, layout):
    """Plain-Python shape check (traceable by Dynamo: no message closures over tensors)."""
    expected = tuple(expected)
    if t.dim() != len(expected) or any(x != e for x, e in zip(t.shape, expected)):
        C.fail(fn, f"{name} must have shape {expected} {layout}, got {tuple(t.shape)}")


def _fold(base, cd) -> bool:
    return base is not None and torch.promote_types(base.dtype, cd) == base.dtype


def _compute(fn, *tensors) -> torch.dtype:
    return C.compute_dtype(fn, **{f"arg{k}": t for k, t in enumerate(tensors)})


# ---------------------------------------------------------------------------
# merge


def lokr_weight(w1: Optional[torch.Tensor] = None, w1a: Optional[torch.Tensor] = None,
                w1b: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None,
                w2a: Optional[torch.Tensor] = None, w2b: Optional[torch.Tensor] = None,
                t2: Optional[torch.Tensor] = None, *, scale: float = 1.0,
                base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """lokr_weight(w1=None, w1a=None, w1b=None, w2=None, w2a=None, w2b=None, t2=None, *, scale=1.0, base=None) -> Tensor

    The LoKr weight ``scale·kron(w1, w2) [+ base]`` of shape (a·c, b·d[, *kernel])
    (see the module docstring for the factor layouts). ``base``, when given, has
    the output's shape.

    Routing: both sides whole (w2 2-D, or a whole conv w2 flattened to
    (c, d·Kk)) -> ``lokr_full_merge_fwd``; a factored side (including a conv w2b
    flattened to (r2, d·Kk), ``shape[3] = d·Kk``) -> ``lokr_merge_fwd``; a tucker
    w2 is rebuilt eagerly (einsum) and then goes in whole. Autograd flows to
    every factor.
    """
    fn = "lokr_weight"
    s1a, s1b = _side1(fn, w1, w1a, w1b)
    _check_side2(fn, w2, w2a, w2b, t2)
    scale = C.float_arg(fn, "scale", scale)
    cd = _compute(fn, s1a, s1b, w2, w2a, w2b, t2)
    if t2 is not None:
        w2 = tucker_w2(t2, w2a, w2b, cd)
        w2a = w2b = None
    if w2 is not None:
        kernel = tuple(w2.shape[2:])
        s2a, s2b = w2.flatten(1) if w2.dim() > 2 else w2, None
        d = w2.shape[1]
    else:
        kernel = tuple(w2b.shape[2:])
        s2a = w2a.flatten(1) if w2a.dim() > 2 else w2a
        s2b = w2b.flatten(1) if w2b.dim() > 2 else w2b
        d = w2b.shape[1]
    a = s1a.shape[0]
    b = s1a.shape[1] if s1b is None else s1b.shape[1]
    c = s2a.shape[0]
    cols = s2a.shape[1] if s2b is None else s2b.shape[1]
    out_shape = (a * c, b * d) + kernel
    if base is not None:
        C.tensor(fn, "base", base)
        _same_shape(fn, "base", base, out_shape, "(a*c, b*d, *kernel)")
    fold = _fold(base, cd)
    base2 = base.reshape(a * c, b * cols) if fold else None
    out_dtype = base.dtype if fold else cd
    if s1b is None and s2b is None:
        y = lycoris.lokr_full_merge_fwd(s1a, s2a, base2, scale, out_dtype)
    else:
        y = lycoris.lokr_merge_fwd(s1a, s1b, s2a, s2b, [a, b, c, cols], base2, scale, out_dtype)
    y = y.reshape(out_shape)
    if base is not None and not fold:
        y = base + y
    return y


#: alias: the merge entry point (``diff_weight`` / ``get_weight`` of a LoKr module)
lokr_merge = lokr_weight


# ---------------------------------------------------------------------------
# bypass


def _whole_sides(fn, w1, w1a, w1b, w2, w2a, w2b, t2, cd):
    """(w1 (a, b), w2 (c, d[, *kernel])) built with torch GEMMs in the compute dtype."""
    s1a, s1b = _side1(fn, w1, w1a, w1b)
    _check_side2(fn, w2, w2a, w2b, t2)
    w1 = s1a if s1b is None else s1a.to(cd) @ s1b.to(cd)
    if t2 is not None:
        w2 = tucker_w2(t2, w2a, w2b, cd)
    elif w2 is None:
        w2a2 = w2a.flatten(1) if w2a.dim() > 2 else w2a
        w2 = (w2a2.to(cd) @ w2b.flatten(1).to(cd)).reshape((w2a.shape[0],) + tuple(w2b.shape[1:]))
    return w1, w2


def lokr_bypass(x: torch.Tensor, w1: Optional[torch.Tensor] = None, w1a: Optional[torch.Tensor] = None,
                w1b: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None,
                w2a: Optional[torch.Tensor] = None, w2b: Optional[torch.Tensor] = None, *,
                scale: float = 1.0, base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """lokr_bypass(x, w1=None, w1a=None, w1b=None, w2=None, w2a=None, w2b=None, *, scale=1.0, base=None) -> Tensor

    Linear LoKr bypass ``scale·x·kron(w1, w2)ᵀ [+ base]`` without building the
    Kronecker product. x (..., b·d) -> (..., a·c); ``base`` (..., a·c) is the
    base layer's output. Factored sides are built with torch GEMMs (w1a·w1b,
    w2a·w2b, their gradients flow through torch), then ``lokr_bypass_fwd``.
    Conv factors (w2 / w2b with kernel axes) go through ``lokr_bypass_conv``.
    Output in x's dtype (base's when folded).
    """
    fn = "lokr_bypass"
    C.tensor(fn, "x", x)
    if x.dim() < 1:
        C.fail(fn, "x must have at least 1 dim (..., b*d)")
    scale = C.float_arg(fn, "scale", scale)
    cd = _compute(fn, x, w1, w1a, w1b, w2, w2a, w2b)
    w1, w2 = _whole_sides(fn, w1, w1a, w1b, w2, w2a, w2b, None, cd)
    if w2.dim() != 2:
        C.fail(fn, f"w2 must be 2-D (c, d) for the linear bypass, got {tuple(w2.shape)}: use lokr_bypass_conv")
    lead = tuple(x.shape[:-1])
    T = math.prod(lead)
    x2 = x.reshape(T, x.shape[-1])
    O = w1.shape[0] * w2.shape[0]
    if base is not None:
        C.tensor(fn, "base", base)
        _same_shape(fn, "base", base, lead + (O,), "(..., a*c)")
    fold = _fold(base, cd)
    y = lycoris.lokr_bypass_fwd(x2, w1, w2, scale, base.reshape(T, O) if fold else None)
    y = y.reshape(lead + (O,))
    if base is not None and not fold:
        y = base + y
    return y


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


#: below this many w2 output channels the structured conv (N·b images of d channels into c)
#: fills too little of a GEMM tile to beat the layer's own conv: the formula runs instead
STRUCTURED_CONV_MIN_C = 32


def _w2_out_channels(w2, w2a, t2) -> Optional[int]:
    """c of the conv side (whole, factored or tucker), None where the factors are malformed
    (the structured route's checks then say why)."""
    if w2 is not None:
        return int(w2.shape[0]) if w2.dim() else None
    if w2a is None or w2a.dim() < 2:
        return None
    return int(w2a.shape[1] if t2 is not None else w2a.shape[0])


def conv_formula_op(w1=None, w1a=None, w1b=None, w2=None, w2a=None, w2b=None, t2=None) -> Optional[str]:
    """The merge op ``lokr_bypass_conv`` builds ΔW with where a groups == 1 conv takes the
    formula's route (a w2 narrower than ``STRUCTURED_CONV_MIN_C``), else None (the structured
    conv). ``lokr_weight``'s routing: both sides whole -> the full merge, else the factored one."""
    c2 = _w2_out_channels(w2, w2a, t2)
    if c2 is None or c2 >= STRUCTURED_CONV_MIN_C:
        return None
    whole = w1 is not None and (w2 is not None or t2 is not None)
    return "lycoris.lokr_full_merge_fwd" if whole else "lycoris.lokr_merge_fwd"


def lokr_bypass_conv(x: torch.Tensor, w1: Optional[torch.Tensor] = None, w1a: Optional[torch.Tensor] = None,
                     w1b: Optional[torch.Tensor] = None, w2: Optional[torch.Tensor] = None,
                     w2a: Optional[torch.Tensor] = None, w2b: Optional[torch.Tensor] = None,
                     t2: Optional[torch.Tensor] = None, *, scale: float = 1.0,
                     base: Optional[torch.Tensor] = None,
                     stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int], str] = 0,
                     dilation: Union[int, Sequence[int]] = 1, groups: int = 1) -> torch.Tensor:
    """lokr_bypass_conv(x, w1=None, w1a=None, w1b=None, w2=None, w2a=None, w2b=None, t2=None, *, scale=1.0, base=None, stride=1, padding=0, dilation=1, groups=1) -> Tensor

    Conv LoKr bypass, eager: ``scale·conv(x, ΔW) [+ base]`` with ΔW the
    (a·c, b·d, *kernel) Kronecker weight, computed without building ΔW when
    groups == 1: x (N, b·d, *S) is viewed as (N·b, d, *S), convolved with w2
    (c, d, *kernel) using the layer's stride/padding/dilation, and the b axis is
    contracted with w1: ``y[n, u·c+i] = Σ_v w1[u, v]·z[n, v, i]``. With groups > 1,
    or a w2 of fewer than ``STRUCTURED_CONV_MIN_C`` output channels, ΔW is built
    (``lokr_weight``) and the layer's conv runs with it. 1-D, 2-D and 3-D convs.
    Output (N, a·c, *S') in x's dtype.
    """
    fn = "lokr_bypass_conv"
    C.tensor(fn, "x", x)
    scale = C.float_arg(fn, "scale", scale)
    cd = _compute(fn, x, w1, w1a, w1b, w2, w2a, w2b, t2)
    if groups != 1 or conv_formula_op(w1, w1a, w1b, w2, w2a, w2b, t2) is not None:
        dw = lokr_weight(w1, w1a, w1b, w2, w2a, w2b, t2, scale=scale).to(cd)
        nd = dw.dim() - 2
        if nd not in _CONV or x.dim() != nd + 2:
            C.fail(fn, f"x must be (N, C, *spatial) with {nd} spatial dims, got {tuple(x.shape)}")
        if x.shape[1] != dw.shape[1] * groups:
            C.fail(fn, f"x.shape[1] must be b*d*groups = {dw.shape[1] * groups}, got {x.shape[1]}")
        y = _CONV[nd](x.to(cd), dw, None, stride, padding, dilation, groups).to(x.dtype)
        return y if base is None else base + y
    w1, w2 = _whole_sides(fn, w1, w1a, w1b, w2, w2a, w2b, t2, cd)
    nd = w2.dim() - 2
    if nd not in _CONV:
        C.fail(fn, f"w2 must be a conv factor (c, d, *kernel) with 1-3 kernel dims, got {tuple(w2.shape)}")
    if x.dim() != nd + 2:
        C.fail(fn, f"x must be (N, b*d, *spatial) with {nd} spatial dims, got {tuple(x.shape)}")
    a, b = w1.shape
    c, d = w2.shape[:2]
    if x.shape[1] != b * d:
        C.fail(fn, f"x.shape[1] must be b*d = w1.shape[1]*w2.shape[1] = {b * d}, got {x.shape[1]}")
    N, spatial = x.shape[0], tuple(x.shape[2:])
    z = _CONV[nd](x.to(cd).reshape((N * b, d) + spatial), w2.to(cd), None, stride, padding, dilation)
    z = z.reshape((N, b, c) + tuple(z.shape[2:]))
    y = torch.einsum("uv,nvi...->nui...", w1.to(cd), z).reshape((N, a * c) + tuple(z.shape[3:]))
    if base is None:
        return (y * scale).to(x.dtype)
    C.tensor(fn, "base", base)
    _same_shape(fn, "base", base, tuple(y.shape), "(N, a*c, *spatial_out)")
    if base.dtype == y.dtype == x.dtype:
        return torch.add(base, y, alpha=scale)  # one kernel: scaled and added in fp32, rounded once
    return base + (y * scale).to(x.dtype)
