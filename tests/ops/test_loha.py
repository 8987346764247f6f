"""LoHa (OPS.md §2.2, §3.2): the three LoHa ops against independent fp64 oracles
(einsum forward, autograd gradients), autograd, opcheck, argument errors (real
and fake kernels) and the functional entry points against the LyCORIS formulas.
The LoHa merge forward itself (lora_merge_fwd mode hada, lora_tucker_fwd) is
covered in test_lora.py and again here through the functional merges."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401
from lycoris_ops.functional import loha
from lycoris_ops.testing import REL_TOL, make, rel_err
from lycoris_ops.testing import loha as table

L = torch.ops.lycoris
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cases(dtype, requires_grad=False, seed=0):
    return table.cases(dtype=dtype, device="cpu", requires_grad=requires_grad,
                       gen=torch.Generator().manual_seed(seed))


def _d(t):
    return None if t is None else t.detach().double()


def _tol(args):
    return max(REL_TOL[a.dtype] for a in args if isinstance(a, torch.Tensor))


# ----------------------------------------------------------------- fp64 oracles

def _dw(a1, b1, a2, b2):
    """ΔW by explicit sums over the rank (einsum), hadamard."""
    return torch.einsum("or,ri->oi", a1, b1) * torch.einsum("or,ri->oi", a2, b2)


def _f_bypass(x, a1, b1, a2, b2, gamma, base=None):
    y = gamma * torch.einsum("ti,oi->to", x, _dw(a1, b1, a2, b2))
    return y if base is None else y + base


def _vjp(fn, inputs, grad):
    ins = [_d(t).requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*ins), ins, _d(grad))


def oracle(op, args):
    if op == "loha_merge_bwd":
        grad, a1, b1, a2, b2, gamma = args
        return _vjp(lambda *f: gamma * _dw(*f), [a1, b1, a2, b2], grad), tuple(t.dtype for t in (a1, b1, a2, b2))
    if op == "loha_bypass_fwd":
        x, a1, b1, a2, b2, gamma = args[:6]
        base = args[6] if len(args) > 6 else None
        y = _f_bypass(*(_d(t) for t in (x, a1, b1, a2, b2)), gamma, _d(base))
        return (y,), (x.dtype if base is None else base.dtype,)
    if op == "loha_bypass_bwd":
        grad, x, a1, b1, a2, b2, gamma = args
        gs = _vjp(lambda *t: _f_bypass(*t, gamma), [x, a1, b1, a2, b2], grad)
        return gs, tuple(t.dtype for t in (x, a1, b1, a2, b2))
    raise AssertionError(op)


def _params(dtypes, requires_grad=False):
    return [pytest.param(c, id=f"{str(dt)[6:]}{'-grad' if requires_grad else ''}-{c.op}-{c.id}")
            for dt in dtypes for c in _cases(dt, requires_grad)]


@pytest.mark.parametrize("case", _params(DTYPES))
def test_parity(case):
    outs = case()
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs, dtypes = oracle(case.op, case.args)
    assert len(outs) == len(refs)
    tol = _tol(case.args)
    for k, (o, r, dt) in enumerate(zip(outs, refs, dtypes)):
        assert o.shape == r.shape and o.dtype == dt and o.is_contiguous(), (k, o.shape, o.dtype)
        err = rel_err(o, r)
        assert err < tol, f"output {k}: rel err {err:.3g} >= {tol}"


def test_every_op_has_a_case():
    assert {c.op for c in _cases(torch.float32)} == {"loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd"}


def test_outputs_do_not_alias_inputs():
    for c in _cases(torch.float32):
        outs = c()
        outs = outs if isinstance(outs, tuple) else (outs,)
        ptrs = {a.untyped_storage().data_ptr() for a in c.tensors()}
        assert all(o.untyped_storage().data_ptr() not in ptrs for o in outs), c.id


def test_bypass_bwd_is_merge_bwd_of_gtx():
    """OPS.md §2.2.3: factor grads = loha_merge_bwd(Gᵀ·x, ...); gx = γ·G·ΔW."""
    g = torch.Generator().manual_seed(2)
    G, x = make((9, 13), gen=g), make((9, 7), gen=g)
    f = [make(s, gen=g) for s in ((13, 3), (3, 7), (13, 3), (3, 7))]
    out = L.loha_bypass_bwd(G, x, *f, 0.7)
    exp = L.loha_merge_bwd(G.t() @ x, *f, 0.7)
    for a, b in zip(out[1:], exp):
        assert rel_err(a, b) < 1e-6
    assert rel_err(out[0], 0.7 * G.double() @ _dw(*(_d(t) for t in f))) < 1e-6


def test_zero_sizes():
    z = torch.zeros
    f0 = (z(5, 0), z(0, 3), z(5, 0), z(0, 3))
    assert L.loha_bypass_fwd(torch.randn(4, 3), *f0, 1.0).abs().sum() == 0
    outs = L.loha_merge_bwd(torch.randn(5, 3), *f0, 1.0)
    assert [tuple(o.shape) for o in outs] == [(5, 0), (0, 3), (5, 0), (0, 3)]
    f = tuple(torch.randn(s) for s in ((5, 2), (2, 3), (5, 2), (2, 3)))
    assert L.loha_bypass_fwd(z(0, 3), *f, 1.0, z(0, 5)).shape == (0, 5)
    gx, *gf = L.loha_bypass_bwd(z(0, 5), z(0, 3), *f, 1.0)
    assert gx.shape == (0, 3) and all(t.abs().sum() == 0 for t in gf)
    with FakeTensorMode():
        assert L.loha_bypass_fwd(z(0, 3), z(5, 2), z(2, 3), z(5, 2), z(2, 3), 1.0).shape == (0, 5)


# ----------------------------------------------------------------- opcheck

@pytest.mark.parametrize("case", _params((torch.float32,)) + _params((torch.float32,), True)
                         + _params((torch.float16,), True))
def test_opcheck(case):
    torch.library.opcheck(getattr(L, case.op), case.args)


# ----------------------------------------------------------------- autograd

def _small(gen, base=False, nc=False):
    def m(*s, nc_=False):
        return make(s, torch.float64, gen=gen, requires_grad=True, noncontiguous=nc_)
    O, I, r, T = 4, 3, 2, 5
    args = (m(T, I, nc_=nc), m(O, r), m(r, I, nc_=nc), m(O, r), m(r, I), 0.8)
    return args + ((m(T, O),) if base else ())


@pytest.mark.parametrize("base,nc", [(False, False), (True, True)])
def test_gradcheck(base, nc):
    args = _small(torch.Generator().manual_seed(1), base, nc)
    tens = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def f(*ts):
        full = list(args)
        for i, t in zip(tens, ts):
            full[i] = t
        return L.loha_bypass_fwd(*full)

    assert torch.autograd.gradcheck(f, [args[i] for i in tens])


def test_gradcheck_hada_merge():
    g = torch.Generator().manual_seed(4)
    f = [make(s, torch.float64, gen=g, requires_grad=True) for s in ((4, 2), (2, 3), (4, 2), (2, 3), (4, 3))]
    assert torch.autograd.gradcheck(lambda a1, b1, a2, b2, base: L.lora_merge_fwd(a1, b1, a2, b2, base, 0.6, "hada"),
                                    f)


def test_double_backward_raises():
    args = _small(torch.Generator().manual_seed(3), base=True)
    out = L.loha_bypass_fwd(*args)
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    gs = torch.autograd.grad((out * torch.randn_like(out)).sum(), tens, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gs[0].sum() + gs[1].sum(), tens, allow_unused=True)


def test_partial_and_mixed_grads():
    g = torch.Generator().manual_seed(6)
    x = make((6, 7), torch.bfloat16, gen=g, requires_grad=True)
    a1 = make((5, 2), torch.float32, gen=g, requires_grad=True)
    b1, a2, b2 = make((2, 7), torch.bfloat16, gen=g), make((5, 2), torch.bfloat16, gen=g), \
        make((2, 7), torch.bfloat16, gen=g)
    base = make((6, 5), torch.float32, gen=g, requires_grad=True)
    y = L.loha_bypass_fwd(x, a1, b1, a2, b2, 1.5, base)
    assert y.dtype == torch.float32
    G = torch.randn(6, 5, generator=g)
    y.backward(G)
    assert x.grad.dtype == torch.bfloat16 and a1.grad.dtype == torch.float32 and torch.equal(base.grad, G)
    assert b1.grad is None
    exp = _vjp(lambda *t: _f_bypass(*t, 1.5), [x, a1.to(torch.bfloat16), b1, a2, b2], G)
    assert rel_err(x.grad, exp[0]) < REL_TOL[torch.bfloat16]
    assert rel_err(a1.grad, exp[1]) < REL_TOL[torch.bfloat16]


# ----------------------------------------------------------------- argument errors

def R(*shape, dt=torch.float32):
    return torch.randn(shape).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)


h, bh, i64 = torch.float16, torch.bfloat16, torch.int64


def _f(O=4, r=2, I=3, dt1=torch.float32, dt2=torch.float32):
    return R(O, r, dt=dt1), R(r, I), R(O, r), R(r, I, dt=dt2)


BAD = [
    ("mbwd-rank", "loha_merge_bwd", lambda: (R(4, 3), R(4), R(2, 3), R(4, 2), R(2, 3), 1.0), "a1"),
    ("mbwd-dim", "loha_merge_bwd", lambda: (R(4, 3), R(4, 2), R(2, 3), R(4, 3), R(2, 3), 1.0), "a2"),
    ("mbwd-dimb", "loha_merge_bwd", lambda: (R(4, 3), R(4, 2), R(3, 3), R(4, 2), R(2, 3), 1.0), "b1"),
    ("mbwd-grad", "loha_merge_bwd", lambda: (R(3, 4), *_f(), 1.0), "grad"),
    ("mbwd-mix", "loha_merge_bwd", lambda: (R(4, 3), *_f(dt1=h, dt2=bh), 1.0), "b2"),
    ("mbwd-int", "loha_merge_bwd", lambda: (R(4, 3), *_f(dt2=i64), 1.0), "b2"),
    ("bypass-rank", "loha_bypass_fwd", lambda: (R(2, 5, 3), *_f(), 1.0), "x"),
    ("bypass-dim", "loha_bypass_fwd", lambda: (R(5, 4), *_f(), 1.0), "x"),
    ("bypass-dimb2", "loha_bypass_fwd", lambda: (R(5, 3), R(4, 2), R(2, 3), R(4, 2), R(2, 4), 1.0), "b2"),
    ("bypass-mix", "loha_bypass_fwd", lambda: (R(5, 3, dt=bh), *_f(dt1=h), 1.0), "a1"),
    ("bypass-int", "loha_bypass_fwd", lambda: (R(5, 3, dt=i64), *_f(), 1.0), "x"),
    ("bypass-base", "loha_bypass_fwd", lambda: (R(5, 3), *_f(), 1.0, R(4, 5)), "base"),
    ("bbwd-rank", "loha_bypass_bwd", lambda: (R(5, 4, 1), R(5, 3), *_f(), 1.0), "grad"),
    ("bbwd-grad", "loha_bypass_bwd", lambda: (R(6, 4), R(5, 3), *_f(), 1.0), "grad"),
    ("bbwd-dim", "loha_bypass_bwd", lambda: (R(5, 4), R(5, 2), *_f(), 1.0), "x"),
    ("bbwd-mix", "loha_bypass_bwd", lambda: (R(5, 4), R(5, 3, dt=h), *_f(dt2=bh), 1.0), "b2"),
    ("bbwd-int", "loha_bypass_bwd", lambda: (R(5, 4), R(5, 3), *_f(dt1=i64), 1.0), "a1"),
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
    assert {b[1] for b in BAD} == {"loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd"}


# ----------------------------------------------------------------- functional (LyCORIS formulas)

def _rebuild_tucker(t, wa, wb):
    """LyCORIS' tucker rebuild: wa (R, O) with t's first index, wb (R, I) with its second."""
    return torch.einsum("i j ..., i p, j r -> p r ...", t, wa, wb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_functional_merge(dtype):
    g = torch.Generator().manual_seed(21)
    O, I, r = 11, 6, 3
    w1a, w1b, w2a, w2b = (make(s, dtype, gen=g) for s in ((O, r), (r, I * 9), (O, r), (r, I * 9)))
    W = make((O, I, 3, 3), dtype, gen=g)
    ref = W.double() + 0.5 * ((w1a.double() @ w1b.double()) * (w2a.double() @ w2b.double())).view(O, I, 3, 3)
    y = loha.merge(w1a, w1b, w2a, w2b, 0.5, base=W)
    assert y.shape == W.shape and y.dtype == dtype and rel_err(y, ref) < REL_TOL[dtype]
    y = loha.merge(w1a, w1b, w2a, w2b, 0.5, shape=(O, I, 3, 3))
    assert y.shape == W.shape and rel_err(y, ref - W.double()) < REL_TOL[dtype]
    # linear, unfoldable bf16 base on fp32 factors: added eagerly
    f = [make(s, gen=g) for s in ((O, r), (r, I), (O, r), (r, I))]
    Wb = make((O, I), torch.bfloat16, gen=g)
    y = loha.merge(*f, 2.0, base=Wb)
    assert y.dtype == torch.float32
    assert rel_err(y, Wb.double() + 2.0 * _dw(*(_d(t) for t in f))) < 1e-5


def test_functional_tucker_merge_and_grads():
    g = torch.Generator().manual_seed(22)
    O, I, r = 7, 5, 3
    t1, t2 = make((r, r, 3, 3), gen=g, requires_grad=True), make((r, r, 3, 3), gen=g, requires_grad=True)
    w1a, w2a = make((r, O), gen=g, requires_grad=True), make((r, O), gen=g, requires_grad=True)
    w1b, w2b = make((r, I), gen=g, requires_grad=True), make((r, I), gen=g, requires_grad=True)
    W = make((O, I, 3, 3), gen=g, requires_grad=True)
    leaves = (w1a, w1b, w2a, w2b, t1, t2, W)
    y = loha.merge(w1a, w1b, w2a, w2b, 0.9, t1=t1, t2=t2, base=W)
    ref = W + 0.9 * _rebuild_tucker(t1, w1a, w1b) * _rebuild_tucker(t2, w2a, w2b)
    assert y.shape == (O, I, 3, 3) and rel_err(y, ref) < 1e-5
    G = torch.randn(O, I, 3, 3, generator=g)
    for a, b in zip(torch.autograd.grad(y, leaves, G), torch.autograd.grad(ref, leaves, G)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_functional_bypass_linear(dtype):
    g = torch.Generator().manual_seed(23)
    O, I, r = 13, 19, 4
    x = make((2, 3, I), dtype, gen=g, requires_grad=True)
    f = [make(s, dtype, gen=g, requires_grad=True) for s in ((O, r), (r, I), (O, r), (r, I))]
    base = make((2, 3, O), dtype, gen=g, requires_grad=True)
    y = loha.bypass(x, *f, 0.3, base=base)
    leaves = [x, *f, base]
    ds = [t.detach().double().requires_grad_() for t in leaves]
    ref = ds[-1] + F.linear(ds[0], 0.3 * (ds[1] @ ds[2]) * (ds[3] @ ds[4]))
    assert y.shape == (2, 3, O) and y.dtype == dtype and rel_err(y, ref) < REL_TOL[dtype]
    G = torch.randn(2, 3, O, generator=g).to(dtype)
    for a, b in zip(torch.autograd.grad(y, leaves, G), torch.autograd.grad(ref, ds, G.double())):
        assert rel_err(a, b) < REL_TOL[dtype]
    assert rel_err(loha.bypass(x, *f, 0.3), ref - ds[-1]) < REL_TOL[dtype]


@pytest.mark.parametrize("tucker", [False, True])
def test_functional_bypass_conv(tucker):
    g = torch.Generator().manual_seed(24)
    O, I, r = 6, 4, 3
    x = make((2, I, 9, 8), gen=g)
    kw = dict(stride=2, padding=1, dilation=2)
    if tucker:
        t1, t2 = make((r, r, 3, 3), gen=g), make((r, r, 3, 3), gen=g)
        w1a, w1b, w2a, w2b = (make(s, gen=g) for s in ((r, O), (r, I), (r, O), (r, I)))
        W = _rebuild_tucker(t1, w1a, w1b) * _rebuild_tucker(t2, w2a, w2b)
        extra = dict(t1=t1, t2=t2)
    else:
        w1a, w1b, w2a, w2b = (make(s, gen=g) for s in ((O, r), (r, I * 9), (O, r), (r, I * 9)))
        W = ((w1a @ w1b) * (w2a @ w2b)).view(O, I, 3, 3)
        extra = dict(kernel_size=(3, 3))
    ref = F.conv2d(x, 0.7 * W, **kw)
    base = make(ref.shape, gen=g)
    y = loha.bypass(x, w1a, w1b, w2a, w2b, 0.7, base=base, **extra, **kw)
    assert y.shape == ref.shape and rel_err(y, base + ref) < 1e-5


def test_eager_body_below_autograd_is_not_recording(monkeypatch):
    """Inside an op's kernel the inputs still say ``requires_grad`` but autograd records
    nothing there, so ``reference.recording`` is False and the eager body keeps its 16-bit
    tensor-core GEMM on CUDA. (It used to read ``requires_grad`` alone: every training
    call of an eager-bodied op ran its GEMM upcast to fp32 - loha_bypass_fwd at
    32768x4096x4096 bf16 took 23 ms on the H200 against eager torch's 1.8 ms.) At top
    level with grad mode on it is True: a differentiable product (double backward)."""
    import lycoris_ops.reference as R
    import lycoris_ops.reference.loha as RL

    seen = []
    inner = RL.gemm_epilogue

    def spy(a, b, *args, **kw):
        seen.append(R.recording(a, b, kw.get("base")))
        return inner(a, b, *args, **kw)

    monkeypatch.setattr(RL, "gemm_epilogue", spy)
    g = torch.Generator().manual_seed(3)

    def leaf(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).requires_grad_()

    x, a1, b1, a2, b2 = leaf(9, 13), leaf(11, 4), leaf(4, 13), leaf(11, 4), leaf(4, 13)
    y = torch.ops.lycoris.loha_bypass_fwd(x, a1, b1, a2, b2, 0.7, None)
    assert y.requires_grad and seen == [False]
    y.sum().backward()
    assert x.grad is not None and a1.grad is not None
    seen.clear()
    RL.loha_bypass_fwd(x, a1, b1, a2, b2, 0.7, None)
    assert seen == [True]
    seen.clear()
    with torch.no_grad():
        RL.loha_bypass_fwd(x, a1, b1, a2, b2, 0.7, None)
    assert seen == [False]
    with torch._C._AutoDispatchBelowAutograd():  # torch.library's redispatch below autograd
        assert not R.recording(x)
    assert R.recording(x) and not R.recording(x.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mm_rounded_is_one_rounding_of_an_fp32_product(dtype):
    """``reference.mm_rounded`` (GW = Gᵀ·x of the bypass backward): fp32 accumulation, one
    rounding, on CPU and (16-bit on CUDA: cuBLAS with fp32 reduction) on the GPU; a long K,
    a transposed operand; torch's reduced-precision flags are left as they were."""
    from lycoris_ops.reference import mm32, mm_rounded

    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    g = torch.Generator().manual_seed(5)
    for dev in devs:
        a = torch.randn(4099, 37, generator=g).to(dev, dtype)
        b = torch.randn(4099, 45, generator=g).to(dev, dtype)
        flags = torch.backends.cuda.matmul
        before = (flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction)
        got = mm_rounded(a.t(), b, dtype)
        assert (flags.allow_fp16_reduced_precision_reduction, flags.allow_bf16_reduced_precision_reduction) == before
        want = mm32(a.t(), b).to(dtype)
        exact = a.double().t() @ b.double()
        assert got.dtype == dtype and got.shape == (37, 45)
        assert rel_err(got.double(), exact) <= rel_err(want.double(), exact) * 1.05 + 1e-7
