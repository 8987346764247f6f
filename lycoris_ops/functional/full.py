"""Full and Norms merges (docs/ops.md §3.10, §3.11) with ``lycoris.add_scaled``.

Both compute ``W_org + multiplier·Δ`` for the weight and (when present) the bias:
Full with its stored diff, Norms with its norm-layer weight/bias deltas. The
result has W_org's shape and dtype (fp32 arithmetic, one rounding); Δ may be in
another float dtype (not float16 with bfloat16) and has W_org's shape.
Gradients: ``G`` for W_org and ``multiplier·G`` for Δ, each in its own dtype.
A tensor ``multiplier`` (a scale with a gradient) goes through eager torch.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from lycoris_ops.reference.add import check_add_scaled

__all__ = ["scaled_add", "full_merge", "norms_merge"]

Scale = Union[float, torch.Tensor]


def scaled_add(base: torch.Tensor, delta: torch.Tensor, multiplier: Scale = 1.0) -> torch.Tensor:
    """``base + multiplier·delta`` in base's shape and dtype."""
    if isinstance(multiplier, torch.Tensor):
        check_add_scaled(base, delta, 1.0)  # the op's rules: delta of base's shape, no broadcasting
        return (base + multiplier * delta).to(base.dtype)
    return torch.ops.lycoris.add_scaled(base, delta, float(multiplier))


def full_merge(org_weight: torch.Tensor, diff: torch.Tensor, multiplier: Scale = 1.0,
               org_bias: Optional[torch.Tensor] = None, diff_b: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Full (``full`` algo) merged weight and bias: ``(W + m·diff, b + m·diff_b)``.

    The bias is ``None`` when the layer has none; without ``diff_b`` it is
    ``org_bias`` unchanged.
    """
    weight = scaled_add(org_weight, diff, multiplier)
    if org_bias is None:
        return weight, None
    bias = org_bias if diff_b is None else scaled_add(org_bias, diff_b, multiplier)
    return weight, bias


def norms_merge(org_weight: torch.Tensor, w_norm: torch.Tensor, multiplier: Scale = 1.0,
                org_bias: Optional[torch.Tensor] = None, b_norm: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Norms merged weight and bias: ``(W + m·w_norm, b + m·b_norm)``."""
    return full_merge(org_weight, w_norm, multiplier, org_bias, b_norm)
