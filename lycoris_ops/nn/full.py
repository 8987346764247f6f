"""Full fine-tune as an adapter (a learned ΔW, ΔB) and LyCORIS's Norms (the same on a
norm layer's affine weight and bias)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import full as _full
from lycoris_ops.nn.base import AdapterModule, ConvByWeight


class FullLinear(AdapterModule):
    """Full fine-tune as an adapter: ``W + m·diff`` and ``b + m·diff_b`` (both zero init), ``add_scaled``."""

    uses_rank = False

    def __init__(self, base: nn.Linear, multiplier: float = 1.0):
        super().__init__(base, multiplier)
        self.diff = nn.Parameter(torch.zeros_like(base.weight))
        self.diff_b = None if base.bias is None else nn.Parameter(torch.zeros_like(base.bias))

    def merged_weight(self, sign: float = 1.0):
        return _full.full_merge(self.base.weight, self.diff, sign * self.multiplier, self.base.bias, self.diff_b)

    def unmerged_weight(self):
        return self.merged_weight(-1.0)

    def adapter_forward(self, x):
        w, b = self.merged_weight()
        return F.linear(x, w, b)

    def route(self):
        return "lycoris.add_scaled", None


class NormAdapter(AdapterModule):
    """LyCORIS' Norms algorithm: the affine weight and bias of a ``LayerNorm`` / ``GroupNorm``
    moved by learned deltas, ``W + m·w_norm`` and ``b + m·b_norm`` (zero init, ``add_scaled``),
    then the norm itself with them. Needs an affine norm (a weight to move)."""

    uses_rank = False
    bases = (nn.LayerNorm, nn.GroupNorm)

    def __init__(self, base: nn.Module, multiplier: float = 1.0):
        if isinstance(base, self.bases) and base.weight is None:
            raise ValueError(f"lycoris_ops.nn.NormAdapter: {type(base).__name__} has no affine weight "
                             "(elementwise_affine/affine=False): nothing to adapt")
        super().__init__(base, multiplier)
        self.w_norm = nn.Parameter(torch.zeros_like(base.weight))
        self.b_norm = None if base.bias is None else nn.Parameter(torch.zeros_like(base.bias))

    def merged_weight(self, sign: float = 1.0):
        return _full.norms_merge(self.base.weight, self.w_norm, sign * self.multiplier, self.base.bias, self.b_norm)

    def unmerged_weight(self):
        return self.merged_weight(-1.0)

    def adapter_forward(self, x):
        w, b = self.merged_weight()
        base = self.base
        if isinstance(base, nn.GroupNorm):
            return F.group_norm(x, base.num_groups, w, b, base.eps)
        return F.layer_norm(x, base.normalized_shape, w, b, base.eps)

    def route(self):
        return "lycoris.add_scaled", None


class FullConv2d(ConvByWeight, FullLinear):
    """Full fine-tune of a conv as an adapter: ``W + m·diff``, ``b + m·diff_b``."""
