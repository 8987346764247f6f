"""PEFT's LoHa and LoKr layers.

- ``loha.Linear``: ``loha_bypass_fwd`` (ΔW never stored); ``loha.Conv2d``: ``conv(x, s·ΔW)``
  with ΔW from ``lora_merge_fwd`` (mode hada). LoHa's tucker convs (``use_effective_conv2d``)
  fall back.
- ``lokr.Linear``: ``lokr_bypass_fwd``; ``lokr.Conv2d`` (whole, factored or tucker w2): the
  input's im2col rows (the base's geometry) through ``lokr_bypass_fwd`` with w2 flattened to
  (c, d·kh·kw): ΔW's flattened columns are ``kron(w1, w2_flat)``'s, so the Kronecker product
  is never built.
- ``rank_dropout`` / ``module_dropout`` in training are drawn as PEFT draws them (one
  ``torch.rand(1)`` per adapter, then ``torch.rand(out)`` for the rank mask, on the CPU
  generator), so a seeded run drops what PEFT drops; PEFT also draws the first when both
  are 0, these forwards do not. A dropped adapter is skipped; the rank mask scales the
  op's output rows.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

from lycoris_ops.functional import loha as _loha
from lycoris_ops.functional import lokr as _lokr
from lycoris_ops.integrations.peft.common import (R_NO_ADAPTER, Route, active_in, batched, call_reason, conv_rows,
                                                  conv_unrows, fallback, state_reason)

_R_CONV_BASE = "grouped, string-padded or non-zero-padded conv base"
_R_LOHA_TUCKER = "LoHa tucker conv (use_effective_conv2d)"
_R_LOKR_TUCKER_LINEAR = "LoKr tucker factors on a linear layer"


def _lyco_draws(self, a, rescale: bool):
    """PEFT's LoHa/LoKr dropouts of adapter ``a`` for this call, drawn in PEFT's order from
    the CPU generator: (kept, rank mask (out,) or None). Module dropout skips the whole
    adapter; rank dropout masks ΔW's output rows (``rescale``: divided by its mean)."""
    p_module, p_rank = self.module_dropout[a], self.rank_dropout[a]
    if not self.training or not (p_module or p_rank):
        return True, None
    if not bool(torch.rand(1) > p_module):
        return False, None
    if not p_rank:
        return True, None
    mask = (torch.rand(self.get_base_layer().weight.shape[0]) > p_rank).float()
    return True, (mask / mask.mean() if rescale else mask)


def _masked(delta: torch.Tensor, mask: torch.Tensor, channel_axis: int) -> torch.Tensor:
    shape = [1] * delta.dim()
    shape[channel_axis] = -1
    return delta * mask.to(device=delta.device, dtype=delta.dtype).view(shape)


def _conv_base_reason(self) -> Optional[str]:
    """LoHa/LoKr convs use the base's geometry: a plain 2-D conv (groups 1, zero padding)."""
    base = self.get_base_layer()
    if (type(base) is not nn.Conv2d or base.groups != 1 or base.padding_mode != "zeros"
            or isinstance(base.padding, str)):
        return _R_CONV_BASE
    return None


def _loha_reason(self, conv: bool = False) -> Optional[str]:
    reason = state_reason(self) or (_conv_base_reason(self) if conv else None)
    if reason is not None:
        return reason
    active = active_in(self, self._available_adapters)
    if not active:
        return R_NO_ADAPTER
    if any(a in self.hada_t1 for a in active):
        return _R_LOHA_TUCKER
    return None


def _loha_run(self, x, args, kwargs, conv: bool):
    """PEFT's LoHa (non-tucker): ``loha_bypass_fwd`` on a linear (ΔW never stored), or
    ``conv(x, s·ΔW)`` with ΔW from the merge op on a conv (w1b/w2b (r, I·kh·kw))."""
    reason = call_reason(args, kwargs) or _loha_reason(self, conv)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    base = self.get_base_layer()
    geometry = dict(kernel_size=base.kernel_size, stride=base.stride, padding=base.padding,
                    dilation=base.dilation) if conv else {}
    result = self.base_layer(x)
    dt = x.dtype
    xin = batched(x) if conv else x
    for a in active_in(self, self._available_adapters):
        kept, mask = _lyco_draws(self, a, rescale=True)  # PEFT's LoHa always rescales the rank mask
        if not kept:
            continue
        factors = (self.hada_w1_a[a], self.hada_w1_b[a], self.hada_w2_a[a], self.hada_w2_b[a])
        s = float(self.scaling[a])
        if mask is None and not conv:
            result = _loha.bypass(x, *factors, s, base=result)
            continue
        delta = _loha.bypass(xin, *factors, s, **geometry)
        delta = delta if mask is None else _masked(delta, mask, 1 if conv else -1)
        result = result + (delta if delta.dim() == x.dim() else delta.squeeze(0))
    return result.to(dt)


def _loha_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, False)


def _loha_conv_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, True)


def _lokr_reason(self, conv: bool = False) -> Optional[str]:
    reason = state_reason(self) or (_conv_base_reason(self) if conv else None)
    if reason is not None:
        return reason
    active = active_in(self, self._available_adapters)
    if not active:
        return R_NO_ADAPTER
    if not conv and any(a in self.lokr_t2 for a in active):
        return _R_LOKR_TUCKER_LINEAR
    return None


def _lokr_factors(self, a, conv: bool = False):
    """PEFT's LoKr tensors of adapter ``a`` as ``functional.lokr`` factors; for a conv,
    side 2 as a (c, d·kh·kw) matrix (PEFT stores a factored w2b flattened already)."""
    f = {}
    if a in self.lokr_w1:
        f["w1"] = self.lokr_w1[a]
    else:
        f["w1a"], f["w1b"] = self.lokr_w1_a[a], self.lokr_w1_b[a]
    if a in self.lokr_w2:
        f["w2"] = self.lokr_w2[a].flatten(1) if conv else self.lokr_w2[a]
    elif a in self.lokr_t2:  # conv only (the reason above keeps linears with t2 on PEFT's forward)
        t2, w2a, w2b = self.lokr_t2[a], self.lokr_w2_a[a], self.lokr_w2_b[a]
        f["w2"] = _lokr.tucker_w2(t2, w2a, w2b, torch.promote_types(t2.dtype, w2a.dtype)).flatten(1)
    else:
        f["w2a"], f["w2b"] = self.lokr_w2_a[a], self.lokr_w2_b[a]
    return f


def _lokr_run(self, x, args, kwargs, conv: bool):
    """PEFT's LoKr: ``lokr_bypass_fwd`` on x (linear) or on x's im2col rows (conv, the
    base's geometry; ΔW's flattened columns are kron(w1, w2_flat)'s)."""
    reason = call_reason(args, kwargs) or _lokr_reason(self, conv)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    dt = x.dtype
    rows = None
    for a in active_in(self, self._available_adapters):
        kept, mask = _lyco_draws(self, a, rescale=bool(self.rank_dropout_scale[a]))
        if not kept:
            continue
        s = float(self.scaling[a])
        if not conv:
            if mask is None:
                result = _lokr.lokr_bypass(x, **_lokr_factors(self, a), scale=s, base=result)
            else:
                result = result + _masked(_lokr.lokr_bypass(x, **_lokr_factors(self, a), scale=s), mask, -1)
            continue
        if rows is None:
            base = self.get_base_layer()
            rows, nhw = conv_rows(batched(x), base.kernel_size, base.stride, base.padding, base.dilation)
        delta = _lokr.lokr_bypass(rows, **_lokr_factors(self, a, conv=True), scale=s)
        delta = conv_unrows(delta if mask is None else _masked(delta, mask, -1), nhw)
        result = result + (delta if x.dim() == 4 else delta.squeeze(0))
    return result.to(dt)


def _lokr_forward(self, x, *args, **kwargs):
    return _lokr_run(self, x, args, kwargs, False)


def _lokr_conv_forward(self, x, *args, **kwargs):
    return _lokr_run(self, x, args, kwargs, True)


#: PEFT module -> {layer class name: route}
ROUTES = {
    "peft.tuners.loha": {"Linear": Route(_loha_forward, _loha_reason, "lycoris.loha_bypass_fwd"),
                         "Conv2d": Route(_loha_conv_forward, functools.partial(_loha_reason, conv=True),
                                         "lycoris.lora_merge_fwd")},
    "peft.tuners.lokr": {"Linear": Route(_lokr_forward, _lokr_reason, "lycoris.lokr_bypass_fwd"),
                         "Conv2d": Route(_lokr_conv_forward, functools.partial(_lokr_reason, conv=True),
                                         "lycoris.lokr_bypass_fwd")},
}
