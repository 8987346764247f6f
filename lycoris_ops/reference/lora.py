"""LoRA / LoCon family (docs/ops.md §2.1): ``lora_merge_fwd`` (modes plain / hada / sum),
``lora_merge_bwd``, ``lora_bypass_fwd``, ``lora_bypass_bwd``, ``lora_tucker_fwd``.

Dtypes (docs/ops.md §1.3): the matrix operands are promoted to
the compute dtype of ``checks.compute_dtype`` (a 16-bit operand rounds the others
down to it; fp64 only when every operand is fp64); products accumulate in fp32
(fp64 for fp64); γ, hadamard and the base add run in the accumulation dtype and
are rounded once at the store. ``base`` and ``grad`` are not matrix operands:
they are read in their own dtype (grad is cast to the compute dtype). Every bwd
op returns each gradient in its own input's dtype.
"""
from __future__ import annotations

import torch

from lycoris_ops.reference import checks as C
from lycoris_ops.reference import cast, gemm_epilogue, mm32

MODES = ("plain", "hada", "sum")


def _acc(compute: torch.dtype) -> torch.dtype:
    return torch.float64 if compute == torch.float64 else torch.float32


# --------------------------------------------------------------------------- merge

@C.cached
def check_lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    """-> (((O, I), out_dtype or a1.dtype),).

    a1 (O, r1), b1 (r1, I); a2 (O, r2), b2 (r2, I) required for modes hada/sum
    (hada: r2 = r1) and ignored for plain; base (O, I) optional, any float dtype.
    """
    op = "lora_merge_fwd"
    C.float_arg(op, "gamma", gamma)
    C.choice(op, "mode", mode, MODES)
    C.tensor(op, "a1", a1, 2, "(O, r1)")
    C.tensor(op, "b1", b1, 2, "(r1, I)")
    O, r1 = a1.shape
    I = b1.shape[1]
    C.size(op, "b1.shape[0] (r1 = a1.shape[1])", b1.shape[0], r1)
    if mode == "plain":
        a2 = b2 = None  # ignored
    else:
        if a2 is None or b2 is None:
            C.fail(op, f"mode={mode!r} needs a2 (O, r2) and b2 (r2, I), got "
                       f"a2={'None' if a2 is None else 'Tensor'}, b2={'None' if b2 is None else 'Tensor'}")
        C.tensor(op, "a2", a2, 2, "(O, r2)")
        C.tensor(op, "b2", b2, 2, "(r2, I)")
        C.size(op, "a2.shape[0] (O = a1.shape[0])", a2.shape[0], O)
        C.size(op, "b2.shape[1] (I = b1.shape[1])", b2.shape[1], I)
        C.size(op, "b2.shape[0] (r2 = a2.shape[1])", b2.shape[0], a2.shape[1])
        if mode == "hada":
            C.size(op, "a2.shape[1] (r2, must equal r1 = a1.shape[1] in mode 'hada')", a2.shape[1], r1)
    if base is not None:
        C.tensor(op, "base", base, 2, "(O, I)")
        C.shape(op, "base", base, (O, I), "(O, I)")
    C.same_device(op, a1=a1, b1=b1, a2=a2, b2=b2, base=base)
    C.compute_dtype(op, a1=a1, b1=b1, a2=a2, b2=b2, base=base)  # float16 + bfloat16 -> error
    return (((O, I), C.out_dtype(op, out_dtype, a1.dtype)),)


def lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    """Rebuild ΔW from low-rank factors, scaled, optionally plus base.

    plain: ``Y = γ·(a1·b1) [+ base]``;
    hada:  ``Y = γ·((a1·b1) ⊙ (a2·b2)) [+ base]`` (r2 = r1);
    sum:   ``Y = γ·(a1·b1 + a2·b2) [+ base]`` (r1 ≠ r2 allowed).
    a1 (O, r1), b1 (r1, I), a2 (O, r2), b2 (r2, I), base (O, I).
    Output (O, I) in ``out_dtype`` (default a1's dtype). Products in fp32
    accumulation over the compute dtype; epilogue in fp32; one rounding.
    """
    ((_, dt),) = check_lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype)
    # the check rejected float16 with bfloat16: promote without re-checking
    if mode == "plain":  # one GEMM; on CUDA the scale and base ride in cuBLAS's epilogue
        c = C.promote_dtypes(a1.dtype, b1.dtype)
        return gemm_epilogue(cast(a1, c), cast(b1, c), dt, gamma, base).contiguous()
    c = C.promote_dtypes(a1.dtype, b1.dtype, a2.dtype, b2.dtype)
    y = mm32(cast(a1, c), cast(b1, c))
    if mode == "hada":
        y = y * mm32(cast(a2, c), cast(b2, c))
    elif mode == "sum":
        y = y + mm32(cast(a2, c), cast(b2, c))
    y = y * gamma
    if base is not None:
        y = y + cast(base, _acc(c))
    return cast(y, dt).contiguous()


@C.cached
def check_lora_merge_bwd(grad, up, down, gamma):
    """-> (((O, r), up.dtype), ((r, I), down.dtype)). grad (O, I), up (O, r), down (r, I)."""
    op = "lora_merge_bwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "grad", grad, 2, "(O, I)")
    C.tensor(op, "up", up, 2, "(O, r)")
    C.tensor(op, "down", down, 2, "(r, I)")
    O, r = up.shape
    I = down.shape[1]
    C.size(op, "down.shape[0] (r = up.shape[1])", down.shape[0], r)
    C.shape(op, "grad", grad, (O, I), "(O, I)")
    C.same_device(op, grad=grad, up=up, down=down)
    C.compute_dtype(op, grad=grad, up=up, down=down)
    return (((O, r), up.dtype), ((r, I), down.dtype))


def lora_merge_bwd(grad, up, down, gamma):
    """Backward of the plain merge ``Y = γ·up·down``.

    ``g_up = γ·G·downᵀ`` (O, r) in up's dtype; ``g_down = γ·upᵀ·G`` (r, I) in
    down's dtype. G (O, I) is cast to the compute dtype of (up, down).
    """
    check_lora_merge_bwd(grad, up, down, gamma)
    c = C.promote_dtypes(up.dtype, down.dtype)
    g, u, d = cast(grad, c), cast(up, c), cast(down, c)
    g_up = gemm_epilogue(g, d.t(), up.dtype, gamma)
    g_down = gemm_epilogue(u.t(), g, down.dtype, gamma)
    return g_up.contiguous(), g_down.contiguous()


# --------------------------------------------------------------------------- bypass

@C.cached
def check_lora_bypass_fwd(x, up, down, gamma, base=None):
    """-> (((T, O), base.dtype if base else x.dtype),). x (T, I), up (O, r), down (r, I), base (T, O)."""
    op = "lora_bypass_fwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "x", x, 2, "(T, I)")
    C.tensor(op, "up", up, 2, "(O, r)")
    C.tensor(op, "down", down, 2, "(r, I)")
    T, I = x.shape
    O, r = up.shape
    C.size(op, "down.shape[0] (r = up.shape[1])", down.shape[0], r)
    C.size(op, "down.shape[1] (I = x.shape[1])", down.shape[1], I)
    if base is not None:
        C.tensor(op, "base", base, 2, "(T, O)")
        C.shape(op, "base", base, (T, O), "(T, O)")
    C.same_device(op, x=x, up=up, down=down, base=base)
    C.compute_dtype(op, x=x, up=up, down=down, base=base)
    return (((T, O), x.dtype if base is None else base.dtype),)


def lora_bypass_fwd(x, up, down, gamma, base=None):
    """``h = x·downᵀ`` (T, r), rounded to the compute dtype; ``Y = γ·h·upᵀ [+ base]``.

    x (T, I), up (O, r), down (r, I), base (T, O) optional. Output (T, O) in
    base's dtype when given, else x's.
    """
    ((_, dt),) = check_lora_bypass_fwd(x, up, down, gamma, base)
    c = C.promote_dtypes(x.dtype, up.dtype, down.dtype)
    h = gemm_epilogue(cast(x, c), cast(down, c).t(), c)
    return gemm_epilogue(h, cast(up, c).t(), dt, gamma, base).contiguous()


@C.cached
def check_lora_bypass_bwd(grad, x, up, down, gamma):
    """-> ((x.shape, x.dtype), (up.shape, up.dtype), (down.shape, down.dtype))."""
    op = "lora_bypass_bwd"
    C.float_arg(op, "gamma", gamma)
    C.tensor(op, "grad", grad, 2, "(T, O)")
    C.tensor(op, "x", x, 2, "(T, I)")
    C.tensor(op, "up", up, 2, "(O, r)")
    C.tensor(op, "down", down, 2, "(r, I)")
    T, I = x.shape
    O, r = up.shape
    C.size(op, "down.shape[0] (r = up.shape[1])", down.shape[0], r)
    C.size(op, "down.shape[1] (I = x.shape[1])", down.shape[1], I)
    C.shape(op, "grad", grad, (T, O), "(T, O)")
    C.same_device(op, grad=grad, x=x, up=up, down=down)
    C.compute_dtype(op, grad=grad, x=x, up=up, down=down)
    return (((T, I), x.dtype), ((O, r), up.dtype), ((r, I), down.dtype))


def lora_bypass_bwd(grad, x, up, down, gamma):
    """Backward of ``Y = γ·(x·downᵀ)·upᵀ``. With G (T, O), ``h = x·downᵀ`` and
    ``q = G·up`` (both rounded to the compute dtype):
    ``gx = γ·q·down`` (T, I), ``g_up = γ·Gᵀ·h`` (O, r), ``g_down = γ·qᵀ·x`` (r, I),
    each in its input's dtype.
    """
    check_lora_bypass_bwd(grad, x, up, down, gamma)
    c = C.promote_dtypes(x.dtype, up.dtype, down.dtype)
    g, xc, u, d = cast(grad, c), cast(x, c), cast(up, c), cast(down, c)
    h = gemm_epilogue(xc, d.t(), c)
    q = gemm_epilogue(g, u, c)
    gx = gemm_epilogue(q, d, x.dtype, gamma)
    g_up = gemm_epilogue(g.t(), h, up.dtype, gamma)
    g_down = gemm_epilogue(q.t(), xc, down.dtype, gamma)
    return gx.contiguous(), g_up.contiguous(), g_down.contiguous()


# --------------------------------------------------------------------------- tucker

def _check_chain(op, k, a, t, b):
    C.tensor(op, f"a{k}", a, 2, "(O, R)")
    C.tensor(op, f"t{k}", t, 3, "(R, R, Kk)")
    C.tensor(op, f"b{k}", b, 2, "(R, I)")
    C.size(op, f"t{k}.shape[0] (R = a{k}.shape[1])", t.shape[0], a.shape[1])
    C.size(op, f"b{k}.shape[0] (R = t{k}.shape[1])", b.shape[0], t.shape[1])


@C.cached
def check_lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    """-> (((O, I, Kk), a1.dtype),).

    a1 (O, R), t1 (R, R', Kk) (first index contracts with a1's rank, second with
    b1's; LyCORIS cores are square), b1 (R', I); a2, t2, b2 all or none, same
    O, I, Kk (their rank may differ).
    """
    op = "lora_tucker_fwd"
    C.float_arg(op, "gamma", gamma)
    _check_chain(op, 1, a1, t1, b1)
    O, I, Kk = a1.shape[0], b1.shape[1], t1.shape[2]
    present = [n for n, v in (("a2", a2), ("t2", t2), ("b2", b2)) if v is not None]
    if present and len(present) != 3:
        C.fail(op, f"a2, t2 and b2 must be given together (all or none), got only {', '.join(present)}")
    if present:
        _check_chain(op, 2, a2, t2, b2)
        C.size(op, "a2.shape[0] (O = a1.shape[0])", a2.shape[0], O)
        C.size(op, "b2.shape[1] (I = b1.shape[1])", b2.shape[1], I)
        C.size(op, "t2.shape[2] (Kk = t1.shape[2])", t2.shape[2], Kk)
    C.same_device(op, a1=a1, t1=t1, b1=b1, a2=a2, t2=t2, b2=b2)
    C.compute_dtype(op, a1=a1, t1=t1, b1=b1, a2=a2, t2=t2, b2=b2)
    return (((O, I, Kk), a1.dtype),)


def tucker_rows(t):
    """(O, X, Kk) -> (O·Kk, X) with rows (o, κ): the one copy after which every tucker
    contraction (forward, and the backward in autograd.py) is a plain GEMM."""
    O, X, Kk = t.shape
    return t.permute(0, 2, 1).reshape(O * Kk, X)


def tucker_core(a, t, c):
    """``AT[o,q,κ] = Σ_p a[o,p]·t[p,q,κ]`` (O, R', Kk) from a, t in the compute dtype ``c``,
    fp32-accumulated and rounded to ``c`` (the chain's deliberate rounding)."""
    Ra, Rb, Kk = t.shape
    at = mm32(cast(a, c), cast(t, c).reshape(Ra, Rb * Kk))
    return cast(at, c).reshape(a.shape[0], Rb, Kk)


def tucker_apply(at, b):
    """``C[o,i,κ] = Σ_q AT[o,q,κ]·b[q,i]`` in fp32 (fp64 for fp64), b in AT's dtype: one
    GEMM with rows (o, κ), returned as an (O, I, Kk) view."""
    O, Rb, Kk = at.shape
    # I given, not -1: with O·Kk = 0 the -1 would be ambiguous
    return mm32(tucker_rows(at), cast(b, at.dtype)).reshape(O, Kk, b.shape[1]).permute(0, 2, 1)


def _tucker_chain(a, t, b, c):
    """``C[o,i,κ] = Σ_{p,q} a[o,p]·t[p,q,κ]·b[q,i]`` in fp32 (a·t rounded to c first)."""
    return tucker_apply(tucker_core(a, t, c), b)


def lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    """Tucker rebuild: ``C1[o,i,κ] = Σ_{p,q} a1[o,p]·t1[p,q,κ]·b1[q,i]``;
    ``Y = γ·C1`` or, with the second chain, ``Y = γ·C1 ⊙ C2``.

    a1 (O, R) (any strides), t1 (R, R, Kk), b1 (R, I). Output (O, I, Kk) in a1's
    dtype (the caller reshapes to (O, I, *kernel)). a·t is rounded to the compute
    dtype before ·b; fp32 accumulation; one rounding at the store.
    """
    ((_, dt),) = check_lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma)
    c = C.compute_dtype("lora_tucker_fwd", a1=a1, t1=t1, b1=b1, a2=a2, t2=t2, b2=b2)
    if a2 is None:  # γ and the rounding in the GEMM's epilogue (one cuBLAS call on CUDA), then (o, κ, i) -> (o, i, κ)
        O, Kk, I = a1.shape[0], t1.shape[2], b1.shape[1]
        rows = gemm_epilogue(tucker_rows(tucker_core(a1, t1, c)), cast(b1, c), dt, gamma)
        return rows.reshape(O, Kk, I).permute(0, 2, 1).contiguous()
    y = _tucker_chain(a1, t1, b1, c) * gamma
    if a2 is not None:
        y = y * _tucker_chain(a2, t2, b2, c)
    return y.to(dt).contiguous()
