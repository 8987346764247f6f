"""DoRA weight decomposition (docs/ops.md §2.4): ``dora_fwd`` and ``dora_bwd``.

Numerics:

- ``M = w + delta`` is formed from the operands read in their own dtypes and all
  math is fp32 (fp64 when w, dscale and delta are all fp64, for gradcheck);
- ε = ``torch.finfo(dscale.dtype).eps`` — the magnitude vector's dtype, as eager
  LyCORIS does;
- ``norms`` (n = ‖M_r‖ + ε, one per norm vector) are returned in fp32 (fp64 in
  the all-fp64 case), y in w's dtype;
- the backward uses the exact derivative of ‖M_r‖ + ε, i.e. ``n_r²·‖M_r‖`` in the
  denominator.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast


def _compute_dtype(w, dscale, delta) -> torch.dtype:
    ts = [t for t in (w, dscale, delta) if t is not None]
    return torch.float64 if all(t.dtype == torch.float64 for t in ts) else torch.float32


def _check_common(op, w, dscale, mult, row_axis, delta):
    C.tensor(op, "w", w, 2, "(R0, R1) (a conv weight flattened to (O, I*Kk))")
    C.tensor(op, "dscale", dscale)
    C.float_arg(op, "mult", mult)
    if isinstance(row_axis, bool) or not isinstance(row_axis, int):
        C.fail(op, f"row_axis must be 0 or 1, got {row_axis!r}")
    C.choice(op, "row_axis", row_axis, (0, 1))
    if delta is not None:
        C.tensor(op, "delta", delta, 2, "(R0, R1) like w")
        C.shape(op, "delta", delta, w.shape, "(w's shape)")
    rows = w.shape[row_axis]
    C.expect(dscale.numel() == rows, op,
             lambda: f"dscale must have w.shape[{row_axis}] = {rows} elements (row_axis={row_axis}), "
                     f"got shape {tuple(dscale.shape)}")
    C.same_device(op, w=w, dscale=dscale, delta=delta)
    C.compute_dtype(op, w=w, delta=delta, dscale=dscale)  # float16 + bfloat16 -> error
    return rows, _compute_dtype(w, dscale, delta)


@C.cached
def check_dora_fwd(w, dscale, mult, row_axis, delta=None):
    """-> ((y shape, w.dtype), ((R,), fp32 | fp64))."""
    op = "dora_fwd"
    rows, cdt = _check_common(op, w, dscale, mult, row_axis, delta)
    return ((tuple(w.shape), w.dtype), ((rows,), cdt))


@C.cached
def check_dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    """-> ((w shape, w.dtype), ((R,), dscale.dtype))."""
    op = "dora_bwd"
    C.tensor(op, "grad", grad)
    rows, cdt = _check_common(op, w, dscale, mult, row_axis, delta)
    C.shape(op, "grad", grad, w.shape, "(w's shape)")

    def layout():  # row_axis may be symbolic under Dynamo: formatted only for a message
        return f"(w.shape[{row_axis}],)"
    C.tensor(op, "norms", norms, 1, layout)
    C.shape(op, "norms", norms, (rows,), layout)
    C.same_device(op, grad=grad, w=w, norms=norms)
    C.compute_dtype(op, grad=grad, w=w, delta=delta, dscale=dscale, norms=norms)
    return ((tuple(w.shape), w.dtype), ((rows,), dscale.dtype))


def _matrix(w, delta, cdt):
    m = cast(w, cdt)
    if delta is not None:
        m = m + cast(delta, cdt)
    return m


def dora_fwd(w, dscale, mult, row_axis, delta=None):
    """DoRA rescale of ``M = w + delta`` (delta optional, never stored).

    w, delta: (R0, R1); dscale: numel = w.shape[row_axis] (any shape, flattened).
    For each norm vector r (row ``M[r, :]`` when row_axis = 0, column ``M[:, r]``
    when 1): ``n_r = ‖M_r‖₂ + ε``, ``s_r = mult·(dscale_r / n_r − 1) + 1``,
    ``y_r = s_r·M_r``; ε = finfo(dscale.dtype).eps.

    Returns y (w's shape and dtype) and norms n (w.shape[row_axis],) in fp32
    (fp64 when w, dscale and delta are all fp64), ε included.
    """
    check_dora_fwd(w, dscale, mult, row_axis, delta)
    cdt = _compute_dtype(w, dscale, delta)
    red = 1 - row_axis
    m = _matrix(w, delta, cdt)
    eps = torch.finfo(dscale.dtype).eps
    n = torch.linalg.vector_norm(m, dim=red, keepdim=True) + eps
    d = dscale.reshape(-1).to(cdt).unsqueeze(red)
    s = mult * (d / n - 1.0) + 1.0
    y = (m * s).to(w.dtype).contiguous()
    return y, n.reshape(-1).contiguous()


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    """Gradients of ``dora_fwd``'s y (G = grad) with ``M = w + delta`` rebuilt.

    Per norm vector r: ``ρ_r = Σ G⊙M_r``, ``g_dscale_r = mult·ρ_r / n_r``,
    ``g_M = s_r·G − (mult·dscale_r·ρ_r / (n_r²·‖M_r‖))·M_r`` (exact derivative of
    ‖M_r‖ + ε; the term is 0 for a zero row). n_r comes from ``norms``.

    Returns g_M (w's shape and dtype; the gradient of both w and delta) and
    g_dscale (w.shape[row_axis],) in dscale's dtype (the autograd reshapes it
    to dscale's shape). Math in fp32 (fp64 when w, dscale, delta are fp64).
    """
    check_dora_bwd(grad, w, dscale, norms, mult, row_axis, delta)
    cdt = _compute_dtype(w, dscale, delta)
    red = 1 - row_axis
    m = _matrix(w, delta, cdt)
    g = cast(grad, cdt)
    n = cast(norms, cdt).unsqueeze(red)
    d = dscale.reshape(-1).to(cdt).unsqueeze(red)
    rho = (g * m).sum(dim=red, keepdim=True)
    mnorm = torch.linalg.vector_norm(m, dim=red, keepdim=True)
    mnorm = torch.where(mnorm > 0, mnorm, torch.ones_like(mnorm))  # zero row: rho = 0, term = 0
    s = mult * (d / n - 1.0) + 1.0
    coef = (mult * d * rho) / (n * n * mnorm)
    g_m = (s * g - coef * m).to(w.dtype).contiguous()
    g_d = (mult * rho / n).reshape(-1).to(dscale.dtype).contiguous()
    return g_m, g_d
