"""What the patched PEFT forwards share: the fallback to PEFT's own forward and the reasons
every layer type can give for it, the active adapters, and the im2col rows the conv
forwards run the linear bypass ops on."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.report import warn_fallback

# Fallback reasons (a report row's ``reason``; one warning each). No per-layer numbers in
# them: a reason is warned about once however many layers share it. The reasons only one
# layer type gives sit beside its forward.
_R_DISABLED = "adapters disabled (disable_adapter)"
_R_MERGED = "adapter merged into the base weight"
R_NO_ADAPTER = "no active adapter on this layer"
#: the base layer alone runs: nothing to fuse, reported but not warned about
QUIET = frozenset({_R_DISABLED, _R_MERGED, R_NO_ADAPTER})
_R_MIXED = "mixed-adapter batch (adapter_names=)"
_R_EXTRA_ARGS = "extra forward arguments"


class Route(NamedTuple):
    """How ``patch_peft`` runs one PEFT layer class."""

    forward: Callable  #: our forward for the layer
    reason: Callable[[nn.Module], Optional[str]]  #: why the layer's current state falls back (None: it doesn't)
    op: Union[str, Callable[[nn.Module], str]]  #: the lycoris op its fast path runs (the main one)
    prepare: Optional[Callable[[nn.Module], None]] = None  #: run once at patch time (eager, outside any compile)


def fallback(self, reason: str, x, args, kwargs):
    """PEFT's own forward, warning once per reason (not while Dynamo traces)."""
    if reason not in QUIET and not torch.compiler.is_compiling():
        warn_fallback(reason)
    return type(self).forward(self, x, *args, **kwargs)


def call_reason(args, kwargs) -> Optional[str]:
    """Why this call's arguments keep PEFT's forward (None: they don't)."""
    if kwargs.get("adapter_names") is not None:
        return _R_MIXED
    if args or any(k != "adapter_names" for k in kwargs):
        return _R_EXTRA_ARGS
    return None


def state_reason(self) -> Optional[str]:
    if self.disable_adapters:
        return _R_DISABLED
    if self.merged:
        return _R_MERGED
    return None


def active_in(self, table):
    """The layer's active adapters that ``table`` (one of its adapter dicts) holds."""
    return [a for a in self.active_adapters if a in table]


def dropped(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x if isinstance(dropout, nn.Identity) else dropout(x)


def batched(x: torch.Tensor) -> torch.Tensor:
    """A conv input as (N, C, H, W) (an unbatched (C, H, W) one gets N = 1)."""
    return x if x.dim() == 4 else x.unsqueeze(0)


def conv_rows(x: torch.Tensor, kernel, stride, padding, dilation):
    """im2col: x (N, C, H, W) -> (N·H'·W', C·kh·kw), row n·H'·W' + p the receptive field
    of output position p in the flattened conv weight's (c, kh, kw) column order; and
    (N, H', W'). A 1×1 kernel without padding is a strided view of the pixels (no unfold)."""
    N, C, H, W = x.shape
    if tuple(kernel) == (1, 1) and tuple(padding) == (0, 0):
        xs = x[:, :, ::stride[0], ::stride[1]]
        return xs.permute(0, 2, 3, 1).reshape(-1, C), (N, xs.shape[2], xs.shape[3])
    Ho, Wo = ((size + 2 * p - d * (k - 1) - 1) // s + 1
              for size, k, s, p, d in zip((H, W), kernel, stride, padding, dilation))
    cols = F.unfold(x, tuple(kernel), tuple(dilation), tuple(padding), tuple(stride))  # (N, C·kh·kw, H'·W')
    return cols.transpose(1, 2).reshape(N * Ho * Wo, cols.shape[1]), (N, Ho, Wo)


def conv_unrows(y: torch.Tensor, nhw) -> torch.Tensor:
    """Rows (N·H'·W', O) -> (N, O, H', W'), a channels-last view."""
    N, Ho, Wo = nhw
    return y.view(N, Ho, Wo, y.shape[-1]).permute(0, 3, 1, 2)
