"""LoRA / LoCon (:class:`LoRALinear`, :class:`LoRAConv2d`), DyLoRA at full rank and GLoRA:
the adapters whose ΔW is a low-rank product ``up·down`` (GLoRA: two of them)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lycoris_ops.functional import locon as _locon
from lycoris_ops.nn.base import RankAdapter, check_conv, kaiming_, out_in


class LoRALinear(RankAdapter):
    """``y = base(x) + (alpha/rank)·m·(x·downᵀ)·upᵀ``; lora_down (r, I) Kaiming, lora_up (O, r) zero."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0):
        super().__init__(base, rank, alpha, multiplier)
        w = base.weight
        kw = dict(device=w.device, dtype=w.dtype)
        self.lora_down = nn.Parameter(kaiming_(torch.empty(rank, base.in_features, **kw)))
        self.lora_up = nn.Parameter(torch.zeros(base.out_features, rank, **kw))

    def adapter_forward(self, x):
        return _locon.bypass(x, self.lora_up, self.lora_down, self.gamma, base=self.base(x))

    def route(self):
        return "lycoris.lora_bypass_fwd", None

    def delta_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, self.gamma, out_dtype=self.base.weight.dtype)

    def merged_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, -self.gamma, base=self.base.weight), None


class LoRAConv2d(RankAdapter):
    """LoCon on a conv: down conv (r, I, kh, kw) with the layer's stride/padding/dilation, then a
    1×1 up conv (O, r, 1, 1) (zero init); eager conv chain (docs/ops.md §3.1), merge via ``lora_merge_fwd``.
    ``use_tucker`` (a kernel larger than 1×1): down (r, I, 1, 1), a core ``lora_mid``
    (r, r, kh, kw) carrying the kernel, up (O, r, 1, 1); merge via ``lora_tucker_fwd``."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier)
        check_conv(base, "LoRAConv2d")
        w = base.weight
        kw = dict(device=w.device, dtype=w.dtype)
        tucker = use_tucker and tuple(base.kernel_size) != (1, 1)
        down_kernel = (1, 1) if tucker else tuple(base.kernel_size)
        self.lora_down = nn.Parameter(kaiming_(torch.empty(rank, base.in_channels, *down_kernel, **kw)))
        self.lora_mid = nn.Parameter(kaiming_(torch.empty(rank, rank, *base.kernel_size, **kw))) if tucker else None
        self.lora_up = nn.Parameter(torch.zeros(base.out_channels, rank, 1, 1, **kw))

    def adapter_forward(self, x):
        b = self.base
        return _locon.bypass(x, self.lora_up, self.lora_down, self.gamma, mid=self.lora_mid, base=b(x),
                             stride=b.stride, padding=b.padding, dilation=b.dilation)

    def route(self):
        return None, "LoCon conv: eager conv chain (no conv bypass op)"

    def merged_weight(self, sign: float = 1.0):
        return _locon.merge(self.lora_up, self.lora_down, sign * self.gamma, mid=self.lora_mid,
                            base=self.base.weight), None

    def unmerged_weight(self):
        return self.merged_weight(-1.0)

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        return _locon.merge(self.lora_up, self.lora_down, self.scale, mid=self.lora_mid,
                            out_dtype=self.base.weight.dtype)

    def _delta_op(self) -> str:
        return "lycoris.lora_tucker_fwd" if self.lora_mid is not None else "lycoris.lora_merge_fwd"


class GLoRALinear(RankAdapter):
    """GLoRA (LyCORIS ``glora``): ``ΔW = s·m·(W·a1·a2 + b1·b2)``, s = alpha/rank, with a1 (I, r),
    a2 (r, I), b1 (O, r), b2 (r, I) (a1, b1 Kaiming, a2, b2 zero: ΔW starts at 0). Forward
    without ΔW: ``y = base(x + s·m·(x·a2ᵀ)·a1ᵀ) + s·m·(x·b2ᵀ)·b1ᵀ`` (two ``locon.bypass`` calls);
    merge via ``glora_merge``. ΔW depends on W, so unmerge restores a copy of W."""

    additive = False

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0):
        super().__init__(base, rank, alpha, multiplier)
        check_conv(base, type(self).__name__)
        O, I = out_in(base)
        k = tuple(getattr(base, "kernel_size", ()))  # a conv's b2 carries the kernel, the rest are 1×1
        one = (1,) * len(k)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.a1 = nn.Parameter(kaiming_(torch.empty(I, rank, *one, **kw)))
        self.a2 = nn.Parameter(torch.zeros(rank, I, *one, **kw))
        self.b1 = nn.Parameter(kaiming_(torch.empty(O, rank, *one, **kw)))
        self.b2 = nn.Parameter(torch.zeros(rank, I, *k, **kw))

    def adapter_forward(self, x):
        b = self.base
        x_a = _locon.bypass(x, self.a1, self.a2, self.gamma, base=x)
        geometry = dict(stride=b.stride, padding=b.padding, dilation=b.dilation) if isinstance(b, nn.Conv2d) else {}
        return _locon.bypass(x, self.b1, self.b2, self.gamma, base=b(x_a), **geometry)

    def route(self):
        return "lycoris.lora_bypass_fwd", None

    def merged_weight(self):
        W = self.base.weight
        if W.dim() == 2:
            return _locon.glora_merge(W, self.a1, self.a2, self.b1, self.b2, self.gamma, base=W), None
        A = _locon.merge(self.a1, self.a2, 1.0, out_dtype=W.dtype)  # (I, I, 1, 1): W·a1·a2 mixes in-channels
        w_a = torch.einsum("oi...,ij->oj...", W, A.reshape(A.shape[0], A.shape[1]))
        return _locon.merge(self.b1, self.b2, self.gamma, base=W + self.gamma * w_a), None


class GLoRAConv2d(GLoRALinear):
    """GLoRA on a conv: a1 (I, r, 1, 1), a2 (r, I, 1, 1) mix the input channels, b1 (O, r, 1, 1),
    b2 (r, I, kh, kw) a LoCon pair with the layer's geometry; the same forward (1×1 conv chains)."""

    bases = (nn.Conv2d,)

    def route(self):
        return None, "GLoRA conv: eager 1x1 conv chains (no conv bypass op)"


class _RankBlocks:
    """DyLoRA (LyCORIS ``dylora``) at its full rank, placed before a LoRA adapter in the bases:
    the rank is ``rank / block_size`` blocks and the scale is ``alpha / blocks`` (lycoris-lora's
    ``alpha/(b+1)`` with all b+1 blocks in play; its training draws a random block count per
    step and trains the last block drawn, here every block is in play and trains)."""

    def _init_blocks(self, block_size: int) -> None:
        if block_size < 1 or self.rank % block_size:
            raise ValueError(f"lycoris_ops.nn.{type(self).__name__}: block_size {block_size} must divide "
                             f"the rank {self.rank}")
        self.block_size = int(block_size)

    @property
    def scale(self) -> float:
        return self._alpha / (self.rank // self.block_size)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, " + super().extra_repr()


class DyLoRALinear(_RankBlocks, LoRALinear):
    """A DyLoRA layer at full rank: ``LoRALinear`` with scale ``alpha / (rank / block_size)``."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 block_size: int = 4):
        super().__init__(base, rank, alpha, multiplier)
        self._init_blocks(block_size)


class DyLoRAConv2d(_RankBlocks, LoRAConv2d):
    """A DyLoRA conv at full rank: ``LoRAConv2d`` with scale ``alpha / (rank / block_size)``."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 block_size: int = 4):
        super().__init__(base, rank, alpha, multiplier)
        self._init_blocks(block_size)
