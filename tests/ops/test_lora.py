"""LoRA / LoCon family (OPS.md §2.1, §3.1, §3.8, §3.9): the five ops against
independent fp64 einsum oracles, autograd, opcheck, argument errors (real and
fake kernels) and the functional entry points against the plain LyCORIS formulas."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401  registers the ops
from lycoris_ops.functional import locon
from lycoris_ops.testing import REL_TOL, make, rel_err
from lycoris_ops.testing import lora as table

L = torch.ops.lycoris
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)


def _cases(dtype, requires_grad=False, seed=0):
    return table.cases(dtype=dtype, device="cpu", requires_grad=requires_grad,
                       gen=torch.Generator().manual_seed(seed))


def _d(t):
    return None if t is None else t.detach().double()


def _tol(args):
    dts = {a.dtype for a in args if isinstance(a, torch.Tensor)}
    return max(REL_TOL[dt] for dt in dts)


# ----------------------------------------------------------------- fp64 oracles (einsum)

def _f_merge(a1, b1, a2, b2, base, gamma, mode):
    if mode == "plain":
        y = torch.einsum("or,ri->oi", a1, b1)
    elif mode == "hada":
        y = torch.einsum("or,ri->oi", a1, b1) * torch.einsum("or,ri->oi", a2, b2)
    else:  # the rank-(r1+r2) product of the stacked factors
        y = torch.einsum("or,ri->oi", torch.cat([a1, a2], 1), torch.cat([b1, b2], 0))
    y = gamma * y
    return y if base is None else y + base


def _f_bypass(x, up, down, gamma, base=None):
    y = gamma * torch.einsum("ti,ri,or->to", x, down, up)
    return y if base is None else y + base


def _f_tucker(a1, t1, b1, a2, t2, b2, gamma):
    y = gamma * torch.einsum("op,pqk,qi->oik", a1, t1, b1)
    if a2 is not None:
        y = y * torch.einsum("op,pqk,qi->oik", a2, t2, b2)
    return y


def _vjp(fn, inputs, grad):
    ins = [_d(t).requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*ins), ins, _d(grad))


def oracle(op, args):
    """(expected fp64 outputs, expected dtypes) for one call."""
    if op == "lora_merge_fwd":
        a1, b1, a2, b2, base, gamma, mode = args[:7]
        out_dtype = args[7] if len(args) > 7 else None
        if mode == "plain":
            a2 = b2 = None
        y = _f_merge(_d(a1), _d(b1), _d(a2), _d(b2), _d(base), gamma, mode)
        return (y,), (out_dtype or a1.dtype,)
    if op == "lora_merge_bwd":
        grad, up, down, gamma = args
        gs = _vjp(lambda u, d: gamma * torch.einsum("or,ri->oi", u, d), [up, down], grad)
        return gs, (up.dtype, down.dtype)
    if op == "lora_bypass_fwd":
        x, up, down, gamma = args[:4]
        base = args[4] if len(args) > 4 else None
        y = _f_bypass(_d(x), _d(up), _d(down), gamma, _d(base))
        return (y,), (x.dtype if base is None else base.dtype,)
    if op == "lora_bypass_bwd":
        grad, x, up, down, gamma = args
        gs = _vjp(lambda x_, u, d: _f_bypass(x_, u, d, gamma), [x, up, down], grad)
        return gs, (x.dtype, up.dtype, down.dtype)
    if op == "lora_tucker_fwd":
        a1, t1, b1, a2, t2, b2, gamma = args
        return (_f_tucker(*(_d(t) for t in (a1, t1, b1, a2, t2, b2)), gamma),), (a1.dtype,)
    raise AssertionError(op)


def _params(dtypes, requires_grad=False):
    out = []
    for dt in dtypes:
        for c in _cases(dt, requires_grad):
            out.append(pytest.param(c, id=f"{str(dt)[6:]}{'-grad' if requires_grad else ''}-{c.op}-{c.id}"))
    return out


# ----------------------------------------------------------------- parity

@pytest.mark.parametrize("case", _params(DTYPES))
def test_parity(case):
    outs = case()
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs, dtypes = oracle(case.op, case.args)
    assert len(outs) == len(refs)
    tol = _tol(case.args)
    for k, (o, r, dt) in enumerate(zip(outs, refs, dtypes)):
        assert o.shape == r.shape, (k, o.shape, r.shape)
        assert o.dtype == dt, (k, o.dtype, dt)
        assert o.is_contiguous()
        err = rel_err(o, r)
        assert err < tol, f"output {k}: rel err {err:.3g} >= {tol}"


def test_every_op_has_a_case():
    ops = {c.op for c in _cases(torch.float32)}
    assert ops == {"lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd", "lora_tucker_fwd"}
    modes = {c.args[6] for c in _cases(torch.float32) if c.op == "lora_merge_fwd"}
    assert modes == {"plain", "hada", "sum"}


def test_outputs_do_not_alias_inputs():
    for c in _cases(torch.float32):
        outs = c()
        outs = outs if isinstance(outs, tuple) else (outs,)
        ptrs = {a.untyped_storage().data_ptr() for a in c.tensors()}
        for o in outs:
            assert o.untyped_storage().data_ptr() not in ptrs, c.id


def test_intermediate_rounding_bypass_bf16():
    """h = x·downᵀ is rounded to the compute dtype before ·upᵀ (OPS.md §1.3 rule 8)."""
    g = torch.Generator().manual_seed(3)
    x, up, down = (make(s, torch.bfloat16, gen=g) for s in ((64, 33), (29, 7), (7, 33)))
    h = (x.double() @ down.double().t()).to(torch.bfloat16).double()
    ref = (0.5 * h @ up.double().t()).to(torch.bfloat16)
    y = L.lora_bypass_fwd(x, up, down, 0.5)
    assert (y.double() - ref.double()).abs().max() <= 2 * ref.double().abs().max() * 2.0 ** -8


# ----------------------------------------------------------------- zero-size operands

def test_zero_sizes():
    z = torch.zeros
    # r = 0: ΔW = 0
    y = L.lora_merge_fwd(z(5, 0), z(0, 3), None, None, torch.ones(5, 3), 2.0, "plain")
    assert torch.equal(y, torch.ones(5, 3))
    assert L.lora_merge_fwd(z(5, 0), z(0, 3), z(5, 0), z(0, 3), None, 1.0, "hada").abs().sum() == 0
    g_up, g_down = L.lora_merge_bwd(torch.randn(5, 3), z(5, 0), z(0, 3), 1.0)
    assert g_up.shape == (5, 0) and g_down.shape == (0, 3)
    # T = 0 tokens
    assert L.lora_bypass_fwd(z(0, 4), torch.randn(6, 2), torch.randn(2, 4), 1.0).shape == (0, 6)
    gx, gu, gd = L.lora_bypass_bwd(z(0, 6), z(0, 4), torch.randn(6, 2), torch.randn(2, 4), 1.0)
    assert gx.shape == (0, 4) and gu.abs().sum() == 0 and gd.abs().sum() == 0
    # R = 0 tucker, O = 0 merge
    assert L.lora_tucker_fwd(z(5, 0), z(0, 0, 9), z(0, 3), None, None, None, 1.0).abs().sum() == 0
    assert L.lora_merge_fwd(z(0, 2), torch.randn(2, 3), None, None, None, 1.0, "plain").shape == (0, 3)
    with FakeTensorMode():
        assert L.lora_bypass_fwd(z(0, 4), z(6, 2), z(2, 4), 1.0).shape == (0, 6)


# ----------------------------------------------------------------- opcheck

@pytest.mark.parametrize("case", _params((torch.float32,)) + _params((torch.float32,), True)
                         + [p for p in _params((torch.bfloat16,), True) if "mixed" in p.id or "hada" in p.id
                            or "bwd" in p.id or "tucker-2" in p.id or p.id.endswith("-bypass")])
def test_opcheck(case):
    torch.library.opcheck(getattr(L, case.op), case.args)


# ----------------------------------------------------------------- autograd

def _small_fwd(gen):
    def m(*s, nc=False):
        return make(s, torch.float64, gen=gen, requires_grad=True, noncontiguous=nc)
    O, I, r, r2, T = 4, 3, 2, 3, 5
    return [
        ("lora_merge_fwd", (m(O, r), m(r, I), None, None, None, 0.7, "plain")),
        ("lora_merge_fwd", (m(O, r, nc=True), m(r, I), None, None, m(O, I), -1.3, "plain")),
        ("lora_merge_fwd", (m(O, r), m(r, I), m(O, r), m(r, I, nc=True), m(O, I), 0.6, "hada")),
        ("lora_merge_fwd", (m(O, r), m(r, I), m(O, r2), m(r2, I), m(O, I), 1.1, "sum")),
        ("lora_bypass_fwd", (m(T, I), m(O, r), m(r, I), 0.8)),
        ("lora_bypass_fwd", (m(T, I, nc=True), m(O, r), m(r, I), -0.5, m(T, O))),
        ("lora_tucker_fwd", (m(O, r), m(r, r, 3), m(r, I), None, None, None, 0.9)),
        ("lora_tucker_fwd", (m(r, O).t(), m(r, r, 2), m(r, I), m(O, r2), m(r2, r2, 2, nc=True), m(r2, I), -1.2)),
    ]


@pytest.mark.parametrize("idx", range(8))
def test_gradcheck(idx):
    op, args = _small_fwd(torch.Generator().manual_seed(idx))[idx]
    fn = getattr(L, op)
    tens = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def f(*ts):
        full = list(args)
        for i, t in zip(tens, ts):
            full[i] = t
        return fn(*full)

    assert torch.autograd.gradcheck(f, [args[i] for i in tens])


@pytest.mark.parametrize("idx", [6, 7])
def test_gradgradcheck_eager_backward(idx):
    """the tucker merge differentiates through eager formulas: double backward is
    supported there and must be right."""
    op, args = _small_fwd(torch.Generator().manual_seed(idx))[idx]
    fn = getattr(L, op)
    tens = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def f(*ts):
        full = list(args)
        for i, t in zip(tens, ts):
            full[i] = t
        return fn(*full)

    assert torch.autograd.gradgradcheck(f, [args[i] for i in tens])


@pytest.mark.parametrize("idx", [0, 2, 3, 4])
def test_double_backward_raises(idx):
    op, args = _small_fwd(torch.Generator().manual_seed(idx))[idx]
    out = getattr(L, op)(*args)
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    gs = torch.autograd.grad((out * torch.randn_like(out)).sum(), tens, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gs[0].sum() + gs[1].sum(), tens, allow_unused=True)


def test_autograd_mixed_dtypes_and_partial_grads():
    """Each gradient comes back in its own leaf's dtype; base gets G in base's dtype;
    inputs that don't need grad get none."""
    g = torch.Generator().manual_seed(5)
    a1 = make((9, 3), torch.bfloat16, gen=g, requires_grad=True)
    b1 = make((3, 7), torch.float32, gen=g, requires_grad=True)
    base = make((9, 7), torch.float32, gen=g, requires_grad=True)
    y = L.lora_merge_fwd(a1, b1, None, None, base, 0.5, "plain", torch.float32)
    G = torch.randn(9, 7, generator=g)
    y.backward(G)
    assert a1.grad.dtype == torch.bfloat16 and b1.grad.dtype == torch.float32
    assert torch.equal(base.grad, G)
    ra = 0.5 * G.double() @ b1.detach().double().t()
    assert rel_err(a1.grad, ra) < REL_TOL[torch.bfloat16]
    x = make((6, 7), torch.float32, gen=g, requires_grad=True)
    up = make((9, 3), torch.float32, gen=g)
    down = make((3, 7), torch.float32, gen=g)
    L.lora_bypass_fwd(x, up, down, 2.0).sum().backward()
    ref = 2.0 * torch.ones(6, 9, dtype=torch.float64) @ up.double() @ down.double()
    assert rel_err(x.grad, ref) < 1e-5


# ----------------------------------------------------------------- argument errors

def R(*shape, dt=torch.float32):
    if dt.is_floating_point:
        return torch.randn(shape).to(dt)
    return torch.zeros(shape, dtype=dt)


h, bh, i64 = torch.float16, torch.bfloat16, torch.int64
BAD = [
    # (id, op, args builder, match)
    ("merge-rank", "lora_merge_fwd", lambda: (R(4), R(2, 3), None, None, None, 1.0, "plain"), "a1"),
    ("merge-dim", "lora_merge_fwd", lambda: (R(4, 2), R(3, 3), None, None, None, 1.0, "plain"), "b1"),
    ("merge-mix", "lora_merge_fwd", lambda: (R(4, 2, dt=h), R(2, 3, dt=bh), None, None, None, 1.0, "plain"), "b1"),
    ("merge-int", "lora_merge_fwd", lambda: (R(4, 2, dt=i64), R(2, 3), None, None, None, 1.0, "plain"), "a1"),
    ("merge-mode", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), None, None, None, 1.0, "kron"), "mode"),
    ("merge-hada-missing", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), None, None, None, 1.0, "hada"), "a2"),
    ("merge-hada-rank", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), R(4, 3), R(3, 3), None, 1.0, "hada"), "a2"),
    ("merge-sum-dim", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), R(5, 3), R(3, 3), None, 1.0, "sum"), "a2"),
    ("merge-base", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), None, None, R(3, 4), 1.0, "plain"), "base"),
    ("merge-base-mix", "lora_merge_fwd", lambda: (R(4, 2, dt=h), R(2, 3, dt=h), None, None, R(4, 3, dt=bh), 1.0,
                                                  "plain"), "base"),
    ("merge-out_dtype", "lora_merge_fwd", lambda: (R(4, 2), R(2, 3), None, None, None, 1.0, "plain", torch.int32),
     "out_dtype"),
    ("mbwd-rank", "lora_merge_bwd", lambda: (R(4, 3), R(4, 2, 1), R(2, 3), 1.0), "up"),
    ("mbwd-dim", "lora_merge_bwd", lambda: (R(4, 3), R(4, 2), R(3, 3), 1.0), "down"),
    ("mbwd-grad", "lora_merge_bwd", lambda: (R(4, 4), R(4, 2), R(2, 3), 1.0), "grad"),
    ("mbwd-mix", "lora_merge_bwd", lambda: (R(4, 3), R(4, 2, dt=h), R(2, 3, dt=bh), 1.0), "down"),
    ("mbwd-int", "lora_merge_bwd", lambda: (R(4, 3, dt=i64), R(4, 2), R(2, 3), 1.0), "grad"),
    ("bypass-rank", "lora_bypass_fwd", lambda: (R(2, 5, 3), R(4, 2), R(2, 3), 1.0), "x"),
    ("bypass-dim", "lora_bypass_fwd", lambda: (R(5, 3), R(4, 2), R(2, 4), 1.0), "down"),
    ("bypass-rankdim", "lora_bypass_fwd", lambda: (R(5, 3), R(4, 2), R(3, 3), 1.0), "down"),
    ("bypass-mix", "lora_bypass_fwd", lambda: (R(5, 3, dt=h), R(4, 2, dt=bh), R(2, 3, dt=h), 1.0), "up"),
    ("bypass-int", "lora_bypass_fwd", lambda: (R(5, 3), R(4, 2), R(2, 3, dt=i64), 1.0), "down"),
    ("bypass-base", "lora_bypass_fwd", lambda: (R(5, 3), R(4, 2), R(2, 3), 1.0, R(5, 3)), "base"),
    ("bbwd-rank", "lora_bypass_bwd", lambda: (R(5, 4), R(5, 3), R(4), R(2, 3), 1.0), "up"),
    ("bbwd-grad", "lora_bypass_bwd", lambda: (R(5, 3), R(5, 3), R(4, 2), R(2, 3), 1.0), "grad"),
    ("bbwd-dim", "lora_bypass_bwd", lambda: (R(5, 4), R(5, 4), R(4, 2), R(2, 3), 1.0), "down"),
    ("bbwd-mix", "lora_bypass_bwd", lambda: (R(5, 4), R(5, 3, dt=bh), R(4, 2, dt=h), R(2, 3), 1.0), "up"),
    ("bbwd-int", "lora_bypass_bwd", lambda: (R(5, 4), R(5, 3, dt=i64), R(4, 2), R(2, 3), 1.0), "x"),
    ("tucker-rank", "lora_tucker_fwd", lambda: (R(4, 2), R(2, 2), R(2, 3), None, None, None, 1.0), "t1"),
    ("tucker-dim", "lora_tucker_fwd", lambda: (R(4, 2), R(2, 2, 9), R(3, 3), None, None, None, 1.0), "b1"),
    ("tucker-dimt", "lora_tucker_fwd", lambda: (R(4, 2), R(3, 2, 9), R(2, 3), None, None, None, 1.0), "t1"),
    ("tucker-partial", "lora_tucker_fwd", lambda: (R(4, 2), R(2, 2, 9), R(2, 3), R(4, 2), None, None, 1.0), "t2"),
    ("tucker-chain2", "lora_tucker_fwd", lambda: (R(4, 2), R(2, 2, 9), R(2, 3), R(4, 2), R(2, 2, 4), R(2, 3), 1.0),
     "t2"),
    ("tucker-mix", "lora_tucker_fwd", lambda: (R(4, 2, dt=h), R(2, 2, 9, dt=bh), R(2, 3), None, None, None, 1.0),
     "t1"),
    ("tucker-int", "lora_tucker_fwd", lambda: (R(4, 2, dt=i64), R(2, 2, 9), R(2, 3), None, None, None, 1.0), "a1"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_bad_input(bad, fake):
    _, op, build, match = bad
    if fake:
        with FakeTensorMode():
            args = build()
            with pytest.raises(ValueError, match=match):
                getattr(L, op)(*args)
    else:
        with pytest.raises(ValueError, match=match):
            getattr(L, op)(*build())


def test_every_op_has_bad_inputs():
    assert {b[1] for b in BAD} == {"lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd",
                                   "lora_tucker_fwd"}


# ----------------------------------------------------------------- functional (LyCORIS formulas)

def _lin_ref(x, w):
    return F.linear(x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_merge_linear(dtype):
    g = torch.Generator().manual_seed(11)
    up, down, W = make((23, 4), dtype, gen=g), make((4, 17), dtype, gen=g), make((23, 17), dtype, gen=g)
    ref = W.double() + 0.3 * (up.double() @ down.double())
    y = locon.merge(up, down, 0.3, base=W)
    assert y.dtype == dtype and y.shape == W.shape
    assert rel_err(y, ref) < REL_TOL[dtype]
    y = locon.merge(up, down, 0.3)
    assert rel_err(y, 0.3 * up.double() @ down.double()) < REL_TOL[dtype]
    # an unfoldable base (bf16 base with fp32 factors) is added eagerly with torch promotion
    upf, downf = up.float(), down.float()
    y = locon.merge(upf, downf, 0.3, base=W.to(torch.bfloat16))
    assert y.dtype == torch.float32
    assert rel_err(y, W.to(torch.bfloat16).double() + 0.3 * upf.double() @ downf.double()) < REL_TOL[torch.bfloat16]


def test_functional_merge_conv_and_grads():
    g = torch.Generator().manual_seed(12)
    O, I, r = 7, 5, 3
    up = make((O, r, 1, 1), gen=g, requires_grad=True)
    down = make((r, I, 3, 3), gen=g, requires_grad=True)
    W = make((O, I, 3, 3), gen=g, requires_grad=True)
    y = locon.merge(up, down, 0.7, base=W)
    ref = W + 0.7 * (up.view(O, r) @ down.view(r, -1)).view(O, I, 3, 3)
    assert y.shape == (O, I, 3, 3) and rel_err(y, ref) < 1e-5
    G = torch.randn(O, I, 3, 3, generator=g)
    got = torch.autograd.grad(y, (up, down, W), G)
    exp = torch.autograd.grad(ref, (up, down, W), G)
    for a, b in zip(got, exp):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5


def test_functional_tucker_merge_is_the_conv_chain():
    """The tucker merge equals the module's down(1×1) -> mid(k×k) -> up(1×1) chain."""
    g = torch.Generator().manual_seed(13)
    O, I, r = 6, 5, 3
    up = make((O, r, 1, 1), torch.float64, gen=g, requires_grad=True)
    mid = make((r, r, 3, 3), torch.float64, gen=g, requires_grad=True)
    down = make((r, I, 1, 1), torch.float64, gen=g, requires_grad=True)
    x = make((2, I, 8, 9), torch.float64, gen=g)
    chain = 0.6 * F.conv2d(F.conv2d(F.conv2d(x, down), mid, padding=1), up)
    W = locon.merge(up, down, 0.6, mid=mid)
    assert W.shape == (O, I, 3, 3)
    assert rel_err(F.conv2d(x, W, padding=1), chain) < 1e-10
    G = torch.randn(chain.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(F.conv2d(x, W, padding=1), (up, mid, down), G)
    exp = torch.autograd.grad(chain, (up, mid, down), G)
    for a, b in zip(got, exp):
        assert rel_err(a, b) < 1e-10
    # base added eagerly, fp32 factors
    base = make((O, I, 3, 3), gen=g)
    W32 = locon.merge(up.float(), down.float(), 0.6, mid=mid.float(), base=base)
    assert W32.dtype == torch.float32 and rel_err(W32, base.double() + W.detach()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_functional_bypass_linear(dtype):
    g = torch.Generator().manual_seed(14)
    x = make((2, 5, 19), dtype, gen=g, requires_grad=True)
    up, down = make((13, 4), dtype, gen=g, requires_grad=True), make((4, 19), dtype, gen=g, requires_grad=True)
    base = make((2, 5, 13), dtype, gen=g, requires_grad=True)
    y = locon.bypass(x, up, down, 0.8, base=base)
    ref = base.double() + 0.8 * F.linear(F.linear(x.double(), down.double()), up.double())
    assert y.shape == (2, 5, 13) and y.dtype == dtype and rel_err(y, ref) < REL_TOL[dtype]
    G = torch.randn(2, 5, 13, generator=g).to(dtype)
    got = torch.autograd.grad(y, (x, up, down, base), G)
    xd, ud, dd, bd = (t.detach().double().requires_grad_() for t in (x, up, down, base))
    ref = bd + 0.8 * F.linear(F.linear(xd, dd), ud)
    exp = torch.autograd.grad(ref, (xd, ud, dd, bd), G.double())
    for a, b, leaf in zip(got, exp, (x, up, down, base)):
        assert a.dtype == leaf.dtype and rel_err(a, b) < REL_TOL[dtype]
    # no base
    assert rel_err(locon.bypass(x, up, down, 0.8), ref - bd) < REL_TOL[dtype]


@pytest.mark.parametrize("nd,tucker", [(2, False), (2, True), (1, False), (3, True)])
def test_functional_bypass_conv(nd, tucker):
    g = torch.Generator().manual_seed(15 + nd)
    O, I, r, k = 6, 4, 3, 3
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    spatial = {1: (11,), 2: (9, 8), 3: (5, 6, 5)}[nd]
    ones = (1,) * nd
    x = make((2, I) + spatial, gen=g)
    up = make((O, r) + ones, gen=g)
    kw = dict(stride=2, padding=1, dilation=1 if nd == 3 else 2)
    if tucker:
        down = make((r, I) + ones, gen=g)
        mid = make((r, r) + (k,) * nd, gen=g)
        ref = conv(conv(conv(x, down), mid, **kw), up)
    else:
        down = make((r, I) + (k,) * nd, gen=g)
        mid = None
        ref = conv(conv(x, down, **kw), up)
    base = make(ref.shape, gen=g)
    y = locon.bypass(x, up, down, 0.4, mid=mid, base=base, **kw)
    assert rel_err(y, base + 0.4 * ref) < 1e-5
    # merged weight through the layer's conv equals the bypass
    W = locon.merge(up, down, 0.4, mid=mid)
    assert rel_err(conv(x, W, **kw), 0.4 * ref) < 1e-5


def test_functional_dylora_glora():
    g = torch.Generator().manual_seed(16)
    up, down, W = make((9, 6), gen=g), make((6, 7), gen=g), make((9, 7), gen=g)
    y = locon.dylora_merge(up, down, 4, 0.5, base=W)
    assert rel_err(y, W.double() + 0.5 * up[:, :4].double() @ down[:4].double()) < 1e-5
    a1, a2, b1, b2 = make((7, 3), gen=g), make((3, 7), gen=g), make((9, 2), gen=g), make((2, 7), gen=g)
    for p in (W, a1, a2, b1, b2):
        p.requires_grad_(True)
    y = locon.glora_merge(W, a1, a2, b1, b2, 0.9, base=W)
    ref = W + 0.9 * (W @ a1 @ a2 + b1 @ b2)
    assert rel_err(y, ref) < 1e-5
    G = torch.randn(9, 7, generator=g)
    for a, b in zip(torch.autograd.grad(y, (W, a1, a2, b1, b2), G), torch.autograd.grad(ref, (W, a1, a2, b1, b2), G)):
        assert rel_err(a, b) < 1e-5
