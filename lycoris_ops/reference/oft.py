"""Diag-OFT (docs/ops.md §2.5): a block-diagonal Cayley rotation of a weight's rows or
of an activation's channels, with an optional per-channel rescale and an
identity shift.

Shared with BOFT (reference/boft.py): the Cayley transform and its gradient, the
work dtype rule and the ``(pre, C, post)`` channel view of a tensor.

Numerics (docs/ops.md §1.3 rule 9): the Cayley transform is computed in float32
from the blocks upcast to float32 (never rounded to a 16-bit activation dtype),
float64 when every tensor operand is float64 (gradcheck). The rotation and its
epilogues run in the same work dtype and are rounded once to x's dtype.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from lycoris_ops.reference import checks as _checks
from lycoris_ops.reference import cast

__all__ = [
    "check_oft_fwd", "oft_fwd", "check_oft_bwd", "oft_bwd", "oft_fwd_native", "oft_bwd_native",
    "work_dtype", "token_dtype", "cayley", "cayley_backward", "channel_view",
]


# ----------------------------------------------------------------- shared helpers

def work_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """float64 when every given (non-None) tensor is float64, else float32."""
    ts = [t for t in tensors if t is not None]
    if ts and all(t.dtype == torch.float64 for t in ts):
        return torch.float64
    return torch.float32


def cayley(blocks: torch.Tensor, cscale: float, dtype: torch.dtype):
    """Batched Cayley transform of raw blocks (..., S, S) in ``dtype``.

    ``Q = cscale·(B − Bᵀ)``, ``M = (I − Q)⁻¹`` (a batched ``linalg.solve`` with
    ``check_errors=False``: ``I − Q`` is always invertible since Q is
    skew-symmetric, and skipping the error check avoids a host sync on CUDA),
    ``R = (I + Q)·M``. Returns ``(R, M)``.
    """
    b = cast(blocks, dtype)
    q = cscale * (b - b.transpose(-1, -2))
    eye = torch.eye(b.shape[-1], dtype=dtype, device=b.device).expand_as(q)
    m = torch.linalg.solve_ex(eye - q, eye, check_errors=False).result
    r = torch.matmul(eye + q, m)
    return r, m


def cayley_backward(g_r: torch.Tensor, m: torch.Tensor, cscale: float) -> torch.Tensor:
    """dL/dB from dL/dR: ``dR = (I + R)·dQ·M = 2·M·dQ·M`` (as ``I + R = 2M``), so
    ``gQ = 2·Mᵀ·gR·Mᵀ`` and ``gB = cscale·(gQ − gQᵀ)``. cscale is a constant."""
    mt = m.transpose(-1, -2)
    g_q = 2.0 * torch.matmul(torch.matmul(mt, g_r), mt)
    return cscale * (g_q - g_q.transpose(-1, -2))


def channel_view(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``x`` reshaped to ``(pre, C, post)`` with C = x.shape[axis] (axis normalized)."""
    pre = math.prod(x.shape[:axis])
    post = math.prod(x.shape[axis + 1:])
    return x.reshape(pre, x.shape[axis], post)


def _oft_axis(x: torch.Tensor, weight: bool) -> int:
    """The rotated axis: rows of a weight; the last dim of a 2-D activation, dim 1 of a ≥3-D one."""
    if weight:
        return 0
    return 1 if x.dim() >= 3 else x.dim() - 1


# ------------------------------------------------------------------------ checks

def _check_common(op, blocks, x, rescale, cscale, shift, weight, grad=None):
    _checks.tensor(op, "blocks", blocks, 3, "(K, S, S)")
    K, S = blocks.shape[0], blocks.shape[1]
    _checks.size(op, "blocks.shape[2] (S, blocks must be (K, S, S))", blocks.shape[2], S)
    if not isinstance(weight, bool):
        _checks.fail(op, f"weight must be a bool, got {type(weight).__name__}")
    if not isinstance(shift, bool):
        _checks.fail(op, f"shift must be a bool, got {type(shift).__name__}")
    _checks.float_arg(op, "cscale", cscale)
    _checks.tensor(op, "x", x)
    if weight:
        if x.dim() != 2:
            _checks.fail(op, f"x must be 2-D (K*S, L) when weight=True, got shape {tuple(x.shape)}")
        _checks.size(op, "x.shape[0] (K*S rows, weight=True)", x.shape[0], K * S)
    else:
        if x.dim() < 2:
            _checks.fail(op, "x must be 2-D (T, K*S) or >=3-D (N, K*S, *spatial) when weight=False, "
                             f"got shape {tuple(x.shape)}")
        ax = _oft_axis(x, weight)
        what = "x.shape[-1] (K*S channels, weight=False, 2-D)" if x.dim() == 2 else \
            "x.shape[1] (K*S channels, weight=False, >=3-D)"
        _checks.size(op, what, x.shape[ax], K * S)
    if rescale is not None:
        _checks.tensor(op, "rescale", rescale)
        rs = tuple(rescale.shape)
        _checks.expect(rescale.numel() == K * S, op,
                       lambda: f"rescale must have K*S = {K * S} elements, got shape {rs}")
    if grad is not None:
        _checks.tensor(op, "grad", grad)
        if grad.dim() != x.dim():
            _checks.fail(op, f"grad must have the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
        for d in range(x.dim()):  # per-dim size checks: closures over ints only (dynamo fullgraph)
            _checks.size(op, f"grad.shape[{d}] (the shape of x)", grad.shape[d], x.shape[d])
    _checks.same_device(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    _checks.compute_dtype(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    return K, S


@_checks.cached
def check_oft_fwd(blocks, x, rescale, cscale, shift, weight):
    """Output spec of ``oft_fwd``: one tensor of x's shape and dtype."""
    _check_common("oft_fwd", blocks, x, rescale, cscale, shift, weight)
    return ((tuple(x.shape), x.dtype),)


@_checks.cached
def check_oft_bwd(grad, blocks, x, rescale, cscale, shift, weight):
    """Output spec of ``oft_bwd``: gx (x), g_blocks (blocks), g_rescale ((K*S,) or (0,), blocks' dtype)."""
    _checks.tensor("oft_bwd", "grad", grad)  # required here (_check_common's None means "no grad")
    K, S = _check_common("oft_bwd", blocks, x, rescale, cscale, shift, weight, grad=grad)
    g_rescale_shape = (K * S,) if rescale is not None else (0,)
    return ((tuple(x.shape), x.dtype), (tuple(blocks.shape), blocks.dtype), (g_rescale_shape, blocks.dtype))


# ------------------------------------------------------------------------- bodies

def _f_matrix(r, rescale, K, S, dtype, shift=False):
    """``F_k = diag(ρ_k)·R_kᵀ − shift·I`` per block, (K, S, S), in the work dtype: the shift
    is taken off before a 16-bit body rounds F, so the difference F·x never cancels in 16 bits
    (R·x − x would: its rounding is of x's size, the difference at small rotations far less)."""
    ft = r.transpose(-1, -2)
    if rescale is not None:
        ft = rescale.reshape(K, S, 1).to(dtype) * ft
    if shift:
        ft = ft - torch.eye(S, dtype=ft.dtype, device=ft.device)
    return ft


def token_dtype(x: torch.Tensor, work: torch.dtype, native: bool) -> torch.dtype:
    """The dtype of the token-sized math: the work dtype (exact bodies), or in the CUDA
    step-down bodies x's own 16-bit dtype (docs/ops.md §1.5)."""
    return x.dtype if native and x.dtype in (torch.float16, torch.bfloat16) else work


def oft_fwd(blocks: torch.Tensor, x: torch.Tensor, rescale: Optional[torch.Tensor], cscale: float,
            shift: bool, weight: bool, *, native: bool = False) -> torch.Tensor:
    """Diag-OFT rotation (docs/ops.md §2.5.1).

    blocks (K, S, S); x (K·S, L) when ``weight`` (rows rotated), else (T, K·S)
    (2-D, channels last) or (N, K·S, *spatial) (channels on dim 1); rescale K·S
    elements or None. With ``R_k = (I + Q_k)(I − Q_k)⁻¹``, ``Q_k = cscale·(B_k − B_kᵀ)``
    and ``F_k = diag(ρ_k)·R_kᵀ − shift·I``: ``out[k·S+i] = Σ_j F_k[i,j]·x[k·S+j]``
    for every column / token / position. Returns x's shape and dtype, computed in
    float32 (float64 if all operands are float64).
    """
    check_oft_fwd(blocks, x, rescale, cscale, shift, weight)
    K, S = blocks.shape[0], blocks.shape[1]
    dt = work_dtype(blocks, x, rescale)
    r, _ = cayley(blocks, cscale, dt)
    td = token_dtype(x, dt, native)
    f = cast(_f_matrix(r, rescale, K, S, dt, shift), td)
    ax = _oft_axis(x, weight)
    xv = channel_view(x, ax).to(td)
    pre, post = xv.shape[0], xv.shape[2]
    xv = xv.reshape(pre, K, S, post)
    out = torch.einsum("kij,nkjt->nkit", f, xv)
    return out.reshape(x.shape).to(x.dtype).contiguous()


def oft_bwd(grad: torch.Tensor, blocks: torch.Tensor, x: torch.Tensor, rescale: Optional[torch.Tensor],
            cscale: float, shift: bool, weight: bool, *, native: bool = False):
    """Gradients of ``oft_fwd`` (docs/ops.md §2.5.2); G is cast to the work dtype (fp32/fp64).

    ``gx_k = F_kᵀ·G_k``; ``P_k = Σ_cols G_k·X_kᵀ``; ``g_rescale[k·S+i] = Σ_j P_k[i,j]·R_k[j,i]``;
    ``gR_k = (diag(ρ_k)·P_k)ᵀ`` (``P_kᵀ`` without rescale), then the Cayley chain
    (cscale is a constant). Returns gx (x's shape and dtype), g_blocks (K, S, S) in
    blocks' dtype, g_rescale (K·S,) in blocks' dtype — or an empty (0,) tensor of
    blocks' dtype when rescale is None.
    """
    check_oft_bwd(grad, blocks, x, rescale, cscale, shift, weight)
    K, S = blocks.shape[0], blocks.shape[1]
    dt = work_dtype(grad, blocks, x, rescale)
    r, m = cayley(blocks, cscale, dt)
    f = _f_matrix(r, rescale, K, S, dt, shift)
    td = token_dtype(x, dt, native)
    ax = _oft_axis(x, weight)
    xv = channel_view(x, ax).to(td)
    pre, post = xv.shape[0], xv.shape[2]
    xv = xv.reshape(pre, K, S, post)
    gv = channel_view(grad, ax).to(td).reshape(pre, K, S, post)

    gx = torch.einsum("kij,nkit->nkjt", cast(f, td), gv)
    p = torch.einsum("nkit,nkjt->kij", gv, xv).to(dt)  # dL/dF_k
    if rescale is not None:
        g_rescale = (p * r.transpose(-1, -2)).sum(-1).reshape(K * S)
        g_r = (rescale.reshape(K, S, 1).to(dt) * p).transpose(-1, -2)
        g_rescale = cast(g_rescale, blocks.dtype).contiguous()
    else:
        g_r = p.transpose(-1, -2)
        g_rescale = blocks.new_empty((0,))
    g_blocks = cayley_backward(g_r, m, cscale)
    return (gx.reshape(x.shape).to(x.dtype).contiguous(),
            cast(g_blocks, blocks.dtype).contiguous(),
            g_rescale)


def oft_fwd_native(blocks, x, rescale, cscale, shift, weight):
    """The step-down body on CUDA (docs/ops.md §1.5): the Cayley transform in fp32, the
    rotation of x in x's 16-bit dtype with fp32 accumulation."""
    return oft_fwd(blocks, x, rescale, cscale, shift, weight, native=True)


def oft_bwd_native(grad, blocks, x, rescale, cscale, shift, weight):
    """The step-down body of ``oft_bwd`` (docs/ops.md §1.5): the token-sized products in x's
    16-bit dtype with fp32 accumulation, the Cayley chain in fp32."""
    return oft_bwd(grad, blocks, x, rescale, cscale, shift, weight, native=True)
