"""LoHa entry points (docs/ops.md §3.2).

``scale`` is the γ the LyCORIS module applies (``alpha / rank · multiplier``),
a Python float. Factor layouts are the module's own (``hada_w1_a`` ... names):

- plain: w1a, w2a (O, r) "up"; w1b, w2b (r, I·Kk) "down" (a conv weight's
  in-channels and kernel flattened; (r, I, *kernel) is accepted too);
- tucker (conv): t1, t2 (r, r, *kernel); w1a, w2a stored (r, O); w1b, w2b (r, I).

``ΔW = (w1a·w1b) ⊙ (w2a·w2b)`` (tucker: ``ΔW[o,i,κ] = C1 ⊙ C2`` with
``C[o,i,κ] = Σ wa[p,o]·t[p,q,κ]·wb[q,i]``). Dtype promotion happens inside the
ops (docs/ops.md §1.3). ``base`` is folded into the op when
``promote_types(base.dtype, compute) == base.dtype`` (result in base's dtype),
else added eagerly afterwards.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from lycoris_ops.reference import checks as C

lycoris = torch.ops.lycoris

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _acc(c):
    return torch.float64 if c == torch.float64 else torch.float32


def _foldable(base, compute) -> bool:
    return base is not None and torch.promote_types(base.dtype, compute) == base.dtype


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def merge(w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor, scale: float = 1.0, *,
          t1: Optional[torch.Tensor] = None, t2: Optional[torch.Tensor] = None,
          shape: Optional[Sequence[int]] = None, base: Optional[torch.Tensor] = None,
          out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """LoHa weight merge: ``scale·ΔW [+ base]`` in the weight's shape.

    - plain (no t1/t2): ``lora_merge_fwd(w1a, w1b, w2a, w2b, base?, scale, "hada")``
      -> (O, I·Kk), reshaped to ``shape`` (default: base's shape, else
      (O,) + w1b.shape[1:]). base (the original weight) folded when safe.
    - tucker (t1 and t2): ``lora_tucker_fwd(w1aᵀ, t1, w1b, w2aᵀ, t2, w2b, scale)``
      -> (O, I, *kernel); base added eagerly.

    Output dtype: base's when folded, else ``out_dtype`` (default w1a's dtype).
    """
    if (t1 is None) != (t2 is None):
        C.fail("functional.loha.merge", "t1 and t2 must be given together (tucker) or not at all")
    if t1 is None:
        a1, b1, a2, b2 = w1a, _flat(w1b), w2a, _flat(w2b)
        if shape is None:
            shape = base.shape if base is not None else (a1.shape[0],) + tuple(w1b.shape[1:])
        c = C.compute_dtype("functional.loha.merge", w1a=a1, w1b=b1, w2a=a2, w2b=b2)
        if _foldable(base, c):
            y = lycoris.lora_merge_fwd(a1, b1, a2, b2, base.reshape(a1.shape[0], -1), float(scale), "hada",
                                       base.dtype)
            return y.reshape(shape)
        y = lycoris.lora_merge_fwd(a1, b1, a2, b2, None, float(scale), "hada", out_dtype).reshape(shape)
    else:
        k = tuple(t1.shape[2:])
        T1 = t1.reshape(t1.shape[0], t1.shape[1], -1)
        T2 = t2.reshape(t2.shape[0], t2.shape[1], -1)
        c = C.compute_dtype("functional.loha.merge", w1a=w1a, t1=T1, w1b=w1b, w2a=w2a, t2=T2, w2b=w2b)
        y = lycoris.lora_tucker_fwd(w1a.t(), T1, w1b, w2a.t(), T2, w2b, float(scale))
        y = y.reshape((w1a.shape[1], w1b.shape[1]) + k if shape is None else tuple(shape))
        if out_dtype is not None and base is None:
            y = y.to(out_dtype)
    if base is None:
        return y
    y = y.reshape(base.shape)
    if _foldable(base, c):
        return (base.to(_acc(c)) + y.to(_acc(c))).to(base.dtype)
    return base + y


def bypass(x: torch.Tensor, w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor,
           scale: float = 1.0, *, t1: Optional[torch.Tensor] = None, t2: Optional[torch.Tensor] = None,
           base: Optional[torch.Tensor] = None, kernel_size: Optional[Sequence[int]] = None,
           stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int], str] = 0,
           dilation: Union[int, Sequence[int]] = 1) -> torch.Tensor:
    """LoHa bypass: ``scale·layer(x; ΔW) [+ base]``.

    - linear (no t1/t2, no kernel_size, 2-D w1b): x (..., I) ->
      ``loha_bypass_fwd`` on x flattened to (T, I) (ΔW never stored); result
      (..., O); base (the base layer's output, (..., O)) folded when safe.
    - conv (t1/t2 given, or kernel_size given, or w1b (r, I, *kernel)): x
      (N, I, *spatial); ΔW built with :func:`merge` (kernel from t1, w1b or
      ``kernel_size``), then ``F.conv{1,2,3}d(x, scale·ΔW, stride, padding,
      dilation)`` (groups=1) in the compute dtype.

    Output dtype: base's when folded, else x's.
    """
    conv_path = t1 is not None or kernel_size is not None or w1b.dim() > 2
    if not conv_path:
        c = C.compute_dtype("functional.loha.bypass", x=x, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
        lead = x.shape[:-1]
        xf = x.reshape(-1, x.shape[-1])
        O = w1a.shape[0]
        if _foldable(base, c):
            y = lycoris.loha_bypass_fwd(xf, w1a, w1b, w2a, w2b, float(scale), base.reshape(-1, O))
            return y.reshape(base.shape)
        y = lycoris.loha_bypass_fwd(xf, w1a, w1b, w2a, w2b, float(scale)).reshape(*lead, O)
        return y if base is None else base + y
    nd = x.dim() - 2
    if nd not in _CONV:
        C.fail("functional.loha.bypass", f"a conv bypass needs x of rank 3, 4 or 5 (N, C, *spatial), got {x.dim()}-D")
    c = C.compute_dtype("functional.loha.bypass", x=x, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, t1=t1, t2=t2)
    if t1 is not None:
        dw = merge(w1a, w1b, w2a, w2b, scale, t1=t1, t2=t2)
    else:
        if kernel_size is None:
            kernel_size = tuple(w1b.shape[2:])
        kernel_size = tuple(kernel_size) if isinstance(kernel_size, (tuple, list)) else (kernel_size,) * nd
        dw = merge(w1a, w1b, w2a, w2b, scale, shape=(w1a.shape[0], x.shape[1]) + kernel_size)
    y = _CONV[nd](x.to(c), dw.to(c), stride=stride, padding=padding, dilation=dilation)
    if base is None:
        return y.to(x.dtype)
    if base.dtype == c:
        return torch.add(base, y)  # one kernel; the sum is formed in fp32 and rounded once, as below
    if _foldable(base, c):
        return (base.to(_acc(c)) + y.to(_acc(c))).to(base.dtype)
    return base + y.to(x.dtype)
