"""LoHa (docs/ops.md §2.2): ``loha_merge_bwd``, ``loha_bypass_fwd``, ``loha_bypass_bwd``.

The LoHa merge forward is ``lora_merge_fwd(mode="hada")`` and the tucker merge is
``lora_tucker_fwd`` (reference/lora.py). ΔW = (a1·b1) ⊙ (a2·b2) with a1, a2 (O, r)
and b1, b2 (r, I). Dtypes as in reference/lora.py: matrix operands promoted to
the compute dtype, fp32 accumulation, each gradient in its own input's dtype.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast, gemm_epilogue, mm32, mm_rounded


def _acc(compute: torch.dtype) -> torch.dtype:
    return torch.float64 if compute == torch.float64 else torch.float32


def _check_factors(op, a1, b1, a2, b2):
    """a1, a2 (O, r); b1, b2 (r, I) -> (O, r, I)."""
    C.tensor(op, "a1", a1, 2, "(O, r)")
    C.tensor(op, "b1", b1, 2, "(r, I)")
    C.tensor(op, "a2", a2, 2, "(O, r)")
    C.tensor(op, "b2", b2, 2, "(r, I)")
    O, r = a1.shape
    I = b1.shape[1]
    C.size(op, "b1.shape[0] (r = a1.shape[1])", b1.shape[0], r)
    C.shape(op, "a2", a2, (O, r), "(O, r) like a1")
    C.shape(op, "b2", b2, (r, I), "(r, I) like b1")
    return O, r, I


def _factor_specs(a1, b1, a2, b2):
    return tuple((tuple(t.shape), t.dtype) for t in (a1, b1, a2, b2))


def _hada_grads(gw, p1, p2, a1, b1, a2, b2, gamma, c):
    """Factor grads of ``γ·(a1·b1)⊙(a2·b2)`` given ``gw`` = dL/dY (compute dtype)
    and the fp32 products p1, p2. ``E1 = γ·G⊙P2`` and ``E2 = γ·G⊙P1`` are
    rounded to the compute dtype before the second contraction."""
    gs = cast(gw, p1.dtype) * gamma
    return hada_contractions((gs * p2).to(c), (gs * p1).to(c), a1, b1, a2, b2, c)


def hada_contractions(e1, e2, a1, b1, a2, b2, c):
    """``(E1·b1ᵀ, a1ᵀ·E1, E2·b2ᵀ, a2ᵀ·E2)`` from the rounded E1, E2 (compute dtype ``c``):
    fp32-accumulated GEMMs, each rounded once to its factor's dtype (also the Triton merge
    backward's ``vendor`` path, after its fused E pass)."""
    a1c, b1c, a2c, b2c = cast(a1, c), cast(b1, c), cast(a2, c), cast(b2, c)
    return (mm32(e1, b1c.t()).to(a1.dtype).contiguous(),
            mm32(a1c.t(), e1).to(b1.dtype).contiguous(),
            mm32(e2, b2c.t()).to(a2.dtype).contiguous(),
            mm32(a2c.t(), e2).to(b2.dtype).contiguous())


@C.cached
def check_loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    """-> one (shape, dtype) per factor: (a1, b1, a2, b2) as given. grad (O, I)."""
    op = "loha_merge_bwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "grad", grad, 2, "(O, I)")
    O, r, I = _check_factors(op, a1, b1, a2, b2)
    C.shape(op, "grad", grad, (O, I), "(O, I)")
    C.same_device(op, grad=grad, a1=a1, b1=b1, a2=a2, b2=b2)
    C.compute_dtype(op, grad=grad, a1=a1, b1=b1, a2=a2, b2=b2)
    return _factor_specs(a1, b1, a2, b2)


def loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    """Backward of ``Y = γ·(a1·b1) ⊙ (a2·b2)`` (lora_merge_fwd mode hada).

    P1 = a1·b1, P2 = a2·b2 regenerated; ``E1 = γ·G⊙P2``, ``E2 = γ·G⊙P1`` rounded
    to the compute dtype; ``g_a1 = E1·b1ᵀ``, ``g_b1 = a1ᵀ·E1``, ``g_a2 = E2·b2ᵀ``,
    ``g_b2 = a2ᵀ·E2``. grad (O, I); outputs shaped and typed like a1, b1, a2, b2.
    """
    check_loha_merge_bwd(grad, a1, b1, a2, b2, gamma)
    c = C.compute_dtype("loha_merge_bwd", a1=a1, b1=b1, a2=a2, b2=b2)
    p1 = mm32(cast(a1, c), cast(b1, c))
    p2 = mm32(cast(a2, c), cast(b2, c))
    return _hada_grads(cast(grad, c), p1, p2, a1, b1, a2, b2, gamma, c)


@C.cached
def check_loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    """-> (((T, O), base.dtype if base else x.dtype),). x (T, I), base (T, O)."""
    op = "loha_bypass_fwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "x", x, 2, "(T, I)")
    O, r, I = _check_factors(op, a1, b1, a2, b2)
    T = x.shape[0]
    C.size(op, "x.shape[1] (I = b1.shape[1])", x.shape[1], I)
    if base is not None:
        C.tensor(op, "base", base, 2, "(T, O)")
        C.shape(op, "base", base, (T, O), "(T, O)")
    C.same_device(op, x=x, a1=a1, b1=b1, a2=a2, b2=b2, base=base)
    C.compute_dtype(op, x=x, a1=a1, b1=b1, a2=a2, b2=b2, base=base)
    return (((T, O), x.dtype if base is None else base.dtype),)


def _delta(a1, b1, a2, b2, c):
    p1 = mm32(cast(a1, c), cast(b1, c))
    p2 = mm32(cast(a2, c), cast(b2, c))
    return p1, p2, (p1 * p2).to(c)


def loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    """``ΔW = (a1·b1) ⊙ (a2·b2)`` (O, I) rounded to the compute dtype;
    ``Y = γ·x·ΔWᵀ [+ base]``.

    x (T, I), a1/a2 (O, r), b1/b2 (r, I), base (T, O) optional. Output (T, O) in
    base's dtype when given, else x's.
    """
    ((_, dt),) = check_loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base)
    c = C.compute_dtype("loha_bypass_fwd", x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    _, _, dw = _delta(a1, b1, a2, b2, c)
    return gemm_epilogue(cast(x, c), dw.t(), dt, gamma, base).contiguous()


@C.cached
def check_loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    """-> (x spec, a1, b1, a2, b2 specs) as given. grad (T, O), x (T, I)."""
    op = "loha_bypass_bwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "grad", grad, 2, "(T, O)")
    C.tensor(op, "x", x, 2, "(T, I)")
    O, r, I = _check_factors(op, a1, b1, a2, b2)
    T = x.shape[0]
    C.size(op, "x.shape[1] (I = b1.shape[1])", x.shape[1], I)
    C.shape(op, "grad", grad, (T, O), "(T, O)")
    C.same_device(op, grad=grad, x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    C.compute_dtype(op, grad=grad, x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    return (((T, I), x.dtype),) + _factor_specs(a1, b1, a2, b2)


def loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    """Backward of ``Y = γ·x·ΔWᵀ``: ``gx = γ·G·ΔW`` (T, I) in x's dtype; with
    ``GW = Gᵀ·x`` (O, I, rounded to the compute dtype) the factor grads are
    ``loha_merge_bwd(GW, a1, b1, a2, b2, γ)``, each in its input's dtype.
    """
    check_loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma)
    c = C.compute_dtype("loha_bypass_bwd", x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    g, xc = cast(grad, c), cast(x, c)
    p1, p2, dw = _delta(a1, b1, a2, b2, c)
    gx = gemm_epilogue(g, dw, x.dtype, gamma).contiguous()
    gw = mm_rounded(g.t(), xc, c)
    return (gx,) + _hada_grads(gw, p1, p2, a1, b1, a2, b2, gamma, c)


# ---------------------------------------------------------------------------
# step-down bodies (docs/ops.md §1.5): the O·I products in the 16-bit compute dtype


def _delta_native(a1, b1, a2, b2, c):
    """``P1 = a1·b1``, ``P2 = a2·b2`` each rounded to ``c`` by one 16-bit GEMM, and their
    product ``ΔW`` rounded again: the user's formula, without the exact body's three fp32
    O·I passes."""
    p1 = mm_rounded(cast(a1, c), cast(b1, c), c)
    p2 = mm_rounded(cast(a2, c), cast(b2, c), c)
    return p1, p2, p1 * p2


def loha_bypass_fwd_native(x, a1, b1, a2, b2, gamma, base=None):
    """The step-down body of ``loha_bypass_fwd``: with a 16-bit compute dtype ΔW built in that
    dtype (``_delta_native``), then the exact body's one GEMM with its epilogue; else the
    exact body."""
    ((_, dt),) = check_loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base)
    c = C.compute_dtype("loha_bypass_fwd", x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    if c not in C.HALF_DTYPES:
        return loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base)
    _, _, dw = _delta_native(a1, b1, a2, b2, c)
    return gemm_epilogue(cast(x, c), dw.t(), dt, gamma, base).contiguous()


def loha_bypass_bwd_native(grad, x, a1, b1, a2, b2, gamma):
    """The step-down body of ``loha_bypass_bwd``: with a 16-bit compute dtype ΔW regenerated in
    that dtype, ``γ·Gᵀ·x`` rounded once by one GEMM, ``E1 = γGW⊙P2`` and ``E2 = γGW⊙P1`` each
    one 16-bit pass (over P2, P1 in place), then the exact body's four small contractions;
    else the exact body."""
    check_loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma)
    c = C.compute_dtype("loha_bypass_bwd", x=x, a1=a1, b1=b1, a2=a2, b2=b2)
    if c not in C.HALF_DTYPES:
        return loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma)
    g, xc = cast(grad, c), cast(x, c)
    p1, p2, dw = _delta_native(a1, b1, a2, b2, c)
    gx = gemm_epilogue(g, dw, x.dtype, gamma).contiguous()
    del dw
    gw = gemm_epilogue(g.t(), xc, c, gamma)
    return (gx,) + hada_contractions(p2.mul_(gw), p1.mul_(gw), a1, b1, a2, b2, c)

