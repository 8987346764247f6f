"""add_scaled (OPS.md §2.8) and functional.full (Full / Norms merges, §3.10-3.11)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import lycoris_ops  # noqa: F401
from lycoris_ops.functional.full import full_merge, norms_merge, scaled_add
from lycoris_ops.reference import add as ref
from lycoris_ops.testing import REL_TOL, cases, rel_err

OPS = torch.ops.lycoris
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def oracle(base, delta, gamma):
    """fp64: flatten both, explicit sum, view back to base's shape."""
    flat = base.double().flatten() + gamma * delta.double().flatten()
    return flat.view(base.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity(dtype):
    for c in cases("add", dtype=dtype):
        base, delta, gamma = c.args
        out = c()
        assert out.dtype == base.dtype and out.shape == base.shape and out.is_contiguous(), c.id
        assert out.data_ptr() not in (base.data_ptr(), delta.data_ptr())
        assert rel_err(out, oracle(base, delta, gamma)) < REL_TOL[dtype], c.id


def test_single_rounding():
    # fp32 arithmetic, one rounding: bf16 base + fp32 delta equals the fp32 sum rounded once
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=gen).bfloat16()
    delta = torch.randn(64, generator=gen) * 1e-3
    out = OPS.add_scaled(base, delta, 0.5)
    assert torch.equal(out, (base.float() + 0.5 * delta).bfloat16())


def test_zero_size():
    out = OPS.add_scaled(torch.randn(0, 5), torch.randn(0, 5), 2.0)
    assert out.shape == (0, 5)


def test_grads():
    # g_base = G, g_delta = γ·G, each in its own dtype and shape
    base = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
    delta = torch.randn(6, 4, requires_grad=True)
    g = torch.randn(6, 4, dtype=torch.bfloat16)
    out = OPS.add_scaled(base, delta, -0.25)
    out.backward(g)
    assert base.grad.dtype == torch.bfloat16 and torch.equal(base.grad, g)
    assert delta.grad.dtype == torch.float32 and delta.grad.shape == (6, 4)
    assert torch.equal(delta.grad, g.float() * -0.25)


def _opcheck_cases():
    out = []
    for rg in (False, True):
        out += [(c, f"fp32-rg{int(rg)}") for c in cases("add", dtype=torch.float32, requires_grad=rg)]
    out += [(c, "bf16") for c in cases("add", dtype=torch.bfloat16)]
    return out


@pytest.mark.parametrize("case,tag", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else f"{v.op}-{v.id}")
def test_opcheck(case, tag):
    torch.library.opcheck(OPS.add_scaled, case.args)


def test_gradcheck():
    for c in cases("add", dtype=torch.float64, requires_grad=True):
        base, delta, gamma = c.args
        assert torch.autograd.gradcheck(lambda a, b: OPS.add_scaled(a, b, gamma), (base, delta)), c.id


def test_double_backward_is_exact():
    # add_scaled has no bwd op: its backward (G, γ·G) is plain torch and linear, so unlike the
    # ops with a *_bwd op, double backward is supported and exact.
    base = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    delta = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: OPS.add_scaled(a, b, 0.3), (base, delta))


def test_symbolic_trace():
    gm = make_fx(lambda a, b: OPS.add_scaled(a, b, 0.5), tracing_mode="symbolic")(torch.randn(7, 5), torch.randn(7, 5))
    assert gm(torch.randn(9, 3), torch.randn(9, 3)).shape == (9, 3)


BAD = [
    (lambda: (torch.randn(4, 5), torch.randn(4, 4), 1.0), r"delta must have shape \(4, 5\)"),
    (lambda: (torch.randn(4, 5), torch.randn(21), 1.0), r"delta must have shape \(4, 5\)"),
    (lambda: (torch.randn(4, 5, dtype=torch.float16), torch.randn(4, 5, dtype=torch.bfloat16), 1.0),
     "float16 and bfloat16"),
    (lambda: (torch.zeros(4, 5, dtype=torch.int32), torch.randn(4, 5), 1.0), "base must be float"),
    (lambda: (torch.randn(4, 5), torch.zeros(4, 5, dtype=torch.int64), 1.0), "delta must be float"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("bad", BAD, ids=lambda v: v[1].replace(" ", "_"))
def test_bad_input(bad, fake):
    build, match = bad
    if fake:
        with FakeTensorMode():
            args = build()
            with pytest.raises(ValueError, match=match):
                OPS.add_scaled(*args)
    else:
        with pytest.raises(ValueError, match=match):
            OPS.add_scaled(*build())


# ---------------------------------------------------------------- functional (LyCORIS formulas)

@pytest.mark.parametrize("merge", [full_merge, norms_merge], ids=["full", "norms"])
@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 3, 3), (8,)], ids=["linear", "conv", "norm"])
def test_functional_merge(merge, shape):
    gen = torch.Generator().manual_seed(3)
    dd = torch.float64
    w = torch.randn(shape, generator=gen, dtype=dd).requires_grad_()
    dw = torch.randn(shape, generator=gen, dtype=dd).requires_grad_()
    b = torch.randn(shape[0], generator=gen, dtype=dd).requires_grad_()
    db = torch.randn(shape[0], generator=gen, dtype=dd).requires_grad_()
    mult = 0.6
    weight, bias = merge(w, dw, mult, b, db)
    ew, eb = w + mult * dw, b + mult * db  # LyCORIS: W_org + multiplier·diff (weight and bias)
    assert rel_err(weight, ew) < 1e-14 and rel_err(bias, eb) < 1e-14
    g, gb = torch.randn_like(ew), torch.randn_like(eb)
    got = torch.autograd.grad((weight, bias), (w, dw, b, db), (g, gb))
    exp = torch.autograd.grad((ew, eb), (w, dw, b, db), (g, gb))
    for a, e in zip(got, exp):
        assert rel_err(a, e) < 1e-14
    # no bias / bias without a diff
    assert merge(w, dw, mult)[1] is None
    assert merge(w, dw, mult, b)[1] is b


def test_functional_dtypes_and_tensor_multiplier():
    w = torch.randn(6, 4).bfloat16()
    dw = torch.randn(6, 4)
    out = scaled_add(w, dw, 0.5)
    assert out.dtype == torch.bfloat16 and rel_err(out, oracle(w, dw, 0.5)) < REL_TOL[torch.bfloat16]
    m = torch.tensor(0.5, requires_grad=True)
    out = scaled_add(w.float(), dw, m)
    out.sum().backward()
    assert m.grad is not None and rel_err(out, oracle(w, dw, 0.5)) < 1e-6


def test_check_spec_matches_outputs():
    for c in cases("add", dtype=torch.float32):
        ((shape, dtype),) = ref.check_add_scaled(*c.args)
        out = c()
        assert tuple(out.shape) == tuple(shape) and out.dtype == dtype, c.id
