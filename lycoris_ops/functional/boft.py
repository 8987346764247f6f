"""BOFT entry points (docs/ops.md §3.6): merge (a weight's output channels, axis 0)
and bypass (a layer output's channels: last dim for linear, dim 1 for conv)
through ``torch.ops.lycoris.boft_fwd``.

blocks (m, nb, s, s): one set of nb Cayley blocks per butterfly stage; the
module multiplier is the op's ``scale`` (``F = scale·R + (1 − scale)·I`` in every
stage), rescale is applied after the last stage, ``diff`` subtracts the input.
All math is float32 in the op.

Constraint: as in ``functional.diag_oft`` — with ``constraint > 0`` the blocks
are scaled on device by the constraint factor (no host sync, gradient through
the norm as in eager LyCORIS) and the op gets ``cscale=1.0``;
``constraint_scale`` returns the float with a documented host sync.
Dropout masks are not supported here.
"""
from __future__ import annotations

from typing import Optional

import torch

from lycoris_ops.functional.diag_oft import _blocks_and_cscale, constrained_blocks, constraint_scale

__all__ = ["constraint_scale", "constrained_blocks", "merge", "bypass"]


def merge(blocks: torch.Tensor, weight: torch.Tensor, rescale: Optional[torch.Tensor] = None, *,
          constraint: float = 0.0, cscale: float = 1.0, multiplier: float = 1.0,
          diff: bool = True) -> torch.Tensor:
    """BOFT weight merge (§3.6): weight (O, *rest), O = nb·s, cast to the blocks'
    dtype, then ``boft_fwd(blocks, W, axis=0, cscale, scale=multiplier, rescale, diff)``.
    Returns ΔW (``diff=True``) or the merged weight, in weight's shape and the
    blocks' dtype (as the LyCORIS module does)."""
    dtype = blocks.dtype
    blocks, cscale = _blocks_and_cscale(blocks, constraint, cscale)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    return torch.ops.lycoris.boft_fwd(blocks, w, 0, cscale, float(multiplier), rescale, diff)


def bypass(blocks: torch.Tensor, org_out: torch.Tensor, rescale: Optional[torch.Tensor] = None, *,
           constraint: float = 0.0, cscale: float = 1.0, multiplier: float = 1.0, conv: bool = False,
           diff: bool = True) -> torch.Tensor:
    """BOFT on a layer output (bypass): org_out (…, C) for linear (axis −1) or
    (N, C, *spatial) for conv (``conv=True``, axis 1). Returns org_out's shape and
    dtype; the module adds org_out itself when ``diff``."""
    blocks, cscale = _blocks_and_cscale(blocks, constraint, cscale)
    if conv and org_out.dim() < 3:
        raise ValueError(f"lycoris.functional.boft.bypass: conv=True needs org_out (N, C, *spatial), "
                         f"got shape {tuple(org_out.shape)}")
    axis = 1 if conv else -1
    return torch.ops.lycoris.boft_fwd(blocks, org_out, axis, cscale, float(multiplier), rescale, diff)
