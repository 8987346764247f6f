"""PEFT's IA3 layers (any base layer; several active adapters: their vectors multiplied) on
``ia3_fwd``: the output scaled along the feature / channel axis, or the input for
feed-forward layers."""
from __future__ import annotations

from typing import Optional

import torch

from lycoris_ops.integrations.peft.common import R_NO_ADAPTER, Route, active_in, call_reason, fallback, state_reason


def _ia3_reason(self) -> Optional[str]:
    return state_reason(self) or (None if active_in(self, self.ia3_l) else R_NO_ADAPTER)


def _ia3_run(self, x, args, kwargs, axis: int):
    """PEFT's IA3: ``base(x)⊙w`` (bias included, as PEFT scales the result) or, for a
    feed-forward layer, ``base(x⊙w)``; w the product of the active adapters' vectors,
    along ``axis`` (``ia3_fwd``)."""
    reason = call_reason(args, kwargs) or _ia3_reason(self)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    w = None
    for a in active_in(self, self.ia3_l):
        v = self.ia3_l[a].reshape(-1)
        w = v if w is None else w * v
    if self.is_feedforward:
        return self.base_layer(torch.ops.lycoris.ia3_fwd(x, w, axis, 0.0, 1.0).to(x.dtype))
    y = self.base_layer(x)
    return torch.ops.lycoris.ia3_fwd(y, w, axis, 0.0, 1.0).to(y.dtype)


def _ia3_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, -1)


def _ia3_conv_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, -3)  # the channel axis of (N, C, H, W) and of unbatched (C, H, W)


#: PEFT module -> {layer class name: route}
ROUTES = {
    "peft.tuners.ia3": {"Linear": Route(_ia3_forward, _ia3_reason, "lycoris.ia3_fwd"),
                        "Conv2d": Route(_ia3_conv_forward, _ia3_reason, "lycoris.ia3_fwd")},
}
