"""Typed Python entry points of the ``torch.ops.lycoris.*`` ops.

Each function calls its op once (so it stays one opaque node under ``torch.compile`` and
``torch.export``) and only adapts the call: keyword arguments with defaults, ``float(gamma)``,
and for the bypass ops any number of leading token dimensions (``x`` of shape ``(..., I)``
is flattened to ``(T, I)`` and the result reshaped back). The math, shapes and dtype rules
of every op are in docs/ops.md §2; bad arguments raise ``ValueError("lycoris.<op>: ...")``
from the op itself. Autograd is registered on the ops: the forward functions here are
differentiable, and their backward runs the ``*_bwd`` ops below, which are exposed for
callers that build their own autograd.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "lora_merge", "lora_bypass", "lora_tucker", "loha_bypass", "lokr_full_merge", "lokr_merge", "lokr_bypass",
    "dora", "oft", "boft", "ia3", "add_scaled",
    "lora_merge_bwd", "lora_bypass_bwd", "loha_merge_bwd", "loha_bypass_bwd", "lokr_full_merge_bwd",
    "lokr_merge_bwd", "lokr_bypass_bwd", "dora_bwd", "oft_bwd", "boft_bwd", "ia3_bwd",
]

_ops = torch.ops.lycoris


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _unrows(y: Tensor, x: Tensor) -> Tensor:
    return y.reshape(*x.shape[:-1], y.shape[-1])


# --------------------------------------------------------------------------- forward ops

def lora_merge(a1: Tensor, b1: Tensor, gamma: float = 1.0, *, a2: Optional[Tensor] = None,
               b2: Optional[Tensor] = None, mode: str = "plain", base: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """The rebuilt weight update ``ΔW`` (O, I) [+ base] (docs/ops.md §2.1.1).

    ``mode="plain"``: ``γ·a1·b1`` (LoRA/LoCon, a1 (O, r) "up", b1 (r, I) "down");
    ``"hada"``: ``γ·(a1·b1)⊙(a2·b2)`` (LoHa); ``"sum"``: ``γ·(a1·b1 + a2·b2)`` (GLoRA).
    Stored in ``out_dtype`` (default a1's dtype)."""
    return _ops.lora_merge_fwd(a1, b1, a2, b2, base, float(gamma), mode, out_dtype)


def lora_bypass(x: Tensor, up: Tensor, down: Tensor, gamma: float = 1.0, base: Optional[Tensor] = None) -> Tensor:
    """``γ·(x·downᵀ)·upᵀ [+ base]`` for x (..., I), up (O, r), down (r, I), base (..., O):
    the LoRA branch of a linear layer without forming ``ΔW`` (docs/ops.md §2.1.3). Pass the
    frozen layer's output as ``base`` to get the adapted output in one op."""
    y = _ops.lora_bypass_fwd(_rows(x), up, down, float(gamma), None if base is None else _rows(base))
    return _unrows(y, x)


def lora_tucker(a1: Tensor, t1: Tensor, b1: Tensor, gamma: float = 1.0, *, a2: Optional[Tensor] = None,
                t2: Optional[Tensor] = None, b2: Optional[Tensor] = None) -> Tensor:
    """A tucker-core rebuild (O, I, k) of a LoCon/LoHa convolution: ``γ·C1`` or, with the
    second chain, ``γ·C1⊙C2``, where ``C = a ×₀ t ×₁ b`` (docs/ops.md §2.1.5)."""
    return _ops.lora_tucker_fwd(a1, t1, b1, a2, t2, b2, float(gamma))


def loha_bypass(x: Tensor, a1: Tensor, b1: Tensor, a2: Tensor, b2: Tensor, gamma: float = 1.0,
                base: Optional[Tensor] = None) -> Tensor:
    """``γ·x·((a1·b1)⊙(a2·b2))ᵀ [+ base]`` for x (..., I): the LoHa branch, ``ΔW`` never
    stored (docs/ops.md §2.2.2)."""
    y = _ops.loha_bypass_fwd(_rows(x), a1, b1, a2, b2, float(gamma), None if base is None else _rows(base))
    return _unrows(y, x)


def lokr_full_merge(w1: Tensor, w2: Tensor, gamma: float = 1.0, base: Optional[Tensor] = None,
                    out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``γ·kron(w1, w2) [+ base]`` (docs/ops.md §2.3.1)."""
    return _ops.lokr_full_merge_fwd(w1, w2, base, float(gamma), out_dtype)


def lokr_merge(w1a: Tensor, w2a: Tensor, shape: Sequence[int], gamma: float = 1.0, *, w1b: Optional[Tensor] = None,
               w2b: Optional[Tensor] = None, base: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``γ·kron(w1, w2) [+ base]`` where a side given as two factors is their product
    (``w1 = w1a·w1b`` when ``w1b`` is given, likewise w2); ``shape`` = (a, b, c, d), the
    sides' shapes (docs/ops.md §2.3.3)."""
    return _ops.lokr_merge_fwd(w1a, w1b, w2a, w2b, list(shape), base, float(gamma), out_dtype)


def lokr_bypass(x: Tensor, w1: Tensor, w2: Tensor, gamma: float = 1.0, base: Optional[Tensor] = None) -> Tensor:
    """``γ·x·kron(w1, w2)ᵀ [+ base]`` for x (..., b·d), w1 (a, b), w2 (c, d): the LoKr branch
    without forming the Kronecker product (docs/ops.md §2.3.5)."""
    y = _ops.lokr_bypass_fwd(_rows(x), w1, w2, float(gamma), None if base is None else _rows(base))
    return _unrows(y, x)


def dora(w: Tensor, magnitude: Tensor, mult: float = 1.0, row_axis: int = 0,
         delta: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """DoRA's weight decomposition: ``M = w + delta``, ``s = mult·(m/‖M‖ − 1) + 1`` along
    ``row_axis``, returns ``(M·s, ‖M‖)`` (docs/ops.md §2.4.1)."""
    return _ops.dora_fwd(w, magnitude, float(mult), int(row_axis), delta)


def oft(blocks: Tensor, x: Tensor, rescale: Optional[Tensor] = None, cscale: float = 1.0, *, shift: bool = False,
        weight: bool = False) -> Tensor:
    """Diag-OFT: the block-diagonal Cayley rotation of ``blocks`` (n, S, S) applied to x's
    channels (``weight=True``: to a weight's rows), optional per-channel ``rescale``, minus
    x with ``shift`` (the ΔW form) (docs/ops.md §2.5.1)."""
    return _ops.oft_fwd(blocks, x, rescale, float(cscale), bool(shift), bool(weight))


def boft(blocks: Tensor, x: Tensor, axis: int = -1, cscale: float = 1.0, scale: float = 1.0,
         rescale: Optional[Tensor] = None, diff: bool = False) -> Tensor:
    """BOFT: the m-stage butterfly of Cayley rotations of ``blocks`` (m, n, s, s) applied to
    x's channels along ``axis``, times ``scale``, optional ``rescale``, minus x with ``diff``
    (docs/ops.md §2.6.1)."""
    return _ops.boft_fwd(blocks, x, int(axis), float(cscale), float(scale), rescale, bool(diff))


def ia3(x: Tensor, w: Tensor, channel_axis: int = -1, alpha: float = 1.0, gamma: float = 1.0) -> Tensor:
    """``x ⊙ (α + γ·w[c])`` along ``channel_axis`` (docs/ops.md §2.7.1)."""
    return _ops.ia3_fwd(x, w, int(channel_axis), float(alpha), float(gamma))


def add_scaled(base: Tensor, delta: Tensor, gamma: float = 1.0) -> Tensor:
    """``base + γ·delta``; ``delta`` must have base's shape (docs/ops.md §2.8)."""
    return _ops.add_scaled(base, delta, float(gamma))


# --------------------------------------------------------------------------- backward ops
# Each returns the gradients of its forward's inputs (docs/ops.md §2), in the forward's argument order.

def lora_merge_bwd(grad: Tensor, up: Tensor, down: Tensor, gamma: float = 1.0) -> Tuple[Tensor, Tensor]:
    return _ops.lora_merge_bwd(grad, up, down, float(gamma))


def lora_bypass_bwd(grad: Tensor, x: Tensor, up: Tensor, down: Tensor,
                    gamma: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    return _ops.lora_bypass_bwd(grad, x, up, down, float(gamma))


def loha_merge_bwd(grad: Tensor, a1: Tensor, b1: Tensor, a2: Tensor, b2: Tensor,
                   gamma: float = 1.0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.loha_merge_bwd(grad, a1, b1, a2, b2, float(gamma))


def loha_bypass_bwd(grad: Tensor, x: Tensor, a1: Tensor, b1: Tensor, a2: Tensor, b2: Tensor,
                    gamma: float = 1.0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _ops.loha_bypass_bwd(grad, x, a1, b1, a2, b2, float(gamma))


def lokr_full_merge_bwd(grad: Tensor, w1: Tensor, w2: Tensor, gamma: float = 1.0) -> Tuple[Tensor, Tensor]:
    return _ops.lokr_full_merge_bwd(grad, w1, w2, float(gamma))


def lokr_merge_bwd(grad: Tensor, w1a: Tensor, w1b: Optional[Tensor], w2a: Tensor, w2b: Optional[Tensor],
                   shape: Sequence[int], gamma: float = 1.0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """An absent factor's gradient is an empty tensor (an op cannot return None)."""
    return _ops.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, list(shape), float(gamma))


def lokr_bypass_bwd(grad: Tensor, x: Tensor, w1: Tensor, w2: Tensor,
                    gamma: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    return _ops.lokr_bypass_bwd(grad, x, w1, w2, float(gamma))


def dora_bwd(grad: Tensor, w: Tensor, magnitude: Tensor, norms: Tensor, mult: float = 1.0, row_axis: int = 0,
             delta: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(g_M, g_magnitude)``, with ``norms`` the second output of :func:`dora`."""
    return _ops.dora_bwd(grad, w, magnitude, norms, float(mult), int(row_axis), delta)


def oft_bwd(grad: Tensor, blocks: Tensor, x: Tensor, rescale: Optional[Tensor] = None, cscale: float = 1.0, *,
            shift: bool = False, weight: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """``(g_x, g_blocks, g_rescale)``; g_rescale is empty without a rescale."""
    return _ops.oft_bwd(grad, blocks, x, rescale, float(cscale), bool(shift), bool(weight))


def boft_bwd(grad: Tensor, blocks: Tensor, x: Tensor, axis: int = -1, cscale: float = 1.0,
             scale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """``(g_x, g_blocks)`` of the plain butterfly chain (no rescale, no diff)."""
    return _ops.boft_bwd(grad, blocks, x, int(axis), float(cscale), float(scale))


def ia3_bwd(grad: Tensor, x: Tensor, w: Tensor, channel_axis: int = -1, alpha: float = 1.0,
            gamma: float = 1.0) -> Tuple[Tensor, Tensor]:
    return _ops.ia3_bwd(grad, x, w, int(channel_axis), float(alpha), float(gamma))
