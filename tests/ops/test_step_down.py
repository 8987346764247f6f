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
    """The ops whose exact body widens token-sized tensors to fp32 have a 16-bit one; the
    others' exact body already runs 16-bit GEMMs with fp32 accumulation."""
    assert set(NATIVE) == {"lokr_bypass_fwd", "lokr_bypass_bwd", "oft_fwd", "oft_bwd", "boft_fwd", "boft_bwd",
                           "ia3_fwd", "ia3_bwd"}


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
