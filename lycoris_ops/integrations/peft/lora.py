"""PEFT's LoRA layers on ``lora_bypass_fwd``.

- ``lora.Linear`` on any base (``nn.Linear``, transformers' ``Conv1D``, bitsandbytes and
  torchao quantized linears): the base layer runs its own forward and the bypass op folds
  that output in as ``base``: ``y = base(x) + s·B·A·dropout(x)`` (PEFT drops only the
  adapter's input); ``lora_bias`` adds ``s·b_B`` to the base output first.
- DoRA (``use_dora=True``) on an ``nn.Linear``: ``k = magnitude/‖W + s·B·A‖`` with the
  row norms in fp32 from ``functional.dora.lowrank_norm_terms`` (no merged weight built;
  detached, as PEFT does), ``y = base(x) + k⊙(W·x' + s·B·A·x') − W·x'``, the bracket one
  bypass call (x' = dropout(x); ``W·x'`` is ``base(x) − bias`` without dropout).
- ``lora.Conv2d``: the input's im2col rows (lora_A's own geometry; a 1×1 kernel without
  padding is a strided view) through the bypass op with lora_A flattened as ``down``; the
  rows cost kh·kw times the input's memory (and the op saves them for the backward).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import dora as _dora
from lycoris_ops.functional import locon as _locon
from lycoris_ops.integrations.peft.common import (R_NO_ADAPTER, Route, active_in, batched, call_reason, conv_rows,
                                                  conv_unrows, dropped, fallback, state_reason)

_R_DORA_BASE = "DoRA on a base other than nn.Linear (Conv1D, quantized)"
_R_DORA_BIAS = "DoRA with lora_bias"
_R_CONV_VARIANT = "LoRA variant (DoRA, ...) on a conv"
_R_LORA_CONV_GROUPED = "LoRA conv on a grouped base or with string padding"


def _lora_reason(self, dora_ok: bool = True) -> Optional[str]:
    """Why PEFT's LoRA Linear (any base) keeps its forward in its current state (None: it doesn't).
    ``dora_ok``: the layer class reads a plain base weight (not the quantized ones)."""
    reason = state_reason(self)
    if reason is not None:
        return reason
    active = active_in(self, self.lora_A)
    if not active:
        return R_NO_ADAPTER
    for a in active:
        v = self.lora_variant.get(a)
        if v is None:
            continue
        if type(v).__name__ != "DoraLinearVariant":
            return f"LoRA variant {type(v).__name__}"
        if not dora_ok or type(self.get_base_layer()) is not nn.Linear or self.base_layer is not self.get_base_layer():
            return _R_DORA_BASE
        if self.lora_B[a].bias is not None:
            return _R_DORA_BIAS
    return None


def _lora_run(self, x, args, kwargs, dora_ok: bool):
    reason = call_reason(args, kwargs) or _lora_reason(self, dora_ok)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    out_dtype = result.dtype
    for a in active_in(self, self.lora_A):
        A, B = self.lora_A[a].weight, self.lora_B[a].weight
        s = float(self.scaling[a])
        dropout = self.lora_dropout[a]
        if a in self.lora_variant:  # DoRA
            base = self.get_base_layer()
            plain_dropout = isinstance(dropout, nn.Identity) or not self.training
            xd = x if plain_dropout else dropout(x)
            mag = self.lora_magnitude_vector[a].weight
            W = base.weight
            with torch.no_grad():  # ‖W + s·B·A‖ per row in fp32, without building the merged weight
                norm = _dora.lowrank_norm_terms(W.detach(), B.detach(), A.detach(), s)[0].clamp_min(0).sqrt()
            k = (mag / norm.to(mag.dtype)).view(1, -1)
            if plain_dropout:  # PEFT uses the running result
                bw = result if base.bias is None else result - base.bias
            else:
                bw = F.linear(xd, W)
            z = _locon.bypass(xd, B, A, s, base=bw)
            result = (result + k * z - bw).to(out_dtype)
        else:
            bias = self.lora_B[a].bias  # lora_bias: s·b_B on every token
            base = result if bias is None else result + (bias * s).to(result.dtype)
            result = _locon.bypass(dropped(dropout, x), B, A, s, base=base)
    return result.to(out_dtype)


def _lora_forward(self, x, *args, **kwargs):
    return _lora_run(self, x, args, kwargs, dora_ok=True)


def _lora_quant_forward(self, x, *args, **kwargs):
    """PEFT's LoRA on a quantized base (bitsandbytes, torchao): its own base forward, our bypass."""
    return _lora_run(self, x, args, kwargs, dora_ok=False)


def _lora_conv_reason(self) -> Optional[str]:
    reason = state_reason(self)
    if reason is not None:
        return reason
    active = active_in(self, self.lora_A)
    if not active:
        return R_NO_ADAPTER
    for a in active:
        if a in self.lora_variant:
            return _R_CONV_VARIANT
        A, B = self.lora_A[a], self.lora_B[a]
        if A.groups != 1 or B.groups != 1 or tuple(B.kernel_size) != (1, 1) or isinstance(A.padding, str):
            return _R_LORA_CONV_GROUPED
    return None


def _lora_conv_forward(self, x, *args, **kwargs):
    """PEFT's LoRA Conv2d: ``base(x) + s·B(A(dropout(x)))`` as ``lora_bypass_fwd`` on the
    im2col rows of dropout(x) (A's own geometry), B the 1×1 up projection."""
    reason = call_reason(args, kwargs) or _lora_conv_reason(self)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    out_dtype = result.dtype
    x4 = batched(x)
    for a in active_in(self, self.lora_A):
        A, B = self.lora_A[a], self.lora_B[a]
        s = float(self.scaling[a])
        rows, nhw = conv_rows(dropped(self.lora_dropout[a], x4), A.kernel_size, A.stride, A.padding, A.dilation)
        delta = _locon.bypass(rows, B.weight, A.weight.flatten(1), s)
        if B.bias is not None:
            delta = delta + (B.bias * s).to(delta.dtype)
        delta = conv_unrows(delta, nhw)
        result = result + (delta if x.dim() == 4 else delta.squeeze(0))
    return result.to(out_dtype)


_LINEAR = Route(_lora_forward, _lora_reason, "lycoris.lora_bypass_fwd")
_QUANTIZED = Route(_lora_quant_forward, functools.partial(_lora_reason, dora_ok=False), "lycoris.lora_bypass_fwd")

#: PEFT module -> {layer class name: route}
ROUTES = {
    "peft.tuners.lora": {"Linear": _LINEAR,
                         "Conv2d": Route(_lora_conv_forward, _lora_conv_reason, "lycoris.lora_bypass_fwd")},
    "peft.tuners.lora.bnb": {"Linear8bitLt": _QUANTIZED, "Linear4bit": _QUANTIZED},
    "peft.tuners.lora.torchao": {"TorchaoLoraLinear": _QUANTIZED},
}
