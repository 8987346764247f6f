"""DoRA (weight decomposition) on LoRA, and LyCORIS's ``dora_wd`` on LoCon / LoHa / LoKr
(DoRA / DoHa / DoKr): ``W' = wd(W + s·ΔW)``, the norms' rescale learned per channel."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import dora as _dora
from lycoris_ops.functional import ia3 as _ia3
from lycoris_ops.functional import locon as _locon
from lycoris_ops.nn.loha import LoHaConv2d, LoHaLinear
from lycoris_ops.nn.lokr import LoKrConv2d, LoKrLinear
from lycoris_ops.nn.lora import LoRAConv2d, LoRALinear


class _Rescale(torch.autograd.Function):
    """The DoRA rescale ``s = m·(d/n) + (1 − m)`` in ``out_dtype``, one per row (``row_axis``
    0) or column (1) of ``M = W + γ·up·down`` (W frozen), with ``n = ‖M‖ + ε`` (ε from d's
    dtype, as ``dora_fwd``) and d the learned norms (dora_scale): one autograd node (the
    division, the blend and the cast inside it are no nodes of their own: host time per
    layer and step in eager). The norms come in fp32 from the expansion of
    ``functional.dora.lowrank_norm_terms``: one O·I·r GEMM over W per direction, M (O×I)
    never built. Columns are the rows of ``Mᵀ = Wᵀ + γ·downᵀ·upᵀ``. The expansion is exact
    algebra in fp32 (no 16-bit rounding of γ·up·down); it loses digits only where
    ‖M‖ ≪ ‖W‖, i.e. an adapter that cancels its weight."""

    @staticmethod
    def _as_rows(W, up, down, row_axis):
        """(Wv, a, b) with the norms over the rows of ``Wv + γ·a·b``."""
        return (W, up, down) if row_axis == 0 else (W.t(), down.t(), up.t())

    # forward(ctx, ...) rather than forward + setup_context: torch binds a setup_context
    # Function's arguments through inspect.signature on every apply (host time per layer/step)
    @staticmethod
    def forward(ctx, W, d, up, down, gamma, row_axis, multiplier, out_dtype):
        m2, P, S = _dora.lowrank_norm_terms(*_Rescale._as_rows(W, up, down, row_axis), gamma)
        # all out of place: in-place steps here made a compiled CUDA graph lose up/down's grads
        n = m2.clamp_min(0).sqrt() + torch.finfo(d.dtype).eps
        s = torch.div(d, n)  # promoted to n's fp32
        if multiplier != 1.0:  # the usual multiplier 1 needs no blend
            s = s * multiplier + (1 - multiplier)
        ctx.save_for_backward(W, d, up, down, n, P, S)
        ctx.gamma, ctx.row_axis, ctx.multiplier = gamma, row_axis, multiplier
        return s.to(out_dtype)

    @staticmethod
    def backward(ctx, g_s):
        W, d, up, down, n, P, S = ctx.saved_tensors
        g = g_s.to(n.dtype) * ctx.multiplier
        g_d = g / n  # ∂s/∂d = m/n
        norm = (n - torch.finfo(d.dtype).eps).clamp_min(torch.finfo(n.dtype).tiny)
        g_m2 = g_d * d / (n * norm * -2)  # ∂s/∂n = −m·d/n², and d‖M‖ = d‖M‖²/(2‖M‖)
        Wv, a, b = _Rescale._as_rows(W, up, down, ctx.row_axis)
        g_a, g_b = _dora.lowrank_norm_grads(Wv, a, b, ctx.gamma, P, S, g_m2)
        g_up, g_down = (g_a, g_b) if ctx.row_axis == 0 else (g_b.t(), g_a.t())
        return None, g_d.to(d.dtype), g_up, g_down, None, None, None, None


def _weight_norms(weight: torch.Tensor, on_out: bool) -> torch.Tensor:
    """‖W‖ per output channel (``on_out``, shape (O, 1, …)) or per input channel ((1, I, …)), in
    W's dtype: the initial ``dora_scale``, with which the adapted layer starts as the base layer."""
    with torch.no_grad():
        axis = 0 if on_out else 1
        dims = [d for d in range(weight.dim()) if d != axis]
        return torch.linalg.vector_norm(weight.float(), dim=dims, keepdim=True).to(weight.dtype)


class DoRALinear(LoRALinear):
    """LoRA + weight decompose: ``W' = wd(W + s·up·down)`` with ``wd(M) = M·(m·(dora_scale/‖M‖ − 1) + 1)``,
    s = alpha/rank (the multiplier m only blends the rescale, as LyCORIS does), norms per output row
    (``wd_on_out=True``, dora_scale (O, 1)) or per input column (dora_scale (1, I)); dora_scale
    starts at ‖W‖ so the initial layer is unchanged.

    Forward without building W': the rescale is a vector s, so ``x·W'ᵀ = s ⊙ (x·Mᵀ)`` (rows) or
    ``(x ⊙ s)·Mᵀ`` (columns), and ``x·Mᵀ`` is the base layer plus the LoRA bypass op. The norms
    come from one O·I·r GEMM over W (``_Rescale``), their gradient from one more: M is
    never built and the backward has no weight-gradient GEMM over the tokens. (With the base
    weight trainable: the merged path, ``y = F.linear(x, W', b)``.)"""

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

    def _rescale(self, dtype):
        """s = m·(dora_scale/n − 1) + 1 in ``dtype``, one per output row (wd_on_out) or input column."""
        return _Rescale.apply(self.base.weight, self.dora_scale.reshape(-1), self.lora_up, self.lora_down,
                              self.scale, 0 if self.wd_on_out else 1, self.multiplier, dtype)

    def adapter_forward(self, x):
        if self.base.weight.requires_grad:
            return F.linear(x, self._weight(), self.base.bias)
        # the rescale on ia3_fwd (y = t⊙s, IA3's diff form): its backward is one pass for G⊙s and
        # Σ G⊙t, where a mul's autograd runs two token-sized muls and a sum
        if not self.wd_on_out:
            x = _ia3.ia3_scale(x, self._rescale(x.dtype), -1, diff=True)
        z = _locon.bypass(x, self.lora_up, self.lora_down, self.scale, base=F.linear(x, self.base.weight))
        if self.wd_on_out:
            z = _ia3.ia3_scale(z, self._rescale(z.dtype), -1, diff=True)
        return z if self.base.bias is None else z + self.base.bias

    def route(self):
        # the op making the output: per output row the rescale comes last (ia3_fwd on the bypass's output)
        if self.base.weight.requires_grad:
            return "lycoris.dora_fwd", None
        return ("lycoris.ia3_fwd" if self.wd_on_out else "lycoris.lora_bypass_fwd"), None

    def merged_weight(self):
        return self._weight(), None


class WeightDecomposed:
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

    def route(self):
        # ΔW by the adapter's merge op, then the rescale on dora_fwd, except per input channel of a
        # conv weight (no 2-D view: functional.dora's eager rescale)
        if self.wd_on_out or self.base.weight.dim() == 2:
            return "lycoris.dora_fwd", None
        return self._delta_op(), None

    def merged_weight(self):
        return self._weight(), None

    def extra_repr(self) -> str:
        return f"wd_on_out={self.wd_on_out}, " + super().extra_repr()


class DoRAConv2d(WeightDecomposed, LoRAConv2d):
    """DoRA on a conv (LoCon with ``dora_wd``): ``W' = wd(W + s·ΔW)`` on the (O, I, kh, kw) weight,
    norms per output channel (dora_scale (O, 1, 1, 1)) or per input channel over the outputs and
    the kernel (dora_scale (1, I, 1, 1)); see ``WeightDecomposed``. A conv weight is small next
    to its activations: W' is built each call."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True, use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier, use_tucker)
        self._init_decompose(wd_on_out)


class DoHaLinear(WeightDecomposed, LoHaLinear):
    """LoHa with ``dora_wd``: ``W' = wd(W + s·(w1a·w1b)⊙(w2a·w2b))`` (see ``WeightDecomposed``)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier)
        self._init_decompose(wd_on_out)


class DoHaConv2d(WeightDecomposed, LoHaConv2d):
    """LoHa on a conv (plain or tucker) with ``dora_wd`` (see ``WeightDecomposed``)."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 wd_on_out: bool = True, use_tucker: bool = False):
        super().__init__(base, rank, alpha, multiplier, use_tucker)
        self._init_decompose(wd_on_out)


class DoKrLinear(WeightDecomposed, LoKrLinear):
    """LoKr with ``dora_wd``: ``W' = wd(W + s·kron(w1, w2))`` (see ``WeightDecomposed``)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False, wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier, factor, decompose_both, full_matrix)
        self._init_decompose(wd_on_out)


class DoKrConv2d(WeightDecomposed, LoKrConv2d):
    """LoKr on a conv with ``dora_wd`` (see ``WeightDecomposed``)."""

    def __init__(self, base: nn.Conv2d, rank: int = 4, alpha: Optional[float] = None, multiplier: float = 1.0,
                 factor: int = -1, decompose_both: bool = False, full_matrix: bool = False, wd_on_out: bool = True):
        super().__init__(base, rank, alpha, multiplier, factor, decompose_both, full_matrix)
        self._init_decompose(wd_on_out)
