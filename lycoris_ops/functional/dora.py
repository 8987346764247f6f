"""DoRA weight decomposition epilogue (docs/ops.md §3.4) for DoRA / DoHa / DoKr.

``weight_decompose(weight, dora_scale, multiplier, wd_on_out, delta=None)``
returns ``M · s`` with ``M = weight + delta`` and, per norm vector,
``s = multiplier·(dora_scale / (‖M‖ + ε) − 1) + 1`` (ε = finfo(dora_scale.dtype).eps),
i.e. LyCORIS's ``apply_weight_decompose``:

- ``wd_on_out=True``: one norm per output channel, over in-features and kernel
  (``lycoris.dora_fwd`` on the (O, I·Kk) view, row_axis 0);
- ``wd_on_out=False`` on a 2-D (linear) weight: one norm per input feature over
  the outputs (row_axis 1);
- ``wd_on_out=False`` on a conv weight (norm per in-channel over out and spatial
  axes): no 2-D view, eager torch (same numerics: fp32 math, one rounding);
- a tensor ``multiplier`` (a scale with a gradient) also goes eager.

Output dtype: the dtype of M (``promote_types(weight, delta)``; weight's when
delta is None) — eager LyCORIS returns dora_scale's dtype; cast if you need it.
Passing ``delta`` (ΔW) lets the fused op read ``weight + delta`` in-kernel so M is
never stored; the gradient of M goes to both weight and delta.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from lycoris_ops.reference import cast, mm32

__all__ = ["weight_decompose", "lowrank_norm_terms", "lowrank_norm_grads"]


def _eager(weight, dora_scale, multiplier, wd_on_out, delta, out_dtype):
    wide = torch.float64 if all(
        t.dtype == torch.float64 for t in (weight, dora_scale, delta) if t is not None) else torch.float32
    m = weight.to(wide) if delta is None else weight.to(wide) + delta.to(wide)
    axis = 0 if wd_on_out else 1
    other = [d for d in range(m.dim()) if d != axis]
    norm = torch.linalg.vector_norm(m, dim=other, keepdim=True) + torch.finfo(dora_scale.dtype).eps
    shape = [1] * m.dim()
    shape[axis] = m.shape[axis]
    mult = multiplier.to(wide) if isinstance(multiplier, torch.Tensor) else multiplier
    scale = mult * (dora_scale.reshape(shape).to(wide) / norm - 1) + 1
    return (m * scale).to(out_dtype)


def weight_decompose(weight: torch.Tensor, dora_scale: torch.Tensor,
                     multiplier: Union[float, torch.Tensor] = 1.0, wd_on_out: bool = True,
                     delta: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DoRA rescale of ``M = weight + delta`` (see the module docstring).

    weight, delta: (O, I) or a conv weight (O, I, *kernel), same shape;
    dora_scale: O elements when ``wd_on_out`` (e.g. (O, 1[, 1, 1])), else I
    (e.g. (1, I[, 1, 1])). Returns M's shape in M's dtype.
    """
    if delta is not None and delta.shape != weight.shape:
        raise ValueError(f"lycoris.weight_decompose: delta must have weight's shape {tuple(weight.shape)}, "
                         f"got {tuple(delta.shape)}")
    out_dtype = weight.dtype if delta is None else torch.promote_types(weight.dtype, delta.dtype)
    if weight.dim() < 2:
        raise ValueError(f"lycoris.weight_decompose: weight must be 2-D or a conv weight, got shape "
                         f"{tuple(weight.shape)}")
    if isinstance(multiplier, torch.Tensor) or (not wd_on_out and weight.dim() > 2):
        return _eager(weight, dora_scale, multiplier, wd_on_out, delta, out_dtype)
    # M = w + delta is symmetric: pass the wider operand as `w` so y comes out in M's dtype.
    w, d = weight, delta
    if d is not None and d.dtype == out_dtype and w.dtype != out_dtype:
        w, d = d, w
    flat = (w.shape[0], math.prod(w.shape[1:]))
    y, _ = torch.ops.lycoris.dora_fwd(w.reshape(flat), dora_scale, float(multiplier),
                                      0 if wd_on_out else 1, None if d is None else d.reshape(flat))
    return y.reshape(weight.shape)


def lowrank_norm_terms(Wv, a, b, gamma):
    """``(‖M_o‖², P, S)`` for the rows o of ``M = Wv + γ·a·b`` (Wv (O, I), a (O, r), b (r, I)),
    fp32 (fp64 stays fp64), without forming M: ``P = Wv·bᵀ`` (O, r), ``S = b·bᵀ`` (r, r),
    ``‖M_o‖² = ‖Wv_o‖² + 2γ·a_o·P_o + γ²·a_o·S·a_oᵀ``."""
    f = torch.float64 if torch.float64 in (Wv.dtype, a.dtype, b.dtype) else torch.float32
    P = cast(mm32(Wv, cast(b, Wv.dtype).t()), f)  # the one pass over W (O·I·r)
    af, bf = cast(a, f), cast(b, f)
    S = bf @ bf.t()
    # few launches (eager runs these per layer and step): (2γ·P + γ²·a·S)·a summed per row
    m2 = torch.linalg.vecdot(torch.addmm(P, af, S, beta=2 * gamma, alpha=gamma * gamma), af, dim=1)
    return m2.add_(torch.linalg.vector_norm(Wv, dim=1, dtype=f).square_()), P, S


def lowrank_norm_grads(Wv, a, b, gamma, P, S, g_m2):
    """Gradients of ``Σ_o g_m2_o·‖M_o‖²`` (see ``lowrank_norm_terms``) for a and b:
    ``g_a = 2γ·g⊙(P + γ·a·S)``, ``g_b = 2γ·((g⊙a)ᵀ·Wv + γ·(aᵀ·(g⊙a))·b)`` (one more pass over W)."""
    f = P.dtype
    af, bf = cast(a, f), cast(b, f)
    g = g_m2[:, None]
    ga = g * af  # (O, r)
    g_a = torch.addmm(g * P, ga, S, alpha=gamma).mul_(2 * gamma)
    g_b = torch.addmm(cast(mm32(cast(ga, Wv.dtype).t(), Wv), f), af.t() @ ga, bf, alpha=gamma).mul_(2 * gamma)
    return g_a.to(a.dtype), g_b.to(b.dtype)
