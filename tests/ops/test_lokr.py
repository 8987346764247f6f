"""LoKr ops (OPS.md §2.3) and functional entry points (§3.3).

The oracle is independent of the eager bodies: explicit ``torch.kron`` in fp64
(the bypass multiplies x by the materialized Kronecker product), and the
backward ops are compared with ``torch.autograd`` gradients of that oracle.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops  # noqa: F401
from lycoris_ops.functional import lokr as FL
from lycoris_ops.reference import lokr as lokr_ops
from lycoris_ops.testing import REL_TOL, rel_err
from lycoris_ops.testing import cases as all_cases

lycoris = torch.ops.lycoris
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FWD = ("lokr_full_merge_fwd", "lokr_merge_fwd", "lokr_bypass_fwd")
OPS = ("lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
       "lokr_bypass_fwd", "lokr_bypass_bwd")


def _cases(dtype=torch.float32, requires_grad=False):
    return all_cases("lokr", dtype=dtype, requires_grad=requires_grad)


def test_every_op_has_cases():
    assert {c.op for c in _cases()} == set(OPS)


# ---------------------------------------------------------------------------
# fp64 oracle (explicit Kronecker product)


def _d(t, compute=None):
    """fp64 copy of t, rounded to the compute dtype first (what the op does to matrix operands)."""
    if t is None:
        return None
    t = t.detach()
    if compute is not None:
        t = t.to(compute)
    return t.double()


def _compute(*ts):
    dts = {t.dtype for t in ts if t is not None}
    for h in HALF:
        if h in dts:
            return h
    return torch.float64 if dts == {torch.float64} else torch.float32


def _kron_fwd(w1, w2, base, gamma):
    y = gamma * torch.kron(w1, w2)
    return y if base is None else y + base


def oracle(op, args):
    """Expected outputs (fp64) of one call."""
    if op == "lokr_full_merge_fwd":
        w1, w2, base, gamma = args[:4]
        cd = _compute(w1, w2)
        return (_kron_fwd(_d(w1, cd), _d(w2, cd), _d(base), gamma),)
    if op == "lokr_merge_fwd":
        w1a, w1b, w2a, w2b, shape, base, gamma = args[:7]
        cd = _compute(w1a, w1b, w2a, w2b)
        w1 = _d(w1a, cd) if w1b is None else _d(w1a, cd) @ _d(w1b, cd)
        w2 = _d(w2a, cd) if w2b is None else _d(w2a, cd) @ _d(w2b, cd)
        return (_kron_fwd(w1, w2, _d(base), gamma),)
    if op == "lokr_bypass_fwd":
        x, w1, w2, gamma = args[:4]
        base = args[4] if len(args) > 4 else None
        cd = _compute(x, w1, w2)
        y = gamma * _d(x, cd) @ torch.kron(_d(w1, cd), _d(w2, cd)).T
        return (y if base is None else y + _d(base),)
    # backward ops: autograd of the forward oracle
    grad = args[0]
    if op == "lokr_full_merge_bwd":
        _, w1, w2, gamma = args
        cd = _compute(w1, w2)
        leaves = [_d(w1, cd).requires_grad_(), _d(w2, cd).requires_grad_()]
        y = _kron_fwd(*leaves, None, gamma)
    elif op == "lokr_merge_bwd":
        _, w1a, w1b, w2a, w2b, shape, gamma = args
        cd = _compute(w1a, w1b, w2a, w2b)
        leaves = [None if t is None else _d(t, cd).requires_grad_() for t in (w1a, w1b, w2a, w2b)]
        l1a, l1b, l2a, l2b = leaves
        y = _kron_fwd(l1a if l1b is None else l1a @ l1b, l2a if l2b is None else l2a @ l2b, None, gamma)
    elif op == "lokr_bypass_bwd":
        _, x, w1, w2, gamma = args
        cd = _compute(x, w1, w2)
        leaves = [_d(t, cd).requires_grad_() for t in (x, w1, w2)]
        y = gamma * leaves[0] @ torch.kron(leaves[1], leaves[2]).T
    else:
        raise AssertionError(op)
    present = [t for t in leaves if t is not None]
    gs = iter(torch.autograd.grad(y, present, _d(grad, cd)))
    return tuple(None if t is None else next(gs) for t in leaves)


def expected_dtypes(op, args):
    if op == "lokr_full_merge_fwd":
        return ((args[4] if len(args) > 4 and args[4] is not None else args[1].dtype),)
    if op == "lokr_merge_fwd":
        return ((args[7] if len(args) > 7 and args[7] is not None else args[2].dtype),)
    if op == "lokr_bypass_fwd":
        base = args[4] if len(args) > 4 else None
        return ((args[0] if base is None else base).dtype,)
    if op == "lokr_merge_bwd":
        w1a, w1b, w2a, w2b = args[1:5]
        return (w1a.dtype, (w1b if w1b is not None else w1a).dtype, w2a.dtype, (w2b if w2b is not None else w2a).dtype)
    return tuple(t.dtype for t in args[1:] if isinstance(t, torch.Tensor))


def _check_outputs(op, args, out, dtype):
    outs = out if isinstance(out, tuple) else (out,)
    exp = oracle(op, args)
    assert len(outs) == len(exp)
    for o, e, dt, k in zip(outs, exp, expected_dtypes(op, args), range(len(outs))):
        assert o.dtype == dt, (op, k, o.dtype, dt)
        assert o.is_contiguous()
        if e is None:  # absent b factor of lokr_merge_bwd
            assert o.numel() == 0 and tuple(o.shape) == (0,)
            continue
        assert o.shape == e.shape, (op, k, o.shape, e.shape)
        err = rel_err(o, e)
        assert err <= max(REL_TOL[dtype], REL_TOL[o.dtype]), (op, k, err)
    for o in outs:  # fresh outputs: no aliasing with an input
        for a in args:
            if isinstance(a, torch.Tensor) and a.numel() and o.numel():
                assert o.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------
# parity


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
def test_parity(dtype):
    for case in _cases(dtype):
        with torch.no_grad():
            out = case()
        _check_outputs(case.op, case.args, out, dtype)


def test_kron_index_convention():
    # kron(w1, w2)[u*c + i, v*d + j] = w1[u, v] * w2[i, j], checked element by element
    w1 = torch.arange(6.0).reshape(2, 3) + 1
    w2 = torch.arange(8.0).reshape(4, 2) * 10 + 1
    y = lycoris.lokr_full_merge_fwd(w1, w2, None, 1.0)
    for u in range(2):
        for v in range(3):
            for i in range(4):
                for j in range(2):
                    assert y[u * 4 + i, v * 2 + j] == w1[u, v] * w2[i, j]
    x = torch.randn(5, 6, dtype=torch.float64)
    yb = lycoris.lokr_bypass_fwd(x, w1.double(), w2.double(), 1.0)
    # per token: vec(w1 · reshape(x_t, (b, d)) · w2ᵀ)
    for t in range(5):
        ref = (w1.double() @ x[t].reshape(3, 2) @ w2.double().T).reshape(-1)
        assert torch.allclose(yb[t], ref)


@pytest.mark.parametrize("half", HALF, ids=str)
def test_mixed_precision_promotion(half):
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(3, 4, generator=g)
    w2 = torch.randn(5, 2, generator=g).to(half)
    x = torch.randn(7, 8, generator=g)
    # fp32 w1 with 16-bit w2: compute in the 16-bit type, default out dtype is w2's
    y = lycoris.lokr_full_merge_fwd(w1, w2, None, 0.5)
    assert y.dtype == half
    assert rel_err(y, oracle("lokr_full_merge_fwd", (w1, w2, None, 0.5))[0]) <= REL_TOL[half]
    # fp32 x, 16-bit factor: output in x's dtype, operands rounded to 16 bits
    yb = lycoris.lokr_bypass_fwd(x, w1, w2, 0.5)
    assert yb.dtype == torch.float32
    assert rel_err(yb, oracle("lokr_bypass_fwd", (x, w1, w2, 0.5))[0]) <= REL_TOL[half]
    # fp32 base with 16-bit factors: result in base's dtype
    base = torch.randn(15, 8, generator=g)
    ym = lycoris.lokr_merge_fwd(w1, None, w2, None, [3, 4, 5, 2], base, 0.5, torch.float32)
    assert ym.dtype == torch.float32
    assert rel_err(ym, oracle("lokr_merge_fwd", (w1, None, w2, None, [3, 4, 5, 2], base, 0.5))[0]) <= REL_TOL[half]
    # bwd: every gradient in its own input's dtype
    G = torch.randn(7, 15, generator=g).to(half)
    gx, g1, g2 = lycoris.lokr_bypass_bwd(G, x, w1, w2, 0.5)
    assert (gx.dtype, g1.dtype, g2.dtype) == (torch.float32, torch.float32, half)
    for o, e in zip((gx, g1, g2), oracle("lokr_bypass_bwd", (G, x, w1, w2, 0.5))):
        assert rel_err(o, e) <= REL_TOL[half]


def test_merge_fwd_all_factor_combinations_agree_with_full_merge():
    g = torch.Generator().manual_seed(2)
    a, b, c, d, r = 4, 6, 5, 3, 2
    w1a, w1b = torch.randn(a, r, generator=g), torch.randn(r, b, generator=g)
    w2a, w2b = torch.randn(c, r, generator=g), torch.randn(r, d, generator=g)
    full = lycoris.lokr_full_merge_fwd(w1a @ w1b, w2a @ w2b, None, 0.3)
    for f1 in (True, False):
        for f2 in (True, False):
            args = ((w1a, w1b) if f1 else (w1a @ w1b, None)) + ((w2a, w2b) if f2 else (w2a @ w2b, None))
            y = lycoris.lokr_merge_fwd(*args, [a, b, c, d], None, 0.3)
            assert rel_err(y, full) < 1e-6


def test_zero_sizes():
    # T = 0 bypass
    x = torch.randn(0, 6)
    w1, w2 = torch.randn(2, 3), torch.randn(4, 2)
    y = lycoris.lokr_bypass_fwd(x, w1, w2, 1.0)
    assert y.shape == (0, 8)
    gx, g1, g2 = lycoris.lokr_bypass_bwd(torch.randn(0, 8), x, w1, w2, 1.0)
    assert gx.shape == (0, 6) and torch.all(g1 == 0) and torch.all(g2 == 0)
    # rank 0: a zero weight
    y = lycoris.lokr_merge_fwd(torch.randn(2, 0), torch.randn(0, 3), w2, None, [2, 3, 4, 2], None, 1.0)
    assert y.shape == (8, 6) and torch.all(y == 0)
    g = lycoris.lokr_merge_bwd(torch.randn(8, 6), torch.randn(2, 0), torch.randn(0, 3), w2, None, [2, 3, 4, 2], 1.0)
    assert [tuple(t.shape) for t in g] == [(2, 0), (0, 3), (4, 2), (0,)]
    # an empty side
    y = lycoris.lokr_full_merge_fwd(torch.randn(0, 3), w2, None, 1.0)
    assert y.shape == (0, 6)


# ---------------------------------------------------------------------------
# opcheck / gradcheck / double backward


def _opcheck_cases():
    out = []
    for rg in (False, True):
        for c in _cases(torch.float32, requires_grad=rg):
            if rg and c.op not in FWD:
                continue  # bwd cases take no requires_grad: already checked
            out.append(pytest.param(c, id=f"fp32-rg{int(rg)}-{c.id}"))
    seen = set()
    for dt in HALF:  # bf16: one case per op; fp16: one base-folding case per forward op
        for c in _cases(dt, requires_grad=True):
            if dt == torch.float16 and (c.op not in FWD or "base" not in c.id):
                continue
            if (c.op, dt) not in seen:
                seen.add((c.op, dt))
                out.append(pytest.param(c, id=f"{dt}-{c.id}".replace("torch.", "")))
    return out


@pytest.mark.parametrize("case", _opcheck_cases())
def test_opcheck(case):
    torch.library.opcheck(getattr(lycoris, case.op), case.args)


def _gradcheck(op, args, fast):
    args = list(args)
    idx = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
    fn = getattr(lycoris, op)

    def f(*ts):
        full = list(args)
        for k, t in zip(idx, ts):
            full[k] = t
        return fn(*full)

    assert torch.autograd.gradcheck(f, tuple(args[k] for k in idx), fast_mode=fast)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in _cases() if c.op in FWD])
def test_gradcheck_fast(case):
    """Every forward case (fp64, random-projection gradcheck through the registered autograd)."""
    c = case.to(dtype=torch.float64, requires_grad=True)
    args = list(c.args)
    if c.op == "lokr_full_merge_fwd" and len(args) > 4:
        args[4] = None  # out_dtype
    if c.op == "lokr_merge_fwd" and len(args) > 7:
        args[7] = None
    _gradcheck(c.op, args, fast=True)


def _tiny_gradcheck_cases():
    g = torch.Generator().manual_seed(11)

    def r(*s, nc=False):
        t = torch.randn(s[:-1] + (2 * s[-1],) if nc else s, generator=g, dtype=torch.float64)
        return (t[..., ::2] if nc else t).requires_grad_()

    return [
        pytest.param("lokr_full_merge_fwd", (r(2, 3), r(3, 2, nc=True), r(6, 6), 0.7), id="full"),
        pytest.param("lokr_merge_fwd", (r(2, 1), r(1, 3), r(3, 2), r(2, 2), [2, 3, 3, 2], r(6, 6), -0.6),
                     id="merge-both"),
        pytest.param("lokr_merge_fwd", (r(2, 3), None, r(3, 1), r(1, 2), [2, 3, 3, 2], None, 0.6), id="merge-side2"),
        pytest.param("lokr_merge_fwd", (r(2, 1), r(1, 3), r(3, 2), None, [2, 3, 3, 2], None, 0.6), id="merge-side1"),
        pytest.param("lokr_bypass_fwd", (r(3, 6, nc=True), r(2, 3), r(3, 2), 0.8, r(3, 6)), id="bypass"),
    ]


@pytest.mark.parametrize("op,args", _tiny_gradcheck_cases())
def test_gradcheck_full(op, args):
    """Full (non-fast) gradcheck in fp64 on tiny sizes, one per forward op and merge layout."""
    _gradcheck(op, args, fast=False)


def test_merge_fwd_backward_maps_absent_factors_to_none():
    w1a = torch.randn(3, 4, requires_grad=True)
    w2a = torch.randn(2, 1, requires_grad=True)
    w2b = torch.randn(1, 5, requires_grad=True)
    y = lycoris.lokr_merge_fwd(w1a, None, w2a, w2b, [3, 4, 2, 5], None, 1.0)
    y.sum().backward()
    assert w1a.grad.shape == (3, 4) and w2a.grad.shape == (2, 1) and w2b.grad.shape == (1, 5)


def test_base_gradient_is_grad():
    for c in _cases(torch.float32, requires_grad=True):
        base = {"lokr_full_merge_fwd": 2, "lokr_merge_fwd": 5, "lokr_bypass_fwd": 4}.get(c.op)
        if base is None or len(c.args) <= base or c.args[base] is None:
            continue
        y = c()
        G = torch.randn_like(y)
        (gb,) = torch.autograd.grad(y, c.args[base], G)
        assert torch.equal(gb, G)


@pytest.mark.parametrize("op", FWD)
def test_double_backward_raises(op):
    c = next(c for c in _cases(torch.float64, requires_grad=True) if c.op == op)
    y = c()
    leaves = [t for t in c.tensors() if t.requires_grad]
    grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sum(g.sum() for g in grads), leaves)


# ---------------------------------------------------------------------------
# bad inputs: same ValueError from the CPU kernel and the fake


def _bad_inputs():
    r = torch.randn
    h, bf = torch.float16, torch.bfloat16
    i32 = torch.int32
    w1, w2 = r(3, 4), r(5, 2)
    K = (15, 8)
    x = r(7, 8)
    B = []

    def add(op, args, match, id):
        B.append(pytest.param(op, args, match, id=f"{op}-{id}"))

    add("lokr_full_merge_fwd", (r(3, 4, 1), w2, None, 1.0), "w1", "rank")
    add("lokr_full_merge_fwd", (w1, r(5), None, 1.0), "w2", "rank_w2")
    add("lokr_full_merge_fwd", (w1, w2, r(15, 9), 1.0), "base", "base_shape")
    add("lokr_full_merge_fwd", (w1.to(h), w2.to(bf), None, 1.0), "float16", "mix")
    add("lokr_full_merge_fwd", (w1, w2.to(i32), None, 1.0), "w2", "int")
    add("lokr_full_merge_fwd", (w1, w2, None, 1.0, torch.int64), "out_dtype", "out_dtype")
    add("lokr_full_merge_bwd", (r(15, 9), w1, w2, 1.0), "grad", "grad_shape")
    add("lokr_full_merge_bwd", (r(*K), w1, r(5, 2, 1), 1.0), "w2", "rank")
    add("lokr_full_merge_bwd", (r(*K).to(h), w1.to(bf), w2, 1.0), "float16", "mix")
    add("lokr_full_merge_bwd", (r(*K), w1.to(i32), w2, 1.0), "w1", "int")
    S = [3, 4, 5, 2]
    add("lokr_merge_fwd", (w1, None, w2, None, [3, 4, 5, 3], None, 1.0), "shape", "shape_inconsistent")
    add("lokr_merge_fwd", (r(3, 2), r(2, 4), w2, None, [4, 4, 5, 2], None, 1.0), "shape", "shape_a")
    add("lokr_merge_fwd", (r(3, 2), r(2, 4), w2, None, [3, 4, 5], None, 1.0), "shape", "shape_len")
    add("lokr_merge_fwd", (r(3, 2), r(3, 4), w2, None, S, None, 1.0), "w1b", "rank_mismatch")
    add("lokr_merge_fwd", (w1, None, r(5, 2, 1), None, S, None, 1.0), "w2a", "ndim")
    add("lokr_merge_fwd", (w1, None, w2, None, S, r(15, 9), 1.0), "base", "base_shape")
    add("lokr_merge_fwd", (w1.to(h), None, w2.to(bf), None, S, None, 1.0), "float16", "mix")
    add("lokr_merge_fwd", (w1.to(i32), None, w2, None, S, None, 1.0), "w1a", "int")
    add("lokr_merge_fwd", (w1, None, w2, None, S, None, 1.0, torch.int32), "out_dtype", "out_dtype")
    add("lokr_merge_bwd", (r(*K), w1, None, w2, None, [3, 4, 5, 3], 1.0), "shape", "shape_inconsistent")
    add("lokr_merge_bwd", (r(15, 9), w1, None, w2, None, S, 1.0), "grad", "grad_shape")
    add("lokr_merge_bwd", (r(*K), w1, None, r(5, 3), r(2, 2), S, 1.0), "w2b", "rank_mismatch")
    add("lokr_merge_bwd", (r(*K).to(bf), w1.to(h), None, w2, None, S, 1.0), "float16", "mix")
    add("lokr_merge_bwd", (r(*K), w1, None, w2.to(i32), None, S, 1.0), "w2a", "int")
    add("lokr_bypass_fwd", (r(7, 9), w1, w2, 1.0), "x", "x_cols")
    add("lokr_bypass_fwd", (r(7, 8, 1), w1, w2, 1.0), "x", "x_rank")
    add("lokr_bypass_fwd", (x, r(3), w2, 1.0), "w1", "w1_rank")
    add("lokr_bypass_fwd", (x, w1, w2, 1.0, r(7, 14)), "base", "base_shape")
    add("lokr_bypass_fwd", (x.to(h), w1, w2.to(bf), 1.0), "float16", "mix")
    add("lokr_bypass_fwd", (x.to(i32), w1, w2, 1.0), "x", "int")
    add("lokr_bypass_bwd", (r(7, 14), x, w1, w2, 1.0), "grad", "grad_shape")
    add("lokr_bypass_bwd", (r(7, 15), r(7, 9), w1, w2, 1.0), "x", "x_cols")
    add("lokr_bypass_bwd", (r(7, 15), x, w1, r(5, 2, 2), 1.0), "w2", "w2_rank")
    add("lokr_bypass_bwd", (r(7, 15).to(h), x.to(bf), w1, w2, 1.0), "float16", "mix")
    add("lokr_bypass_bwd", (r(7, 15), x, w1.to(torch.int64), w2, 1.0), "w1", "int")
    return B


@pytest.mark.parametrize("op,args,match", _bad_inputs())
def test_bad_input(op, args, match):
    fn = getattr(lycoris, op)
    with pytest.raises(ValueError, match=match):
        fn(*args)
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        with pytest.raises(ValueError, match=match):
            fn(*fake)


def test_every_op_has_bad_inputs():
    assert {p.values[0] for p in _bad_inputs()} == set(OPS)


# ---------------------------------------------------------------------------
# functional entry points vs the plain LyCORIS formulas


def _r(*shape, g, dtype=torch.float64, rg=True):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(rg)


def _kron_weight(w1, w2):
    """LyCORIS's rebuild: w1 unsqueezed over the kernel axes, then torch.kron."""
    while w1.dim() < w2.dim():
        w1 = w1.unsqueeze(-1)
    return torch.kron(w1, w2.contiguous())


def _tucker(t, wa, wb):
    # w2[p, q, *k] = sum_ij t[i, j, *k] wa[i, p] wb[j, q], via tensordot (not einsum)
    m = torch.tensordot(wa, t, dims=([0], [0]))  # (p, j, *k)
    m = torch.tensordot(wb, m, dims=([0], [1]))  # (q, p, *k)
    return m.transpose(0, 1)


def _grads(y, yref, leaves, ref_leaves):
    """(autograd grads of y, fp64 autograd grads of the formula) for one random G."""
    G = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(y, leaves, G.to(y.dtype))
    exp = torch.autograd.grad(yref, ref_leaves, G)
    return got, exp


def _weight_configs(g, dtype):
    a, b, c, d, r1, r2 = 3, 5, 4, 3, 2, 2
    K = (3, 3)
    W = lambda *s: _r(*s, g=g, dtype=dtype)  # noqa: E731
    cfg = []
    cfg.append(("whole", dict(w1=W(a, b), w2=W(c, d)), lambda p: _kron_weight(p["w1"], p["w2"])))
    cfg.append(("whole-conv", dict(w1=W(a, b), w2=W(c, d, *K)), lambda p: _kron_weight(p["w1"], p["w2"])))
    cfg.append(("both", dict(w1a=W(a, r1), w1b=W(r1, b), w2a=W(c, r2), w2b=W(r2, d)),
                lambda p: _kron_weight(p["w1a"] @ p["w1b"], p["w2a"] @ p["w2b"])))
    cfg.append(("side1", dict(w1a=W(a, r1), w1b=W(r1, b), w2=W(c, d)),
                lambda p: _kron_weight(p["w1a"] @ p["w1b"], p["w2"])))
    cfg.append(("side1-conv-w2", dict(w1a=W(a, r1), w1b=W(r1, b), w2=W(c, d, *K)),
                lambda p: _kron_weight(p["w1a"] @ p["w1b"], p["w2"])))
    cfg.append(("side2", dict(w1=W(a, b), w2a=W(c, r2), w2b=W(r2, d)),
                lambda p: _kron_weight(p["w1"], p["w2a"] @ p["w2b"])))
    cfg.append(("side2-conv-w2b", dict(w1=W(a, b), w2a=W(c, r2), w2b=W(r2, d, *K)),
                lambda p: _kron_weight(p["w1"], (p["w2a"] @ p["w2b"].flatten(1)).reshape(c, d, *K))))
    cfg.append(("tucker", dict(w1a=W(a, r1), w1b=W(r1, b), w2a=W(r2, c), w2b=W(r2, d), t2=W(r2, r2, *K)),
                lambda p: _kron_weight(p["w1a"] @ p["w1b"], _tucker(p["t2"], p["w2a"], p["w2b"]))))
    cfg.append(("tucker-w1", dict(w1=W(a, b), w2a=W(r2, c), w2b=W(r2, d), t2=W(r2, r2, 1, 3)),
                lambda p: _kron_weight(p["w1"], _tucker(p["t2"], p["w2a"], p["w2b"]))))
    return cfg


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16), ids=str)
def test_functional_weight(dtype):
    g = torch.Generator().manual_seed(3)
    tol = REL_TOL[dtype] * (5 if dtype in HALF else 1)  # tucker: one extra eager rounding
    for name, p, formula in _weight_configs(g, dtype):
        ref_p = {k: v.detach().double().requires_grad_() for k, v in p.items()}
        for scale in (0.7, 0.0):
            y = FL.lokr_weight(**p, scale=scale)
            yref = scale * formula(ref_p)
            assert y.shape == yref.shape, name
            assert y.dtype == dtype
            assert rel_err(y, yref) <= tol or scale == 0.0 and torch.all(y == 0), name
        y = FL.lokr_weight(**p, scale=0.7)
        got, exp = _grads(y, 0.7 * formula(ref_p), list(p.values()), list(ref_p.values()))
        for k, (gg, ee) in enumerate(zip(got, exp)):
            assert gg.dtype == dtype
            assert rel_err(gg, ee) <= tol, (name, k)
        # base: folded (same dtype) or added after (narrower base)
        base = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dtype)
        yb = FL.lokr_weight(**p, scale=0.7, base=base)
        assert yb.dtype == dtype
        assert rel_err(yb, base.double() + 0.7 * formula(ref_p)) <= tol, name


def test_functional_weight_base_dtypes():
    g = torch.Generator().manual_seed(4)
    w1, w2 = _r(3, 4, g=g, dtype=torch.bfloat16), _r(5, 2, g=g, dtype=torch.bfloat16)
    base32 = torch.randn(15, 8, generator=g)
    y = FL.lokr_weight(w1=w1, w2=w2, scale=0.5, base=base32)  # folded: result in base's dtype
    assert y.dtype == torch.float32
    exp = base32.double() + 0.5 * torch.kron(w1.double(), w2.double())
    assert rel_err(y, exp) <= REL_TOL[torch.float32]
    w1f, w2f = w1.float(), w2.float()
    basebf = base32.to(torch.bfloat16)  # not folded: added after, torch promotion
    y = FL.lokr_weight(w1=w1f, w2=w2f, scale=0.5, base=basebf)
    assert y.dtype == torch.float32
    assert rel_err(y, basebf.double() + 0.5 * torch.kron(w1f.double(), w2f.double())) <= REL_TOL[torch.float32]


def test_functional_scale():
    g = torch.Generator().manual_seed(5)
    w1a, w1b, w2b = _r(3, 4, g=g), _r(4, 5, g=g), _r(2, 6, g=g)
    assert FL.lokr_scale(8.0, w1b=w1b) == 2.0
    assert FL.lokr_scale(8.0, w2b=w2b) == 4.0
    assert FL.lokr_scale(8.0, w1b=w1b, w2b=w2b) == 2.0
    # both sides whole: gamma itself (no division by gamma; gamma = 0 is fine)
    assert FL.lokr_scale(3.0) == 3.0
    assert FL.lokr_scale(0.0) == 0.0
    w1, w2 = _r(3, 4, g=g), _r(2, 3, g=g)
    y = FL.lokr_weight(w1=w1, w2=w2, scale=FL.lokr_scale(3.0))
    assert rel_err(y, 3.0 * torch.kron(w1, w2)) < 1e-12


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.float16), ids=str)
def test_functional_bypass_linear(dtype):
    g = torch.Generator().manual_seed(6)
    a, b, c, d, r = 3, 5, 4, 3, 2
    W = lambda *s: _r(*s, g=g, dtype=dtype)  # noqa: E731
    configs = [
        ("whole", dict(w1=W(a, b), w2=W(c, d)), lambda p: torch.kron(p["w1"], p["w2"])),
        ("both", dict(w1a=W(a, r), w1b=W(r, b), w2a=W(c, r), w2b=W(r, d)),
         lambda p: torch.kron(p["w1a"] @ p["w1b"], p["w2a"] @ p["w2b"])),
        ("side2", dict(w1=W(a, b), w2a=W(c, r), w2b=W(r, d)), lambda p: torch.kron(p["w1"], p["w2a"] @ p["w2b"])),
    ]
    for name, p, formula in configs:
        x = W(2, 3, b * d)
        base = W(2, 3, a * c)
        for bs in (None, base):
            y = FL.lokr_bypass(x, **p, scale=0.6, base=bs)
            ref_p = {k: v.detach().double().requires_grad_() for k, v in p.items()}
            xr = x.detach().double().requires_grad_()
            yref = 0.6 * F.linear(xr, formula(ref_p))
            if bs is not None:
                yref = yref + bs.detach().double()
            assert y.shape == (2, 3, a * c) and y.dtype == dtype
            assert rel_err(y, yref) <= REL_TOL[dtype], name
            got, exp = _grads(y, yref, [x] + list(p.values()), [xr] + list(ref_p.values()))
            for k, (gg, ee) in enumerate(zip(got, exp)):
                assert rel_err(gg, ee) <= REL_TOL[dtype] * (2 if dtype in HALF else 1), (name, k)


@pytest.mark.parametrize("route", ("structured", "formula"))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=str)
def test_functional_bypass_conv(dtype, route, monkeypatch):
    """Both routes of a groups == 1 conv: the structured one (x viewed as N·b images of d
    channels) and the formula's (ΔW built, one conv; a w2 narrower than STRUCTURED_CONV_MIN_C)."""
    monkeypatch.setattr(FL, "STRUCTURED_CONV_MIN_C", 0 if route == "structured" else 1 << 30)
    built = []
    lokr_weight = FL.lokr_weight
    monkeypatch.setattr(FL, "lokr_weight", lambda *a, **k: built.append(1) or lokr_weight(*a, **k))
    g = torch.Generator().manual_seed(7)
    for name, p, formula in _weight_configs(g, dtype):
        if name in ("whole", "both", "side1", "side2"):
            continue  # linear configs
        w = formula({k: v.detach().double() for k, v in p.items()})  # (a*c, b*d, kh, kw)
        x = _r(2, w.shape[1], 7, 6, g=g, dtype=dtype)
        for kw in (dict(stride=1, padding=1), dict(stride=2, padding=0, dilation=1)):
            y = FL.lokr_bypass_conv(x, **p, scale=0.4, **kw)
            yref = 0.4 * F.conv2d(x.detach().double(), w, None, **kw)
            assert y.shape == yref.shape and y.dtype == dtype
            assert rel_err(y, yref) <= REL_TOL[dtype] * 5, (name, kw)
        # groups path (builds ΔW), with base
        x2 = _r(2, 2 * w.shape[1], 5, 5, g=g, dtype=dtype)
        yref = 0.4 * F.conv2d(x2.detach().double(), w, None, padding=1, groups=2)
        base = torch.randn(yref.shape, generator=g, dtype=torch.float64).to(dtype)
        y = FL.lokr_bypass_conv(x2, **p, scale=0.4, base=base, padding=1, groups=2)
        assert y.shape == yref.shape and y.dtype == dtype
        assert rel_err(y, yref + base.double()) <= REL_TOL[dtype] * 5, name
    # gradients of the chain (eager autograd) vs the formula, conv1d too
    a, b, c, d, r = 2, 3, 3, 2, 2
    p = dict(w1a=_r(a, r, g=g), w1b=_r(r, b, g=g), w2a=_r(c, r, g=g), w2b=_r(r, d, 3, g=g))
    x = _r(2, b * d, 9, g=g)
    y = FL.lokr_bypass_conv(x, **p, scale=0.5, padding=1)
    ref_p = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
    xr = x.detach().clone().requires_grad_()
    w = torch.kron((ref_p["w1a"] @ ref_p["w1b"]).unsqueeze(-1),
                   (ref_p["w2a"] @ ref_p["w2b"].flatten(1)).reshape(c, d, 3))
    yref = 0.5 * F.conv1d(xr, w, None, padding=1)
    assert rel_err(y, yref) < 1e-12
    G = torch.randn(y.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(y, [x] + list(p.values()), G)
    exp = torch.autograd.grad(yref, [xr] + list(ref_p.values()), G)
    for gg, ee in zip(got, exp):
        assert rel_err(gg, ee) < 1e-12
    # the groups == 1 calls built ΔW exactly on the formula's route (the groups path always does)
    groups1 = sum(1 for name, _, _ in _weight_configs(torch.Generator().manual_seed(7), dtype)
                  if name not in ("whole", "both", "side1", "side2")) * 2 + 1
    groups2 = groups1 // 2
    assert len(built) == groups2 + (groups1 if route == "formula" else 0)


def test_lokr_conv_route_by_w2_width():
    """A conv w2 narrower than STRUCTURED_CONV_MIN_C output channels (SD 1.5's 320 channels at
    factor -1: w2 20x20) takes the formula's route; 32 and wider (SDXL's 640: 32x32) the
    structured one; whole, factored and tucker sides alike."""
    r = torch.randn
    assert FL._w2_out_channels(r(20, 20, 3, 3), None, None) == 20
    assert FL._w2_out_channels(None, r(32, 4), None) == 32  # factored: w2a (c, r)
    assert FL._w2_out_channels(None, r(4, 40), r(4, 4, 3, 3)) == 40  # tucker: w2a (r, c)
    assert FL._w2_out_channels(None, None, None) is None
    assert FL.STRUCTURED_CONV_MIN_C == 32
    w1 = r(16, 16)
    assert FL.conv_formula_op(w1=w1, w2=r(20, 20, 3, 3)) == "lycoris.lokr_full_merge_fwd"
    assert FL.conv_formula_op(w1=w1, w2a=r(20, 4), w2b=r(4, 20, 3, 3)) == "lycoris.lokr_merge_fwd"
    assert FL.conv_formula_op(w1a=r(16, 2), w1b=r(2, 16), w2=r(20, 20, 3, 3)) == "lycoris.lokr_merge_fwd"
    assert FL.conv_formula_op(w1=w1, w2=r(32, 32, 3, 3)) is None


def test_functional_errors():
    g = torch.Generator().manual_seed(8)
    w1, w2 = _r(3, 4, g=g), _r(5, 2, g=g)
    with pytest.raises(ValueError, match="w1"):
        FL.lokr_weight(w2=w2)
    with pytest.raises(ValueError, match="w2"):
        FL.lokr_weight(w1=w1, w2=w2, w2a=w2)
    with pytest.raises(ValueError, match="base"):
        FL.lokr_weight(w1=w1, w2=w2, base=torch.randn(15, 9, dtype=torch.float64))
    with pytest.raises(ValueError, match="lokr_bypass_conv"):
        FL.lokr_bypass(torch.randn(2, 12, dtype=torch.float64), w1=w1, w2=_r(5, 3, 3, 3, g=g))
    with pytest.raises(ValueError, match="float16"):
        FL.lokr_weight(w1=w1.to(torch.float16), w2=w2.to(torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        FL.lokr_bypass(torch.randn(2, 9, dtype=torch.float64), w1=w1, w2=w2)


# (w1 shape, w2 shape): each picks a different branch of the CUDA step-down body
# (reference.lokr.lokr_bypass_*_native): forward order, g_w1's token sum, g_w2's mix
STEP_DOWN_FACTORS = [
    ((8, 8), (48, 48)),   # X·w2ᵀ first; g_w1 from per-token partials; g_w2 through w1·X
    ((3, 40), (20, 7)),   # the w1 mix first
    ((24, 20), (6, 3)),   # g_w1 as one GEMM over (t, j)
    ((24, 2), (3, 16)),   # g_w2 through w1ᵀ·G
]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shapes", STEP_DOWN_FACTORS, ids=lambda s: f"w1{s[0]}-w2{s[1]}")
def test_bypass_step_down_body_against_kron(shapes, dtype):
    """The 16-bit step-down body at every branch, with a non-contiguous x and a base, against
    the explicit fp64 Kronecker product (forward) and autograd through it (backward)."""
    (a, b), (c, d) = shapes
    g = torch.Generator().manual_seed(a * 1000 + d)
    T = 29
    x = torch.randn(b * d, T, generator=g).to(dtype).t()  # non-contiguous (T, b·d)
    w1 = torch.randn(a, b, generator=g).to(dtype)
    w2 = (torch.randn(c, d, generator=g) * 0.2).to(dtype)
    base = torch.randn(T, a * c, generator=g).to(dtype)
    G = torch.randn(T, a * c, generator=g).to(dtype)
    xd, w1d, w2d = (t.double().requires_grad_() for t in (x, w1, w2))
    ref = 0.7 * xd @ torch.kron(w1d, w2d).t()
    got = lokr_ops.lokr_bypass_fwd_native(x, w1, w2, 0.7, base)
    assert got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, ref + base.double()) <= REL_TOL[dtype]
    got = lokr_ops.lokr_bypass_fwd_native(x, w1, w2, 0.7)  # γ folded into w1
    assert got.dtype == dtype and got.is_contiguous() and rel_err(got, ref) <= REL_TOL[dtype]
    want = torch.autograd.grad(ref, (xd, w1d, w2d), G.double())
    for got_g, want_g, like in zip(lokr_ops.lokr_bypass_bwd_native(G, x, w1, w2, 0.7), want, (x, w1, w2)):
        assert got_g.dtype == like.dtype and got_g.shape == like.shape and got_g.is_contiguous()
        assert rel_err(got_g, want_g) <= REL_TOL[dtype], (got_g - want_g).abs().max()
