"""LoHa: ``ΔW = (w1a·w1b)⊙(w2a·w2b)`` (Hadamard product of two low-rank products)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from lycoris_ops.functional import loha as _loha
from lycoris_ops.nn.base import RankAdapter, check_conv


class LoHaLinear(RankAdapter):
    """``ΔW = (alpha/rank)·m·(w1a·w1b)⊙(w2a·w2b)``; w1a, w1b, w2b normal(0.1), w2a zero."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0):
        super().__init__(base, rank, alpha, multiplier)
        self._make(base.out_features, base.in_features, base.weight)

    def _make(self, O, I, w):
        kw = dict(device=w.device, dtype=w.dtype)
        r = self.rank
        self.hada_w1_a = nn.Parameter(torch.randn(O, r, **kw) * 0.1)
        self.hada_w1_b = nn.Parameter(torch.randn(r, I, **kw) * 0.1)
        self.hada_w2_a = nn.Parameter(torch.zeros(O, r, **kw))
        self.hada_w2_b = nn.Parameter(torch.randn(r, I, **kw) * 0.1)

    def _f(self):
        return self.hada_w1_a, self.hada_w1_b, self.hada_w2_a, self.hada_w2_b

    def _tucker(self):
        return {}

    def adapter_forward(self, x):
        return _loha.bypass(x, *self._f(), self.gamma, base=self.base(x))

    def route(self):
        return "lycoris.loha_bypass_fwd", None

    def merged_weight(self):
        return _loha.merge(*self._f(), self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _loha.merge(*self._f(), -self.gamma, base=self.base.weight), None

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        W = self.base.weight
        return _loha.merge(*self._f(), self.scale, **self._tucker(), shape=W.shape, out_dtype=W.dtype)

    def _delta_op(self) -> str:
        return "lycoris.lora_merge_fwd"


class LoHaConv2d(LoHaLinear):
    """LoHa on a conv: w1b/w2b stored (r, I·kh·kw); forward builds ΔW with the merge op, then conv.
    ``use_tucker`` (a kernel larger than 1×1): cores ``hada_t1``/``hada_t2`` (r, r, kh, kw) and
    factors stored the LyCORIS way, w1a/w2a (r, O), w1b/w2b (r, I); merge via ``lora_tucker_fwd``."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 use_tucker: bool = False):
        RankAdapter.__init__(self, base, rank, alpha, multiplier)
        check_conv(base, "LoHaConv2d")
        if use_tucker and tuple(base.kernel_size) != (1, 1):
            w, r = base.weight, self.rank
            kw = dict(device=w.device, dtype=w.dtype)
            O, I = base.out_channels, base.in_channels
            self.hada_t1 = nn.Parameter(torch.randn(r, r, *base.kernel_size, **kw) * 0.1)
            self.hada_t2 = nn.Parameter(torch.randn(r, r, *base.kernel_size, **kw) * 0.1)
            self.hada_w1_a = nn.Parameter(torch.randn(r, O, **kw) * 0.1)
            self.hada_w1_b = nn.Parameter(torch.randn(r, I, **kw) * 0.1)
            self.hada_w2_a = nn.Parameter(torch.zeros(r, O, **kw))
            self.hada_w2_b = nn.Parameter(torch.randn(r, I, **kw) * 0.1)
        else:
            self.hada_t1 = self.hada_t2 = None
            self._make(base.out_channels, base.in_channels * math.prod(base.kernel_size), base.weight)

    def _tucker(self):
        return dict(t1=self.hada_t1, t2=self.hada_t2)

    def adapter_forward(self, x):
        b = self.base
        return _loha.bypass(x, *self._f(), self.gamma, **self._tucker(), base=b(x), kernel_size=b.kernel_size,
                            stride=b.stride, padding=b.padding, dilation=b.dilation)

    def route(self):  # the conv runs with ΔW from the merge op
        return self._delta_op(), None

    def _delta_op(self) -> str:
        return "lycoris.lora_tucker_fwd" if self.hada_t1 is not None else "lycoris.lora_merge_fwd"

    def merged_weight(self, sign: float = 1.0):
        return _loha.merge(*self._f(), sign * self.gamma, **self._tucker(), base=self.base.weight), None

    def unmerged_weight(self):
        return self.merged_weight(-1.0)
