"""Diag-OFT entry points (docs/ops.md §3.5): merge (a weight's rows) and bypass (a
layer output's channels) through ``torch.ops.lycoris.oft_fwd``.

Conventions (LyCORIS diag-OFT): blocks (K, S, S) raw trainable blocks,
``R_k = (I + Q_k)(I − Q_k)⁻¹`` with ``Q_k = c·(B_k − B_kᵀ)``; the module applies
``Rᵀ`` to the weight's rows (``einsum("k n m, k n ... -> k m ...")``) and
``y_k·R_k`` to each output row vector, then the per-channel rescale, then
subtracts the input when ``diff``. The multiplier is folded into the rotation:
``F = multiplier·R + (1 − multiplier)·I``.

Constraint (docs/ops.md §2.5): the constraint factor
``c = constraint/ν`` (when ``ν = ‖B − Bᵀ‖_F + 1e-8 > constraint``, else 1) is a
float argument of the op. Turning a device norm into a float needs a host sync,
so ``merge``/``bypass`` never do that: with ``constraint > 0`` they scale the
blocks on device (``blocks·c`` with ``c`` a 0-d tensor from ``torch.where``) and
call the op with ``cscale=1.0``. That is sync-free, graph-capturable, and the
gradient through ν flows exactly as in eager LyCORIS. ``constraint_scale``
gives the float (with a documented sync) for callers who want lycoris-lora's
behaviour (no gradient through ν).

Blocks are never rounded to a 16-bit activation dtype: the op computes
the Cayley transform in float32 from them. Dropout masks are not supported here
(a module in training with dropout goes eager on its own).
"""
from __future__ import annotations

from typing import Optional

import torch

from lycoris_ops.reference.oft import channel_view, work_dtype

__all__ = ["constraint_scale", "constrained_blocks", "merge", "bypass"]

_EPS = 1e-8


def constraint_scale(blocks: torch.Tensor, constraint: float) -> float:
    """lycoris-lora's constraint factor as a Python float (docs/ops.md §2.5).

    ``ν = ‖B − Bᵀ‖_F + 1e-8`` over all blocks; ``constraint/ν`` if
    ``constraint > 0`` and ``ν > constraint``, else 1.0. **Host sync** when
    ``constraint > 0`` (the norm is read back with ``.item()``), and the result is
    a constant: no gradient flows through ν. Prefer ``merge``/``bypass`` with
    ``constraint=``, which do neither.
    """
    if constraint <= 0:
        return 1.0
    with torch.no_grad():
        b = blocks.detach()
        b = b if b.dtype in (torch.float32, torch.float64) else b.float()
        nu = float(torch.linalg.vector_norm(b - b.transpose(-1, -2)).item()) + _EPS  # host sync
    return constraint / nu if nu > constraint else 1.0


def constrained_blocks(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """``blocks·c`` with the constraint factor c computed on device (differentiable,
    no host sync): ``Q = (B·c) − (B·c)ᵀ = c·(B − Bᵀ)`` is the constrained Q.
    16-bit blocks are upcast to float32 first. ``constraint <= 0`` returns blocks."""
    if constraint <= 0:
        return blocks
    b = blocks if blocks.dtype in (torch.float32, torch.float64) else blocks.float()
    nu = torch.linalg.vector_norm(b - b.transpose(-1, -2)) + _EPS
    c = torch.where(nu > constraint, constraint / nu, torch.ones_like(nu))
    return b * c


def _blocks_and_cscale(blocks, constraint, cscale):
    if constraint > 0:
        if cscale != 1.0:
            raise ValueError("lycoris.functional: pass either constraint= (computed on device) or cscale=, not both")
        return constrained_blocks(blocks, constraint), 1.0
    return blocks, float(cscale)


def _eager(blocks, x, axis, rescale, cscale, multiplier, shift):
    """Eager diag-OFT with a multiplier (§3.5): ``F = m·R + (1 − m)·I``,
    ``out_k = diag(ρ_k)·F_kᵀ·x_k − shift·x_k`` along ``axis``; float32 math
    (float64 if all operands are), autograd through torch."""
    K, S = blocks.shape[0], blocks.shape[1]
    dt = work_dtype(blocks, x, rescale)
    b = blocks.to(dt)
    q = cscale * (b - b.transpose(-1, -2))
    eye = torch.eye(S, dtype=dt, device=b.device)
    r = torch.linalg.solve_ex(eye - q, eye + q, left=False, check_errors=False).result  # (I + Q)(I − Q)⁻¹
    f = multiplier * r + (1.0 - multiplier) * eye
    ft = f.transpose(-1, -2)
    if rescale is not None:
        ft = rescale.reshape(K, S, 1).to(dt) * ft
    xv = channel_view(x, axis).to(dt)
    pre, post = xv.shape[0], xv.shape[2]
    xv = xv.reshape(pre, K, S, post)
    out = torch.einsum("kij,nkjt->nkit", ft, xv)
    if shift:
        out = out - xv
    return out.reshape(x.shape).to(x.dtype)


def merge(blocks: torch.Tensor, weight: torch.Tensor, rescale: Optional[torch.Tensor] = None, *,
          constraint: float = 0.0, cscale: float = 1.0, multiplier: float = 1.0,
          diff: bool = True) -> torch.Tensor:
    """Diag-OFT weight merge.

    blocks (K, S, S); weight (O, *rest) with O = K·S (conv weights flattened to
    (O, rest) for the op); rescale O elements (any shape, e.g. the module's
    (O, 1, …)) or None. Returns ``diag(ρ)·Fᵀ·W − W`` (``diff=True``: ΔW) or the
    merged weight ``diag(ρ)·Fᵀ·W`` (``diff=False``), in weight's shape and dtype.
    ``multiplier != 1`` runs eagerly (the op has no multiplier argument).
    """
    blocks, cscale = _blocks_and_cscale(blocks, constraint, cscale)
    w2 = weight.reshape(weight.shape[0], -1) if weight.dim() != 2 else weight
    if multiplier != 1.0:
        out = _eager(blocks, w2, 0, rescale, cscale, float(multiplier), diff)
    else:
        out = torch.ops.lycoris.oft_fwd(blocks, w2, rescale, cscale, diff, True)
    return out.reshape(weight.shape)


def bypass(blocks: torch.Tensor, org_out: torch.Tensor, rescale: Optional[torch.Tensor] = None, *,
           constraint: float = 0.0, cscale: float = 1.0, multiplier: float = 1.0, conv: bool = False,
           diff: bool = True) -> torch.Tensor:
    """Diag-OFT on a layer output (bypass mode).

    org_out (…, C) for a linear layer (leading dims flattened to (T, C) for the
    op) or (N, C, *spatial) for a conv (``conv=True``, channels on dim 1), C = K·S.
    Per block: ``out_k = ρ_k ⊙ (y_k·F_k) − diff·y_k`` for each token / position
    (row-vector form of ``diag(ρ)·Fᵀ·y``). Returns org_out's shape and dtype; the
    module adds org_out itself when ``diff``.
    """
    blocks, cscale = _blocks_and_cscale(blocks, constraint, cscale)
    if conv:
        if org_out.dim() < 3:
            raise ValueError(f"lycoris.functional.diag_oft.bypass: conv=True needs org_out (N, C, *spatial), "
                             f"got shape {tuple(org_out.shape)}")
        x = org_out
    else:
        x = org_out.reshape(-1, org_out.shape[-1]) if org_out.dim() != 2 else org_out
    axis = 1
    if multiplier != 1.0:
        out = _eager(blocks, x, axis, rescale, cscale, float(multiplier), diff)
    else:
        out = torch.ops.lycoris.oft_fwd(blocks, x, rescale, cscale, diff, False)
    return out.reshape(org_out.shape)
