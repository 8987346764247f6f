"""BOFT (OPS.md §2.6, §3.6): boft_fwd / boft_bwd against an fp64 oracle that
builds the full C×C orthogonal matrix explicitly: the product over stages of
``Pᵢᵀ·blockdiag(F_{i,β})·Pᵢ`` with permutation matrices Pᵢ written from the
§2.6.1 formula for π_i (plain Python integers), then one matmul along the axis."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401
from lycoris_ops.functional import boft as F_boft
from lycoris_ops.reference.boft import stage_permutation
from lycoris_ops.testing import REL_TOL, cases, make, rel_err

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------ fp64 oracle

def pi(i, s, C, p):
    k = 2 ** i * s // 2
    return (p // (2 * k)) * 2 * k + (p % 2) * k + (p % (2 * k)) // 2


def perm_matrix(i, s, C):
    P = torch.zeros(C, C, dtype=torch.float64)
    for p in range(C):
        P[p, pi(i, s, C, p)] = 1.0  # (P·u)[p] = u[π_i(p)]
    return P


def cayley64(blocks, cscale):
    b = blocks.double()
    q = cscale * (b - b.transpose(-1, -2))
    eye = torch.eye(b.shape[-1], dtype=torch.float64)
    return (eye + q) @ torch.linalg.inv(eye - q)


def boft_matrix(blocks, cscale, scale):
    m, nb, s, _ = blocks.shape
    C = nb * s
    F = scale * cayley64(blocks, cscale) + (1 - scale) * torch.eye(s, dtype=torch.float64)
    M = torch.eye(C, dtype=torch.float64)
    for i in range(m):
        P = perm_matrix(i, s, C)
        M = P.T @ torch.block_diag(*F[i]) @ P @ M
    return M


def boft_oracle(blocks, x, axis, cscale, scale, rescale, diff):
    C = blocks.shape[1] * blocks.shape[2]
    M = boft_matrix(blocks, cscale, scale)
    if rescale is not None:
        M = torch.diag(rescale.double().reshape(-1)) @ M
    if diff:
        M = M - torch.eye(C, dtype=torch.float64)
    xm = x.double().movedim(axis, -1)
    return (xm @ M.T).movedim(-1, axis)


# ---------------------------------------------------------------- permutation

def test_stage_permutation_matches_formula():
    for s in (2, 4, 6):
        for nb in (1, 2, 4, 8):
            C = nb * s
            m_max = int(math.log2(nb)) + 1 if nb & (nb - 1) == 0 else 1
            for i in range(m_max):
                perm, inv = stage_permutation(i, s, C)
                assert perm.tolist() == [pi(i, s, C, p) for p in range(C)]
                assert sorted(perm.tolist()) == list(range(C))
                assert inv[perm].tolist() == list(range(C))
    # stage 0 interleaves: position 2j+h of a block is channel h*s/2 + j of its group
    perm, _ = stage_permutation(0, 6, 12)
    for blk in range(2):
        for j in range(3):
            for h in range(2):
                assert perm[blk * 6 + 2 * j + h] == blk * 6 + h * 3 + j


def test_orthogonal_and_applies_R():
    gen = torch.Generator().manual_seed(0)
    blocks = make((3, 4, 2, 2), torch.float64, gen=gen, scale=0.3)
    M = boft_matrix(blocks, 1.0, 1.0)
    torch.testing.assert_close(M @ M.T, torch.eye(8, dtype=torch.float64))
    # one stage, one block: BOFT applies R itself to the (interleaved) channels
    b1 = make((1, 1, 2, 2), torch.float64, gen=gen, scale=0.3)
    R = cayley64(b1, 1.0)[0, 0]
    out = torch.ops.lycoris.boft_fwd(b1, torch.eye(2, dtype=torch.float64), 0, 1.0, 1.0, None, False)
    torch.testing.assert_close(out, R)


# ---------------------------------------------------------------- parity tests

@pytest.mark.parametrize("dtype", DTYPES)
def test_boft_fwd_parity(dtype):
    n = 0
    for case in cases("boft", dtype=dtype):
        if case.op != "boft_fwd":
            continue
        blocks, x, axis, cscale, scale, rescale, diff = case.args
        out = case()
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        ref = boft_oracle(blocks, x, axis, cscale, scale, rescale, diff)
        assert rel_err(out, ref) < REL_TOL[dtype], case.id
        n += 1
    assert n >= 9


@pytest.mark.parametrize("dtype", DTYPES)
def test_boft_bwd_parity(dtype):
    for case in cases("boft", dtype=dtype):
        if case.op != "boft_bwd":
            continue
        grad, blocks, x, axis, cscale, scale = case.args
        gx, gb = case()
        b64 = blocks.detach().double().requires_grad_()
        x64 = x.detach().double().requires_grad_()
        out = boft_oracle(b64, x64, axis, cscale, scale, None, False)
        rb, rx = torch.autograd.grad(out, (b64, x64), grad.double())
        assert gx.dtype == x.dtype and gx.shape == x.shape and gx.is_contiguous()
        assert gb.dtype == blocks.dtype and gb.shape == blocks.shape
        assert rel_err(gb, rb) < REL_TOL[dtype], case.id
        assert rel_err(gx, rx) < REL_TOL[dtype], case.id


@pytest.mark.parametrize("dtype", DTYPES)
def test_boft_autograd_rescale_diff(dtype):
    """The registered backward (rescale + diff around boft_bwd, §3.6) vs the oracle."""
    for case in cases("boft", dtype=dtype, requires_grad=True):
        if case.op != "boft_fwd" or case.args[1].numel() == 0:
            continue
        blocks, x, axis, cscale, scale, rescale, diff = case.args
        out = case()
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ins = [blocks, x] + ([rescale] if rescale is not None else [])
        grads = torch.autograd.grad(out, ins, g.to(out.dtype))
        ins64 = [t.detach().double().requires_grad_() for t in ins]
        ref = boft_oracle(ins64[0], ins64[1], axis, cscale, scale, ins64[2] if rescale is not None else None, diff)
        refs = torch.autograd.grad(ref, ins64, g)
        for a, e, t in zip(grads, refs, ins):
            assert a.dtype == t.dtype and a.shape == t.shape
            assert rel_err(a, e) < REL_TOL[dtype], case.id


# ---------------------------------------------------------------- op contract

@pytest.mark.parametrize("requires_grad", [False, True])
def test_boft_opcheck_fp32(requires_grad):
    for case in cases("boft", dtype=torch.float32, requires_grad=requires_grad):
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)


def test_boft_opcheck_half():
    for case in cases("boft", dtype=torch.bfloat16, requires_grad=True)[:4]:
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)
    for case in cases("boft", dtype=torch.float16, requires_grad=True)[-2:]:
        torch.library.opcheck(getattr(torch.ops.lycoris, case.op), case.args)


# (m, nb, s, x shape, axis, scale, with rescale, diff): m = 1 … log2(nb)+1, every axis
GRADCHECK = (
    (1, 4, 2, (8, 2), 0, 1.0, True, True),
    (2, 4, 2, (3, 8), -1, 0.7, False, True),
    (3, 4, 2, (2, 8, 2), 1, 1.0, True, False),
    (1, 2, 4, (2, 2, 8), 2, 1.3, True, True),
    (2, 2, 4, (1, 8, 2, 1), 1, 1.0, True, True),
    (4, 8, 2, (16, 1), 0, 1.0, False, False),
)


@pytest.mark.parametrize("spec", GRADCHECK, ids=lambda s: f"m{s[0]}nb{s[1]}s{s[2]}ax{s[4]}")
def test_boft_gradcheck(spec):
    m, nb, s, xs, axis, scale, with_rs, diff = spec
    gen = torch.Generator().manual_seed(12)
    blocks = make((m, nb, s, s), torch.float64, gen=gen, scale=0.1, requires_grad=True)
    x = make(xs, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make((nb * s,), torch.float64, gen=gen, scale=0.3)).requires_grad_() if with_rs else None
    assert torch.autograd.gradcheck(
        lambda b, xx, r: torch.ops.lycoris.boft_fwd(b, xx, axis, 0.8, scale, r, diff), (blocks, x, rescale))


def test_boft_double_backward_raises():
    gen = torch.Generator().manual_seed(2)
    blocks = make((2, 2, 2, 2), torch.float64, gen=gen, scale=0.2, requires_grad=True)
    x = make((3, 4), torch.float64, gen=gen, requires_grad=True)
    y = torch.ops.lycoris.boft_fwd(blocks, x, -1, 1.0, 1.0, None, True)
    (g,) = torch.autograd.grad(y.sum(), blocks, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


# ------------------------------------------------------------------ bad input

def _bad_calls(new):
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    b = lambda: new((2, 4, 2, 2), f32)  # noqa: E731
    fwd, bwd = torch.ops.lycoris.boft_fwd, torch.ops.lycoris.boft_bwd
    return [
        (lambda: fwd(new((2, 4, 2), f32), new((8, 3), f32), 0, 1.0, 1.0, None, True), "blocks"),
        (lambda: fwd(new((2, 4, 2, 3), f32), new((8, 3), f32), 0, 1.0, 1.0, None, True), "blocks"),
        (lambda: fwd(new((1, 3, 3, 3), f32), new((9, 3), f32), 0, 1.0, 1.0, None, True), "blocks"),  # s odd
        (lambda: fwd(new((3, 3, 2, 2), f32), new((6, 3), f32), 0, 1.0, 1.0, None, True), "blocks"),  # 2^(m-1)s ∤ C
        (lambda: fwd(new((0, 4, 2, 2), f32), new((8, 3), f32), 0, 1.0, 1.0, None, True), "blocks"),  # m = 0
        (lambda: fwd(b(), new((7, 3), f32), 0, 1.0, 1.0, None, True), "x"),
        (lambda: fwd(b(), new((3, 8), f32), 0, 1.0, 1.0, None, True), "x"),
        (lambda: fwd(b(), new((3, 8), f32), 2, 1.0, 1.0, None, True), "axis"),
        (lambda: fwd(b(), new((3, 8), f32), -3, 1.0, 1.0, None, True), "axis"),
        (lambda: fwd(b(), new((2, 8, 3), f32), 1, 1.0, 1.0, new((7,), f32), True), "rescale"),
        (lambda: fwd(new((2, 4, 2, 2), f16), new((3, 8), bf16), -1, 1.0, 1.0, None, True), "x"),
        (lambda: fwd(b(), new((3, 8), torch.int32), -1, 1.0, 1.0, None, True), "x"),
        (lambda: fwd(b(), new((3, 8), f32), -1, 1.0, 1.0, new((8,), torch.int64), True), "rescale"),
        (lambda: bwd(new((3, 7), f32), b(), new((3, 8), f32), -1, 1.0, 1.0), "grad"),
        (lambda: bwd(new((3, 8), f32), b(), new((3, 8), f32), 5, 1.0, 1.0), "axis"),
        (lambda: bwd(new((3, 8), f16), b(), new((3, 8), bf16), -1, 1.0, 1.0), "grad"),
        (lambda: bwd(new((3, 8), f32), new((2, 4, 3, 3), f32), new((3, 8), f32), -1, 1.0, 1.0), "blocks"),
        (lambda: bwd(new((3, 8), torch.int32), b(), new((3, 8), f32), -1, 1.0, 1.0), "grad"),
    ]


def test_boft_bad_input_eager():
    for call, name in _bad_calls(lambda s, d: torch.zeros(s, dtype=d)):
        with pytest.raises(ValueError, match=name):
            call()


def test_boft_bad_input_fake():
    with FakeTensorMode():
        for call, name in _bad_calls(lambda s, d: torch.empty(s, dtype=d)):
            with pytest.raises(ValueError, match=name):
                call()


# ------------------------------------------------------------------ functional

def lyco_get_r(blocks, constraint):
    """LyCORIS Cayley over all (m, nb) blocks, constraint on the joint norm."""
    s = blocks.shape[-1]
    eye = torch.eye(s, dtype=blocks.dtype)
    q = blocks - blocks.transpose(-1, -2)
    normed = q
    if constraint > 0:
        q_norm = torch.norm(q) + 1e-8
        if q_norm > constraint:
            normed = q * constraint / q_norm
    return (eye + normed) @ torch.linalg.inv(eye - normed)


def lyco_butterfly(blocks, inp, constraint, scale):
    """LyCORIS-style reshape formulation on channels-first ``inp`` (C, ...)."""
    m, nb, s, _ = blocks.shape
    r = lyco_get_r(blocks, constraint)
    eye = torch.eye(s, dtype=r.dtype)
    for i in range(m):
        bi = r[i]
        k = 2 ** i * (s // 2)
        if scale != 1:
            bi = bi * scale + (1 - scale) * eye
        inp = inp.unflatten(0, (-1, 2, k)).transpose(1, 2).flatten(0, 2).unflatten(0, (-1, s))
        inp = torch.einsum("b i j, b j ... -> b i ...", bi, inp)
        inp = inp.flatten(0, 1).unflatten(0, (-1, k, 2)).transpose(1, 2).flatten(0, 2)
    return inp


def lyco_merge(blocks, W, rescale, constraint, scale, diff):
    out = lyco_butterfly(blocks, W, constraint, scale)
    if rescale is not None:
        out = out * rescale
    return out - W if diff else out


def lyco_bypass(blocks, y, rescale, constraint, scale, conv):
    axis = 1 if conv else -1
    out = lyco_butterfly(blocks, y.movedim(axis, 0), constraint, scale)
    if rescale is not None:
        out = out * rescale.reshape((-1,) + (1,) * (out.dim() - 1))
    return out.movedim(0, axis) - y


@pytest.mark.parametrize("constraint", [0.0, 0.5])
@pytest.mark.parametrize("multiplier", [1.0, 0.6])
@pytest.mark.parametrize("conv_weight", [False, True])
def test_functional_merge(constraint, multiplier, conv_weight):
    gen = torch.Generator().manual_seed(4)
    m, nb, s = 3, 4, 2
    C = nb * s
    wshape = (C, 3, 3, 2) if conv_weight else (C, 7)
    rshape = (C,) + (1,) * (len(wshape) - 1)
    blocks = make((m, nb, s, s), torch.float64, gen=gen, scale=0.3, requires_grad=True)
    W = make(wshape, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make(rshape, torch.float64, gen=gen, scale=0.3)).requires_grad_()
    out = F_boft.merge(blocks, W, rescale, constraint=constraint, multiplier=multiplier)
    ref = lyco_merge(blocks, W, rescale, constraint, multiplier, True)
    assert out.shape == W.shape
    torch.testing.assert_close(out, ref)
    g = make(wshape, torch.float64, gen=gen)
    ins = (blocks, W, rescale)
    for a, e in zip(torch.autograd.grad(out, ins, g), torch.autograd.grad(ref, ins, g)):
        torch.testing.assert_close(a, e)  # includes d/dν when the constraint is active
    torch.testing.assert_close(F_boft.merge(blocks, W, rescale, constraint=constraint, multiplier=multiplier,
                                            diff=False), ref + W)


@pytest.mark.parametrize("constraint", [0.0, 0.5])
@pytest.mark.parametrize("layout", ["linear2d", "linear3d", "conv1d", "conv2d"])
def test_functional_bypass(constraint, layout):
    gen = torch.Generator().manual_seed(5)
    m, nb, s = 2, 2, 6
    C = nb * s
    shape = {"linear2d": (7, C), "linear3d": (2, 3, C), "conv1d": (2, C, 5), "conv2d": (2, C, 3, 4)}[layout]
    conv = layout.startswith("conv")
    blocks = make((m, nb, s, s), torch.float64, gen=gen, scale=0.3, requires_grad=True)
    y = make(shape, torch.float64, gen=gen, requires_grad=True)
    rescale = (1 + make((C, 1), torch.float64, gen=gen, scale=0.3)).requires_grad_()
    out = F_boft.bypass(blocks, y, rescale, constraint=constraint, multiplier=0.8, conv=conv)
    ref = lyco_bypass(blocks, y, rescale, constraint, 0.8, conv)
    assert out.shape == y.shape
    torch.testing.assert_close(out, ref)
    g = make(shape, torch.float64, gen=gen)
    ins = (blocks, y, rescale)
    for a, e in zip(torch.autograd.grad(out, ins, g), torch.autograd.grad(ref, ins, g)):
        torch.testing.assert_close(a, e)


def test_functional_dtypes():
    gen = torch.Generator().manual_seed(6)
    blocks = make((2, 4, 2, 2), torch.float32, gen=gen, scale=0.3)
    y = make((9, 8), torch.float32, gen=gen).to(torch.bfloat16)
    out = F_boft.bypass(blocks, y, None, constraint=0.4)
    ref = lyco_bypass(blocks.double(), y.double(), None, 0.4, 1.0, False)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]
    # merge: W cast to the blocks' dtype, ΔW in the blocks' dtype (§3.6)
    W = make((8, 5), torch.float32, gen=gen).to(torch.bfloat16)
    dW = F_boft.merge(blocks, W)
    assert dW.dtype == torch.float32
    assert rel_err(dW, lyco_merge(blocks.double(), W.double(), None, 0.0, 1.0, True)) < REL_TOL[torch.float32]
    c = F_boft.constraint_scale(blocks, 0.4)
    torch.testing.assert_close(F_boft.bypass(blocks, y, None, cscale=c), out)


@pytest.mark.parametrize("m,nb,s", [(3, 4, 6), (7, 64, 48), (1, 2, 2), (2, 2, 4)], ids=str)
def test_stage_shuffles_are_the_stage_permutations(m, nb, s):
    """The bodies move channels into each stage's blocks by reshape/transpose
    (``_to_blocks`` / ``_from_blocks``): the same elements as gathering by ``stage_permutation``
    and its inverse, every stage, channel-first, channels-last and (N, C, spatial) views."""
    from lycoris_ops.reference import boft as B
    C = nb * s
    for pre, post in [(5, 1), (1, 7), (3, 2)]:
        u = torch.randn(pre, C, post)
        w = torch.randn(pre, nb, s, post)
        for i in range(m):
            perm, inv = B.stage_permutation(i, s, C, u.device)
            assert torch.equal(B._to_blocks(u, i, s), u.index_select(1, perm).reshape(pre, nb, s, post))
            assert torch.equal(B._from_blocks(w, i), w.reshape(pre, C, post).index_select(1, inv))
