"""The CUDA step-down bodies (``reference.step_down``, docs/ops.md §1.5): the token-sized
math in the operands' 16-bit dtype, checked on CPU against the fp64 oracle within the
documented tolerance, at every dtype, on every case of the op's table (odd sizes,
non-contiguous operands, bases, rescales, both OFT/BOFT layouts)."""
import pytest
import torch

from lycoris_ops import reference, testing
from lycoris_ops._library.optable import OPS
from lycoris_ops.testing import REL_TOL, rel_err

NATIVE = [op.name for op in OPS if reference.step_down(op.name) is not reference.eager(op.name)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def test_which_ops_have_a_step_down_body():
    """The ops whose exact body widens token-sized (or, LoKr's merges and LoHa's bypass,
    weight-sized) tensors to fp32 have a 16-bit one; the others' exact body already runs 16-bit GEMMs with
    fp32 accumulation."""
    assert set(NATIVE) == {"lokr_bypass_fwd", "lokr_bypass_bwd", "oft_fwd", "oft_bwd", "boft_fwd", "boft_bwd",
                           "ia3_fwd", "ia3_bwd", "lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd",
                           "lokr_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd"}


def _cases(op, dtype):
    return [c for c in testing.cases(op and next(o.family for o in OPS if o.name == op), dtype=dtype, seed=7)
            if c.op == op]


def _double(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", NATIVE)
def test_step_down_within_the_dtype_tolerance(op, dtype):
    cases = _cases(op, dtype)
    assert cases, op
    native, exact = reference.step_down(op), reference.eager(op)
    for case in cases:
        got = native(*case.args)
        want = exact(*case.args)
        oracle = exact(*(_double(a) for a in case.args))
        got, want, oracle = ((v if isinstance(v, tuple) else (v,)) for v in (got, want, oracle))
        for g, w, o in zip(got, want, oracle):
            assert g.shape == w.shape and g.dtype == w.dtype, (case.id, g.shape, g.dtype, w.shape, w.dtype)
            assert g.is_contiguous(), case.id
            if not w.numel():
                continue
            if dtype == torch.float32:  # an fp32 compute dtype runs the exact body
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            else:
                assert rel_err(g, o) <= REL_TOL[dtype], (case.id, rel_err(g, o))


def test_lokr_step_down_at_a_wide_factor():
    """LoKr factor=8 on a 384-channel layer (w2 48x48): out of the fused kernels' scope, the
    step-down body stays in bf16 and within its tolerance of the fp64 oracle."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 384, generator=g).bfloat16()
    w1, w2 = torch.randn(8, 8, generator=g).bfloat16(), torch.randn(48, 48, generator=g).bfloat16() * 0.1
    base = torch.randn(37, 384, generator=g).bfloat16()
    y = reference.lokr.lokr_bypass_fwd_native(x, w1, w2, 0.5, base)
    ref = reference.lokr.lokr_bypass_fwd(x.double(), w1.double(), w2.double(), 0.5, base.double())
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) <= REL_TOL[torch.bfloat16]
    G = torch.randn(37, 384, generator=g).bfloat16()
    got = reference.lokr.lokr_bypass_bwd_native(G, x, w1, w2, 0.5)
    want = reference.lokr.lokr_bypass_bwd(G.double(), x.double(), w1.double(), w2.double(), 0.5)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) <= REL_TOL[torch.bfloat16]


def test_lokr_step_down_dense_route_where_a_factor_is_small():
    """LoKr ``factor=4`` on 3072 channels at Flux's 4608 tokens: the step-down bodies build ΔW
    and run dense GEMMs (the user's formula), where the structured route's mix over a 4-wide
    factor runs far below the GEMM rate; ``factor`` 8 (where the structured route measured
    faster than the formula), 16, -1 and short GEMMs keep it."""
    L = reference.lokr
    assert L.dense_route(4608, 4, 4, 768, 768) and L.dense_route(8192, 4, 4, 1024, 1024)
    assert L.dense_route(4608, 768, 768, 4, 4)  # the small factor as w2
    assert not L.dense_route(4608, 8, 8, 384, 384) and not L.dense_route(4608, 16, 16, 192, 192)
    assert not L.dense_route(4608, 48, 48, 64, 64)
    assert not L.dense_route(64, 4, 4, 768, 768)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("base_dtype", [None, "same", torch.float32], ids=["nobase", "base", "fp32base"])
def test_lokr_step_down_dense_route(dtype, base_dtype, monkeypatch):
    """The dense route (taken here at a small size: its GEMM-length threshold lowered) against the
    fp64 oracle, forward with and without base and backward, in the operands' dtypes."""
    L = reference.lokr
    monkeypatch.setattr(L, "DENSE_MIN_MACS", 0)
    T, a, b, c, d = 29, 2, 3, 40, 50
    assert L.dense_route(T, a, b, c, d)
    dense = L._kron_epilogue
    calls = []
    monkeypatch.setattr(L, "_kron_epilogue", lambda *args: calls.append(1) or dense(*args))
    g = torch.Generator().manual_seed(21)
    x = torch.randn(T, b * d, generator=g).to(dtype)
    w1, w2 = torch.randn(a, b, generator=g).to(dtype), (torch.randn(c, d, generator=g) * 0.1).to(dtype)
    base = None if base_dtype is None else torch.randn(T, a * c, generator=g).to(dtype if base_dtype == "same"
                                                                                 else base_dtype)
    y = L.lokr_bypass_fwd_native(x, w1, w2, 0.7, base)
    want = L.lokr_bypass_fwd(x.double(), w1.double(), w2.double(), 0.7, None if base is None else base.double())
    assert y.dtype == (dtype if base is None else base.dtype) and y.is_contiguous()
    assert rel_err(y, want) <= REL_TOL[dtype], rel_err(y, want)
    G = torch.randn(T, a * c, generator=g).to(dtype)
    got = L.lokr_bypass_bwd_native(G, x, w1, w2, 0.7)
    ref = L.lokr_bypass_bwd(G.double(), x.double(), w1.double(), w2.double(), 0.7)
    for out, r, src in zip(got, ref, (x, w1, w2)):
        assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous()
        assert rel_err(out, r) <= REL_TOL[dtype], rel_err(out, r)
    assert len(calls) == 2  # both took the dense route


@pytest.mark.parametrize("a,b,c,d", [(4, 4, 24, 24), (3, 5, 7, 2), (1, 6, 9, 1)])
def test_lokr_dense_route_pieces(a, b, c, d):
    """The dense route's ΔW (one pass, one rounding) and its factor gradients (no permuted copy)
    equal the merge op's kron and ``_kron_grads`` (fp64: exactly the same sums)."""
    L = reference.lokr
    g = torch.Generator().manual_seed(a * 100 + d)
    w1, w2 = torch.randn(a, b, generator=g, dtype=torch.float64), torch.randn(c, d, generator=g, dtype=torch.float64)
    want = L.lokr_full_merge_fwd(w1, w2, None, 0.3, torch.float32)
    torch.testing.assert_close(L._kron_epilogue(w1, w2, 0.3, None, torch.float32), want, rtol=2 ** -22, atol=0)
    for dt in (torch.bfloat16, torch.float16):
        assert rel_err(L._kron_epilogue(w1, w2, 0.3, None, dt), want.double()) <= 2 ** -8
    base = torch.randn(a * c, b * d, generator=g, dtype=torch.float64).t().contiguous().t()  # non-contiguous
    want = L.lokr_full_merge_fwd(w1, w2, base, 0.3, torch.float32)
    torch.testing.assert_close(L._kron_epilogue(w1, w2, 0.3, base, torch.float32), want, rtol=2 ** -22, atol=0)
    G = torch.randn(a * c, b * d, generator=g, dtype=torch.float64)
    for got, ref in zip(L._kron_grads_batched(G, w1, w2, 0.3), L._kron_grads(G, w1, w2, 0.3)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


# BOFT at a step-down geometry (block s = 48, out of the fused kernels' scope): 3 stages of 8
# blocks on a 384-channel axis, channels last, conv (N, C, H, W) and weight (C, rest) layouts.
BOFT_WIDE = [
    pytest.param((37, 384), -1, torch.bfloat16, torch.float32, True, True, id="channels_last-bf16-rescale-diff"),
    pytest.param((2, 384, 3, 5), 1, torch.float16, torch.float16, False, False, id="conv-fp16"),
    pytest.param((384, 3, 5), 0, torch.bfloat16, torch.bfloat16, True, False, id="weight-bf16-rescale"),
]


def _boft_wide(shape, dtype, blocks_dtype, rescale):
    g = torch.Generator().manual_seed(5)
    blocks = (torch.randn(3, 8, 48, 48, generator=g) * 0.05).to(blocks_dtype)
    x = torch.randn(*shape, generator=g).to(dtype)
    rs = (1.0 + 0.1 * torch.randn(384, generator=g)).to(dtype) if rescale else None
    return blocks, x, rs, torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("shape,axis,dtype,blocks_dtype,rescale,diff", BOFT_WIDE)
def test_boft_step_down_at_a_wide_block(shape, axis, dtype, blocks_dtype, rescale, diff):
    """The step-down BOFT body at s = 48, each layout: forward and backward within the dtype's
    tolerance of the fp64 exact body, in x's / blocks' dtype, contiguous."""
    blocks, x, rs, G = _boft_wide(shape, dtype, blocks_dtype, rescale)
    y = reference.boft.boft_fwd_native(blocks, x, axis, 1.0, 0.8, rs, diff)
    ref = reference.boft.boft_fwd(blocks.double(), x.double(), axis, 1.0, 0.8,
                                  None if rs is None else rs.double(), diff)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert rel_err(y, ref) <= REL_TOL[dtype], rel_err(y, ref)
    gx, g_blocks = reference.boft.boft_bwd_native(G, blocks, x, axis, 1.0, 0.8)
    want = reference.boft.boft_bwd(G.double(), blocks.double(), x.double(), axis, 1.0, 0.8)
    assert gx.shape == x.shape and gx.dtype == dtype and gx.is_contiguous()
    assert g_blocks.shape == blocks.shape and g_blocks.dtype == blocks_dtype and g_blocks.is_contiguous()
    for got, w in zip((gx, g_blocks), want):
        assert rel_err(got, w) <= REL_TOL[dtype], rel_err(got, w)


class _TokenCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copies (clone / copy_ / dtype casts) that write at least ``numel`` elements."""

    COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES and out.numel() >= self.numel:
            self.count += 1
        return out


@pytest.mark.parametrize("shape,axis,dtype,blocks_dtype,rescale,diff", [
    pytest.param((301, 384), -1, torch.bfloat16, torch.float32, True, True, id="channels_last"),
    pytest.param((2, 384, 9, 11), 1, torch.float16, torch.float16, False, False, id="conv"),
    pytest.param((384, 200), 0, torch.bfloat16, torch.bfloat16, True, False, id="weight"),
])
def test_boft_step_down_copies_tokens_once_a_stage(shape, axis, dtype, blocks_dtype, rescale, diff):
    """The step-down BOFT body moves the tokens at most once a stage between its GEMMs (the
    reorders bmm reads through strides are not copies): forward ≤ m + 1 token-sized copies,
    backward (which recomputes the stage inputs) ≤ 2m + 1. x is larger than all the blocks,
    so that no copy of the stage matrices counts."""
    blocks, x, rs, G = _boft_wide(shape, dtype, blocks_dtype, rescale)
    assert x.numel() > blocks.numel()
    m = blocks.shape[0]
    with _TokenCopies(x.numel()) as fwd:
        reference.boft.boft_fwd_native(blocks, x, axis, 1.0, 0.8, rs, diff)
    with _TokenCopies(x.numel()) as bwd:
        reference.boft.boft_bwd_native(G, blocks, x, axis, 1.0, 0.8)
    assert fwd.count <= m + 1 and bwd.count <= 2 * m + 1, (fwd.count, bwd.count)


def test_boft_step_down_compiles_with_dynamic_shapes():
    """The compile tier compiles the step-down body on CUDA, and Dynamo turns the sizes
    symbolic after a recompile: the body's views must hold for symbolic block sizes (a
    ``.view`` of the stacked block gradients failed inductor there)."""
    from lycoris_ops.reference import boft as B

    bwd = torch.compile(B.boft_bwd_native, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    m, nb, s, T = 1, 4, 6, 5  # one stage: the failing graph
    blocks = torch.randn(m, nb, s, s, generator=g) * 0.1
    x = torch.randn(T, nb * s, generator=g).bfloat16()
    grad = torch.randn(T, nb * s, generator=g).bfloat16()
    for got, want in zip(bwd(grad, blocks, x, -1, 1.0, 1.0), B.boft_bwd_native(grad, blocks, x, -1, 1.0, 1.0)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got.float(), want.float()) <= 1e-2


@pytest.mark.parametrize("scale", [1e-3, 1e-2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["oft_fwd", "oft_bwd", "boft_fwd"])
def test_difference_step_down_at_small_rotations(op, dtype, scale):
    """The nn adapters ask OFT / BOFT for the difference R·x − x, and start training with tiny
    blocks (zero init, then small steps). The 16-bit step-down body must not round R·x to x's
    size before subtracting x: that error (about 2^-9 |x|) is as large as the difference itself,
    and the tuner, which checks fused kernels against this body, then rejected every accurate
    kernel (relative error 0.1 at blocks of 1e-3, bf16)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(53, 384, generator=g).to(dtype)
    grad = torch.randn(53, 384, generator=g).to(dtype)
    if op == "boft_fwd":
        args = (torch.randn(4, 16, 24, 24, generator=g) * scale, x, -1, 1.0, 1.0, None, True)
    else:
        blocks = torch.randn(12, 32, 32, generator=g) * scale
        args = (blocks, x, None, 1.0, True, False) if op == "oft_fwd" else (grad, blocks, x, None, 1.0, True, False)
    got = reference.step_down(op)(*args)
    oracle = reference.eager(op)(*(_double(a) for a in args))
    got, oracle = (v[0] if isinstance(v, tuple) else v for v in (got, oracle))  # the token-sized output
    assert float(oracle.norm() / x.double().norm()) < 30 * scale  # a small difference indeed
    assert got.dtype == dtype and rel_err(got, oracle) <= REL_TOL[dtype], rel_err(got, oracle)
