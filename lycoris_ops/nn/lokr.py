"""LoKr: ``ΔW = kron(w1, w2)`` with either side whole or a low-rank product."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn

from lycoris_ops.functional import lokr as _lokr
from lycoris_ops.nn.base import RankAdapter, check_conv, factorization, kaiming_, out_in


#: LoKr factor name (``functional.lokr``'s keywords) -> the module attribute, LyCORIS's tensor name
LOKR_FACTORS = {"w1": "lokr_w1", "w1a": "lokr_w1_a", "w1b": "lokr_w1_b", "w2": "lokr_w2", "w2a": "lokr_w2_a",
                "w2b": "lokr_w2_b", "t2": "lokr_t2"}


class LoKrLinear(RankAdapter):
    """``ΔW = scale·m·kron(w1, w2)``, O = a·c, I = b·d with (a, c) = factorization(O, factor),
    (b, d) = factorization(I, factor). w1 (a, b) whole (or w1a·w1b with ``decompose_both``),
    w2 = w2a (c, r)·w2b (r, d) when ``rank < max(c, d)/2`` else whole (c, d). The w2 side
    (w2 or w2a) is zero-initialised. scale = alpha/rank when a side is factored, else 1."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False):
        super().__init__(base, rank, alpha, multiplier)
        check_conv(base, type(self).__name__)
        O, I = out_in(base)
        a, c = factorization(O, factor)
        b, d = factorization(I, factor)
        k = tuple(getattr(base, "kernel_size", ()))  # a conv's w2 side carries the kernel
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        r = self.rank
        names = []
        if decompose_both and r < max(a, b) / 2 and not full_matrix:
            self.lokr_w1_a = nn.Parameter(kaiming_(torch.empty(a, r, **kw)))
            self.lokr_w1_b = nn.Parameter(kaiming_(torch.empty(r, b, **kw)))
            names += ["w1a", "w1b"]
        else:
            self.lokr_w1 = nn.Parameter(kaiming_(torch.empty(a, b, **kw)))
            names += ["w1"]
        if r < max(c, d) / 2 and not full_matrix:
            self.lokr_w2_a = nn.Parameter(torch.zeros(c, r, **kw))
            self.lokr_w2_b = nn.Parameter(kaiming_(torch.empty(r, d, *k, **kw)))
            names += ["w2a", "w2b"]
        else:
            self.lokr_w2 = nn.Parameter(torch.zeros(c, d, *k, **kw))
            names += ["w2"]
        self._names = tuple(names)
        if not self._factored():  # the scale is 1; LyCORIS then saves alpha = rank
            self.alpha.fill_(r)
            self._alpha = float(r)

    def _factored(self) -> bool:
        return "w1a" in self._names or "w2a" in self._names

    @property
    def scale(self) -> float:
        return self._alpha / self.rank if self._factored() else 1.0

    def factors(self) -> Dict[str, torch.Tensor]:
        return {n: getattr(self, LOKR_FACTORS[n]) for n in self._names}

    def adapter_forward(self, x):
        return _lokr.lokr_bypass(x, **self.factors(), scale=self.gamma, base=self.base(x))

    def route(self):
        return "lycoris.lokr_bypass_fwd", None

    def merged_weight(self):
        return _lokr.lokr_weight(**self.factors(), scale=self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _lokr.lokr_weight(**self.factors(), scale=-self.gamma, base=self.base.weight), None

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        W = self.base.weight
        return _lokr.lokr_weight(**self.factors(), scale=self.scale).reshape(W.shape).to(W.dtype)

    def _delta_op(self) -> str:
        # a tucker w2 is built whole first: only a factored side takes the factored merge
        factored = "w1a" in self._names or ("w2a" in self._names and "t2" not in self._names)
        return "lycoris.lokr_merge_fwd" if factored else "lycoris.lokr_full_merge_fwd"


class LoKrConv2d(LoKrLinear):
    """LoKr on a conv: ``ΔW = scale·m·kron(w1, w2)`` of shape (O, I, kh, kw), w1 (a, b) broadcast
    over the kernel, w2 (c, d, kh, kw) whole or w2a (c, r)·w2b (r, d, kh, kw) (factored when
    ``rank < max(c, d)/2``); a LyCORIS state dict may also hold the tucker side (``lokr_t2``
    (r, r, kh, kw), w2a (r, c), w2b (r, d)). Forward: ``lokr_bypass_conv`` (x convolved with w2
    per group of d input channels, then contracted with w1; ΔW built only for a w2 narrower than
    ``STRUCTURED_CONV_MIN_C`` output channels, where the layer's own conv is faster)."""

    bases = (nn.Conv2d,)

    def adapter_forward(self, x):
        b = self.base
        return _lokr.lokr_bypass_conv(x, **self.factors(), scale=self.gamma, base=b(x), stride=b.stride,
                                      padding=b.padding, dilation=b.dilation)

    def route(self):
        op = _lokr.conv_formula_op(**self.factors())  # a narrow w2: ΔW by the merge op, one conv
        return (op, None) if op else (None, "LoKr conv: eager grouped conv chain (no conv bypass op)")
