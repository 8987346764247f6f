"""Diag-OFT (OPS.md §2.5, §3.5): oft_fwd / oft_bwd against an fp64 oracle that
builds the full block-diagonal orthogonal matrix explicitly (Cayley by matrix
inverse, ``torch.block_diag``) and applies ``diag(ρ)·Rᵀ − shift·I`` with one matmul."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401
from lycoris_ops.functional import diag_oft as F_oft
from lycoris_ops.testing import REL_TOL, cases, make, rel_err

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------ fp64 oracle

def cayley64(blocks, cscale):
    b = blocks.double()
    q = cscale * (b - b.transpose(-1, -2))
    eye = torch.eye(b.shape[-1], dtype=torch.float64)
    return (eye + q) @ torch.linalg.inv(eye - q)


def oft_oracle(blocks, x, rescale, cscale, shift, weight):
    K, S = blocks.shape[0], blocks.shape[1]
    C = K * S
    R = torch.block_diag(*cayley64(blocks, cscale)) if K else torch.zeros(0, 0, dtype=torch.float64)
    rho = rescale.double().reshape(-1) if rescale is not None else torch.ones(C, dtype=torch.float64)
    F = torch.diag(rho) @ R.T - float(shift) * torch.eye(C, dtype=torch.float64)
    x64 = x.double()
    if weight:
        return F @ x64
    if x.dim() == 2:
        return x64 @ F.T
    return torch.einsum("ij,nj...->ni...", F, x64)


def _fwd_args(case):
    return case.args


# ---------------------------------------------------------------- parity tests

@pytest.mark.parametrize("dtype", DTYPES)
def test_oft_fwd_parity(dtype):
    n = 0
    for case in cases("oft", dtype=dtype):
        if case.op != "oft_fwd":
            continue
        out = case()
        blocks, x, rescale, cscale, shift, weight = case.args
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        ref = oft_oracle(blocks, x, rescale, cscale, shift, weight)
        assert rel_err(out, ref) < REL_TOL[dtype], case.id
        n += 1
    assert n >= 9


@pytest.mark.parametrize("dtype", DTYPES)
def test_oft_bwd_parity(dtype):
    for case in cases("oft", dtype=dtype):
        if case.op != "oft_bwd":
            continue
        grad, blocks, x, rescale, cscale, shift, weight = case.args
        gx, gb, gr = case()
        b64 = blocks.detach().double().requires_grad_()
        x64 = x.detach().double().requires_grad_()
        r64 = rescale.detach().double().requires_grad_() if rescale is not None else None
        out = oft_oracle(b64, x64, r64, cscale, shift, weight)
        ins = [b64, x64] + ([r64] if r64 is not None else [])
        refs = torch.autograd.grad(out, ins, grad.double(), allow_unused=True)
        assert gx.dtype == x.dtype and gx.shape == x.shape
        assert gb.dtype == blocks.dtype and gb.shape == blocks.shape
        assert gr.dtype == blocks.dtype
        tol = REL_TOL[dtype]
        assert rel_err(gb, refs[0]) < tol, case.id
        assert rel_err(gx, refs[1]) < tol, case.id
        if rescale is None:
            assert gr.numel() == 0
        else:
            assert gr.shape == (rescale.numel(),)
            assert rel_err(gr, refs[2].reshape(-1)) < tol, case.id


def test_oft_applies_R_transpose():
    """Direct convention check on one 2x2 block: weight rows get Rᵀ."""
    blocks = torch.tensor([[[0.0, 0.3], [0.0, 0.0]]], dtype=torch.float64)
    R = cayley64(blocks, 1.0)[0]
    w = torch.eye(2, dtype=torch.float64)
    out = torch.ops.lycoris.oft_fwd(blocks, w, None, 1.0, False, True)
    torch.testing.assert_close(out, R.T)
    torch.testing.assert_close(R @ R.T, torch.eye(2, dtype=torch.float64))


def test_oft_fp32_blocks_with_half_x_not_rounded():
    """Cayley from fp32 blocks even with a bf16 activation."""
    gen = torch.Generator().manual_seed(3)
    blocks = make((2, 8, 8), torch.float32, gen=gen, scale=0.2)
    x = make((5, 16), torch.float32, gen=gen).to(torch.bfloat16)
    out = torch.ops.lycoris.oft_fwd(blocks, x, None, 1.0, False, False)
    ref = oft_oracle(blocks, x, None, 1.0, False, False)
    # one bf16 rounding of the output only
    assert rel_err(out, ref) < 5e-3
    assert out.dtype == torch.bfloat16


def test_oft_empty_blocks():
    blocks = torch.zeros(0, 3, 3)
    x = torch.zeros(4, 0)
    assert torch.ops.lycoris.oft_fwd(blocks, x, None, 1.0, True, False).shape == (4, 0)
    gx, gb, gr = torch.ops.lycoris.oft_bwd(torch.zeros(4, 0), blocks, x, None, 1.0, True, False)
    assert gb.shape == (0, 3, 3) and gx.shape == (4, 0) and gr.numel() == 0


# ---------------------------------------------------------------- op contract

@pytest.mark.parametrize("requires_grad", [False, True])
def test_oft_opcheck_fp32(requires_grad):
    for case in cases("oft", dtype=torch.float32, requires_grad=requires_grad):
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)


def test_oft_opcheck_half():
    for case in cases("oft", dtype=torch.bfloat16, requires_grad=True)[:4]:
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)
    for case in cases("oft", dtype=torch.float16, requires_grad=True)[-2:]:
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)


# (x shape, K, S, weight, with rescale, cscale, shift): every layout, tiny
GRADCHECK = (
    ((6, 3), 2, 3, True, True, 1.0, True),
    ((4, 6), 2, 3, False, True, 0.7, False),
    ((2, 4, 3), 2, 2, False, False, 1.0, True),
    ((1, 6, 2, 2), 3, 2, False, True, 1.0, True),
)


@pytest.mark.parametrize("spec", GRADCHECK, ids=lambda s: str(s[0]))
def test_oft_gradcheck(spec):
    xs, K, S, weight, with_rs, cscale, shift = spec
    gen = torch.Generator().manual_seed(11)
    blocks = make((K, S, S), torch.float64, gen=gen, scale=0.1, requires_grad=True)
    x = make(xs, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make((K * S,), torch.float64, gen=gen, scale=0.3)).requires_grad_() if with_rs else None
    assert torch.autograd.gradcheck(
        lambda b, xx, r: torch.ops.lycoris.oft_fwd(b, xx, r, cscale, shift, weight), (blocks, x, rescale))


def test_oft_gradcheck_partial_requires_grad():
    gen = torch.Generator().manual_seed(1)
    blocks = make((2, 3, 3), torch.float64, gen=gen, scale=0.2, requires_grad=True)
    x = make((4, 6), torch.float64, gen=gen)
    rescale = (1 + make((6,), torch.float64, gen=gen, scale=0.3))
    y = torch.ops.lycoris.oft_fwd(blocks, x, rescale, 0.5, True, False)
    (g,) = torch.autograd.grad(y.square().sum(), blocks)
    assert g.shape == blocks.shape
    rescale.requires_grad_()
    assert torch.autograd.gradcheck(lambda r: torch.ops.lycoris.oft_fwd(blocks.detach(), x, r, 0.5, True, False),
                                    (rescale,))


def test_oft_double_backward_raises():
    gen = torch.Generator().manual_seed(2)
    blocks = make((2, 3, 3), torch.float64, gen=gen, scale=0.2, requires_grad=True)
    x = make((4, 6), torch.float64, gen=gen, requires_grad=True)
    y = torch.ops.lycoris.oft_fwd(blocks, x, None, 1.0, True, False)
    (g,) = torch.autograd.grad(y.sum(), blocks, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


# ------------------------------------------------------------------ bad input

def _bad_calls(new):
    """(call, argument name expected in the message); ``new(shape, dtype)`` makes a tensor."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    b = lambda: new((3, 5, 5), f32)  # noqa: E731
    fwd, bwd = torch.ops.lycoris.oft_fwd, torch.ops.lycoris.oft_bwd
    return [
        (lambda: fwd(new((3, 5), f32), new((15, 7), f32), None, 1.0, True, True), "blocks"),
        (lambda: fwd(new((3, 5, 4), f32), new((15, 7), f32), None, 1.0, True, True), "blocks"),
        (lambda: fwd(b(), new((15, 7, 2), f32), None, 1.0, True, True), "x"),
        (lambda: fwd(b(), new((14, 7), f32), None, 1.0, True, True), "x"),
        (lambda: fwd(b(), new((7, 14), f32), None, 1.0, True, False), "x"),
        (lambda: fwd(b(), new((2, 14, 3), f32), None, 1.0, True, False), "x"),
        (lambda: fwd(b(), new((15,), f32), None, 1.0, True, False), "x"),
        (lambda: fwd(b(), new((15, 7), f32), new((14,), f32), 1.0, True, True), "rescale"),
        (lambda: fwd(new((3, 5, 5), f16), new((15, 7), bf16), None, 1.0, True, True), "x"),
        (lambda: fwd(b(), new((15, 7), torch.int32), None, 1.0, True, True), "x"),
        (lambda: fwd(new((3, 5, 5), torch.int64), new((15, 7), f32), None, 1.0, True, True), "blocks"),
        (lambda: bwd(new((15, 6), f32), b(), new((15, 7), f32), None, 1.0, True, True), "grad"),
        (lambda: bwd(new((15, 7), f32), b(), new((15, 7), f32), new((16,), f32), 1.0, True, True), "rescale"),
        (lambda: bwd(new((15, 7), f16), b(), new((15, 7), bf16), None, 1.0, True, True), "grad"),
        (lambda: bwd(new((15, 7), f32), new((3, 5), f32), new((15, 7), f32), None, 1.0, True, True), "blocks"),
        (lambda: bwd(new((15, 7), torch.int32), b(), new((15, 7), f32), None, 1.0, True, True), "grad"),
    ]


def test_oft_bad_input_eager():
    for call, name in _bad_calls(lambda s, d: torch.zeros(s, dtype=d)):
        with pytest.raises(ValueError, match=name):
            call()


def test_oft_bad_input_fake():
    with FakeTensorMode():
        for call, name in _bad_calls(lambda s, d: torch.empty(s, dtype=d)):
            with pytest.raises(ValueError, match=name):
                call()


# ------------------------------------------------------------------ functional

def lyco_get_r(blocks, constraint):
    """LyCORIS diag-OFT rotation (plain formula, differentiable through the norm)."""
    S = blocks.shape[-1]
    eye = torch.eye(S, dtype=blocks.dtype)
    q = blocks - blocks.transpose(1, 2)
    normed = q
    if constraint > 0:
        q_norm = torch.norm(q) + 1e-8
        if q_norm > constraint:
            normed = q * constraint / q_norm
    return (eye + normed) @ torch.linalg.inv(eye - normed)


def lyco_merge(blocks, W, rescale, constraint, scale, diff):
    K, S = blocks.shape[0], blocks.shape[1]
    r = lyco_get_r(blocks, constraint)
    _, *shape = W.shape
    w = W.view(K, S, *shape)
    f = r * scale + (1 - scale) * torch.eye(S, dtype=r.dtype)
    out = torch.einsum("k n m, k n ... -> k m ...", f, w).reshape(-1, *shape)
    if rescale is not None:
        out = rescale * out
    if diff:
        out = out - W
    return out


def lyco_bypass(blocks, org_out, rescale, constraint, scale, conv):
    K, S = blocks.shape[0], blocks.shape[1]
    r = lyco_get_r(blocks, constraint)
    y = org_out.transpose(1, -1) if conv else org_out
    *shape, _ = y.shape
    yk = y.reshape(*shape, K, S)
    f = r * scale + (1 - scale) * torch.eye(S, dtype=r.dtype)
    out = torch.einsum("k n m, ... k n -> ... k m", f, yk).reshape(*shape, K * S)
    if rescale is not None:
        out = out * rescale.reshape(-1)
    out = out - y
    return out.transpose(1, -1) if conv else out


def _grads(out, ins, g):
    return torch.autograd.grad(out, ins, g)


@pytest.mark.parametrize("constraint", [0.0, 0.5])
@pytest.mark.parametrize("multiplier", [1.0, 0.6])
@pytest.mark.parametrize("conv_weight", [False, True])
def test_functional_merge(constraint, multiplier, conv_weight):
    gen = torch.Generator().manual_seed(4)
    K, S = 3, 4
    wshape = (K * S, 3, 3, 2) if conv_weight else (K * S, 7)
    rshape = (K * S,) + (1,) * (len(wshape) - 1)
    blocks = make((K, S, S), torch.float64, gen=gen, scale=0.3, requires_grad=True)
    W = make(wshape, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make(rshape, torch.float64, gen=gen, scale=0.3)).requires_grad_()
    out = F_oft.merge(blocks, W, rescale, constraint=constraint, multiplier=multiplier)
    ref = lyco_merge(blocks, W, rescale, constraint, multiplier, True)
    assert out.shape == W.shape and out.dtype == W.dtype
    torch.testing.assert_close(out, ref)
    g = make(wshape, torch.float64, gen=gen)
    for a, e in zip(_grads(out, (blocks, W, rescale), g), _grads(ref, (blocks, W, rescale), g)):
        torch.testing.assert_close(a, e)  # includes d/dν when the constraint is active
    merged = F_oft.merge(blocks, W, rescale, constraint=constraint, multiplier=multiplier, diff=False)
    torch.testing.assert_close(merged, ref + W)


@pytest.mark.parametrize("constraint", [0.0, 0.5])
@pytest.mark.parametrize("multiplier", [1.0, 0.6])
@pytest.mark.parametrize("layout", ["linear2d", "linear3d", "conv1d", "conv2d"])
def test_functional_bypass(constraint, multiplier, layout):
    gen = torch.Generator().manual_seed(5)
    K, S = 2, 5
    C = K * S
    shape = {"linear2d": (7, C), "linear3d": (2, 3, C), "conv1d": (2, C, 5), "conv2d": (2, C, 3, 4)}[layout]
    conv = layout.startswith("conv")
    blocks = make((K, S, S), torch.float64, gen=gen, scale=0.3, requires_grad=True)
    y = make(shape, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make((C, 1), torch.float64, gen=gen, scale=0.3)).requires_grad_()
    out = F_oft.bypass(blocks, y, rescale, constraint=constraint, multiplier=multiplier, conv=conv)
    ref = lyco_bypass(blocks, y, rescale, constraint, multiplier, conv)
    assert out.shape == y.shape
    torch.testing.assert_close(out, ref)
    g = make(shape, torch.float64, gen=gen)
    for a, e in zip(_grads(out, (blocks, y, rescale), g), _grads(ref, (blocks, y, rescale), g)):
        torch.testing.assert_close(a, e)


def test_functional_half_activation_fp32_blocks():
    gen = torch.Generator().manual_seed(6)
    blocks = make((2, 4, 4), torch.float32, gen=gen, scale=0.3)
    y = make((9, 8), torch.float32, gen=gen).to(torch.bfloat16)
    rescale = 1 + make((8,), torch.float32, gen=gen, scale=0.3)
    out = F_oft.bypass(blocks, y, rescale, constraint=0.4)
    ref = lyco_bypass(blocks.double(), y.double(), rescale.double(), 0.4, 1.0, False)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]


def test_constraint_scale_float_path():
    gen = torch.Generator().manual_seed(7)
    blocks = make((3, 4, 4), torch.float64, gen=gen, scale=0.3)
    W = make((12, 5), torch.float64, gen=gen)
    c = F_oft.constraint_scale(blocks, 0.5)
    assert isinstance(c, float) and 0 < c < 1
    assert F_oft.constraint_scale(blocks, 0.0) == 1.0
    assert F_oft.constraint_scale(blocks, 1e6) == 1.0
    torch.testing.assert_close(F_oft.merge(blocks, W, cscale=c), lyco_merge(blocks, W, None, 0.5, 1.0, True))
    with pytest.raises(ValueError, match="constraint"):
        F_oft.merge(blocks, W, constraint=0.5, cscale=c)
