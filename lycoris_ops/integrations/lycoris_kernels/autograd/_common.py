"""Shared by the ``lycoris.kernels.autograd`` entry points: the backend check and
the scale split (a float is the op's γ; a tensor scale is folded into one small
factor, which keeps it in the autograd graph and needs no host sync)."""
from __future__ import annotations

import torch

from lycoris_ops.integrations.lycoris_kernels.select import FUSED, backend_name


def check_backend(fn: str, backend) -> None:
    """These entry points run lycoris_ops' ops: ``backend`` must name a fused tier."""
    if backend_name(backend) not in (None,) + FUSED:
        raise ValueError(f"lycoris.kernels.autograd.{fn} runs lycoris_ops' ops: backend must be None, "
                         f"'lycoris_ops', 'triton' or 'tilelang', got {backend!r} (lycoris.functional's "
                         f"backend='torch' or 'compile' runs lycoris-lora's eager body)")


def split_scale(factor: torch.Tensor, scale):
    """``(factor', γ)`` with ``factor'·γ == factor·scale`` and γ a float."""
    if isinstance(scale, torch.Tensor):
        return factor * scale, 1.0
    return factor, float(scale)
