"""IA3: ia3_fwd / ia3_bwd (OPS.md §2.7) and functional.ia3 (§3.7)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import lycoris_ops  # noqa: F401
from lycoris_ops.functional.ia3 import ia3_bypass, ia3_merge, ia3_scale
from lycoris_ops.reference import ia3 as ref
from lycoris_ops.testing import REL_TOL, cases, rel_err

OPS = torch.ops.lycoris
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def oracle(x, w, channel_axis, alpha, gamma):
    """fp64 via einsum: move the channel axis last, scale with a diagonal matrix."""
    xd = x.double().movedim(channel_axis, -1)
    diag = torch.diag(alpha + gamma * w.double().reshape(-1))
    return torch.einsum("...c,cd->...d", xd, diag).movedim(-1, channel_axis)


def _cases(dtype, op, requires_grad=False):
    return [c for c in cases("ia3", dtype=dtype, requires_grad=requires_grad) if c.op == op]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fwd_parity(dtype):
    for c in _cases(dtype, "ia3_fwd"):
        x, w, ax, alpha, gamma = c.args
        y = c()
        out = torch.promote_types(x.dtype, w.dtype)
        assert y.dtype == out and y.shape == x.shape and y.is_contiguous(), c.id
        assert rel_err(y, oracle(x, w, ax, alpha, gamma)) < REL_TOL[out], c.id


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bwd_parity(dtype):
    for c in _cases(dtype, "ia3_bwd"):
        g, x, w, ax, alpha, gamma = c.args
        gx, gw = c()
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        ex, ew = torch.autograd.grad(oracle(xd, wd, ax, alpha, gamma), (xd, wd), g.double())
        assert gx.dtype == x.dtype and gx.shape == x.shape, c.id
        assert gw.dtype == w.dtype and gw.shape == w.shape, c.id
        assert rel_err(gx, ex) < REL_TOL[x.dtype], c.id
        assert rel_err(gw, ew) < REL_TOL[w.dtype], c.id


def test_zero_size():
    x = torch.randn(0, 5)
    y = OPS.ia3_fwd(x, torch.randn(5), -1, 1.0, 1.0)
    assert y.shape == (0, 5)
    gx, gw = OPS.ia3_bwd(torch.randn(0, 5), x, torch.randn(5), -1, 1.0, 1.0)
    assert gx.shape == (0, 5) and torch.equal(gw, torch.zeros(5))
    x = torch.randn(3, 0, 2)
    y = OPS.ia3_fwd(x, torch.randn(0), 1, 1.0, 1.0)
    gx, gw = OPS.ia3_bwd(torch.randn(3, 0, 2), x, torch.randn(0), 1, 1.0, 1.0)
    assert y.shape == gx.shape == (3, 0, 2) and gw.shape == (0,)


def _opcheck_cases():
    out = []
    for rg in (False, True):
        out += [(c, f"fp32-rg{int(rg)}") for c in cases("ia3", dtype=torch.float32, requires_grad=rg)
                if not (rg and c.op.endswith("_bwd"))]
    out += [(c, "fp16") for c in cases("ia3", dtype=torch.float16)]
    return out


@pytest.mark.parametrize("case,tag", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else f"{v.op}-{v.id}")
def test_opcheck(case, tag):
    torch.library.opcheck(getattr(OPS, case.op), case.args)


def test_gradcheck():
    for c in _cases(torch.float64, "ia3_fwd", requires_grad=True):
        x, w, ax, alpha, gamma = c.args
        assert torch.autograd.gradcheck(lambda a, b: OPS.ia3_fwd(a, b, ax, alpha, gamma), (x, w)), c.id


def test_autograd_dtypes():
    # bf16 activation, fp32 vector: output fp32, gx bf16, gw fp32 with w's shape
    x = torch.randn(4, 3, 6, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1, 3, 1, requires_grad=True)
    y = OPS.ia3_fwd(x, w, 1, 1.0, 0.5)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and w.grad.shape == (1, 3, 1)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    oracle(xd, wd, 1, 1.0, 0.5).square().sum().backward()
    assert rel_err(x.grad, xd.grad) < REL_TOL[torch.bfloat16] and rel_err(w.grad, wd.grad) < 1e-5


def test_double_backward_raises():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = OPS.ia3_fwd(x, w, -1, 1.0, 1.0)
    (gw,) = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gw.sum().backward()


def test_symbolic_trace():
    def f(x, w):
        return OPS.ia3_fwd(x, w, -1, 1.0, 0.5)
    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(7, 5), torch.randn(5))
    assert gm(torch.randn(9, 3), torch.randn(3)).shape == (9, 3)


# ---------------------------------------------------------------- bad input

def _bad_fwd():
    r, h, b = torch.randn, torch.float16, torch.bfloat16
    return [
        (lambda: (torch.tensor(1.0), r(1), 0, 1.0, 1.0), "x must have at least 1 dim"),
        (lambda: (r(4, 5), r(4), -1, 1.0, 1.0), "w must have"),
        (lambda: (r(4, 5), r(5, 2), 1, 1.0, 1.0), "w must have"),
        (lambda: (r(4, 5, dtype=h), r(5, dtype=b), -1, 1.0, 1.0), "float16 and bfloat16"),
        (lambda: (torch.zeros(4, 5, dtype=torch.int32), r(5), -1, 1.0, 1.0), "x must be float"),
        (lambda: (r(4, 5), torch.zeros(5, dtype=torch.int64), -1, 1.0, 1.0), "w must be float"),
        (lambda: (r(4, 5), r(5), 2, 1.0, 1.0), "channel_axis"),
        (lambda: (r(4, 5), r(4), -3, 1.0, 1.0), "channel_axis"),
    ]


def _bad_bwd():
    r, h, b = torch.randn, torch.float16, torch.bfloat16
    return [
        (lambda: (r(4, 5), torch.tensor(1.0), r(1), 0, 1.0, 1.0), "x must have at least 1 dim"),
        (lambda: (r(4, 5), r(4, 5), r(4), 1, 1.0, 1.0), "w must have"),
        (lambda: (r(5, 4), r(4, 5), r(5), 1, 1.0, 1.0), "grad must have shape"),
        (lambda: (r(4, 5, 1), r(4, 5), r(5), 1, 1.0, 1.0), "grad must have shape"),
        (lambda: (r(4, 5, dtype=b), r(4, 5, dtype=h), r(5), 1, 1.0, 1.0), "float16 and bfloat16"),
        (lambda: (torch.zeros(4, 5, dtype=torch.int32), r(4, 5), r(5), 1, 1.0, 1.0), "grad must be float"),
        (lambda: (r(4, 5), r(4, 5), r(5), 5, 1.0, 1.0), "channel_axis"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("op,bad", [("ia3_fwd", b) for b in _bad_fwd()] + [("ia3_bwd", b) for b in _bad_bwd()],
                         ids=lambda v: v if isinstance(v, str) else v[1].replace(" ", "_"))
def test_bad_input(op, bad, fake):
    build, match = bad
    if fake:
        with FakeTensorMode():
            args = build()
            with pytest.raises(ValueError, match=match):
                getattr(OPS, op)(*args)
    else:
        with pytest.raises(ValueError, match=match):
            getattr(OPS, op)(*build())


# ---------------------------------------------------------------- functional (LyCORIS formulas)
# LyCORIS IA3 stores its vector as (1, I) / (O, 1) for linear and (1, I, 1, 1) / (O, 1, 1, 1) for conv.

def _setup(conv, train_on_input, gen):
    w_org = torch.randn((6, 4, 3, 3) if conv else (6, 4), generator=gen, dtype=torch.float64)
    if train_on_input:
        shape = (1, 4, 1, 1) if conv else (1, 4)
    else:
        shape = (6, 1, 1, 1) if conv else (6, 1)
    vec = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    return w_org, vec


@pytest.mark.parametrize("diff", [False, True])
@pytest.mark.parametrize("train_on_input", [False, True])
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_functional_merge(conv, train_on_input, diff):
    gen = torch.Generator().manual_seed(7)
    w_org, vec = _setup(conv, train_on_input, gen)
    w_org.requires_grad_()
    mult = 0.7
    got = ia3_merge(w_org, vec, mult, train_on_input, diff)
    expected = w_org * (vec * mult + (0 if diff else 1))  # LyCORIS: W ⊙ (w·m + 1), broadcast
    assert got.shape == w_org.shape and rel_err(got, expected) < 1e-12
    g = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (w_org, vec), g), torch.autograd.grad(expected, (w_org, vec), g)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-12


@pytest.mark.parametrize("train_on_input", [False, True])
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_functional_bypass(conv, train_on_input):
    gen = torch.Generator().manual_seed(8)
    w_org, vec = _setup(conv, train_on_input, gen)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    if conv:
        x = torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64)
        layer = lambda t: F.conv2d(t, w_org, bias, padding=1)  # noqa: E731
        vshape = (1, -1, 1, 1)
    else:
        x = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
        layer = lambda t: F.linear(t, w_org, bias)  # noqa: E731
        vshape = (-1,)
    x.requires_grad_()
    mult = 1.3
    got = ia3_bypass(x, vec, layer, mult, train_on_input, is_conv=conv)
    s = vec.reshape(vshape) * mult + 1
    expected = layer(x * s) if train_on_input else layer(x) * s
    assert rel_err(got, expected) < 1e-12
    g = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, vec), g), torch.autograd.grad(expected, (x, vec), g)):
        assert rel_err(a, b) < 1e-12


def test_functional_tensor_multiplier_and_dtypes():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    w = torch.randn(5)
    m = torch.tensor(0.5, requires_grad=True)
    y = ia3_scale(x, w, -1, m)
    y.sum().backward()
    assert m.grad is not None and y.dtype == torch.float32
    assert rel_err(y, oracle(x, w, -1, 1.0, 0.5)) < 1e-6
    assert ia3_scale(x, w.bfloat16(), -1, 0.5).dtype == torch.bfloat16


def test_check_spec_matches_outputs():
    for c in _cases(torch.float32, "ia3_fwd") + _cases(torch.float32, "ia3_bwd"):
        spec = getattr(ref, "check_" + c.op)(*c.args)
        outs = c()
        outs = outs if isinstance(outs, tuple) else (outs,)
        for (shape, dtype), o in zip(spec, outs):
            assert tuple(o.shape) == tuple(shape) and o.dtype == dtype, c.id
