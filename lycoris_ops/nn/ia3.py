"""IA3: the output (or input) channels scaled by a learned vector, ``1 + m·w``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import ia3 as _ia3
from lycoris_ops.nn.base import AdapterModule, ConvByWeight, out_in


class IA3Linear(AdapterModule):
    """``y = base(x)⊙(1 + m·w)`` (w: O, zero init), or with ``train_on_input``
    ``y = base(x⊙(1 + m·w))`` (w: I). The merge scales W's rows (and the bias) or columns.
    ``scale_bias=False`` (LyCORIS's IA3; the loader sets it): on the output only the weight's
    rows are scaled, ``y = (x·Wᵀ)⊙(1 + m·w) + b``."""

    additive = False
    uses_rank = False

    def __init__(self, base: nn.Linear, multiplier: float = 1.0, train_on_input: bool = False,
                 scale_bias: bool = True):
        super().__init__(base, multiplier)
        self.train_on_input = bool(train_on_input)
        self.scale_bias = bool(scale_bias)
        n = out_in(base)[1 if train_on_input else 0]
        self.ia3_weight = nn.Parameter(torch.zeros(n, device=base.weight.device, dtype=base.weight.dtype))

    def adapter_forward(self, x):
        if self.train_on_input:
            return self.base(_ia3.ia3_scale(x, self.ia3_weight, -1, self.multiplier).to(x.dtype))
        b = self.base.bias
        if self.scale_bias or b is None:
            y = self.base(x)
            return _ia3.ia3_scale(y, self.ia3_weight, -1, self.multiplier).to(y.dtype)
        y = F.linear(x, self.base.weight)
        return _ia3.ia3_scale(y, self.ia3_weight, -1, self.multiplier).to(y.dtype) + b

    def route(self):
        return "lycoris.ia3_fwd", None

    def merged_weight(self):
        W, b = self.base.weight, self.base.bias
        w = _ia3.ia3_merge(W, self.ia3_weight, self.multiplier, self.train_on_input).to(W.dtype)
        if b is not None and not self.train_on_input and self.scale_bias:
            b = _ia3.ia3_scale(b, self.ia3_weight, 0, self.multiplier).to(b.dtype)
        return w, b


class IA3Conv2d(ConvByWeight, IA3Linear):
    """IA3 on a conv: output channels (or input channels with ``train_on_input``) scaled by 1 + m·w."""
