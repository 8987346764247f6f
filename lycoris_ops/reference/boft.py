"""BOFT (docs/ops.md §2.6): an m-stage butterfly of block-diagonal Cayley rotations
along one channel axis, with a module multiplier folded into every stage, an
optional per-channel rescale after the last stage and an optional difference.

Numerics: everything (Cayley, stages, epilogues) in float32 — float64 when every
tensor operand is float64 (gradcheck) — rounded once to x's dtype. The CUDA
step-down bodies (``native=True`` with a 16-bit x) keep the Cayley transforms in
float32 but run every stage as a batched GEMM in x's dtype (fp32 accumulation,
rounded per stage), with the rescale folded into the last stage's matrices (rounded
to x's dtype with them) and the block gradients' token sums returned in fp32 where
``torch.bmm`` has an fp32 output for 16-bit operands (CUDA), else rounded to x's dtype.

Stage geometry (§2.6.1), implemented literally with index tensors built from the
static sizes: with ``κ_i = 2^i·s/2``, position p of stage i holds channel
``π_i(p) = ⌊p/2κ_i⌋·2κ_i + (p mod 2)·κ_i + ⌊(p mod 2κ_i)/2⌋``; positions are cut
into nb blocks of s and ``u^{i+1}[π_i(β·s+p)] = Σ_q F_{i,β}[p,q]·u^i[π_i(β·s+q)]``
with ``F = scale·R + (1 − scale)·I`` (BOFT applies R; diag-OFT applies Rᵀ).
"""
from __future__ import annotations

from typing import Optional

import torch

from lycoris_ops.reference import checks as _checks
from lycoris_ops.reference import cast, mm32
from lycoris_ops.reference.oft import cayley, cayley_backward, channel_view, token_dtype, work_dtype

__all__ = ["check_boft_fwd", "boft_fwd", "check_boft_bwd", "boft_bwd", "boft_fwd_native", "boft_bwd_native",
           "stage_permutation"]


def stage_permutation(i: int, s: int, C: int, device=None):
    """``(perm, inv)`` of stage i: ``perm[p] = π_i(p)`` (position → channel) and its
    inverse ``inv[c]`` (channel → position), int64 tensors of length C."""
    k = (s // 2) * (1 << i)  # κ_i
    two_k = 2 * k
    p = torch.arange(C, device=device)
    perm = (p // two_k) * two_k + (p % 2) * k + (p % two_k) // 2
    # channel c = g·2κ + h·κ + j  <->  position g·2κ + 2j + h
    c = p
    inv = (c // two_k) * two_k + 2 * ((c % two_k) % k) + (c % two_k) // k
    return perm, inv


def _to_blocks(u: torch.Tensor, i: int, s: int) -> torch.Tensor:
    """``u.index_select(1, perm_i).reshape(pre, nb, s, post)`` as a reshape/transpose: position
    g·2κ + 2j + h holds channel g·2κ + h·κ + j. Static strides, so a compiled graph folds the
    shuffle into its copies instead of a gather by an index tensor."""
    pre, C, post = u.shape
    k = (s // 2) << i
    return u.reshape(pre, C // (2 * k), 2, k, post).transpose(2, 3).reshape(pre, C // s, s, post)


def _from_blocks(w: torch.Tensor, i: int) -> torch.Tensor:
    """The inverse of ``_to_blocks``: (pre, nb, s, post) blocks back to (pre, C, post) channels."""
    pre, nb, s, post = w.shape
    C, k = nb * s, (s // 2) << i
    return w.reshape(pre, C // (2 * k), k, 2, post).transpose(2, 3).reshape(pre, C, post)


def _check_common(op, blocks, x, axis, cscale, scale, rescale=None, grad=None):
    _checks.tensor(op, "blocks", blocks, 4, "(m, nb, s, s)")
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    _checks.size(op, "blocks.shape[3] (s, blocks must be (m, nb, s, s))", blocks.shape[3], s)
    _checks.expect(m >= 1, op, lambda: f"blocks must have m >= 1 stages (blocks.shape[0]), got {m}")
    _checks.expect(s >= 2, op, lambda: f"blocks block size s (blocks.shape[2]) must be even and >= 2, got {s}")
    _checks.expect(s % 2 == 0, op, lambda: f"blocks block size s (blocks.shape[2]) must be even, got {s}")
    _checks.float_arg(op, "cscale", cscale)
    _checks.float_arg(op, "scale", scale)
    _checks.tensor(op, "x", x)
    if x.dim() < 1:
        _checks.fail(op, "x must have at least 1 dim (the channel axis), got a 0-D tensor")
    if isinstance(axis, bool) or not isinstance(axis, int):
        _checks.fail(op, f"axis must be an int, got {type(axis).__name__}")
    ax = _checks.axis(op, "axis", axis, x.dim())
    _checks.size(op, lambda: f"x.shape[{axis}] (the channel axis, C = nb*s)", x.shape[ax], nb * s)
    stride = (1 << (m - 1)) if isinstance(m, int) else 2 ** (m - 1)
    _checks.expect(nb % stride == 0, op,
                   lambda: f"blocks: 2^(m-1)*s = {stride * s} must divide C = nb*s = {nb * s} "
                           f"(m={m} stages need nb={nb} to be a multiple of 2^(m-1))")
    if rescale is not None:
        _checks.tensor(op, "rescale", rescale)
        rs = tuple(rescale.shape)
        _checks.expect(rescale.numel() == nb * s, op,
                       lambda: f"rescale must have C = nb*s = {nb * s} elements, got shape {rs}")
    if grad is not None:
        _checks.tensor(op, "grad", grad)
        if grad.dim() != x.dim():
            _checks.fail(op, f"grad must have the shape of x {tuple(x.shape)}, got {tuple(grad.shape)}")
        for d in range(x.dim()):  # per-dim size checks: closures over ints only (dynamo fullgraph)
            _checks.size(op, f"grad.shape[{d}] (the shape of x)", grad.shape[d], x.shape[d])
    _checks.same_device(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    _checks.compute_dtype(op, grad=grad, blocks=blocks, x=x, rescale=rescale)
    return m, nb, s, ax


@_checks.cached
def check_boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    """Output spec of ``boft_fwd``: one tensor of x's shape and dtype."""
    if not isinstance(diff, bool):
        _checks.fail("boft_fwd", f"diff must be a bool, got {type(diff).__name__}")
    _check_common("boft_fwd", blocks, x, axis, cscale, scale, rescale)
    return ((tuple(x.shape), x.dtype),)


@_checks.cached
def check_boft_bwd(grad, blocks, x, axis, cscale, scale):
    """Output spec of ``boft_bwd``: gx (x's shape and dtype), g_blocks (blocks' shape and dtype)."""
    _checks.tensor("boft_bwd", "grad", grad)  # required here (_check_common's None means "no grad")
    _check_common("boft_bwd", blocks, x, axis, cscale, scale, grad=grad)
    return ((tuple(x.shape), x.dtype), (tuple(blocks.shape), blocks.dtype))


def _geometry(blocks, x, axis):
    """``(m, nb, s, channel axis)`` of a checked call."""
    return blocks.shape[0], blocks.shape[1], blocks.shape[2], axis % x.dim()


def _stage_matrices(blocks, cscale, scale, dt):
    r, m_inv = cayley(blocks, cscale, dt)
    if scale != 1.0:
        eye = torch.eye(r.shape[-1], dtype=dt, device=r.device)
        f = scale * r + (1.0 - scale) * eye
    else:
        f = r
    return f, m_inv


# The step-down bodies keep the tokens block-major, (nb, s, N) with the N = pre·post token
# positions innermost: every stage is one bmm, every change of stage one permuting copy of whole
# N-runs (no index tensors, no einsum permutes). A block's rows are in position order
# p = 2·l + e (e the κ-half bit, l < s/2), except stage 0's input rows and the last stage's output
# rows, in (e, l) order: the channels of a block in order at stage 0 (x is read as a view), and
# runs of s/2 channels at the last stage (the output is written by one strided copy).

def _native_matrices(f, rescale, td):
    """The m stage matrices in the token dtype, each (nb, s, s) contiguous: stage 0's columns
    and the last stage's rows in (e, l) order, the last stage's rows times their channels' rescale."""
    m, nb, s = f.shape[0], f.shape[1], f.shape[2]
    hs, G, J = s // 2, nb >> (m - 1), 1 << (m - 1)
    mats = []
    for i in range(m):
        v = f[i].view(nb, hs, 2, hs, 2)  # (β, l, e | l, e)
        v = v.permute(0, *((2, 1) if i == m - 1 else (1, 2)), *((4, 3) if i == 0 else (3, 4)))
        if i == m - 1 and rescale is not None:
            # the last stage's block (g, j) row (e, l) is channel g·2κ + e·κ + j·s/2 + l
            rs = rescale.reshape(G, 2, J, hs, 1, 1).to(f.dtype).transpose(1, 2)
            v = (v.unflatten(0, (G, J)) * rs).flatten(0, 1)
        mats.append(v.to(td).contiguous().view(nb, s, s))  # (.to keeps a view as is when td is its dtype)
    return mats


def _native_from_storage(q, first, last):
    """A (nb, s, s) block matrix with storage-ordered rows/columns (as ``_native_matrices``) in
    position order, as a (nb, s/2, 2, s/2, 2) view (``torch.stack`` lays it out)."""
    nb, s = q.shape[0], q.shape[1]
    hs = s // 2
    q = q.view(nb, *((2, hs) if last else (hs, 2)), *((2, hs) if first else (hs, 2)))
    return q.permute(0, *((2, 1) if last else (1, 2)), *((4, 3) if first else (3, 4)))


def _native_next(o, i):
    """Stage i's output (nb, s, N), rows in position order, as stage i+1's input: block
    (g, h', j) row (l, e) holds what is block (g, e, j) row (l, h') of stage i+1 (one copy)."""
    nb, s, n = o.shape
    k = 1 << i
    return o.view(nb // (2 * k), 2, k, s // 2, 2, n).transpose(1, 4).reshape(nb, s, n)


def _native_input(x0, nb, s):
    """(pre, C, post) as stage 0's block-major input (nb, s, pre·post): a strided view when pre
    or post is 1 (bmm reads it as is), else one copy."""
    pre, _, post = x0.shape
    return x0.view(pre, nb, s, post).permute(1, 2, 0, 3).reshape(nb, s, pre * post)


def _native_gram(g, u, dt):
    """``Σ_n g[β, :, n]·u[β, :, n]ᵀ`` (nb, s, s) in dt: the token sum accumulated in fp32; on CUDA
    ``mm32``'s fp32 output, elsewhere rounded to the token dtype (no fp32 copies of the tokens)."""
    if g.is_cuda:
        return mm32(g, u.transpose(1, 2)).to(dt)
    return torch.bmm(g, u.transpose(1, 2)).to(dt)


def _boft_fwd_native(f, x, ax, m, nb, s, rescale, diff):
    """``boft_fwd`` on a 16-bit x: stage products as bmm in x's dtype, block-major tokens."""
    x0 = channel_view(x, ax)
    pre, _, post = x0.shape
    mats = _native_matrices(f, rescale, x.dtype)
    u = _native_input(x0, nb, s)
    for i in range(m - 1):
        u = _native_next(torch.bmm(mats[i], u), i)
    G, J, hs = nb >> (m - 1), 1 << (m - 1), s // 2
    # the output's channel g·2κ + e·κ + j·s/2 + l is the last stage's block (g, j) row (e, l)
    if post == 1:  # channels last: the product token-major, so the final copy moves s/2-runs
        y = torch.bmm(u.transpose(1, 2), mats[m - 1].transpose(1, 2))
        y = y.view(G, J, pre, 2, hs, 1).permute(2, 0, 3, 1, 4, 5)
    else:
        y = torch.bmm(mats[m - 1], u).view(G, J, 2, hs, pre, post).permute(4, 0, 2, 1, 3, 5)
    if not diff:
        return y.reshape(x.shape).contiguous()
    x0 = x0.view(pre, G, 2, J, hs, post)
    if torch.compiler.is_compiling() or y.requires_grad:  # out= neither traces nor records autograd
        return (y - x0).reshape(x.shape).contiguous()  # (a compiler fuses the two passes itself)
    # the difference writes the reordered output: one pass instead of a copy and a subtraction
    out = torch.empty((pre, G, 2, J, hs, post), dtype=x.dtype, device=x.device)
    return torch.sub(y, x0, out=out).view(x.shape)


def _boft_bwd_native(grad, f, x, ax, m, nb, s, dt):
    """``boft_bwd``'s token part on a 16-bit x: gx and the stacked ``P_{i,β}`` (m, nb, s, s) in dt,
    the stage inputs recomputed and kept block-major, every product a bmm in x's dtype."""
    td = x.dtype
    x0 = channel_view(x, ax)
    pre, _, post = x0.shape
    mats = _native_matrices(f, None, td)
    u = _native_input(x0, nb, s)
    stage_inputs = [u]
    for i in range(m - 1):
        u = _native_next(torch.bmm(mats[i], u), i)
        stage_inputs.append(u)
    G, J, hs = nb >> (m - 1), 1 << (m - 1), s // 2
    g3 = cast(channel_view(grad, ax), td)
    if post == 1:  # token-major (one copy of s/2-runs), read through a transposed view
        g = g3.view(pre, G, 2, J, hs).permute(1, 3, 0, 2, 4).reshape(nb, pre, s).transpose(1, 2)
    else:
        g = g3.view(pre, G, 2, J, hs, post).permute(1, 3, 2, 4, 0, 5).reshape(nb, s, pre * post)
    g_r = []  # stage m-1 first (appended: torch 2.11's Dynamo cannot trace a list's item store)
    for i in reversed(range(m)):
        g_r.append(_native_from_storage(_native_gram(g, stage_inputs[i], dt), i == 0, i == m - 1))
        if i > 0:
            g = _native_next(torch.bmm(mats[i].transpose(1, 2), g), i - 1)
    # stage 0's columns are the channels of a block in order
    if post == 1:
        gx = torch.bmm(g.transpose(1, 2), mats[0]).transpose(0, 1)
    else:
        gx = torch.bmm(mats[0].transpose(1, 2), g).view(nb, s, pre, post).permute(2, 0, 1, 3)
    return gx.reshape(x.shape).contiguous(), torch.stack(g_r[::-1]).reshape(m, nb, s, s)


def boft_fwd(blocks: torch.Tensor, x: torch.Tensor, axis: int, cscale: float, scale: float,
             rescale: Optional[torch.Tensor], diff: bool, *, native: bool = False) -> torch.Tensor:
    """BOFT butterfly (docs/ops.md §2.6.1).

    blocks (m, nb, s, s), s even; x with C = nb·s channels on ``axis`` (0: weight
    (C, rest…); −1 / last: channels last; 1: (N, C, *spatial)); rescale C elements
    or None. ``u⁰ = x``; stage i applies ``F_{i,β} = scale·R_{i,β} + (1 − scale)·I``
    to each block of the π_i-permuted channels; ``y = u^m ⊙ rescale − diff·x``.
    Returns x's shape and dtype; computed in float32 (float64 if all operands are).
    """
    check_boft_fwd(blocks, x, axis, cscale, scale, rescale, diff)
    m, nb, s, ax = _geometry(blocks, x, axis)
    dt = work_dtype(blocks, x, rescale)
    C = nb * s
    f, _ = _stage_matrices(blocks, cscale, scale, dt)
    if token_dtype(x, dt, native) != dt:
        if diff:  # u − x cancels at small rotations: the stages' 16-bit rounding is of x's size
            return _boft_fwd_native(f, x.to(dt), ax, m, nb, s, rescale, diff).to(x.dtype)
        return _boft_fwd_native(f, x, ax, m, nb, s, rescale, diff)
    x0 = channel_view(x, ax).to(dt)
    u = x0
    for i in range(m):
        u = _from_blocks(torch.einsum("bpq,nbqt->nbpt", f[i], _to_blocks(u, i, s)), i)
    if rescale is not None:
        u = u * rescale.reshape(1, C, 1).to(dt)
    if diff:
        u = u - x0
    return u.reshape(x.shape).to(x.dtype).contiguous()


def boft_bwd(grad: torch.Tensor, blocks: torch.Tensor, x: torch.Tensor, axis: int, cscale: float,
             scale: float, *, native: bool = False):
    """Gradients of the plain chain ``u^m(x)`` (no rescale, no diff; docs/ops.md §2.6.2).

    One forward pass keeps the m stage inputs (in the permuted block basis); then
    for i = m−1 … 0: ``P_{i,β} = Σ g_β·(u^i_β)ᵀ``, ``g ← F_{i,β}ᵀ·g``, ``gR = scale·P``,
    Cayley chain (cscale constant). Returns gx (x's shape and dtype) and g_blocks
    (m, nb, s, s) in blocks' dtype; G is cast to float32 (float64 if all operands are).
    """
    check_boft_bwd(grad, blocks, x, axis, cscale, scale)
    m, nb, s, ax = _geometry(blocks, x, axis)
    dt = work_dtype(grad, blocks, x)
    f, m_inv = _stage_matrices(blocks, cscale, scale, dt)
    if token_dtype(x, dt, native) != dt:
        gx, p = _boft_bwd_native(grad, f, x, ax, m, nb, s, dt)
        g_r = p if scale == 1.0 else scale * p
        return gx, cast(cayley_backward(g_r, m_inv, cscale), blocks.dtype).contiguous()
    u = channel_view(x, ax).to(dt)
    stage_inputs = []
    for i in range(m):
        v = _to_blocks(u, i, s)
        stage_inputs.append(v)
        if i + 1 < m:
            u = _from_blocks(torch.einsum("bpq,nbqt->nbpt", f[i], v), i)
    g = channel_view(grad, ax).to(dt)
    g_r = []  # stage m-1 first (appended: torch 2.11's Dynamo cannot trace a list's item store)
    for i in reversed(range(m)):
        gw = _to_blocks(g, i, s)
        g_r.append(scale * torch.einsum("nbpt,nbqt->bpq", gw, stage_inputs[i]))
        g = _from_blocks(torch.einsum("bpq,nbpt->nbqt", f[i], gw), i)
    g_blocks = cayley_backward(torch.stack(g_r[::-1]), m_inv, cscale)
    return g.reshape(x.shape).to(x.dtype).contiguous(), cast(g_blocks, blocks.dtype).contiguous()


def boft_fwd_native(blocks, x, axis, cscale, scale, rescale, diff):
    """The step-down body on CUDA (docs/ops.md §1.5): the Cayley transforms in fp32; for a
    16-bit x, every stage one bmm in x's dtype (fp32 accumulation, rounded per stage) over the
    block-major tokens and one permuting copy into the next stage's blocks, the rescale folded
    into the last stage's matrices and the difference written by the final reorder; with
    ``diff`` the same stages on an fp32 copy of x (rounded once at the end). A 32/64-bit x runs
    the exact body."""
    return boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, native=True)


def boft_bwd_native(grad, blocks, x, axis, cscale, scale):
    """The step-down body of ``boft_bwd`` (docs/ops.md §1.5): for a 16-bit x, the stage inputs
    recomputed as in ``boft_fwd_native`` and kept block-major, the block gradients (token sums
    accumulated in fp32) and the token gradient's stages as bmm in x's dtype, one permuting copy
    a stage; the Cayley chain in fp32. A 32/64-bit x runs the exact body."""
    return boft_bwd(grad, blocks, x, axis, cscale, scale, native=True)
