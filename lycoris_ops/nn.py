"""Adapter modules on ``torch.ops.lycoris.*`` for users without LyCORIS or PEFT.

Each module wraps an existing ``nn.Linear`` (or ``nn.Conv2d``) as ``self.base``,
freezes its parameters and adds the adapter's trainable parameters, initialised
the LyCORIS way so that the initial ΔW is 0 (the "up" side is zero):

=================  ==========================================================  ================
module             forward (``s = alpha/rank·multiplier``)                     functional path
=================  ==========================================================  ================
``LoRALinear``     ``base(x) + s·(x·downᵀ)·upᵀ``                               ``locon.bypass``
``LoRAConv2d``     ``base(x) + s·conv1x1(conv(x, down), up)``                  ``locon.bypass`` (eager chain)
``LoHaLinear``     ``base(x) + s·x·((w1a·w1b)⊙(w2a·w2b))ᵀ``                   ``loha.bypass``
``LoHaConv2d``     ``base(x) + conv(x, s·ΔW)`` (ΔW via the merge op)           ``loha.bypass``
``LoKrLinear``     ``base(x) + s·x·kron(w1, w2)ᵀ`` (w2 = w2a·w2b if factored)  ``lokr.lokr_bypass``
``LoKrConv2d``     ``base(x) + conv(x, s·kron(w1, w2))`` (ΔW never built)      ``lokr.lokr_bypass_conv``
``DoRALinear``     ``F.linear(x, wd(W + α/r·up·down), b)`` (m only in wd)       ``locon.bypass`` + ``dora.lowrank_norm_terms``
``DoRAConv2d``     ``conv(x, wd(W + α/r·ΔW), b)`` (W' built each call)       ``dora.weight_decompose``
``DoHa*, DoKr*``   LoHa / LoKr with ``dora_wd``: ``op(x, wd(W + α/r·ΔW), b)``   merge op + ``dora.weight_decompose``
``GLoRALinear``    ``base(x + s·(x·a2ᵀ)·a1ᵀ) + s·(x·b2ᵀ)·b1ᵀ``                  ``locon.bypass`` twice
                   (ΔW = s·(W·a1·a2 + b1·b2); ``GLoRAConv2d``: 1×1 conv chains)
``DyLoRALinear``   ``LoRALinear`` with s = alpha/(rank/block_size)·multiplier  ``locon.bypass``
``OFTLinear``      ``diag(ρ)·Rᵀ·(x·Wᵀ) + b`` (diag-OFT on the output channels)  ``diag_oft.bypass``
``BOFTLinear``     ``B·(x·Wᵀ) + b`` (butterfly of Cayley rotations)            ``boft.bypass``
``IA3Linear``      ``base(x)⊙(1 + m·w)`` (or ``base(x⊙(1 + m·w))`` on input)    ``ia3.ia3_bypass``
                   (LyCORIS's, ``scale_bias=False``: ``(x·Wᵀ)⊙(1 + m·w) + b``)
``FullLinear``     ``F.linear(x, W + m·diff, b + m·diff_b)``                   ``full.scaled_add``
``*Conv2d``        OFT / BOFT / IA3 / Full on a conv: the conv with the merged  the merge ops
                   (O, I, kh, kw) weight, built each call
``NormAdapter``    ``layer_norm / group_norm`` with ``W + m·w_norm``,           ``full.norms_merge``
                   ``b + m·b_norm`` (wraps ``nn.LayerNorm`` / ``nn.GroupNorm``)
=================  ==========================================================  ================

(OFT/BOFT rotate the bias-free output and add the bias after, so that the bypass
and the merged weight ``R·W`` agree; IA3 on the output scales the bias too, and
its merge scales the bias the same way.)

``merge()`` folds the adapter into ``base.weight`` (and bias) with the merge ops
(``lora_merge_fwd``, ``lokr_*merge_fwd``, ``dora_fwd``, ``oft_fwd``, ``boft_fwd``,
``ia3_fwd``, ``add_scaled``) so the model runs as a plain layer (the inference
path before export); ``unmerge()`` takes it back out: additive adapters
(LoRA/LoHa/LoKr/DyLoRA/Full/Norm) re-run the merge op with −γ, the others (DoRA and
``dora_wd``, GLoRA, OFT, BOFT, IA3, whose merge is not invertible from the merged weight
alone) restore a copy
of the original weight kept at merge time (not in the state dict). While merged,
``forward`` is ``base(x)``. A state dict saved while merged holds the merged
weight; ``merged`` is not saved.

Helpers: :func:`add_adapters` (replace matching submodules in place),
:func:`merge_adapters`, :func:`unmerge_adapters`, :func:`adapters`,
:func:`mark_only_adapters_trainable`, :func:`remove_adapters`,
:func:`load_lycoris_state_dict` (build the adapters of a LyCORIS network from its state
dict or file: every algorithm and option lycoris-lora saves, or a clear error) and
:func:`lycoris_state_dict` (save them back in LyCORIS's format).

Parameter names follow LyCORIS (``lora_up``/``lora_down``/``alpha``,
``hada_w1_a`` ..., ``lokr_w1`` ..., ``oft_blocks``/``rescale``, ``dora_scale``, ``w_norm``/``b_norm``)
but are plain ``nn.Parameter``s (``lora_down`` instead of ``lora_down.weight``).
The base layer's parameters appear as ``<name>.base.weight`` / ``.base.bias``.
``alpha`` is a buffer; loading a state dict updates the Python scale from it
(the forward never reads a tensor to get its scale: no host sync, CUDA-graph safe).
No dropout / rank dropout (use LyCORIS itself for those).
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import boft as _boft
from lycoris_ops.functional import diag_oft as _oft
from lycoris_ops.functional import dora as _dora
from lycoris_ops.functional import full as _full
from lycoris_ops.functional import ia3 as _ia3
from lycoris_ops.functional import locon as _locon
from lycoris_ops.functional import loha as _loha
from lycoris_ops.functional import lokr as _lokr

__all__ = [
    "AdapterModule", "LoRALinear", "LoRAConv2d", "LoHaLinear", "LoHaConv2d", "LoKrLinear", "LoKrConv2d",
    "DoRALinear", "DoRAConv2d", "DoHaLinear", "DoHaConv2d", "DoKrLinear", "DoKrConv2d",
    "GLoRALinear", "GLoRAConv2d", "DyLoRALinear", "DyLoRAConv2d",
    "OFTLinear", "BOFTLinear", "IA3Linear", "FullLinear", "OFTConv2d", "BOFTConv2d", "IA3Conv2d", "FullConv2d",
    "NormAdapter", "ADAPTERS", "add_adapters", "adapters",
    "merge_adapters", "unmerge_adapters", "remove_adapters", "mark_only_adapters_trainable",
    "factorization", "load_lycoris_state_dict", "lycoris_state_dict", "LycorisLoadResult",
]


def _kaiming(t: torch.Tensor) -> torch.Tensor:
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    return t


def factorization(dim: int, factor: int = -1) -> Tuple[int, int]:
    """``(m, n)`` with ``m·n = dim`` and ``m <= n``: ``factor`` itself when it divides
    ``dim`` (``factor > 0``), else the divisor pair closest to √dim (``factor`` as
    an upper bound for m when given)."""
    if factor > 0 and dim % factor == 0:
        m, n = factor, dim // factor
        return (m, n) if m <= n else (n, m)
    bound = factor if factor > 0 else dim
    m = 1
    for k in range(1, int(math.isqrt(dim)) + 1):
        if dim % k == 0 and k <= bound:
            m = k
    return m, dim // m


class AdapterModule(nn.Module):
    """Common part: ``self.base`` (frozen), ``multiplier``, merge/unmerge."""

    additive = True
    uses_rank = True
    bases: Tuple[Type[nn.Module], ...] = (nn.Linear,)

    def __init__(self, base: nn.Module, multiplier: float = 1.0):
        super().__init__()
        if isinstance(base, AdapterModule):
            raise TypeError("lycoris_ops.nn: the layer already has an adapter")
        if not isinstance(base, self.bases):
            raise TypeError(f"lycoris_ops.nn.{type(self).__name__} wraps {[b.__name__ for b in self.bases]}, "
                            f"got {type(base).__name__}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.multiplier = float(multiplier)
        self.merged = False
        self._backup: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    # the wrapped layer's tensors, for code that reads ``layer.weight``
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base(x)
        return self.adapter_forward(x)

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def merged_weight(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias) of the equivalent plain layer, differentiable, in the base's dtypes."""
        raise NotImplementedError

    def unmerged_weight(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Additive adapters: (weight, bias) with the adapter taken back out (merge op with −γ)."""
        raise NotImplementedError

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        w, b = self.merged_weight()
        if not self.additive:
            bb = self.base.bias
            self._backup = (self.base.weight.detach().clone(), None if bb is None else bb.detach().clone())
        self.base.weight.copy_(w)
        if b is not None and self.base.bias is not None:
            self.base.bias.copy_(b)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        if self.additive:
            w, b = self.unmerged_weight()
        else:
            w, b = self._backup
            self._backup = None
        self.base.weight.copy_(w)
        if b is not None and self.base.bias is not None:
            self.base.bias.copy_(b)
        self.merged = False

    def extra_repr(self) -> str:
        return f"multiplier={self.multiplier}, merged={self.merged}"


class _Scaled(AdapterModule):
    """Adapters with a rank and an ``alpha`` buffer: ``scale = alpha / rank``."""

    def __init__(self, base, rank: int, alpha: Optional[float], multiplier: float):
        super().__init__(base, multiplier)
        if rank < 1:
            raise ValueError(f"lycoris_ops.nn: rank must be >= 1, got {rank}")
        self.rank = int(rank)
        alpha = float(rank if alpha is None or alpha == 0 else alpha)
        self.register_buffer("alpha", torch.tensor(alpha, device=base.weight.device))
        self._alpha = alpha

    @property
    def scale(self) -> float:
        return self._alpha / self.rank

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        a = state_dict.get(prefix + "alpha")
        if a is not None:
            self._alpha = float(a)  # load time, outside any graph

    @property
    def gamma(self) -> float:
        return self.scale * self.multiplier

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self._alpha}, " + super().extra_repr()


# --------------------------------------------------------------------------- LoRA / LoCon


class LoRALinear(_Scaled):
    """``y = base(x) + (alpha/rank)·m·(x·downᵀ)·upᵀ``; lora_down (r, I) Kaiming, lora_up (O, r) zero."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0):
        super().__init__(base, rank, alpha, multiplier)
        w = base.weight
        kw = dict(device=w.device, dtype=w.dtype)
        self.lora_down = nn.Parameter(_kaiming(torch.empty(rank, base.in_features, **kw)))
        self.lora_up = nn.Parameter(torch.zeros(base.out_features, rank, **kw))

    def adapter_forward(self, x):
        return _locon.bypass(x, self.lora_up, self.lora_down, self.gamma, base=self.base(x))

    def delta_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, self.gamma, out_dtype=self.base.weight.dtype)

    def merged_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _locon.merge(self.lora_up, self.lora_down, -self.gamma, base=self.base.weight), None


def _out_in(base: nn.Module) -> Tuple[int, int]:
    """(out, in) features of a Linear, channels of a Conv2d."""
    if isinstance(base, nn.Conv2d):
        return base.out_channels, base.in_channels
    return base.out_features, base.in_features


def _conv_check(base: nn.Conv2d, name: str):
    if isinstance(base, nn.Conv2d) and (base.groups != 1 or base.padding_mode != "zeros"):
        raise ValueError(f"lycoris_ops.nn.{name}: only groups=1, padding_mode='zeros' convolutions are supported")


class LoRAConv2d(_Scaled):
    """LoCon on a conv: down conv (r, I, kh, kw) with the layer's stride/padding/dilation, then a
    1×1 up conv (O, r, 1, 1) (zero init); eager conv chain (docs/ops.md §3.1), merge via ``lora_merge_fwd``.
    ``use_tucker`` (a kernel larger than 1×1): down (r, I, 1, 1), a core ``lora_mid``
    (r, r, kh, kw) carrying the kernel, up (O, r, 1, 1); merge via ``lora_tucker_fwd``."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier)
        _conv_check(base, "LoRAConv2d")
        w = base.weight
        kw = dict(device=w.device, dtype=w.dtype)
        tucker = use_tucker and tuple(base.kernel_size) != (1, 1)
        down_kernel = (1, 1) if tucker else tuple(base.kernel_size)
        self.lora_down = nn.Parameter(_kaiming(torch.empty(rank, base.in_channels, *down_kernel, **kw)))
        self.lora_mid = nn.Parameter(_kaiming(torch.empty(rank, rank, *base.kernel_size, **kw))) if tucker else None
        self.lora_up = nn.Parameter(torch.zeros(base.out_channels, rank, 1, 1, **kw))

    def adapter_forward(self, x):
        b = self.base
        return _locon.bypass(x, self.lora_up, self.lora_down, self.gamma, mid=self.lora_mid, base=b(x),
                             stride=b.stride, padding=b.padding, dilation=b.dilation)

    def merged_weight(self, sign: float = 1.0):
        return _locon.merge(self.lora_up, self.lora_down, sign * self.gamma, mid=self.lora_mid,
                            base=self.base.weight), None

    def unmerged_weight(self):
        return self.merged_weight(-1.0)

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        return _locon.merge(self.lora_up, self.lora_down, self.scale, mid=self.lora_mid,
                            out_dtype=self.base.weight.dtype)


# --------------------------------------------------------------------------- LoHa


class LoHaLinear(_Scaled):
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

    def merged_weight(self):
        return _loha.merge(*self._f(), self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _loha.merge(*self._f(), -self.gamma, base=self.base.weight), None

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        W = self.base.weight
        return _loha.merge(*self._f(), self.scale, **self._tucker(), shape=W.shape, out_dtype=W.dtype)


class LoHaConv2d(LoHaLinear):
    """LoHa on a conv: w1b/w2b stored (r, I·kh·kw); forward builds ΔW with the merge op, then conv.
    ``use_tucker`` (a kernel larger than 1×1): cores ``hada_t1``/``hada_t2`` (r, r, kh, kw) and
    factors stored the LyCORIS way, w1a/w2a (r, O), w1b/w2b (r, I); merge via ``lora_tucker_fwd``."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 use_tucker: bool = False):
        _Scaled.__init__(self, base, rank, alpha, multiplier)
        _conv_check(base, "LoHaConv2d")
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

    def merged_weight(self, sign: float = 1.0):
        return _loha.merge(*self._f(), sign * self.gamma, **self._tucker(), base=self.base.weight), None

    def unmerged_weight(self):
        return self.merged_weight(-1.0)


# --------------------------------------------------------------------------- LoKr


#: LoKr factor name (``functional.lokr``'s keywords) -> the module attribute, LyCORIS's tensor name
_LOKR_ATTR = {"w1": "lokr_w1", "w1a": "lokr_w1_a", "w1b": "lokr_w1_b", "w2": "lokr_w2", "w2a": "lokr_w2_a",
              "w2b": "lokr_w2_b", "t2": "lokr_t2"}


class LoKrLinear(_Scaled):
    """``ΔW = scale·m·kron(w1, w2)``, O = a·c, I = b·d with (a, c) = factorization(O, factor),
    (b, d) = factorization(I, factor). w1 (a, b) whole (or w1a·w1b with ``decompose_both``),
    w2 = w2a (c, r)·w2b (r, d) when ``rank < max(c, d)/2`` else whole (c, d). The w2 side
    (w2 or w2a) is zero-initialised. scale = alpha/rank when a side is factored, else 1."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False):
        super().__init__(base, rank, alpha, multiplier)
        _conv_check(base, type(self).__name__)
        O, I = _out_in(base)
        a, c = factorization(O, factor)
        b, d = factorization(I, factor)
        k = tuple(getattr(base, "kernel_size", ()))  # a conv's w2 side carries the kernel
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        r = self.rank
        names = []
        if decompose_both and r < max(a, b) / 2 and not full_matrix:
            self.lokr_w1_a = nn.Parameter(_kaiming(torch.empty(a, r, **kw)))
            self.lokr_w1_b = nn.Parameter(_kaiming(torch.empty(r, b, **kw)))
            names += ["w1a", "w1b"]
        else:
            self.lokr_w1 = nn.Parameter(_kaiming(torch.empty(a, b, **kw)))
            names += ["w1"]
        if r < max(c, d) / 2 and not full_matrix:
            self.lokr_w2_a = nn.Parameter(torch.zeros(c, r, **kw))
            self.lokr_w2_b = nn.Parameter(_kaiming(torch.empty(r, d, *k, **kw)))
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
        return {n: getattr(self, _LOKR_ATTR[n]) for n in self._names}

    def adapter_forward(self, x):
        return _lokr.lokr_bypass(x, **self.factors(), scale=self.gamma, base=self.base(x))

    def merged_weight(self):
        return _lokr.lokr_weight(**self.factors(), scale=self.gamma, base=self.base.weight), None

    def unmerged_weight(self):
        return _lokr.lokr_weight(**self.factors(), scale=-self.gamma, base=self.base.weight), None

    def _delta(self):
        """``scale·ΔW`` (no multiplier) in the weight's shape and dtype, for ``dora_wd``."""
        W = self.base.weight
        return _lokr.lokr_weight(**self.factors(), scale=self.scale).reshape(W.shape).to(W.dtype)


class LoKrConv2d(LoKrLinear):
    """LoKr on a conv: ``ΔW = scale·m·kron(w1, w2)`` of shape (O, I, kh, kw), w1 (a, b) broadcast
    over the kernel, w2 (c, d, kh, kw) whole or w2a (c, r)·w2b (r, d, kh, kw) (factored when
    ``rank < max(c, d)/2``); a LyCORIS state dict may also hold the tucker side (``lokr_t2``
    (r, r, kh, kw), w2a (r, c), w2b (r, d)). Forward: ``lokr_bypass_conv`` (x convolved with w2
    per group of d input channels, then contracted with w1; ΔW never built)."""

    bases = (nn.Conv2d,)

    def adapter_forward(self, x):
        b = self.base
        return _lokr.lokr_bypass_conv(x, **self.factors(), scale=self.gamma, base=b(x), stride=b.stride,
                                      padding=b.padding, dilation=b.dilation)


# --------------------------------------------------------------------------- DoRA


class _AdaptedNorms(torch.autograd.Function):
    """``n = ‖M‖ + ε`` per row (``row_axis`` 0) or column (1) of ``M = W + γ·up·down`` (W
    frozen; ε from dora_scale's dtype, as ``dora_fwd``), fp32, from the expansion of
    ``functional.dora.lowrank_norm_terms``: one O·I·r GEMM over W per direction, M (O×I)
    never built. Columns are the rows of ``Mᵀ = Wᵀ + γ·downᵀ·upᵀ``. The expansion is exact algebra in fp32 (no
    16-bit rounding of γ·up·down); it loses digits only where ‖M‖ ≪ ‖W‖, i.e. an adapter
    that cancels its weight."""

    @staticmethod
    def _as_rows(W, up, down, row_axis):
        """(Wv, a, b) with the norms over the rows of ``Wv + γ·a·b``."""
        return (W, up, down) if row_axis == 0 else (W.t(), down.t(), up.t())

    # forward(ctx, ...) rather than forward + setup_context: torch binds a setup_context
    # Function's arguments through inspect.signature on every apply (host time per layer/step)
    @staticmethod
    def forward(ctx, W, eps, up, down, gamma, row_axis):
        m2, P, S = _dora.lowrank_norm_terms(*_AdaptedNorms._as_rows(W, up, down, row_axis), gamma)
        n = m2.clamp_min(0).sqrt() + eps  # out of place: in place, the compiled CUDA graph lost up/down's grads
        ctx.save_for_backward(W, up, down, n, P, S)
        ctx.eps, ctx.gamma, ctx.row_axis = eps, gamma, row_axis
        ctx.mark_non_differentiable(P, S)
        return n, P, S

    @staticmethod
    def backward(ctx, g_n, _g_p, _g_s):
        W, up, down, n, P, S = ctx.saved_tensors
        Wv, a, b = _AdaptedNorms._as_rows(W, up, down, ctx.row_axis)
        norm = (n - ctx.eps).clamp_min(torch.finfo(n.dtype).tiny)
        g_a, g_b = _dora.lowrank_norm_grads(Wv, a, b, ctx.gamma, P, S, g_n.to(n.dtype) / (2 * norm))  # d‖M‖ = d‖M‖²/(2‖M‖)
        g_up, g_down = (g_a, g_b) if ctx.row_axis == 0 else (g_b.t(), g_a.t())
        return None, None, g_up, g_down, None, None


def _weight_norms(weight: torch.Tensor, on_out: bool) -> torch.Tensor:
    """‖W‖ per output channel (``on_out``, shape (O, 1, …)) or per input channel ((1, I, …)), in
    W's dtype: the initial ``dora_scale``, with which the adapted layer starts as the base layer."""
    with torch.no_grad():
        axis = 0 if on_out else 1
        dims = [d for d in range(weight.dim()) if d != axis]
        return torch.linalg.vector_norm(weight.float(), dim=dims, keepdim=True).to(weight.dtype)


class DoRALinear(LoRALinear):
    """LoRA + weight decompose: ``W' = wd(W + s·up·down)`` with ``wd(M) = M·(m·(dora_scale/‖M‖ − 1) + 1)``,
    s = alpha/rank (the multiplier m only blends the rescale, as LyCORIS does), norms per output row (``wd_on_out=True``, dora_scale (O, 1)) or per input column (dora_scale
    (1, I)); dora_scale starts at ‖W‖ so the initial layer is unchanged.

    Forward without building W': the rescale is a vector s, so ``x·W'ᵀ = s ⊙ (x·Mᵀ)`` (rows) or
    ``(x ⊙ s)·Mᵀ`` (columns), and ``x·Mᵀ`` is the base layer plus the LoRA bypass op. The norms
    come from one O·I·r GEMM over W (``_AdaptedNorms``), their gradient from one more: M is
    never built and the backward has no weight-gradient GEMM over the tokens. (The base weight trainable: the merged path,
    ``y = F.linear(x, W', b)``.)"""

    additive = False

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier)
        self.wd_on_out = bool(wd_on_out)
        self.dora_scale = nn.Parameter(_weight_norms(base.weight, self.wd_on_out))

    def _weight(self):
        W = self.base.weight
        delta = _locon.merge(self.lora_up, self.lora_down, self.scale, out_dtype=W.dtype)
        return _dora.weight_decompose(W, self.dora_scale, self.multiplier, self.wd_on_out, delta=delta).to(W.dtype)

    def _rescale(self):
        """s = m·(dora_scale/n − 1) + 1, fp32, one per output row (wd_on_out) or input column."""
        d = self.dora_scale.reshape(-1)
        n, _, _ = _AdaptedNorms.apply(self.base.weight, torch.finfo(d.dtype).eps, self.lora_up, self.lora_down,
                                      self.scale, 0 if self.wd_on_out else 1)
        return (d.to(n.dtype) / n).mul_(self.multiplier).add_(1 - self.multiplier)

    def adapter_forward(self, x):
        if self.base.weight.requires_grad:
            return F.linear(x, self._weight(), self.base.bias)
        s = self._rescale()
        if not self.wd_on_out:
            x = x * s.to(x.dtype)
        z = _locon.bypass(x, self.lora_up, self.lora_down, self.scale, base=F.linear(x, self.base.weight))
        if self.wd_on_out:
            s = s.to(z.dtype)
            return z * s if self.base.bias is None else torch.addcmul(self.base.bias, z, s)
        return z if self.base.bias is None else z + self.base.bias

    def merged_weight(self):
        return self._weight(), None


class _WeightDecomposed:
    """LyCORIS's ``dora_wd`` on an additive adapter (placed before it in the bases):
    ``W' = wd(W + s·ΔW)`` with ``wd(M) = M·(m·(dora_scale/‖M‖ − 1) + 1)``, s the adapter's scale
    (the multiplier m only blends the rescale), norms per output channel (``wd_on_out``,
    dora_scale (O, 1, …)) or per input channel (dora_scale (1, I, …)). The layer runs with W',
    built each call (ΔW by the adapter's merge op, the rescale by ``dora_fwd``), exact gradients
    to every parameter through the ops."""

    additive = False

    def _init_decompose(self, wd_on_out: bool) -> None:
        self.wd_on_out = bool(wd_on_out)
        self.dora_scale = nn.Parameter(_weight_norms(self.base.weight, self.wd_on_out))

    def _weight(self):
        W = self.base.weight
        return _dora.weight_decompose(W, self.dora_scale, self.multiplier, self.wd_on_out,
                                      delta=self._delta()).to(W.dtype)

    def adapter_forward(self, x):
        b = self.base
        if isinstance(b, nn.Conv2d):
            return F.conv2d(x, self._weight(), b.bias, b.stride, b.padding, b.dilation)
        return F.linear(x, self._weight(), b.bias)

    def merged_weight(self):
        return self._weight(), None

    def extra_repr(self) -> str:
        return f"wd_on_out={self.wd_on_out}, " + super().extra_repr()


class DoRAConv2d(_WeightDecomposed, LoRAConv2d):
    """DoRA on a conv (LoCon with ``dora_wd``): ``W' = wd(W + s·ΔW)`` on the (O, I, kh, kw) weight,
    norms per output channel (dora_scale (O, 1, 1, 1)) or per input channel over the outputs and
    the kernel (dora_scale (1, I, 1, 1)); see ``_WeightDecomposed``. A conv weight is small next
    to its activations: W' is built each call."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True, use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier, use_tucker)
        self._init_decompose(wd_on_out)


class DoHaLinear(_WeightDecomposed, LoHaLinear):
    """LoHa with ``dora_wd``: ``W' = wd(W + s·(w1a·w1b)⊙(w2a·w2b))`` (see ``_WeightDecomposed``)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier)
        self._init_decompose(wd_on_out)


class DoHaConv2d(_WeightDecomposed, LoHaConv2d):
    """LoHa on a conv (plain or tucker) with ``dora_wd`` (see ``_WeightDecomposed``)."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True, use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier, use_tucker)
        self._init_decompose(wd_on_out)


class DoKrLinear(_WeightDecomposed, LoKrLinear):
    """LoKr with ``dora_wd``: ``W' = wd(W + s·kron(w1, w2))`` (see ``_WeightDecomposed``)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False, wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier, factor, decompose_both, full_matrix)
        self._init_decompose(wd_on_out)


class DoKrConv2d(_WeightDecomposed, LoKrConv2d):
    """LoKr on a conv with ``dora_wd`` (see ``_WeightDecomposed``)."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False, wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier, factor, decompose_both, full_matrix)
        self._init_decompose(wd_on_out)


# --------------------------------------------------------------------------- GLoRA / DyLoRA


class GLoRALinear(_Scaled):
    """GLoRA (LyCORIS ``glora``): ``ΔW = s·m·(W·a1·a2 + b1·b2)``, s = alpha/rank, with a1 (I, r),
    a2 (r, I), b1 (O, r), b2 (r, I) (a1, b1 Kaiming, a2, b2 zero: ΔW starts at 0). Forward
    without ΔW: ``y = base(x + s·m·(x·a2ᵀ)·a1ᵀ) + s·m·(x·b2ᵀ)·b1ᵀ`` (two ``locon.bypass`` calls);
    merge via ``glora_merge``. ΔW depends on W, so unmerge restores a copy of W."""

    additive = False

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0):
        super().__init__(base, rank, alpha, multiplier)
        _conv_check(base, type(self).__name__)
        O, I = _out_in(base)
        k = tuple(getattr(base, "kernel_size", ()))  # a conv's b2 carries the kernel, the rest are 1×1
        one = (1,) * len(k)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.a1 = nn.Parameter(_kaiming(torch.empty(I, rank, *one, **kw)))
        self.a2 = nn.Parameter(torch.zeros(rank, I, *one, **kw))
        self.b1 = nn.Parameter(_kaiming(torch.empty(O, rank, *one, **kw)))
        self.b2 = nn.Parameter(torch.zeros(rank, I, *k, **kw))

    def adapter_forward(self, x):
        b = self.base
        x_a = _locon.bypass(x, self.a1, self.a2, self.gamma, base=x)
        geometry = dict(stride=b.stride, padding=b.padding, dilation=b.dilation) if isinstance(b, nn.Conv2d) else {}
        return _locon.bypass(x, self.b1, self.b2, self.gamma, base=b(x_a), **geometry)

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


# --------------------------------------------------------------------------- OFT / BOFT


class OFTLinear(AdapterModule):
    """Diag-OFT on the output channels: K = O / block_size Cayley blocks ``R_k`` from
    ``oft_blocks`` (K, S, S) (zero init: R = I), optional ``rescale`` (O, 1) (ones);
    ``y = diag(ρ)·Fᵀ·(x·Wᵀ) + b`` with F = m·R + (1 − m)·I; ``constraint > 0`` bounds ‖B − Bᵀ‖."""

    additive = False
    uses_rank = False

    def __init__(self, base: nn.Linear, block_size: int = 4, multiplier: float = 1.0, constraint: float = 0.0,
                 rescaled: bool = False):
        super().__init__(base, multiplier)
        O = _out_in(base)[0]
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
        nb = _out_in(base)[0] // block_size
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


# --------------------------------------------------------------------------- IA3 / Full


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
        n = _out_in(base)[1 if train_on_input else 0]
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

    def merged_weight(self):
        W, b = self.base.weight, self.base.bias
        w = _ia3.ia3_merge(W, self.ia3_weight, self.multiplier, self.train_on_input).to(W.dtype)
        if b is not None and not self.train_on_input and self.scale_bias:
            b = _ia3.ia3_scale(b, self.ia3_weight, 0, self.multiplier).to(b.dtype)
        return w, b


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


class _ConvByWeight:
    """Conv form of an adapter whose merged weight is defined on any (O, I, kh, kw) weight:
    the layer's conv with the merged weight and bias. A conv weight is small next to its
    activations, so it is built each call (through the adapter's merge ops, differentiable)."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, *args, **kw):
        _conv_check(base, type(self).__name__)
        super().__init__(base, *args, **kw)

    def adapter_forward(self, x):
        w, b = self.merged_weight()
        base = self.base
        return F.conv2d(x, w, base.bias if b is None else b, base.stride, base.padding, base.dilation)


class OFTConv2d(_ConvByWeight, OFTLinear):
    """Diag-OFT on a conv's output channels (the (O, I·kh·kw) weight's rows rotated)."""


class BOFTConv2d(_ConvByWeight, BOFTLinear):
    """BOFT on a conv's output channels (the (O, I·kh·kw) weight's rows)."""


class IA3Conv2d(_ConvByWeight, IA3Linear):
    """IA3 on a conv: output channels (or input channels with ``train_on_input``) scaled by 1 + m·w."""


class FullConv2d(_ConvByWeight, FullLinear):
    """Full fine-tune of a conv as an adapter: ``W + m·diff``, ``b + m·diff_b``."""


# --------------------------------------------------------------------------- model helpers

#: kind -> {base layer type: adapter class}
ADAPTERS: Dict[str, Dict[Type[nn.Module], Type[AdapterModule]]] = {
    "lora": {nn.Linear: LoRALinear, nn.Conv2d: LoRAConv2d},
    "locon": {nn.Linear: LoRALinear, nn.Conv2d: LoRAConv2d},
    "loha": {nn.Linear: LoHaLinear, nn.Conv2d: LoHaConv2d},
    "lokr": {nn.Linear: LoKrLinear, nn.Conv2d: LoKrConv2d},
    "dora": {nn.Linear: DoRALinear, nn.Conv2d: DoRAConv2d},
    "glora": {nn.Linear: GLoRALinear, nn.Conv2d: GLoRAConv2d},
    "oft": {nn.Linear: OFTLinear, nn.Conv2d: OFTConv2d},
    "diag-oft": {nn.Linear: OFTLinear, nn.Conv2d: OFTConv2d},
    "boft": {nn.Linear: BOFTLinear, nn.Conv2d: BOFTConv2d},
    "ia3": {nn.Linear: IA3Linear, nn.Conv2d: IA3Conv2d},
    "full": {nn.Linear: FullLinear, nn.Conv2d: FullConv2d},
    "norm": {nn.LayerNorm: NormAdapter, nn.GroupNorm: NormAdapter},
}


def _match(name: str, patterns) -> bool:
    if patterns is None:
        return False
    if isinstance(patterns, str):
        patterns = (patterns,)
    import fnmatch
    return any(fnmatch.fnmatchcase(name, p) or name.split(".")[-1] == p for p in patterns)


def add_adapters(model: nn.Module, kind: str, rank: int = 4, target: Sequence[Type[nn.Module]] = (nn.Linear,), *,
                 include=None, exclude=None, **kw) -> nn.Module:
    """Replace every submodule whose type is exactly one of ``target`` (and, if given, whose
    qualified name matches ``include`` — fnmatch patterns or a last-name-component — and not
    ``exclude``) by the ``kind`` adapter wrapping it, in place. ``kind``: one of :data:`ADAPTERS`.
    ``rank`` goes to the rank-based adapters; ``**kw`` (alpha, multiplier, block_size, ...) to every
    adapter. Returns the model (a new object only if the model itself is a target)."""
    if kind not in ADAPTERS:
        raise ValueError(f"lycoris_ops.nn.add_adapters: kind must be one of {sorted(ADAPTERS)}, got {kind!r}")
    table = ADAPTERS[kind]
    target = tuple(target)
    for t in target:
        if t not in table:
            raise ValueError(f"lycoris_ops.nn.add_adapters: {kind!r} has no adapter for {t.__name__} "
                             f"(supported: {[b.__name__ for b in table]})")

    def make(name, mod):
        cls = table[type(mod)]
        args = dict(kw)
        if cls.uses_rank:
            args["rank"] = rank
        return cls(mod, **args)

    def wanted(name, mod):
        if type(mod) not in target:
            return False
        if include is not None and not _match(name, include):
            return False
        return not _match(name, exclude)

    if wanted("", model):
        return make("", model)
    todo = [(name, mod) for name, mod in model.named_modules()
            if wanted(name, mod) and not any(isinstance(p, AdapterModule) for p in _parents(model, name))]
    for name, mod in todo:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, make(name, mod))
    return model


def _parents(model, name) -> Iterator[nn.Module]:
    parts = name.split(".")[:-1]
    m = model
    for p in parts:
        m = getattr(m, p)
        yield m


def adapters(model: nn.Module) -> Iterator[Tuple[str, AdapterModule]]:
    """(name, adapter) for every adapter module of the model."""
    for name, m in model.named_modules():
        if isinstance(m, AdapterModule):
            yield name, m


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (merge ops); forward then runs the plain layers."""
    for _, m in adapters(model):
        m.merge()
    return model


def unmerge_adapters(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_adapters`."""
    for _, m in adapters(model):
        m.unmerge()
    return model


def remove_adapters(model: nn.Module, merge: bool = True) -> nn.Module:
    """Replace each adapter by its base layer (merged into it first when ``merge``)."""
    if isinstance(model, AdapterModule):
        if merge:
            model.merge()
        return model.base
    for name, m in list(adapters(model)):
        if merge:
            m.merge()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, m.base)
    return model


def mark_only_adapters_trainable(model: nn.Module) -> nn.Module:
    """requires_grad = True on adapter parameters only (base layers and the rest frozen)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for _, m in adapters(model):
        for n, p in m.named_parameters():
            if not n.startswith("base."):
                p.requires_grad_(True)
    return model


# --------------------------------------------------------------------------- LyCORIS state dicts

#: LyCORIS algorithm -> (the tensor names that identify a module of it, every tensor name it holds);
#: "oft" is diag-OFT (3-D oft_blocks) or BOFT (4-D)
_LYCORIS_ALGOS: Dict[str, Tuple[frozenset, frozenset]] = {
    "locon": (frozenset({"lora_up.weight"}),
              frozenset({"lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "dora_scale"})),
    "loha": (frozenset({"hada_w1_a"}),
             frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "alpha",
                        "dora_scale"})),
    "lokr": (frozenset({"lokr_w1", "lokr_w1_a"}),
             frozenset({"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "alpha",
                        "dora_scale"})),
    "oft": (frozenset({"oft_blocks"}), frozenset({"oft_blocks", "rescale", "alpha"})),
    "ia3": (frozenset({"on_input"}), frozenset({"weight", "on_input"})),
    "full": (frozenset({"diff"}), frozenset({"diff", "diff_b"})),
    "norm": (frozenset({"w_norm"}), frozenset({"w_norm", "b_norm"})),
    "glora": (frozenset({"a1.weight"}), frozenset({"a1.weight", "a2.weight", "b1.weight", "b2.weight", "bm.weight",
                                                   "alpha"})),
    "tlora": (frozenset({"lambda_layer"}), frozenset({"lambda_layer", "q_layer.weight", "p_layer.weight", "alpha"})),
}

#: ``algo=`` hint (lycoris-lora's algorithm names) -> the algorithm its tensors show
_ALGO_HINTS = {"lora": "locon", "locon": "locon", "dylora": "locon", "loha": "loha", "lokr": "lokr",
               "diag-oft": "diag-oft", "boft": "boft", "ia3": "ia3", "full": "full", "glora": "glora"}

#: lycoris-lora's DyLoRA block size when the network was made without one
_DYLORA_BLOCK_SIZE = 4


class LycorisLoadResult(NamedTuple):
    """What ``load_lycoris_state_dict(..., strict=False)`` returns."""

    model: nn.Module
    #: how many layers got an adapter
    adapters: int
    #: keys whose module name is no layer of the model
    unmatched_keys: List[str]
    #: keys of an adapted (or unidentifiable) module that no adapter reads
    unused_keys: List[str]


def _fail(msg: str) -> ValueError:
    return ValueError(f"lycoris_ops.nn.load_lycoris_state_dict: {msg}")


def _listing(keys: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:most])
    return f"[{shown}{f', ... ({len(keys) - most} more)' if len(keys) > most else ''}]"


def _read_lycoris_file(path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of a ``.safetensors`` file, or of a ``torch.save``'d dict (no metadata)."""
    if str(path).endswith(".safetensors"):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("lycoris_ops.nn.load_lycoris_state_dict: reading a .safetensors file needs the "
                              "safetensors package (pip install safetensors)") from e
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise _fail(f"{path} holds a {type(sd).__name__}, not a state dict")
    return sd, {}


def _dylora_marker(metadata: Dict[str, str]) -> Optional[int]:
    """The DyLoRA block size when the metadata says a lycoris-lora DyLoRA network made the file
    (kohya's trainer writes ``ss_network_module`` and the network's arguments as the JSON
    ``ss_network_args``), else None."""
    if "lycoris" not in str(metadata.get("ss_network_module", "")):
        return None
    try:
        args = json.loads(metadata.get("ss_network_args") or "{}")
    except ValueError as e:
        raise _fail(f"the metadata's ss_network_args is not JSON: {e}") from e
    if not isinstance(args, dict) or str(args.get("algo", "")).lower() != "dylora":
        return None
    try:
        return int(args.get("block_size") or _DYLORA_BLOCK_SIZE)
    except (TypeError, ValueError) as e:
        raise _fail(f"the metadata's DyLoRA block_size {args.get('block_size')!r} is not an integer") from e


def _identify(tensors: Iterable[str]) -> List[str]:
    """The LyCORIS algorithms whose identifying tensors a module's tensors hold."""
    names = set(tensors)
    return [algo for algo, (ids, _) in _LYCORIS_ALGOS.items() if names & ids]


def load_lycoris_state_dict(model: nn.Module, state_dict, prefixes: Sequence[str] = (
        "lycoris_", "lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", ""), multiplier: float = 1.0, *,
        strict: bool = True, algo: Optional[str] = None, block_size: Optional[int] = None,
        metadata: Optional[Dict[str, str]] = None):
    """Build our adapters from a LyCORIS (lycoris-lora) network's state dict, without importing
    LyCORIS; the adapters compute what lycoris-lora's modules compute (fp32 rounding aside).

    ``state_dict``: a dict of tensors, or the path of a ``.safetensors`` file (tensors and
    metadata) or of a ``torch.save``'d dict. LyCORIS names a module's tensors
    ``<prefix><module path with '.'→'_'>.<tensor>``; each such module of ``model`` (``prefixes``
    tried in order) gets the adapter its tensors name:

    - LoCon (``lora_down.weight``/``lora_up.weight``/``alpha``, ``lora_mid.weight`` for a conv's
      tucker core), DoRA with ``dora_scale`` (per output or input channel, by its shape);
    - LoHa (``hada_w1_a`` ..., ``hada_t1``/``hada_t2``), LoKr (``lokr_w1``/``lokr_w1_a``/
      ``lokr_w1_b``/``lokr_w2``/``lokr_w2_a``/``lokr_w2_b``/``lokr_t2``), each with ``dora_scale``
      too (``DoHa*`` / ``DoKr*``);
    - diag-OFT (3-D ``oft_blocks``) and BOFT (4-D), ``rescale``, ``alpha`` the constraint
      (lycoris-lora bounds ‖Q‖ by ``alpha × out_features``);
    - IA3 (``weight``/``on_input``; the bias is not scaled: ``scale_bias=False``), Full
      (``diff``/``diff_b``), GLoRA (``a1.weight``/``a2.weight``/``b1.weight``/``b2.weight``/
      ``alpha``), and for an affine ``LayerNorm`` / ``GroupNorm`` Norms (``w_norm``/``b_norm``);
    - DyLoRA: its files hold LoCon's tensors, its scale is ``alpha / (rank / block_size)``
      (LoCon's is ``alpha / rank``). A file is DyLoRA when its metadata says so (kohya's trainer
      records ``ss_network_args`` ``{"algo": "dylora", "block_size": ...}``) or when the caller
      passes ``algo="dylora"``; else LoCon tensors load as LoCon. ``block_size``: the argument,
      else the metadata's, else lycoris-lora's default 4.

    ``algo``: the network's algorithm (lycoris-lora's name: ``"lora"``/``"locon"``, ``"loha"``,
    ``"lokr"``, ``"dylora"``, ``"glora"``, ``"diag-oft"``, ``"boft"``, ``"ia3"``, ``"full"``) when
    the caller knows it; every module's tensors must agree (norms excepted, lycoris-lora adds them
    to any network), else ValueError. ``metadata``: the file's metadata when ``state_dict`` is a dict.

    Every key must be used: with ``strict`` (default) keys naming no layer of the model and
    tensors no adapter reads raise a ValueError listing them, and nothing changes; with
    ``strict=False`` the rest loads and a :class:`LycorisLoadResult` (the model, the number of
    adapters, those keys) is returned. What cannot be built exactly raises in both modes, naming
    the layer: a layer type without an adapter here (Conv1d, Conv3d, grouped convs, ...), T-LoRA
    (its rank mask depends on the diffusion timestep), GLoRA's tucker core ``bm.weight``
    (lycoris-lora cannot build it either), tensors of another layer's shape, a missing tensor.

    Returns the model (a new object only if the model itself is adapted), or with
    ``strict=False`` a :class:`LycorisLoadResult`.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict, file_metadata = _read_lycoris_file(state_dict)
        metadata = file_metadata if metadata is None else metadata
    dylora_block = _dylora_marker(metadata or {})
    if algo is not None:
        algo = str(algo).lower()
        if algo not in _ALGO_HINTS:
            raise _fail(f"algo must be one of {sorted(_ALGO_HINTS)}, got {algo!r}")
        if dylora_block is not None and algo != "dylora":
            raise _fail(f"algo={algo!r}, but the file's metadata says a DyLoRA network made it")
        if algo == "dylora" and dylora_block is None:
            dylora_block = _DYLORA_BLOCK_SIZE
    if block_size is not None:
        if dylora_block is None:
            raise _fail("block_size applies to DyLoRA files only (pass algo='dylora')")
        dylora_block = int(block_size)

    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    keys: Dict[str, List[str]] = {}  # the file's keys per module key, for the lists below
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            raise _fail(f"{k!r} is a {type(v).__name__}, not a tensor")
        mod_key, _, t = k.partition(".")
        groups.setdefault(mod_key, {})[t] = v
        keys.setdefault(mod_key, []).append(k)
    layers = {}
    for name, mod in model.named_modules():
        layers.setdefault(name.replace(".", "_"), (name, mod))
    unmatched: List[str] = []
    unused: List[str] = []
    built: Dict[str, AdapterModule] = {}
    owner: Dict[str, str] = {}  # layer -> the module key its tensors came under
    for mod_key, sd in groups.items():
        hit = next((layers[mod_key[len(p):]] for p in prefixes
                    if mod_key.startswith(p) and mod_key[len(p):] in layers), None)
        if hit is None:
            unmatched += keys[mod_key]
            continue
        name, mod = hit
        if name in owner:
            raise _fail(f"{name or 'the model'} has tensors under two module keys: {owner[name]!r} and {mod_key!r}")
        owner[name] = mod_key
        found = _identify(sd)
        if not found:
            unused += keys[mod_key]
            continue
        if len(found) > 1:
            raise _fail(f"{name or 'the model'}: tensors of several LyCORIS algorithms {found} ({sorted(sd)})")
        lyco = found[0]
        if lyco == "oft":
            blocks = sd["oft_blocks"]
            lyco = {3: "diag-oft", 4: "boft"}.get(blocks.dim())
            if lyco is None:
                raise _fail(f"{name}: oft_blocks must be 3-D (diag-OFT) or 4-D (BOFT), got {tuple(blocks.shape)}")
        if algo is not None and lyco != "norm" and _ALGO_HINTS[algo] != lyco:
            raise _fail(f"algo={algo!r}, but {name}'s tensors are LyCORIS' {lyco!r} ({sorted(sd)})")
        used = {t: v for t, v in sd.items() if t in _LYCORIS_ALGOS[found[0]][1]}
        unused += [f"{mod_key}.{t}" for t in sd if t not in used]
        built[name] = _build_adapter(name, mod, lyco, used, multiplier, dylora_block if lyco == "locon" else None)
    if strict and (unmatched or unused):
        parts = []
        if unmatched:
            parts.append(f"{len(unmatched)} key(s) name no layer of the model (prefixes {list(prefixes)}): "
                         f"{_listing(sorted(unmatched))}")
        if unused:
            parts.append(f"{len(unused)} tensor(s) no adapter reads: {_listing(sorted(unused))}")
        raise _fail("; ".join(parts) + " (strict=False loads the rest and returns these keys)")
    for name, ad in built.items():
        if name == "":
            model = ad
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, ad)
    if strict:
        return model
    return LycorisLoadResult(model, len(built), sorted(unmatched), sorted(unused))


def _build_adapter(name, mod, lyco, sd, multiplier, dylora_block) -> AdapterModule:
    """The adapter for one layer from its LyCORIS tensors, checked to make that layer's weight;
    it records each tensor's shape and dtype (``lycoris_state_dict`` writes them back so)."""
    where = f"{name or 'the model'} ({type(mod).__name__}"
    if isinstance(mod, AdapterModule):
        raise _fail(f"{where}) already has an adapter: load into the plain model")
    norm = isinstance(mod, (nn.LayerNorm, nn.GroupNorm))
    if not (norm or isinstance(mod, (nn.Linear, nn.Conv2d))):
        raise _fail(f"{where}) has LyCORIS' {lyco!r} tensors, but lycoris_ops.nn adapts only Linear, Conv2d, "
                    f"LayerNorm and GroupNorm layers")
    if norm != (lyco == "norm"):
        raise _fail(f"{where}): a {type(mod).__name__} with the tensors of LyCORIS' {lyco!r} algorithm "
                    f"({sorted(sd)})")
    if lyco == "tlora":
        raise _fail(f"{where}): T-LoRA is not supported (its rank mask depends on the diffusion timestep, and "
                    f"its base factors are not in the file)")
    where += f" with weight {tuple(mod.weight.shape)})"
    try:
        ad = _BUILDERS[lyco](mod, sd, multiplier, dylora_block)
        with torch.no_grad():  # the tensors must make this layer's weight (not another model's)
            merged = ad.merged_weight()[0]
        if merged.shape != mod.weight.shape:
            raise RuntimeError(f"they make a weight of shape {tuple(merged.shape)}")
    except (RuntimeError, KeyError, TypeError, ValueError) as e:  # shapes of another model, a missing tensor
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        raise _fail(f"{where} cannot take the LyCORIS tensors {shapes}: {type(e).__name__}: {e}") from e
    ad._lyco_layout = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    return ad


def _alpha(sd) -> Optional[float]:
    return float(sd["alpha"]) if "alpha" in sd else None


def _set(ad: AdapterModule, attr: str, t: torch.Tensor) -> None:
    """``ad.attr`` = the stored tensor in the parameter's own shape (same leading size and element
    count: LyCORIS keeps conv factors flat or 4-D), dtype and device."""
    like = getattr(ad, attr)
    if t.dim() == 0 or t.shape[0] != like.shape[0] or t.numel() != like.numel():
        raise ValueError(f"{attr} must have shape {tuple(like.shape)} here (or the same leading size and element "
                         f"count), got {tuple(t.shape)}")
    setattr(ad, attr, nn.Parameter(t.detach().reshape(like.shape).to(device=like.device, dtype=like.dtype).clone()))


def _dora_on_out(mod, ds: torch.Tensor) -> bool:
    """dora_scale holds one norm per output channel ((O, 1, …)) or per input channel ((1, I, …))."""
    O, I = _out_in(mod)
    if ds.dim() >= 1 and ds.shape[0] == O and ds.numel() == O:
        return True
    if ds.dim() >= 2 and ds.shape[1] == I and ds.numel() == I:
        return False
    raise ValueError(f"dora_scale must be (O, 1, ...) = ({O}, 1, ...) or (1, I, ...) = (1, {I}, ...), "
                     f"got {tuple(ds.shape)}")


def _from_locon(mod, sd, multiplier, dylora_block):
    down = sd["lora_down.weight"]
    r, alpha = down.shape[0], _alpha(sd)
    conv = isinstance(mod, nn.Conv2d)
    tucker = "lora_mid.weight" in sd
    if tucker and not conv:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    if dylora_block is not None:
        if {"dora_scale", "lora_mid.weight"} & set(sd):
            raise ValueError("a DyLoRA module has neither dora_scale nor lora_mid.weight")
        ad = (DyLoRAConv2d if conv else DyLoRALinear)(mod, r, alpha, multiplier, block_size=dylora_block)
    elif "dora_scale" in sd:
        on_out = _dora_on_out(mod, sd["dora_scale"])
        ad = (DoRAConv2d(mod, r, alpha, multiplier, wd_on_out=on_out, use_tucker=tucker) if conv
              else DoRALinear(mod, r, alpha, multiplier, wd_on_out=on_out))
        _set(ad, "dora_scale", sd["dora_scale"])
    else:
        ad = (LoRAConv2d(mod, r, alpha, multiplier, use_tucker=tucker) if conv
              else LoRALinear(mod, r, alpha, multiplier))
    if tucker:
        if ad.lora_mid is None:
            raise ValueError("lora_mid.weight on a 1x1 conv (LyCORIS makes tucker cores for larger kernels only)")
        _set(ad, "lora_mid", sd["lora_mid.weight"])
    _set(ad, "lora_down", down)
    _set(ad, "lora_up", sd["lora_up.weight"])
    return ad


def _from_loha(mod, sd, multiplier, _):
    r, alpha = sd["hada_w1_b"].shape[0], _alpha(sd)
    conv = isinstance(mod, nn.Conv2d)
    tucker = "hada_t1" in sd or "hada_t2" in sd
    if tucker and not conv:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    on_out = _dora_on_out(mod, sd["dora_scale"]) if "dora_scale" in sd else None
    if conv:
        ad = (LoHaConv2d(mod, r, alpha, multiplier, use_tucker=tucker) if on_out is None
              else DoHaConv2d(mod, r, alpha, multiplier, wd_on_out=on_out, use_tucker=tucker))
        if tucker and ad.hada_t1 is None:
            raise ValueError("hada_t1/hada_t2 on a 1x1 conv (LyCORIS makes tucker cores for larger kernels only)")
    else:
        ad = LoHaLinear(mod, r, alpha, multiplier) if on_out is None else DoHaLinear(mod, r, alpha, multiplier, on_out)
    names = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") + (("hada_t1", "hada_t2") if tucker else ())
    for k in names + (("dora_scale",) if on_out is not None else ()):
        _set(ad, k, sd[k])
    return ad


def _from_lokr(mod, sd, multiplier, _):
    conv = isinstance(mod, nn.Conv2d)
    if conv:
        _conv_check(mod, "load_lycoris_state_dict")
    elif "lokr_t2" in sd:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    on_out = _dora_on_out(mod, sd["dora_scale"]) if "dora_scale" in sd else None
    cls = (LoKrConv2d if conv else LoKrLinear) if on_out is None else (DoKrConv2d if conv else DoKrLinear)
    ad = cls.__new__(cls)  # the factors' shapes come from the file, not from a factorization
    rank = next((sd[k].shape[0] for k in ("lokr_w1_b", "lokr_w2_b") if k in sd), 1)
    _Scaled.__init__(ad, mod, rank, _alpha(sd), multiplier)  # (the scale ignores alpha when no side is factored)
    names = []
    for n, k in _LOKR_ATTR.items():
        if k in sd:
            t = sd[k]
            if conv and k == "lokr_w2_b" and "lokr_t2" not in sd:  # LyCORIS stores it (r, d·kh·kw)
                t = t.reshape(t.shape[0], -1, *mod.kernel_size)
            setattr(ad, k, nn.Parameter(t.detach().to(device=mod.weight.device, dtype=mod.weight.dtype).clone()))
            names.append(n)
    ad._names = tuple(names)
    if on_out is not None:
        ad._init_decompose(on_out)
        _set(ad, "dora_scale", sd["dora_scale"])
    return ad


def _from_oft(mod, sd, multiplier, _):
    blocks = sd["oft_blocks"]
    out = _out_in(mod)[0]
    constraint = float(sd["alpha"]) * out if "alpha" in sd else 0.0  # lycoris-lora: constraint × out_dim
    rescaled = "rescale" in sd
    conv = isinstance(mod, nn.Conv2d)
    if blocks.dim() == 3:
        ad = (OFTConv2d if conv else OFTLinear)(mod, blocks.shape[1], multiplier, constraint, rescaled)
    else:
        ad = (BOFTConv2d if conv else BOFTLinear)(mod, blocks.shape[2], blocks.shape[0], multiplier, constraint,
                                                  rescaled)
    _set(ad, "oft_blocks", blocks)
    if rescaled:
        _set(ad, "rescale", sd["rescale"])
    return ad


def _from_ia3(mod, sd, multiplier, _):
    cls = IA3Conv2d if isinstance(mod, nn.Conv2d) else IA3Linear
    ad = cls(mod, multiplier, bool(sd["on_input"]), scale_bias=False)  # LyCORIS's IA3 leaves the bias unscaled
    _set(ad, "ia3_weight", sd["weight"].reshape(-1))
    return ad


def _from_full(mod, sd, multiplier, _):
    ad = (FullConv2d if isinstance(mod, nn.Conv2d) else FullLinear)(mod, multiplier)
    _set(ad, "diff", sd["diff"])
    if "diff_b" in sd:
        if ad.diff_b is None:
            raise ValueError("diff_b for a layer without a bias")
        _set(ad, "diff_b", sd["diff_b"])
    return ad


def _from_norm(mod, sd, multiplier, _):
    ad = NormAdapter(mod, multiplier)
    _set(ad, "w_norm", sd["w_norm"])
    if "b_norm" in sd:
        if ad.b_norm is None:
            raise ValueError("b_norm for a norm without a bias")
        _set(ad, "b_norm", sd["b_norm"])
    return ad


def _from_glora(mod, sd, multiplier, _):
    if "bm.weight" in sd:
        raise ValueError("GLoRA with a tucker core (bm.weight) is not supported (lycoris-lora cannot build it either)")
    cls = GLoRAConv2d if isinstance(mod, nn.Conv2d) else GLoRALinear
    ad = cls(mod, sd["a2.weight"].shape[0], _alpha(sd), multiplier)
    for k in ("a1", "a2", "b1", "b2"):
        _set(ad, k, sd[f"{k}.weight"])
    return ad


#: LyCORIS algorithm -> builder(layer, its tensors, multiplier, DyLoRA block size or None)
_BUILDERS = {"locon": _from_locon, "loha": _from_loha, "lokr": _from_lokr, "diag-oft": _from_oft,
             "boft": _from_oft, "ia3": _from_ia3, "full": _from_full, "norm": _from_norm, "glora": _from_glora}


def lycoris_state_dict(model: nn.Module, prefix: str = "lycoris_") -> Dict[str, torch.Tensor]:
    """The adapters of ``model`` as a LyCORIS network state dict: the inverse of
    :func:`load_lycoris_state_dict` (load a network, train or edit it on the ops, save it for
    lycoris-lora or any LyCORIS tool). Keys ``<prefix><module path with '.'→'_'>.<tensor>``
    with lycoris-lora's tensor names, shapes and dtypes (a tensor read by the loader keeps the
    shape and dtype it had in the file); lycoris-lora loads them into the same network and
    computes the same outputs. Detached copies.

    An adapter LyCORIS has no form for raises a ValueError naming it: IA3 with
    ``scale_bias=True`` on a layer with a bias (LyCORIS's IA3 leaves the bias unscaled; build it
    with ``scale_bias=False``)."""
    out: Dict[str, torch.Tensor] = {}
    for name, ad in adapters(model):
        head = prefix + name.replace(".", "_") + "."
        layout = getattr(ad, "_lyco_layout", {})
        shapes = _lycoris_shapes(ad)
        for k, t in _lycoris_tensors(ad).items():
            t = t.detach().clone()
            if k in layout:
                shape, dtype = layout[k]
                t = t.reshape(shape).to(dtype)
            elif k in shapes:
                t = t.reshape(shapes[k])
            out[head + k] = t
    return out


def _lycoris_tensors(ad: AdapterModule) -> Dict[str, torch.Tensor]:
    """LyCORIS tensor name -> tensor (the parameters themselves, in the module's shapes), for one adapter."""
    if isinstance(ad, (LoRALinear, LoRAConv2d)):
        t = {"lora_down.weight": ad.lora_down, "lora_up.weight": ad.lora_up, "alpha": ad.alpha}
        if getattr(ad, "lora_mid", None) is not None:
            t["lora_mid.weight"] = ad.lora_mid
    elif isinstance(ad, LoHaLinear):
        t = {k: getattr(ad, k) for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
        if getattr(ad, "hada_t1", None) is not None:
            t.update(hada_t1=ad.hada_t1, hada_t2=ad.hada_t2)
        t["alpha"] = ad.alpha
    elif isinstance(ad, LoKrLinear):
        t = dict({_LOKR_ATTR[n]: getattr(ad, _LOKR_ATTR[n]) for n in ad._names}, alpha=ad.alpha)
    elif isinstance(ad, GLoRALinear):
        t = {"a1.weight": ad.a1, "a2.weight": ad.a2, "b1.weight": ad.b1, "b2.weight": ad.b2, "alpha": ad.alpha}
    elif isinstance(ad, OFTLinear):
        t = {"oft_blocks": ad.oft_blocks}
        if ad.rescale is not None:
            t["rescale"] = ad.rescale
        # lycoris-lora saves the constraint over out_features, 0 for none (a file read without it stays so)
        if ad.constraint or "alpha" in getattr(ad, "_lyco_layout", {"alpha": None}):
            t["alpha"] = torch.tensor(ad.constraint / _out_in(ad.base)[0], dtype=torch.float32)
    elif isinstance(ad, IA3Linear):
        if ad.scale_bias and not ad.train_on_input and ad.base.bias is not None:
            raise ValueError("lycoris_ops.nn.lycoris_state_dict: an IA3 adapter with scale_bias=True on a layer "
                             "with a bias has no LyCORIS form (LyCORIS's IA3 leaves the bias unscaled; build the "
                             "adapter with scale_bias=False)")
        t = {"weight": ad.ia3_weight, "on_input": torch.tensor(int(ad.train_on_input))}
    elif isinstance(ad, FullLinear):
        t = {"diff": ad.diff} if ad.diff_b is None else {"diff": ad.diff, "diff_b": ad.diff_b}
    elif isinstance(ad, NormAdapter):
        t = {"w_norm": ad.w_norm} if ad.b_norm is None else {"w_norm": ad.w_norm, "b_norm": ad.b_norm}
    else:
        raise TypeError(f"lycoris_ops.nn.lycoris_state_dict: no LyCORIS form for {type(ad).__name__}")
    if isinstance(ad, (DoRALinear, _WeightDecomposed)):
        t["dora_scale"] = ad.dora_scale
    return t


def _lycoris_shapes(ad: AdapterModule) -> Dict[str, Tuple[int, ...]]:
    """The tensors lycoris-lora shapes otherwise than the module: a conv LoKr's w2_b flattened
    (r, d·kh·kw), a conv's per-channel OFT rescale and IA3 weight with the weight's rank."""
    w = ad.base.weight
    if isinstance(ad, LoKrConv2d) and "w2b" in ad._names and "t2" not in ad._names:
        return {"lokr_w2_b": (ad.lokr_w2_b.shape[0], -1)}
    if isinstance(ad, (OFTConv2d, BOFTConv2d)) and ad.rescale is not None:
        return {"rescale": (w.shape[0],) + (1,) * (w.dim() - 1)}
    if isinstance(ad, IA3Conv2d):
        return {"weight": (1, -1) + (1,) * (w.dim() - 2)}
    return {}
