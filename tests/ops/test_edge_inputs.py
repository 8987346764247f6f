"""Edge inputs a randomized sweep of every op found mishandled (CPU kernels and fakes alike):
zero-size Tucker chains, float arguments past fp32's range, the fp16 / bf16 meeting of a
merge's ``out_dtype`` and the gradient in the backward ops."""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops
from lycoris_ops._library import autograd_kernel as _autograd_kernel

lycoris = torch.ops.lycoris
HALVES = (torch.float16, torch.bfloat16)


def _rand(*shape, dtype=torch.float32, grad=False, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


def _tucker(a, t, b):
    return torch.einsum("op,pqk,qi->oik", a.double(), t.double(), b.double())


@pytest.mark.parametrize("O,R,Kk,I", [(0, 2, 3, 4), (5, 2, 0, 4), (5, 0, 3, 4), (5, 2, 3, 0)])
def test_two_chain_tucker_with_an_empty_dim(O, R, Kk, I):
    """Both chains, each of O, R, Kk, I zero in turn: CPU (values and gradients) and fake agree
    on the (O, I, Kk) result (O·Kk = 0 made the CPU kernel's reshape ambiguous)."""
    args = [_rand(O, R, grad=True), _rand(R, R, Kk, grad=True), _rand(R, I, grad=True),
            _rand(O, R, grad=True), _rand(R, R, Kk, grad=True), _rand(R, I, grad=True)]
    y = lycoris.lora_tucker_fwd(*args, 0.5)
    want = 0.5 * _tucker(*args[:3]) * _tucker(*args[3:])
    assert y.shape == (O, I, Kk) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want)
    y.sum().backward()
    for a in args:
        assert a.grad.shape == a.shape and torch.isfinite(a.grad).all()
    plain = [a.detach() for a in args]
    with FakeTensorMode() as mode:
        fy = lycoris.lora_tucker_fwd(*(mode.from_tensor(a) for a in plain), 0.5)
    assert fy.shape == y.shape and fy.dtype == y.dtype


def _gamma_calls(gamma, dtype):
    """(op, args) of the ops whose CPU kernel hands γ to a torch ``alpha=`` argument."""
    r = lambda *s: _rand(*s, dtype=dtype)  # noqa: E731
    return [
        ("lora_merge_fwd", (r(4, 2), r(2, 3), None, None, None, gamma, "plain")),
        ("lora_merge_fwd", (r(4, 2), r(2, 3), None, None, r(4, 3), gamma, "plain")),
        ("lora_merge_bwd", (r(4, 3), r(4, 2), r(2, 3), gamma)),
        ("lora_bypass_fwd", (r(5, 3), r(4, 2), r(2, 3), gamma, None)),
        ("lora_bypass_bwd", (r(5, 4), r(5, 3), r(4, 2), r(2, 3), gamma)),
        ("loha_bypass_fwd", (r(5, 3), r(4, 2), r(2, 3), r(4, 2), r(2, 3), gamma, None)),
        ("add_scaled", (r(3, 2), r(3, 2), gamma)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gamma_past_fp32_range_is_its_fp32_rounding(dtype):
    """γ = 1e300 is inf in fp32 (and 16-bit) arithmetic: the CPU kernels return what that
    gives, as the fakes do, instead of torch's "cannot be converted to type float" from
    ``alpha=``; fp64 operands keep γ finite."""
    for op, args in _gamma_calls(1e300, dtype):
        outs = getattr(lycoris, op)(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        with FakeTensorMode() as mode:
            fake = getattr(lycoris, op)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        fake = fake if isinstance(fake, tuple) else (fake,)
        for o, f in zip(outs, fake):
            assert (o.shape, o.dtype) == (f.shape, f.dtype), op
        first = outs[0]
        if dtype == torch.float64:
            assert torch.isfinite(first).all() and first.abs().max() > 1e290, op
        else:
            assert torch.isinf(first).any(), op
    # an ordinary γ is untouched
    x, d = _rand(3, 2), _rand(3, 2)
    torch.testing.assert_close(lycoris.add_scaled(x, d, 2.5), x + 2.5 * d)
    assert math.isinf(lycoris_ops.reference.scalar_in(-1e300, torch.bfloat16))
    assert lycoris_ops.reference.scalar_in(1e300, torch.float64) == 1e300


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "python"])
@pytest.mark.parametrize("half", HALVES)
def test_merge_out_dtype_of_the_other_half_differentiates(half, direct):
    """A merge of half-precision factors whose ``out_dtype`` is the other 16-bit dtype: its
    backward gets that G, widened to fp32 before the ``*_bwd`` op (fp16 and bf16 never meet
    in one call), in the C++ direct backward and the Python one alike; the gradients are the
    eager chain's with G rounded to the factors' dtype (OPS.md §1.3 rule 7)."""
    other = HALVES[1 - HALVES.index(half)]
    calls = [
        ("lokr_full_merge_fwd", [(2, 3), (3, 2)], lambda w, g: (w[0], w[1], None, 0.7, other),
         lambda w: 0.7 * torch.kron(w[0], w[1])),
        ("lokr_merge_fwd", [(2, 2), (3, 2)], lambda w, g: (w[0], None, w[1], None, [2, 2, 3, 2], None, 0.7, other),
         lambda w: 0.7 * torch.kron(w[0], w[1])),
        ("lora_merge_fwd", [(4, 2), (2, 3)], lambda w, g: (w[0], w[1], None, None, None, 0.7, "plain", other),
         lambda w: 0.7 * w[0] @ w[1]),
        ("lora_merge_fwd", [(4, 2), (2, 3), (4, 2), (2, 3)],
         lambda w, g: (w[0], w[1], w[2], w[3], None, 0.7, "hada", other),
         lambda w: 0.7 * (w[0] @ w[1]) * (w[2] @ w[3])),
    ]
    with _autograd_kernel.direct_backward(direct):
        for op, shapes, args, formula in calls:
            ws = [_rand(*s, dtype=half, grad=True) for s in shapes]
            y = getattr(lycoris, op)(*args(ws, None))
            assert y.dtype == other
            g = _rand(*y.shape, dtype=other)
            y.backward(g)
            ref = [w.detach().double().requires_grad_() for w in ws]
            torch.autograd.backward(formula(ref), g.to(half).double())
            for w, r in zip(ws, ref):
                assert w.grad.dtype == half
                torch.testing.assert_close(w.grad.double(), r.grad, rtol=2e-2, atol=2e-2)


BWD_OPS = [
    ("lora_merge_bwd", lambda g, h: (g, _rand(4, 2, dtype=h), _rand(2, 3, dtype=h), 1.0), (4, 3)),
    ("lora_bypass_bwd", lambda g, h: (g, _rand(5, 3, dtype=h), _rand(4, 2, dtype=h), _rand(2, 3, dtype=h), 1.0),
     (5, 4)),
    ("loha_merge_bwd", lambda g, h: (g, *(_rand(*s, dtype=h) for s in ((4, 2), (2, 3), (4, 2), (2, 3))), 1.0),
     (4, 3)),
    ("loha_bypass_bwd", lambda g, h: (g, _rand(5, 3, dtype=h), *(_rand(*s, dtype=h) for s in ((4, 2), (2, 3),
                                                                                          (4, 2), (2, 3))), 1.0),
     (5, 4)),
]


@pytest.mark.parametrize("op,make,gshape", BWD_OPS, ids=[b[0] for b in BWD_OPS])
@pytest.mark.parametrize("half", HALVES)
def test_backward_ops_reject_a_gradient_of_the_other_half(op, make, gshape, half):
    """fp16 operands with a bf16 G (or the reverse) raise, naming grad, on CPU and fake, as
    every other family's backward op does; before, the LoRA / LoHa ones rounded G to the
    operands' dtype without a word (a bf16 7e4 became inf in fp16)."""
    other = HALVES[1 - HALVES.index(half)]
    args = make(torch.full(gshape, 7e4 if other == torch.bfloat16 else 6e4, dtype=other), half)
    with pytest.raises(ValueError, match=rf"lycoris\.{op}:.*grad.*cannot be mixed"):
        getattr(lycoris, op)(*args)
    with FakeTensorMode() as mode, pytest.raises(ValueError, match=rf"lycoris\.{op}:.*grad"):
        getattr(lycoris, op)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    # an fp32 G with 16-bit operands stays valid
    getattr(lycoris, op)(*make(torch.ones(gshape), half))
