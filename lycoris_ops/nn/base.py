"""What every ``lycoris_ops.nn`` adapter shares: :class:`AdapterModule` (the frozen base
layer, the multiplier, merge/unmerge, the op its forward runs), :class:`RankAdapter` (rank
and ``alpha``), :class:`ConvByWeight` (a conv run on the merged weight), the helpers the
adapter modules use, and the adapters' rows of ``lycoris_ops.explain``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.report import LayerRoute, register_describer

#: where an adapter's forward runs: (the lycoris op, None) or (None, why it runs none)
Route = Tuple[Optional[str], Optional[str]]


def kaiming_(t: torch.Tensor) -> torch.Tensor:
    """``t`` initialised as ``nn.Linear`` initialises its weight (LyCORIS's init of its down factors)."""
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


def out_in(base: nn.Module) -> Tuple[int, int]:
    """(out, in) features of a Linear, channels of a Conv2d."""
    if isinstance(base, nn.Conv2d):
        return base.out_channels, base.in_channels
    return base.out_features, base.in_features


def check_conv(base: nn.Conv2d, name: str):
    """The convs the adapters' conv paths and merges handle: ``groups=1``, zero padding."""
    if isinstance(base, nn.Conv2d) and (base.groups != 1 or base.padding_mode != "zeros"):
        raise ValueError(f"lycoris_ops.nn.{name}: only groups=1, padding_mode='zeros' convolutions are supported")


class AdapterModule(nn.Module):
    """Common part: ``self.base`` (frozen), ``multiplier``, merge/unmerge, and :meth:`route`:
    the op the forward runs, declared by each class beside its forward."""

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

    def route(self) -> Route:
        """``(op, None)``: the lycoris op this adapter's forward runs in its current state (the last
        one, which makes its output or its weight), or ``(None, reason)``: it runs none, and why.
        tests/integration/test_report.py checks every exported class against its forward."""
        return None, f"no route declared for {type(self).__name__}"

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


class RankAdapter(AdapterModule):
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


class ConvByWeight:
    """Conv form of an adapter whose merged weight is defined on any (O, I, kh, kw) weight:
    the layer's conv with the merged weight and bias. A conv weight is small next to its
    activations, so it is built each call (through the adapter's merge ops, differentiable).
    The route stays the adapter's: its bypass and its merge run the same op."""

    bases = (nn.Conv2d,)

    def __init__(self, base: nn.Conv2d, *args, **kw):
        check_conv(base, type(self).__name__)
        super().__init__(base, *args, **kw)

    def adapter_forward(self, x):
        w, b = self.merged_weight()
        base = self.base
        return F.conv2d(x, w, base.bias if b is None else b, base.stride, base.padding, base.dilation)



def _describe(name: str, module: nn.Module) -> Optional[LayerRoute]:
    """``lycoris_ops.explain``'s row for an adapter of this package (None for any other module)."""
    if not isinstance(module, AdapterModule):
        return None
    adapter = "lycoris_ops." + type(module).__name__
    if module.merged:
        return LayerRoute(name, adapter, None, "merged into the base weight")
    op, reason = module.route()
    return LayerRoute(name, adapter, op, reason)


register_describer(_describe)
