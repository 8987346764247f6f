"""LoCon / LoRA entry points (docs/ops.md §3.1), plus the trivial GLoRA (docs/ops.md §3.8)
and DyLoRA (§3.9) merges.

``scale`` is the γ the LyCORIS module applies (``alpha / rank · multiplier``),
a Python float. Factor layouts are the module's own:

- linear: up (O, r), down (r, I);
- conv:   up (O, r, 1, ..), down (r, I, *kernel);
- conv with a tucker mid: up (O, r, 1, ..), mid (r, r, *kernel), down (r, I, 1, ..)
  (mid's first index is the up side, its second the down side).

Operands of different float dtypes are promoted by the ops themselves
(docs/ops.md §1.3); float16 with bfloat16 is an error. ``base`` (the original weight
for a merge, the base layer's output for a bypass) is folded into the op when
``promote_types(base.dtype, compute) == base.dtype`` (result in base's dtype),
otherwise added eagerly afterwards (ordinary torch promotion).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from lycoris_ops.reference import checks as C

lycoris = torch.ops.lycoris

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _foldable(base: Optional[torch.Tensor], compute: torch.dtype) -> bool:
    return base is not None and torch.promote_types(base.dtype, compute) == base.dtype


def _flat_1x1(name: str, t: torch.Tensor) -> torch.Tensor:
    """(A, B, 1, ..) -> (A, B); a 2-D tensor passes through."""
    if t.dim() > 2 and any(s != 1 for s in t.shape[2:]):
        C.fail("functional.locon", f"{name} must be (A, B) or (A, B, 1, ...) here, got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], t.shape[1]) if t.dim() != 2 else t


def _acc(c):
    return torch.float64 if c == torch.float64 else torch.float32


def _add_base(delta: torch.Tensor, base: Optional[torch.Tensor], compute: torch.dtype) -> torch.Tensor:
    """Eager ``base + delta``: in base's dtype (one rounding) when foldable, else torch promotion."""
    if base is None:
        return delta
    delta = delta.reshape(base.shape)
    if _foldable(base, compute):
        return (base.to(_acc(compute)) + delta.to(_acc(compute))).to(base.dtype)
    return base + delta


def merge(up: torch.Tensor, down: torch.Tensor, scale: float = 1.0, *, mid: Optional[torch.Tensor] = None,
          base: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """LoCon/LoRA weight merge: ``scale·ΔW [+ base]`` in the weight's shape.

    - no mid: ``ΔW = up·down`` with up (O, r[, 1, ..]) and down (r, I[, *kernel])
      flattened to (r, I·Kk); result (O, I[, *kernel]) via ``lora_merge_fwd``
      (mode plain), base (the original weight, same shape) folded when safe.
    - mid (r, r, *kernel) (conv tucker): ``ΔW[o,i,κ] = Σ up[o,p]·mid[p,q,κ]·down[q,i]``
      via ``lora_tucker_fwd``; result (O, I, *kernel); base added eagerly.

    Output dtype: base's when folded, else ``out_dtype`` (default up's dtype).
    Differentiable in every tensor argument.
    """
    if mid is None:
        u = _flat_1x1("up", up)
        d = down.reshape(down.shape[0], -1) if down.dim() != 2 else down
        shape = (u.shape[0],) + tuple(down.shape[1:])
        c = C.compute_dtype("functional.locon.merge", up=u, down=d)
        if _foldable(base, c):
            y = lycoris.lora_merge_fwd(u, d, None, None, base.reshape(u.shape[0], -1), float(scale), "plain",
                                       base.dtype)
            return y.reshape(base.shape)
        y = lycoris.lora_merge_fwd(u, d, None, None, None, float(scale), "plain", out_dtype).reshape(shape)
        return _add_base(y, base, c)
    u = _flat_1x1("up", up)
    d = _flat_1x1("down", down)
    t = mid.reshape(mid.shape[0], mid.shape[1], -1)
    c = C.compute_dtype("functional.locon.merge", up=u, mid=t, down=d)
    y = lycoris.lora_tucker_fwd(u, t, d, None, None, None, float(scale))
    y = y.reshape((u.shape[0], d.shape[1]) + tuple(mid.shape[2:]))
    if out_dtype is not None and base is None:
        y = y.to(out_dtype)
    return _add_base(y, base, c)


def bypass(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float = 1.0, *,
           mid: Optional[torch.Tensor] = None, base: Optional[torch.Tensor] = None,
           stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int], str] = 0,
           dilation: Union[int, Sequence[int]] = 1) -> torch.Tensor:
    """LoCon/LoRA bypass: ``scale·up(mid(down(x))) [+ base]`` without building ΔW.

    - linear (down 2-D, no mid): x (..., I), up (O, r), down (r, I) ->
      ``lora_bypass_fwd`` on x flattened to (T, I); result (..., O). base (the
      base layer's output, (..., O)) folded when safe.
    - conv (down (r, I, *kernel), or a mid given): x (N, I, *spatial), an eager
      conv chain with groups=1: down conv (the layer's stride/padding/dilation,
      or 1×1 when mid is given), mid conv (the layer's stride/padding/dilation),
      1×1 up conv; all in the compute dtype, scale and base add in fp32.

    Output dtype: base's when folded, else x's (an unfoldable base is added
    eagerly with torch promotion).
    """
    if mid is None and down.dim() == 2:
        u = _flat_1x1("up", up)
        c = C.compute_dtype("functional.locon.bypass", x=x, up=u, down=down)
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1])
        O = u.shape[0]
        if _foldable(base, c):
            y = lycoris.lora_bypass_fwd(xf, u, down, float(scale), base.reshape(-1, O))
            return y.reshape(base.shape)
        y = lycoris.lora_bypass_fwd(xf, u, down, float(scale)).reshape(*lead, O)
        return y if base is None else base + y
    nd = x.dim() - 2
    if nd not in _CONV:
        C.fail("functional.locon.bypass", f"a conv bypass needs x of rank 3, 4 or 5 (N, C, *spatial), got {x.dim()}-D")
    conv = _CONV[nd]
    ones = (1,) * nd
    c = C.compute_dtype("functional.locon.bypass", x=x, up=up, down=down, mid=mid)
    xc = x.to(c)
    O, r = up.shape[0], up.shape[1]
    if mid is None:
        h = conv(xc, down.to(c), stride=stride, padding=padding, dilation=dilation)
    else:
        h = conv(xc, down.to(c).reshape(down.shape[0], down.shape[1], *ones))
        h = conv(h, mid.to(c), stride=stride, padding=padding, dilation=dilation)
    y = conv(h, up.to(c).reshape(O, r, *ones))
    if base is not None and base.dtype == c:
        # one kernel, as the user's `base + γ·conv(…)`: torch.add scales and adds in fp32 and rounds once
        return torch.add(base, y, alpha=float(scale))
    y = y.to(_acc(c)) * float(scale)
    if base is None:
        return y.to(x.dtype)
    if _foldable(base, c):
        return (base.to(_acc(c)) + y).to(base.dtype)
    return base + y.to(x.dtype)


def dylora_merge(up: torch.Tensor, down: torch.Tensor, rank: int, scale: float = 1.0, *,
                 base: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """DyLoRA merge (docs/ops.md §3.9): the plain LoCon merge of the rank-sliced
    factors ``up[:, :rank]`` (O, rank[, 1, ..]) and ``down[:rank]`` (rank, I[, *kernel])."""
    return merge(up[:, :rank], down[:rank], scale, base=base, out_dtype=out_dtype)


def glora_merge(weight: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor,
                scale: float = 1.0, *, base: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """GLoRA linear merge (docs/ops.md §3.8): ``scale·(W·a1·a2 + b1·b2) [+ base]``.

    weight W (O, I), a1 (I, r), a2 (r, I), b1 (O, r'), b2 (r', I). ``U = W·a1``
    (torch GEMM, in the graph), then ``lora_merge_fwd(U, a2, b1, b2, base?, scale,
    "sum")``. base (O, I), e.g. W itself, folded when safe. Result (O, I).
    """
    c0 = C.compute_dtype("functional.locon.glora_merge", weight=weight, a1=a1)
    U = weight.to(c0) @ a1.to(c0)
    c = C.compute_dtype("functional.locon.glora_merge", U=U, a2=a2, b1=b1, b2=b2)
    if _foldable(base, c):
        return lycoris.lora_merge_fwd(U, a2, b1, b2, base, float(scale), "sum", base.dtype)
    y = lycoris.lora_merge_fwd(U, a2, b1, b2, None, float(scale), "sum", out_dtype)
    return _add_base(y, base, c)
