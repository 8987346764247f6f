"""Diag-OFT and BOFT: the output channels rotated by learned Cayley blocks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import boft as _boft
from lycoris_ops.functional import diag_oft as _oft
from lycoris_ops.nn.base import AdapterModule, ConvByWeight, out_in


class OFTLinear(AdapterModule):
    """Diag-OFT on the output channels: K = O / block_size Cayley blocks ``R_k`` from
    ``oft_blocks`` (K, S, S) (zero init: R = I), optional ``rescale`` (O, 1) (ones);
    ``y = diag(ρ)·Fᵀ·(x·Wᵀ) + b`` with F = m·R + (1 − m)·I; ``constraint > 0`` bounds ‖B − Bᵀ‖."""

    additive = False
    uses_rank = False

    def __init__(self, base: nn.Linear, block_size: int = 4, multiplier: float = 1.0, constraint: float = 0.0,
                 rescaled: bool = False):
        super().__init__(base, multiplier)
        O = out_in(base)[0]
        if block_size < 1 or O % block_size:
            raise ValueError(f"lycoris_ops.nn.{type(self).__name__}: block_size {block_size} must divide "
                             f"out_features {O}")
        self.block_size = int(block_size)
        self.constraint = float(constraint)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.oft_blocks = nn.Parameter(self._blocks_shape(O, kw))
        self.rescale = nn.Parameter(torch.ones(O, 1, **kw)) if rescaled else None

    def _blocks_shape(self, O, kw):
        S = self.block_size
        return torch.zeros(O // S, S, S, **kw)

    _fn = _oft

    def _rotate(self, y, diff):
        return self._fn.bypass(self.oft_blocks, y, self.rescale, constraint=self.constraint,
                               multiplier=self.multiplier, diff=diff)

    def adapter_forward(self, x):
        y0 = F.linear(x, self.base.weight)
        y = y0 + self._rotate(y0, True)
        return y if self.base.bias is None else y + self.base.bias

    def route(self):
        if self.multiplier != 1.0:
            return None, "diag-OFT with multiplier != 1 (eager: the op has no multiplier)"
        return "lycoris.oft_fwd", None

    def merged_weight(self):
        W = self.base.weight
        w = self._fn.merge(self.oft_blocks, W.reshape(W.shape[0], -1), self.rescale, constraint=self.constraint,
                           multiplier=self.multiplier, diff=False)
        return w.reshape(W.shape).to(W.dtype), None


class BOFTLinear(OFTLinear):
    """BOFT on the output channels: ``oft_blocks`` (m, nb, s, s) with nb = O / block_size
    (zero init), ``n_butterfly`` = m stages (nb must be a multiple of 2^(m−1));
    ``y = ρ⊙B·(x·Wᵀ) + b`` with B the butterfly product of F = m·R + (1 − m)·I (docs/ops.md §2.6)."""

    def __init__(self, base: nn.Linear, block_size: int = 4, n_butterfly: int = 1, multiplier: float = 1.0,
                 constraint: float = 0.0, rescaled: bool = False):
        self._m = int(n_butterfly)
        super().__init__(base, block_size, multiplier, constraint, rescaled)
        if block_size % 2:
            raise ValueError(f"lycoris_ops.nn.{type(self).__name__}: block_size must be even, got {block_size}")
        nb = out_in(base)[0] // block_size
        if self._m < 1 or nb % (1 << (self._m - 1)):
            raise ValueError(f"lycoris_ops.nn.{type(self).__name__}: n_butterfly={self._m} needs "
                             f"out_features/block_size={nb} "
                             f"to be a multiple of 2^(m-1)")

    def _blocks_shape(self, O, kw):
        S = self.block_size
        return torch.zeros(self._m, O // S, S, S, **kw)

    _fn = _boft

    def _rotate(self, y, diff):
        return _boft.bypass(self.oft_blocks, y, self.rescale, constraint=self.constraint,
                            multiplier=self.multiplier, diff=diff).to(y.dtype)

    def route(self):
        return "lycoris.boft_fwd", None


class OFTConv2d(ConvByWeight, OFTLinear):
    """Diag-OFT on a conv's output channels (the (O, I·kh·kw) weight's rows rotated)."""


class BOFTConv2d(ConvByWeight, BOFTLinear):
    """BOFT on a conv's output channels (the (O, I·kh·kw) weight's rows)."""
