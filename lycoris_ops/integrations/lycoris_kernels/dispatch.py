"""``lycoris.kernels.dispatch`` (lycoris-lora 4.1's backend inventory), on lycoris_ops.

lycoris-lora's LoKr functional layer asks ``fused_backends()`` for the factor-size
caps of its fused apply kernels (it imports ``lycoris.kernels.<name>.lokr.bypass``);
lycoris_ops declares no such cap (its ops step down per call inside the op), so
that import is refused and the cap is unbounded.
"""
from __future__ import annotations

import torch

from lycoris_ops.backends import registry as _ours

from lycoris_ops.integrations.lycoris_kernels.select import FUSED, backend_name

__all__ = ["ORDER", "FUSED", "available_backends", "fused_backends", "resolve_backend"]

#: preference order: our ops, then lycoris-lora's eager bodies compiled, then as they are
ORDER = ("lycoris_ops", "compile", "torch")


def _serves(device) -> bool:
    return device is None or torch.device(device).type in ("cpu", "cuda")


def available_backends(device=None) -> tuple:
    """The backends usable on ``device`` (any device when None), in preference order."""
    usable = {"lycoris_ops": _serves(device), "compile": _ours.probe_error("compile") is None, "torch": True}
    return tuple(name for name in ORDER if usable[name])


def fused_backends(device=None) -> tuple:
    """The available backends with a fused op set: ``("lycoris_ops",)`` on CPU and CUDA."""
    return FUSED if _serves(device) else ()


def resolve_backend(requested=None, device=None) -> str:
    """The backend a call on ``device`` gets: the requested one (validated; an
    unavailable one raises ValueError), else the first available."""
    name = backend_name(requested)
    available = available_backends(device)
    if name is None:
        return available[0]
    if name not in available:
        raise ValueError(f"lycoris.kernels (served by lycoris_ops): backend {requested!r} is not available"
                         f"{'' if device is None else f' on {device}'}; available: {', '.join(available)}")
    return name
