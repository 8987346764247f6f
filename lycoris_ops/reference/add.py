"""Scaled add (docs/ops.md §2.8): ``add_scaled`` (Full and Norms merges).

No bwd op: the autograd gives ``g_base = G`` and ``g_delta = γ·G``.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast, scalar_in


@C.cached
def check_add_scaled(base, delta, gamma):
    """-> ((base shape, base.dtype),). delta must have base's shape: no reshape and no
    broadcasting (a delta of another shape is a caller's mistake, e.g. a transposed weight,
    that would otherwise give a wrong sum silently)."""
    op = "add_scaled"
    C.tensor(op, "base", base)
    C.tensor(op, "delta", delta)
    C.float_arg(op, "gamma", gamma)
    C.shape(op, "delta", delta, base.shape, "(base's shape)")
    C.same_device(op, base=base, delta=delta)
    C.compute_dtype(op, base=base, delta=delta)  # float16 + bfloat16 -> error
    return ((tuple(base.shape), base.dtype),)


def add_scaled(base, delta, gamma):
    """``out = base + γ·delta`` elementwise.

    base: any shape; delta: base's shape, any float dtype (not float16 with
    bfloat16). fp32 arithmetic (fp64 when either is fp64); out in base's shape
    and dtype.
    """
    check_add_scaled(base, delta, gamma)
    cdt = torch.float64 if torch.float64 in (base.dtype, delta.dtype) else torch.float32
    out = torch.add(cast(base, cdt), cast(delta, cdt), alpha=scalar_in(gamma, cdt))
    return cast(out, base.dtype).contiguous()
