"""DoRA: dora_fwd / dora_bwd (OPS.md §2.4) and functional.dora (§3.4)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import lycoris_ops  # noqa: F401
from lycoris_ops.functional.dora import weight_decompose
from lycoris_ops.reference import dora as ref
from lycoris_ops.testing import REL_TOL, cases, rel_err

OPS = torch.ops.lycoris
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- oracle (fp64)

def oracle(w, dscale, mult, row_axis, delta=None, eps=None):
    """Eager-LyCORIS formulation in fp64: norms via einsum on the transposed view,
    ``scale = mult·dscale/n + 1 − mult``. Differentiable (autograd is the bwd oracle)."""
    eps = torch.finfo(dscale.dtype).eps if eps is None else eps
    m = w.double() if delta is None else w.double() + delta.double()
    mt = m if row_axis == 0 else m.transpose(0, 1)
    n = torch.einsum("ij,ij->i", mt, mt).sqrt() + eps
    scale = mult * dscale.double().reshape(-1) / n + 1 - mult
    y = mt * scale[:, None]
    return (y if row_axis == 0 else y.transpose(0, 1)), n


def _cases(dtype, op, requires_grad=False):
    return [c for c in cases("dora", dtype=dtype, requires_grad=requires_grad) if c.op == op]


# ---------------------------------------------------------------- parity

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fwd_parity(dtype):
    for c in _cases(dtype, "dora_fwd"):
        w, ds, mult, ax, delta = c.args
        y, norms = c()
        ey, en = oracle(w, ds, mult, ax, delta)
        assert y.dtype == w.dtype and y.shape == w.shape and y.is_contiguous(), c.id
        assert norms.dtype == torch.float32 and norms.shape == (w.shape[ax],), c.id
        assert rel_err(y, ey) < REL_TOL[dtype], c.id
        assert rel_err(norms, en) < REL_TOL[torch.float32], c.id


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bwd_parity(dtype):
    for c in _cases(dtype, "dora_bwd"):
        g, w, ds, norms, mult, ax, delta = c.args
        g_m, g_d = c()
        m = (w.double() + (0 if delta is None else delta.double())).requires_grad_()
        d = ds.double().requires_grad_()
        y, _ = oracle(m, d, mult, ax, eps=torch.finfo(ds.dtype).eps)  # eps of the magnitude's dtype
        em, ed = torch.autograd.grad(y, (m, d), g.double())
        assert g_m.dtype == w.dtype and g_m.shape == w.shape, c.id
        assert g_d.dtype == ds.dtype and g_d.shape == (w.shape[ax],), c.id
        assert rel_err(g_m, em) < REL_TOL[dtype], c.id
        assert rel_err(g_d, ed.reshape(-1)) < REL_TOL[ds.dtype], c.id


def test_eps_is_magnitude_dtype():
    # a zero row: n = eps of dscale's dtype (fp32 magnitude with a bf16 weight -> fp32 eps)
    w = torch.zeros(3, 4, dtype=torch.bfloat16)
    w[1] = 1
    ds = torch.ones(3, 1)
    y, n = OPS.dora_fwd(w, ds, 1.0, 0)
    assert n[0].item() == torch.finfo(torch.float32).eps
    assert n[1].item() == pytest.approx(2.0 + torch.finfo(torch.float32).eps)
    g_m, g_d = OPS.dora_bwd(torch.ones(3, 4, dtype=torch.bfloat16), w, ds, n, 1.0, 0)
    assert torch.isfinite(g_m.float()).all() and torch.isfinite(g_d).all()


def test_exact_norm_derivative():
    # rows with ‖M‖ ~ 1e-6, so ε (fp32: 1.2e-7) matters: the op uses d(‖M‖ + ε)/dM exactly
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(4, 6, generator=gen) * 1e-6
    ds = torch.rand(4, generator=gen) + 0.5
    g = torch.randn(4, 6, generator=gen)
    _, n = OPS.dora_fwd(w, ds, 1.0, 0)
    g_m, g_d = OPS.dora_bwd(g, w, ds, n, 1.0, 0)
    m = w.double().requires_grad_()
    d = ds.double().requires_grad_()
    y, _ = oracle(m, d, 1.0, 0, eps=torch.finfo(torch.float32).eps)
    em, ed = torch.autograd.grad(y, (m, d), g.double())
    assert rel_err(g_m, em) < 1e-4 and rel_err(g_d, ed) < 1e-4
    # the reference package's n³ rule would be visibly off here
    n64 = n.double()[:, None]
    rho = (g.double() * w.double()).sum(1, keepdim=True)
    approx = (d.detach()[:, None] / n64) * g.double() - d.detach()[:, None] * rho / n64 ** 3 * w.double()
    assert rel_err(approx, em) > 1e-2


def test_zero_size():
    for shape, ax in (((0, 5), 0), ((5, 0), 0), ((0, 5), 1)):
        w = torch.randn(shape)
        ds = torch.rand(shape[ax])
        y, n = OPS.dora_fwd(w, ds, 0.5, ax)
        assert y.shape == shape and n.shape == (shape[ax],)
        g_m, g_d = OPS.dora_bwd(torch.randn(shape), w, ds, n, 0.5, ax)
        assert g_m.shape == shape and g_d.shape == (shape[ax],)
        assert torch.isfinite(g_m).all() and torch.isfinite(g_d).all()


# ---------------------------------------------------------------- opcheck / autograd

def _opcheck_cases():
    out = []
    for rg in (False, True):
        out += [(c, f"fp32-rg{int(rg)}") for c in cases("dora", dtype=torch.float32, requires_grad=rg)
                if not (rg and c.op.endswith("_bwd"))]
    out += [(c, "bf16") for c in cases("dora", dtype=torch.bfloat16)]
    return out


@pytest.mark.parametrize("case,tag", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else f"{v.op}-{v.id}")
def test_opcheck(case, tag):
    torch.library.opcheck(getattr(OPS, case.op), case.args)


def _grad_fn(c):
    idx = [i for i, a in enumerate(c.args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def fn(*ts):
        args = list(c.args)
        for i, t in zip(idx, ts):
            args[i] = t
        return getattr(OPS, c.op)(*args)[0]
    return fn, tuple(c.args[i] for i in idx)


def test_gradcheck():
    for c in _cases(torch.float64, "dora_fwd", requires_grad=True):
        fn, inputs = _grad_fn(c)
        assert torch.autograd.gradcheck(fn, inputs), c.id


def test_autograd_grads_match_oracle():
    # through the registered autograd: w and delta both receive g_M (own dtype), dscale keeps its shape
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 5, generator=gen, dtype=torch.float64).requires_grad_()
    delta = (0.1 * torch.randn(7, 5, generator=gen)).requires_grad_()
    ds = (torch.rand(1, 5, generator=gen, dtype=torch.float64) + 1).requires_grad_()
    g = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    y, norms = OPS.dora_fwd(w, ds, 0.8, 1, delta)
    assert not norms.requires_grad
    gw, gds, gdl = torch.autograd.grad(y, (w, ds, delta), g)
    assert gw.dtype == torch.float64 and gdl.dtype == torch.float32 and gds.shape == (1, 5)
    ey, _ = oracle(w, ds, 0.8, 1, delta)
    ew, eds, edl = torch.autograd.grad(ey, (w, ds, delta), g)
    assert rel_err(gw, ew) < 1e-5 and rel_err(gdl, edl) < 1e-5 and rel_err(gds, eds) < 1e-5


def test_double_backward_raises():
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    ds = torch.rand(5, dtype=torch.float64, requires_grad=True)
    y, _ = OPS.dora_fwd(w, ds, 1.0, 0)
    (gw,) = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gw.sum().backward()


def test_symbolic_trace():
    def f(w, ds):
        return OPS.dora_fwd(w, ds, 0.5, 0)
    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(7, 5), torch.rand(7))
    y, n = gm(torch.randn(9, 3), torch.rand(9))
    assert y.shape == (9, 3) and n.shape == (9,)


# ---------------------------------------------------------------- bad input

def _bad_fwd():
    f32, h, b = torch.float32, torch.float16, torch.bfloat16
    r = torch.randn
    return [
        (lambda: (r(4, 5, 1), r(4), 1.0, 0, None), "w must be 2-D"),
        (lambda: (r(4, 5), r(5), 1.0, 0, None), "dscale must have"),
        (lambda: (r(4, 5), r(4), 1.0, 1, None), "dscale must have"),
        (lambda: (r(4, 5), r(4), 1.0, 0, r(5, 4)), "delta must have shape"),
        (lambda: (r(4, 5), r(4), 1.0, 0, r(4, 5, 1)), "delta must be 2-D"),
        (lambda: (r(4, 5, dtype=h), r(4, dtype=b), 1.0, 0, None), "float16 and bfloat16"),
        (lambda: (r(4, 5, dtype=h), r(4), 1.0, 0, r(4, 5, dtype=b)), "delta is bfloat16"),
        (lambda: (torch.zeros(4, 5, dtype=torch.int32), r(4), 1.0, 0, None), "w must be float"),
        (lambda: (r(4, 5), torch.zeros(4, dtype=torch.int64), 1.0, 0, None), "dscale must be float"),
        (lambda: (r(4, 5, dtype=f32), r(4), 1.0, 2, None), "row_axis"),
        (lambda: (r(4, 5), r(4), 1.0, -1, None), "row_axis"),
    ]


def _bad_bwd():
    r = torch.randn
    n = lambda k: torch.rand(k) + 1  # noqa: E731
    return [
        (lambda: (r(4, 5), r(4, 5, 1), r(4), n(4), 1.0, 0, None), "w must be 2-D"),
        (lambda: (r(5, 4), r(4, 5), r(4), n(4), 1.0, 0, None), "grad must have shape"),
        (lambda: (r(4, 5), r(4, 5), r(4), n(5), 1.0, 0, None), "norms must have shape"),
        (lambda: (r(4, 5), r(4, 5), r(4), n(4).reshape(4, 1), 1.0, 0, None), "norms must be 1-D"),
        (lambda: (r(4, 5), r(4, 5), r(3), n(4), 1.0, 0, None), "dscale must have"),
        (lambda: (r(4, 5, dtype=torch.bfloat16), r(4, 5, dtype=torch.float16), r(4), n(4), 1.0, 0, None),
         "float16 and bfloat16"),
        (lambda: (torch.zeros(4, 5, dtype=torch.int32), r(4, 5), r(4), n(4), 1.0, 0, None), "grad must be float"),
        (lambda: (r(4, 5), r(4, 5), r(4), n(4), 1.0, 3, None), "row_axis"),
        (lambda: (r(4, 5), r(4, 5), r(4), n(4), 1.0, 0, r(4, 4)), "delta must have shape"),
    ]


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("op,bad", [("dora_fwd", b) for b in _bad_fwd()] + [("dora_bwd", b) for b in _bad_bwd()],
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


# ---------------------------------------------------------------- functional (LyCORIS formula)

def lycoris_weight_decompose(weight, dora_scale, multiplier, wd_on_out):
    """LyCORIS ``apply_weight_decompose``, written from its formula (fp64 here)."""
    weight = weight.to(dora_scale.dtype)
    eps = torch.finfo(weight.dtype).eps
    if wd_on_out:
        norm = weight.reshape(weight.size(0), -1).norm(dim=1)
        norm = norm.reshape(weight.size(0), *[1] * (weight.dim() - 1)) + eps
    else:
        norm = weight.transpose(0, 1).reshape(weight.size(1), -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.size(1), *[1] * (weight.dim() - 1)).transpose(0, 1) + eps
    scale = dora_scale / norm
    if multiplier != 1:
        scale = multiplier * scale + 1 - multiplier
    return weight * scale


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("wd_on_out", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (6, 4, 3, 3), (5, 3, 3)], ids=["linear", "conv2d", "conv1d"])
def test_functional_weight_decompose(shape, wd_on_out, with_delta):
    gen = torch.Generator().manual_seed(1)
    dd = torch.float64
    w = torch.randn(shape, generator=gen, dtype=dd).requires_grad_()
    delta = (0.2 * torch.randn(shape, generator=gen, dtype=dd)).requires_grad_() if with_delta else None
    ax = 0 if wd_on_out else 1
    sshape = [1] * len(shape)
    sshape[ax] = shape[ax]
    ds = (torch.rand(sshape, generator=gen, dtype=dd) * 3 + 1).requires_grad_()
    g = torch.randn(shape, generator=gen, dtype=dd)
    for mult in (1.0, 0.6):
        y = weight_decompose(w, ds, mult, wd_on_out, delta=delta)
        e = lycoris_weight_decompose(w if delta is None else w + delta, ds, mult, wd_on_out)
        assert y.shape == e.shape and y.dtype == dd
        assert rel_err(y, e) < 1e-10
        leaves = [t for t in (w, ds, delta) if t is not None]
        got = torch.autograd.grad(y, leaves, g)
        exp = torch.autograd.grad(e, leaves, g)
        for a, b in zip(got, exp):
            assert a.shape == b.shape and rel_err(a, b) < 1e-10


def test_functional_mixed_dtypes_and_tensor_mult():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 4, 3, 3, generator=gen).to(torch.bfloat16)
    delta = 0.1 * torch.randn(6, 4, 3, 3, generator=gen)  # fp32 delta: M (and y) fp32
    ds = torch.rand(6, 1, 1, 1, generator=gen) + 1
    y = weight_decompose(w, ds, 0.9, True, delta=delta)
    assert y.dtype == torch.float32
    e = lycoris_weight_decompose(w.double() + delta.double(), ds.double(), 0.9, True)
    assert rel_err(y, e) < REL_TOL[torch.float32]
    # bf16 weight alone: output bf16
    y = weight_decompose(w, ds, 1.0, True)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, lycoris_weight_decompose(w.double(), ds.double(), 1.0, True)) < REL_TOL[torch.bfloat16]
    # a multiplier tensor with a gradient goes eager and gets its gradient
    m = torch.tensor(0.7, requires_grad=True)
    y = weight_decompose(w.float(), ds, m, True, delta=delta)
    y.sum().backward()
    assert m.grad is not None
    assert rel_err(y, lycoris_weight_decompose(w.double() + delta.double(), ds.double(), 0.7, True)) < 1e-5


def test_functional_conv_forward_uses_weight():
    # the decomposed weight drops into F.conv2d exactly like the LyCORIS one
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 4, 3, 3, generator=gen)
    ds = torch.rand(1, 4, 1, 1, generator=gen) + 1
    x = torch.randn(2, 4, 5, 5, generator=gen)
    y = F.conv2d(x, weight_decompose(w, ds, 1.0, False))
    e = F.conv2d(x.double(), lycoris_weight_decompose(w.double(), ds.double(), 1.0, False))
    assert rel_err(y, e) < REL_TOL[torch.float32]


def test_check_spec_matches_outputs():
    for c in _cases(torch.float32, "dora_fwd") + _cases(torch.float32, "dora_bwd"):
        spec = getattr(ref, "check_" + c.op)(*c.args)
        outs = c()
        for (shape, dtype), o in zip(spec, outs):
            assert tuple(o.shape) == tuple(shape) and o.dtype == dtype, c.id
