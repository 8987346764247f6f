"""LoKr: eager bodies and argument checks (docs/ops.md §2.3).

Kronecker convention: ``kron(w1, w2)[u·c + i, v·d + j] = w1[u, v]·w2[i, j]`` for
w1 (a, b) and w2 (c, d), giving (a·c, b·d) = (O, I).

Conv factors: w2 may arrive flattened as (c, d·Kk) (a conv w2 (c, d, *kernel)
reshaped row-major). Every op here treats w2's column count as "d"; the
Kronecker product of w1 with the flattened factor is then the flattened 4-D
LoKr weight, because column ``v·(d·Kk) + j·Kk + κ = (v·d + j)·Kk + κ``. So the
merges return (a·c, b·w2.shape[1]) and ``lokr_merge_fwd``'s ``shape[3]`` is
w2's column count (d·Kk for a flattened conv factor).

Dtypes (docs/ops.md §1.3): the matrix operands are promoted to
the compute dtype (a 16-bit operand wins; fp16 with bf16 is an error), every
product accumulates in fp32 (fp64 when the compute dtype is fp64), the factored
sides are never rounded before the Kronecker multiply, γ and the base add are
done in fp32 and the result is rounded once. Merges store in ``out_dtype``
(default: w2's / w2a's dtype); bypass stores in base's dtype when given, else
x's. Every backward op returns each gradient in its own input's dtype.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast, mm32


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for a compute dtype: fp64 stays fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _up(t: torch.Tensor, compute: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """``t`` rounded to the compute dtype (exact for an up-cast), then widened to acc."""
    return cast(t, compute).to(acc)


def _epilogue_dtype(acc: torch.dtype, base) -> torch.dtype:
    return acc if base is None else torch.promote_types(acc, base.dtype)


def _gamma(op, gamma) -> float:
    return C.float_arg(op, "gamma", gamma)


def _kron(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kron(w1, w2) of 2-D tensors by broadcasting: (a, c, b, d) -> (a·c, b·d)."""
    a, b = w1.shape
    c, d = w2.shape
    return (w1[:, None, :, None] * w2[None, :, None, :]).reshape(a * c, b * d)


# ---------------------------------------------------------------------------
# lokr_full_merge_fwd / lokr_full_merge_bwd


@C.cached
def check_lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    op = "lokr_full_merge_fwd"
    C.tensor(op, "w1", w1, 2, "(a, b)")
    C.tensor(op, "w2", w2, 2, "(c, d) (a conv w2 flattened to (c, d*Kk))")
    _gamma(op, gamma)
    a, b = w1.shape
    c, d = w2.shape
    out_shape = (a * c, b * d)
    if base is not None:
        C.tensor(op, "base", base, 2, "(a*c, b*d)")
        C.shape(op, "base", base, out_shape, "(a*c, b*d)")
    C.same_device(op, w1=w1, w2=w2, base=base)
    C.compute_dtype(op, w1=w1, w2=w2, base=base)  # fp16 + bf16 check (base included)
    C.compute_dtype(op, w1=w1, w2=w2)
    return ((out_shape, C.out_dtype(op, out_dtype, w2.dtype)),)


def lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    """``Y = γ·kron(w1, w2) [+ base]`` (docs/ops.md §2.3.1).

    w1 (a, b), w2 (c, d) or a conv w2 flattened to (c, d·Kk); base (a·c, b·d)
    optional. Output (a·c, b·d) in ``out_dtype``, default w2's dtype. The
    product, γ and the base add are fp32 (fp64 for fp64 operands), one rounding.
    """
    ((_, dtype),) = check_lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype)
    cd = C.compute_dtype("lokr_full_merge_fwd", w1=w1, w2=w2)
    acc = _acc(cd)
    ep = _epilogue_dtype(acc, base)
    y = _kron(_up(w1, cd, acc), _up(w2, cd, acc)).to(ep) * float(gamma)
    if base is not None:
        y = y + cast(base, ep)
    return cast(y, dtype).contiguous()


@C.cached
def check_lokr_full_merge_bwd(grad, w1, w2, gamma):
    op = "lokr_full_merge_bwd"
    C.tensor(op, "w1", w1, 2, "(a, b)")
    C.tensor(op, "w2", w2, 2, "(c, d)")
    C.tensor(op, "grad", grad, 2, "(a*c, b*d)")
    _gamma(op, gamma)
    a, b = w1.shape
    c, d = w2.shape
    C.shape(op, "grad", grad, (a * c, b * d), "(a*c, b*d)")
    C.same_device(op, grad=grad, w1=w1, w2=w2)
    C.compute_dtype(op, grad=grad, w1=w1, w2=w2)
    return (((a, b), w1.dtype), ((c, d), w2.dtype))


def _kron_grads(g, w1, w2, gamma):
    """g (a·c, b·d) in acc dtype -> (γ·Σ_ij G4·w2, γ·Σ_uv G4·w1), both in acc."""
    a, b = w1.shape
    c, d = w2.shape
    g4 = g.reshape(a, c, b, d)
    g_w1 = torch.einsum("uivj,ij->uv", g4, w2) * gamma
    g_w2 = torch.einsum("uivj,uv->ij", g4, w1) * gamma
    return g_w1, g_w2


def lokr_full_merge_bwd(grad, w1, w2, gamma):
    """Gradients of ``γ·kron(w1, w2)`` (docs/ops.md §2.3.2).

    With G viewed as G4 (a, c, b, d): ``g_w1[u,v] = γ·Σ_ij G4[u,i,v,j]·w2[i,j]``,
    ``g_w2[i,j] = γ·Σ_uv G4[u,i,v,j]·w1[u,v]``. G is cast to the compute dtype of
    (w1, w2) first; fp32 accumulation. Returns (g_w1 (a, b) in w1's dtype,
    g_w2 (c, d) in w2's dtype).
    """
    (_, d1), (_, d2) = check_lokr_full_merge_bwd(grad, w1, w2, gamma)
    cd = C.compute_dtype("lokr_full_merge_bwd", w1=w1, w2=w2)
    acc = _acc(cd)
    g_w1, g_w2 = _kron_grads(_up(grad, cd, acc), _up(w1, cd, acc), _up(w2, cd, acc), float(gamma))
    return cast(g_w1, d1).contiguous(), cast(g_w2, d2).contiguous()


# ---------------------------------------------------------------------------
# lokr_merge_fwd / lokr_merge_bwd


def _check_factored(op, w1a, w1b, w2a, w2b, shape):
    """Validate the four factors against ``shape`` = [a, b, c, d]; returns (a, b, c, d)."""
    if not isinstance(shape, (list, tuple)) or len(shape) != 4:
        C.fail(op, f"shape must be a list of 4 ints [a, b, c, d], got {shape!r}")
    for k, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, (int, torch.SymInt)):
            C.fail(op, f"shape[{k}] must be an int, got {s!r}")
        C.expect(s >= 0, op, lambda: f"shape must hold non-negative sizes [a, b, c, d], got {list(shape)}")
    a, b, c, d = shape

    def _match(name, dim, actual, letter, expected):
        C.expect(actual == expected, op, lambda: (
            f"{name}.shape[{dim}] is {actual} but shape={list(shape)} requires {letter}={expected} "
            f"(shape must match the factors)"))

    for side, wa, wb, rows, cols, lr, lc in (("1", w1a, w1b, a, b, "a", "b"), ("2", w2a, w2b, c, d, "c", "d")):
        na, nb = f"w{side}a", f"w{side}b"
        if wb is None:
            C.tensor(op, na, wa, 2, f"({lr}, {lc}) when {nb} is None")
            _match(na, 0, wa.shape[0], lr, rows)
            _match(na, 1, wa.shape[1], lc, cols)
        else:
            C.tensor(op, na, wa, 2, f"({lr}, r{side})")
            C.tensor(op, nb, wb, 2, f"(r{side}, {lc})")
            _match(na, 0, wa.shape[0], lr, rows)
            _match(nb, 1, wb.shape[1], lc, cols)
            C.size(op, f"{nb}.shape[0] (r{side}, the rank of {na})", wb.shape[0], wa.shape[1])
    return a, b, c, d


@C.cached
def check_lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    op = "lokr_merge_fwd"
    a, b, c, d = _check_factored(op, w1a, w1b, w2a, w2b, shape)
    _gamma(op, gamma)
    out_shape = (a * c, b * d)
    if base is not None:
        C.tensor(op, "base", base, 2, "(a*c, b*d)")
        C.shape(op, "base", base, out_shape, "(a*c, b*d)")
    C.same_device(op, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, base=base)
    C.compute_dtype(op, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b, base=base)
    return ((out_shape, C.out_dtype(op, out_dtype, w2a.dtype)),)


def _side(wa, wb, cd, acc):
    """The whole side in acc dtype: wa·wb (fp32 accumulation, not rounded) or wa."""
    if wb is None:
        return _up(wa, cd, acc)
    return _up(wa, cd, acc) @ _up(wb, cd, acc)


def lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    """``Y = γ·kron(w1a·w1b | w1a, w2a·w2b | w2a) [+ base]`` (docs/ops.md §2.3.3).

    ``shape`` = [a, b, c, d]: w1a (a, r1) with w1b (r1, b), or w1a (a, b) whole
    when w1b is None; w2a (c, r2) with w2b (r2, d), or w2a (c, d) whole. For a
    conv w2 flattened to (·, d·Kk), ``shape[3]`` is that column count d·Kk.
    Either, both or neither side may be factored. The sides are generated in
    fp32 and not rounded before the Kronecker multiply. Output (a·c, b·d) in
    ``out_dtype``, default w2a's dtype. A ``shape`` inconsistent with the factors
    raises ValueError naming ``shape``.
    """
    ((_, dtype),) = check_lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)
    cd = C.compute_dtype("lokr_merge_fwd", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    acc = _acc(cd)
    ep = _epilogue_dtype(acc, base)
    y = _kron(_side(w1a, w1b, cd, acc), _side(w2a, w2b, cd, acc)).to(ep) * float(gamma)
    if base is not None:
        y = y + cast(base, ep)
    return cast(y, dtype).contiguous()


@C.cached
def check_lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    op = "lokr_merge_bwd"
    a, b, c, d = _check_factored(op, w1a, w1b, w2a, w2b, shape)
    _gamma(op, gamma)
    C.tensor(op, "grad", grad, 2, "(a*c, b*d)")
    C.shape(op, "grad", grad, (a * c, b * d), "(a*c, b*d)")
    C.same_device(op, grad=grad, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    C.compute_dtype(op, grad=grad, w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    return (
        (tuple(w1a.shape), w1a.dtype),
        ((0,), w1a.dtype) if w1b is None else (tuple(w1b.shape), w1b.dtype),
        (tuple(w2a.shape), w2a.dtype),
        ((0,), w2a.dtype) if w2b is None else (tuple(w2b.shape), w2b.dtype),
    )


def lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    """Gradients of ``lokr_merge_fwd`` (docs/ops.md §2.3.4).

    Regenerates w1, w2 (fp32), computes g_w1, g_w2 as in ``lokr_full_merge_bwd``
    and chains through the factored sides: ``g_w1a = g_w1·w1bᵀ``,
    ``g_w1b = w1aᵀ·g_w1`` (else ``g_w1a = g_w1``); the same for side 2. All in
    fp32, rounded once. Returns (g_w1a, g_w1b, g_w2a, g_w2b), each in its own
    input's dtype and shape; an absent b factor gives an empty tensor of shape
    (0,) in its a partner's dtype.
    """
    specs = check_lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma)
    cd = C.compute_dtype("lokr_merge_bwd", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    acc = _acc(cd)
    w1 = _side(w1a, w1b, cd, acc)
    w2 = _side(w2a, w2b, cd, acc)
    g_w1, g_w2 = _kron_grads(_up(grad, cd, acc), w1, w2, float(gamma))
    return _factored_grads(grad, g_w1, g_w2, w1a, w1b, w2a, w2b, specs, cd, acc)


def _factored_grads(grad, g_w1, g_w2, w1a, w1b, w2a, w2b, specs, cd, acc):
    """``lokr_merge_bwd``'s outputs from g_w1, g_w2 (acc): through each factored side
    (``g_wa = g_w·wbᵀ``, ``g_wb = waᵀ·g_w``), each rounded once to its input's dtype."""
    outs = []
    for g_w, wa, wb in ((g_w1, w1a, w1b), (g_w2, w2a, w2b)):
        if wb is None:
            outs += [g_w, None]
        else:
            outs += [g_w @ _up(wb, cd, acc).t(), _up(wa, cd, acc).t() @ g_w]
    result = []
    for g, (shp, dt) in zip(outs, specs):
        if g is None:
            result.append(grad.new_empty(shp, dtype=dt))
        else:
            result.append(cast(g, dt).contiguous())
    return tuple(result)


def lokr_full_merge_fwd_native(w1, w2, base, gamma, out_dtype=None):
    """The step-down body of ``lokr_full_merge_fwd``: with a 16-bit compute dtype the exact
    body's math in one broadcast pass (``_kron_epilogue``); else the exact body."""
    ((_, dtype),) = check_lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype)
    cd = C.compute_dtype("lokr_full_merge_fwd", w1=w1, w2=w2)
    if cd not in C.HALF_DTYPES:
        return lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype)
    acc = _acc(cd)
    return _kron_epilogue(_up(w1, cd, acc), _up(w2, cd, acc), gamma, base, dtype)


def lokr_merge_fwd_native(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    """The step-down body of ``lokr_merge_fwd``: the sides generated in fp32 (small GEMMs), then
    ``_kron_epilogue``'s one pass; else the exact body."""
    ((_, dtype),) = check_lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)
    cd = C.compute_dtype("lokr_merge_fwd", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    if cd not in C.HALF_DTYPES:
        return lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)
    acc = _acc(cd)
    return _kron_epilogue(_side(w1a, w1b, cd, acc), _side(w2a, w2b, cd, acc), gamma, base, dtype)


def lokr_full_merge_bwd_native(grad, w1, w2, gamma):
    """The step-down body of ``lokr_full_merge_bwd`` (docs/ops.md §1.5): with a 16-bit compute
    dtype, G is read in that dtype by two batched GEMMs with fp32 accumulation
    (``_kron_grads_batched``), no fp32 or permuted copy of the O·I gradient. Else the exact body."""
    (_, d1), (_, d2) = check_lokr_full_merge_bwd(grad, w1, w2, gamma)
    cd = C.compute_dtype("lokr_full_merge_bwd", w1=w1, w2=w2)
    if cd not in C.HALF_DTYPES:
        return lokr_full_merge_bwd(grad, w1, w2, gamma)
    g_w1, g_w2 = _kron_grads_batched(cast(grad, cd), w1.float(), w2.float(), float(gamma))
    return cast(g_w1, d1).contiguous(), cast(g_w2, d2).contiguous()


def lokr_merge_bwd_native(grad, w1a, w1b, w2a, w2b, shape, gamma):
    """The step-down body of ``lokr_merge_bwd``: ``lokr_full_merge_bwd_native``'s products with
    the regenerated sides w1, w2 rounded to the 16-bit compute dtype, then the factored sides'
    chain in fp32 as the exact body. Else the exact body."""
    specs = check_lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma)
    cd = C.compute_dtype("lokr_merge_bwd", w1a=w1a, w1b=w1b, w2a=w2a, w2b=w2b)
    if cd not in C.HALF_DTYPES:
        return lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma)
    acc = _acc(cd)
    w1, w2 = _side(w1a, w1b, cd, acc), _side(w2a, w2b, cd, acc)
    g_w1, g_w2 = _kron_grads_batched(cast(grad, cd), w1, w2, float(gamma))
    return _factored_grads(grad, g_w1, g_w2, w1a, w1b, w2a, w2b, specs, cd, acc)


# ---------------------------------------------------------------------------
# lokr_bypass_fwd / lokr_bypass_bwd


@C.cached
def check_lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    op = "lokr_bypass_fwd"
    C.tensor(op, "x", x, 2, "(T, b*d)")
    C.tensor(op, "w1", w1, 2, "(a, b)")
    C.tensor(op, "w2", w2, 2, "(c, d)")
    _gamma(op, gamma)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    C.size(op, "x.shape[1] (I = b*d = w1.shape[1]*w2.shape[1])", x.shape[1], b * d)
    if base is not None:
        C.tensor(op, "base", base, 2, "(T, a*c)")
        C.shape(op, "base", base, (T, a * c), "(T, a*c)")
    C.same_device(op, x=x, w1=w1, w2=w2, base=base)
    C.compute_dtype(op, x=x, w1=w1, w2=w2, base=base)
    return (((T, a * c), x.dtype if base is None else base.dtype),)


def lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    """``Y = γ·x·kron(w1, w2)ᵀ [+ base]`` without forming the Kronecker product
    (docs/ops.md §2.3.5).

    x (T, b·d), w1 (a, b), w2 (c, d), base (T, a·c) optional. Per token,
    ``X_t = reshape(x_t, (b, d))`` and ``Y_t = γ·vec(w1·X_t·w2ᵀ)``: two batched
    products with fp32 accumulation (no intermediate rounding), γ and base in
    fp32. Output (T, a·c) in base's dtype when given, else x's.
    """
    ((_, dtype),) = check_lokr_bypass_fwd(x, w1, w2, gamma, base)
    cd = C.compute_dtype("lokr_bypass_fwd", x=x, w1=w1, w2=w2)
    acc = _acc(cd)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    X = _up(x, cd, acc).reshape(T, b, d)
    w1c, w2c = _up(w1, cd, acc), _up(w2, cd, acc)
    # two orders give the same value; take the cheaper (weight dims only: no guard on T)
    if b * c * (a + d) <= a * d * (b + c):
        y = torch.matmul(w1c, torch.matmul(X, w2c.t()))  # (T, b, c) then (T, a, c)
    else:
        y = torch.matmul(torch.matmul(w1c, X), w2c.t())  # (T, a, d) then (T, a, c)
    ep = _epilogue_dtype(acc, base)
    y = y.reshape(T, a * c).to(ep) * float(gamma)
    if base is not None:
        y = y + cast(base, ep)
    return cast(y, dtype).contiguous()


@C.cached
def check_lokr_bypass_bwd(grad, x, w1, w2, gamma):
    op = "lokr_bypass_bwd"
    C.tensor(op, "grad", grad, 2, "(T, a*c)")
    C.tensor(op, "x", x, 2, "(T, b*d)")
    C.tensor(op, "w1", w1, 2, "(a, b)")
    C.tensor(op, "w2", w2, 2, "(c, d)")
    _gamma(op, gamma)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    C.size(op, "x.shape[1] (I = b*d = w1.shape[1]*w2.shape[1])", x.shape[1], b * d)
    C.shape(op, "grad", grad, (T, a * c), "(T, a*c)")
    C.same_device(op, grad=grad, x=x, w1=w1, w2=w2)
    C.compute_dtype(op, grad=grad, x=x, w1=w1, w2=w2)
    return (((T, b * d), x.dtype), ((a, b), w1.dtype), ((c, d), w2.dtype))


def lokr_bypass_bwd(grad, x, w1, w2, gamma):
    """Gradients of ``lokr_bypass_fwd`` (docs/ops.md §2.3.6).

    With ``G_t = reshape(G[t], (a, c))`` and ``X_t = reshape(x[t], (b, d))``:
    ``gX_t = γ·w1ᵀ·G_t·w2`` (flattened row-major into gx[t]),
    ``g_w1 = γ·Σ_t G_t·w2·X_tᵀ``, ``g_w2 = γ·Σ_t G_tᵀ·w1·X_t``. G and the operands
    are cast to the compute dtype of (x, w1, w2); fp32 accumulation, one
    rounding. Returns (gx (T, b·d) in x's dtype, g_w1 (a, b) in w1's dtype,
    g_w2 (c, d) in w2's dtype).
    """
    (_, dx), (_, d1), (_, d2) = check_lokr_bypass_bwd(grad, x, w1, w2, gamma)
    cd = C.compute_dtype("lokr_bypass_bwd", x=x, w1=w1, w2=w2)
    acc = _acc(cd)
    gamma = float(gamma)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    G = cast(grad, cd).reshape(T, a, c)
    w1c, w2c = cast(w1, cd), cast(w2, cd)
    # The first products take two compute-dtype operands: one GEMM each over all tokens,
    # exact products with fp32 accumulation (mm32: 16-bit tensor cores, fp32 out), no
    # fp32 copy of G. H_t = G_t·w2 (T, a, d); R_t = G_tᵀ·w1 (T, c, b) (so w1ᵀ·G_t = R_tᵀ).
    H = mm32(G.reshape(T * a, c), w2c).to(acc).reshape(T, a, d)
    R = mm32(G.transpose(1, 2).reshape(T * c, a), w1c).to(acc).reshape(T, c, b)
    # The second products (accumulation dtype) contract the smaller inner dimension.
    if a <= c:
        gx = torch.einsum("ab,tad->tbd", w1c.to(acc), H)  # w1ᵀ·(G_t·w2)
    else:
        gx = torch.einsum("tcb,cd->tbd", R, w2c.to(acc))  # (w1ᵀ·G_t)·w2
    gx = gx.reshape(T, b * d) * gamma
    X = _up(x, cd, acc).reshape(T, b, d)
    g_w1 = torch.einsum("tad,tbd->ab", H, X) * gamma  # Σ_t (G_t·w2)·X_tᵀ
    g_w2 = torch.einsum("tcb,tbd->cd", R, X) * gamma  # Σ_t (G_tᵀ·w1)·X_t
    return cast(gx, dx).contiguous(), cast(g_w1, d1).contiguous(), cast(g_w2, d2).contiguous()


# --------------------------------------------------------------------------- CUDA step-down

#: the step-down bodies take the dense route (ΔW = γ·kron(w1, w2), then token GEMMs: the
#: formula a user writes) where it does at most this many times the structured route's
#: multiply-adds — a Kronecker factor so small (``factor`` 4: about 4x; the structured route
#: still wins at ``factor`` 8, about 8x) that its mix runs far below the GEMM rate — and its
#: T·O·I GEMM is at least this long
DENSE_MAX_MAC_RATIO = 5
DENSE_MIN_MACS = 1 << 32


def _structured_macs(a: int, b: int, c: int, d: int):
    """Multiply-adds per token of the forward's two contraction orders: X_t·w2ᵀ then the w1
    mix, and the w1 mix then ·w2ᵀ."""
    return b * c * (a + d), a * d * (b + c)


def dense_route(T: int, a: int, b: int, c: int, d: int) -> bool:
    """Whether the step-down bodies build ΔW and run dense GEMMs (``DENSE_MAX_MAC_RATIO``)."""
    dense = a * b * c * d
    return T * dense >= DENSE_MIN_MACS and dense <= DENSE_MAX_MAC_RATIO * min(_structured_macs(a, b, c, d))


def _kron_epilogue(w1: torch.Tensor, w2: torch.Tensor, gamma, base, dtype: torch.dtype) -> torch.Tensor:
    """``γ·kron(w1, w2) [+ base]`` (a·c, b·d) in ``dtype`` in one broadcast pass: the products, γ
    and the base add in the promoted dtype of w1, w2 (fp32 / fp64) and base, rounded once (the
    exact bodies write an fp32 kron, a scaled copy and the sum before the cast)."""
    a, b = w1.shape
    c, d = w2.shape
    out = torch.empty((a, c, b, d), dtype=dtype, device=w2.device)
    w1e, w2e = w1[:, None, :, None], w2[None, :, None, :]
    if base is None:
        torch.mul(w1e * float(gamma), w2e, out=out)
    else:
        torch.addcmul(base.reshape(a, c, b, d), w1e, w2e, value=float(gamma), out=out)
    return out.view(a * c, b * d)


def _kron_grads_batched(g: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gamma: float):
    """``_kron_grads`` of g (a·c, b·d) as two batched matrix-vector products over its (a, c) row
    blocks (``mm32``: fp32 accumulation and output): no permuted copy of g (einsum makes one per
    factor) and, for a 16-bit g, no fp32 copy either; the factors are rounded to g's dtype."""
    a, b = w1.shape
    c, d = w2.shape
    g3 = g.reshape(a * c, b, d)
    w2e = cast(w2, g.dtype).reshape(1, c, d, 1).expand(a, c, d, 1).reshape(a * c, d, 1)
    w1e = cast(w1, g.dtype).reshape(a, 1, 1, b).expand(a, c, 1, b).reshape(a * c, 1, b)
    g_w1 = mm32(g3, w2e).view(a, c, b).sum(1) * gamma  # Σ_ij G4[u,i,v,j]·w2[i,j]
    g_w2 = mm32(w1e, g3).view(a, c, d).sum(0) * gamma  # Σ_uv G4[u,i,v,j]·w1[u,v]
    return g_w1, g_w2


def _mix(w: torch.Tensor, t3: torch.Tensor) -> torch.Tensor:
    """``w·t3[t]`` for every token: w (p, q) on the middle axis of t3 (T, q, n) -> (T, p, n), one
    batched GEMM whose w operand is a stride-0 batch (no token-sized permute)."""
    return torch.bmm(w.expand(t3.shape[0], *w.shape), t3)


def lokr_bypass_fwd_native(x, w1, w2, gamma, base=None):
    """The step-down body on CUDA (docs/ops.md §1.5): ``lokr_bypass_fwd`` with 16-bit operands
    kept 16-bit — a GEMM over all tokens for the w2 side and a batched GEMM for the w1 mix, fp32
    accumulation, the intermediate rounded to the compute dtype; γ and base in one ``add``, or
    without a base γ folded into w1. Neither order permutes a token-sized tensor. fp32 / fp64
    compute: the exact body."""
    ((_, dtype),) = check_lokr_bypass_fwd(x, w1, w2, gamma, base)
    cd = C.compute_dtype("lokr_bypass_fwd", x=x, w1=w1, w2=w2)
    if cd not in C.HALF_DTYPES:
        return lokr_bypass_fwd(x, w1, w2, gamma, base)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    if dense_route(T, a, b, c, d):  # γ·kron rounded once to the compute dtype, one GEMM
        dw = _kron_epilogue(w1.float(), w2.float(), gamma, None, cd)
        if base is not None and base.dtype == cd == dtype:  # base as the GEMM's C: no pass of its own
            return torch.addmm(base, cast(x, cd), dw.t()).contiguous()
        y = cast(x, cd) @ dw.t()
        return (cast(y, dtype) if base is None else torch.add(cast(base, dtype), cast(y, dtype))).contiguous()
    X = cast(x, cd).reshape(T, b, d)
    # without a base, γ goes into the small w1 (one rounding to the compute dtype), not a pass over y
    w1c, w2c = cast(w1 if base is not None else w1.float() * float(gamma), cd), cast(w2, cd)
    w2_first, w1_first = _structured_macs(a, b, c, d)
    if w2_first <= w1_first:  # X_t·w2ᵀ over all tokens (T·b, c), then the w1 mix
        y = _mix(w1c, (X.reshape(T * b, d) @ w2c.t()).reshape(T, b, c))
    else:  # the w1 mix (T, a, d), then ·w2ᵀ over all tokens
        y = _mix(w1c, X).reshape(T * a, d) @ w2c.t()
    y = y.reshape(T, a * c)
    if base is None:
        return cast(y, dtype).contiguous()
    return torch.add(cast(base, dtype), cast(y, dtype), alpha=float(gamma)).contiguous()


def lokr_bypass_bwd_native(grad, x, w1, w2, gamma):
    """The step-down body of ``lokr_bypass_bwd`` (docs/ops.md §1.5): every product a 16-bit
    (batched) GEMM with fp32 accumulation, the token-sized intermediates rounded to the compute
    dtype, γ folded into gx's w1 factor, the weight gradients' token sums in fp32; no token-sized
    permute except g_w1's where its per-token partials would be larger. fp32 / fp64 compute: the
    exact body."""
    (_, dx), (_, d1), (_, d2) = check_lokr_bypass_bwd(grad, x, w1, w2, gamma)
    cd = C.compute_dtype("lokr_bypass_bwd", x=x, w1=w1, w2=w2)
    if cd not in C.HALF_DTYPES:
        return lokr_bypass_bwd(grad, x, w1, w2, gamma)
    gamma = float(gamma)
    a, b = w1.shape
    c, d = w2.shape
    T = x.shape[0]
    if dense_route(T, a, b, c, d):
        return _bypass_bwd_dense(cast(grad, cd), cast(x, cd), w1, w2, gamma, cd, dx, d1, d2)
    G = cast(grad, cd).reshape(T * a, c)
    X = cast(x, cd).reshape(T, b, d)
    w1c, w2c = cast(w1, cd), cast(w2, cd)
    H = (G @ w2c).reshape(T, a, d)  # G_t·w2
    gx = _mix(cast(w1.float() * gamma, cd).t(), H).reshape(T, b * d)  # γ·w1ᵀ·G_t·w2: γ in the small factor
    # g_w1 = Σ_t H_t·X_tᵀ: per-token (a, b) fp32 partials summed, or one GEMM over (t, j) after
    # permuting H and X, whichever moves fewer bytes
    if 2 * a * b <= (a + b) * d:
        g_w1 = mm32(H, X.transpose(1, 2)).sum(0)
    else:
        g_w1 = mm32(H.transpose(0, 1).reshape(a, T * d), X.transpose(0, 1).reshape(b, T * d).t())
    # g_w2 = Σ_t G_tᵀ·(w1·X_t) = Gᵀ·P over the (t, u) rows, or Σ_t (w1ᵀ·G_t)ᵀ·X_t over (t, v):
    # the smaller mix
    if a * d <= b * c:
        g_w2 = mm32(G.t(), _mix(w1c, X).reshape(T * a, d))
    else:
        g_w2 = mm32(_mix(w1c.t(), G.reshape(T, a, c)).reshape(T * b, c).t(), X.reshape(T * b, d))
    return (cast(gx, dx).contiguous(), cast(g_w1 * gamma, d1).contiguous(),
            cast(g_w2 * gamma, d2).contiguous())


def _bypass_bwd_dense(G, x, w1, w2, gamma, cd, dx, d1, d2):
    """``lokr_bypass_bwd_native``'s dense route: ``gx = G·ΔW`` with ΔW = γ·kron(w1, w2) rounded to
    the compute dtype, ``gΔW = Gᵀ·x`` over all tokens (fp32 accumulation and output), and the
    factor gradients from gΔW viewed (a, c, b, d): ``g_w1 = γ·Σ gΔW·w2``, ``g_w2 = γ·Σ gΔW·w1``."""
    gx = G @ _kron_epilogue(w1.float(), w2.float(), gamma, None, cd)
    g_w1, g_w2 = _kron_grads_batched(mm32(G.t(), x), w1.float(), w2.float(), gamma)  # gΔW kept fp32
    return cast(gx, dx).contiguous(), cast(g_w1, d1).contiguous(), cast(g_w2, d2).contiguous()
