"""IA3 entry points (docs/ops.md §3.7): merge on the weight, bypass on the input or output.

All paths compute ``t ⊙ (α + γ·w[c])`` with ``lycoris.ia3_fwd`` (α = 1: the
scaled tensor itself; α = 0 with ``diff=True``: only the delta ``γ·w[c]·t``).
Operands keep their own dtypes; the result has ``promote_types(t, w)``.
A tensor ``multiplier`` (a scale with a gradient) goes through eager torch.

Channel axes: on a weight (O, I[, *kernel]) the IA3 vector scales the input
channels (axis 1) when ``train_on_input`` else the output channels (axis 0); on
an activation it scales the channel axis: −1 for linear, 1 for conv (N, C, ...).
"""
from __future__ import annotations

from typing import Callable, Union

import torch

__all__ = ["ia3_scale", "ia3_merge", "ia3_bypass"]

Scale = Union[float, torch.Tensor]


def ia3_scale(t: torch.Tensor, ia3_weight: torch.Tensor, channel_axis: int,
              multiplier: Scale = 1.0, diff: bool = False) -> torch.Tensor:
    """``t ⊙ (α + multiplier·w[c])`` along ``channel_axis``; α = 0 if ``diff`` else 1."""
    alpha = 0.0 if diff else 1.0
    if isinstance(multiplier, torch.Tensor):
        ax = channel_axis % t.dim()
        w = ia3_weight.reshape([t.shape[ax]] + [1] * (t.dim() - 1 - ax))
        return t * (w * multiplier + alpha)
    return torch.ops.lycoris.ia3_fwd(t, ia3_weight, channel_axis, alpha, float(multiplier))


def ia3_merge(org_weight: torch.Tensor, ia3_weight: torch.Tensor, multiplier: Scale = 1.0,
              train_on_input: bool = False, diff: bool = False) -> torch.Tensor:
    """Merged weight ``W ⊙ (1 + γ·w)`` (or the diff ``W ⊙ γ·w`` when ``diff``).

    org_weight: (O, I) or (O, I, *kernel); ia3_weight: I elements when
    ``train_on_input`` (scales in-channels, axis 1), else O (axis 0).
    """
    axis = 1 if train_on_input else 0
    return ia3_scale(org_weight, ia3_weight, axis, multiplier, diff)


def ia3_bypass(x: torch.Tensor, ia3_weight: torch.Tensor, org_forward: Callable[[torch.Tensor], torch.Tensor],
               multiplier: Scale = 1.0, train_on_input: bool = False, is_conv: bool = False,
               diff: bool = False) -> torch.Tensor:
    """Bypass forward: ``org_forward(x ⊙ s)`` when ``train_on_input`` else ``org_forward(x) ⊙ s``,
    ``s = α + γ·w`` along the channel axis (−1 linear, 1 conv)."""
    axis = 1 if is_conv else -1
    if train_on_input:
        return org_forward(ia3_scale(x, ia3_weight, axis, multiplier, diff))
    return ia3_scale(org_forward(x), ia3_weight, axis, multiplier, diff)
