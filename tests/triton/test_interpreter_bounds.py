"""The interpreter's bounds check (tests/interpreter_bounds.py, on for every test by
tests/conftest.py) is live: an unmasked read or write past a tensor fails, a masked one
does not."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter runs only")


@triton.jit
def _copy(x_ptr, y_ptr, n, N: tl.constexpr, OFF: tl.constexpr, MASKED: tl.constexpr, ON_STORE: tl.constexpr):
    o = tl.arange(0, N)
    m = (o + OFF < n) if MASKED else o < N
    if ON_STORE:
        tl.store(y_ptr + o + OFF, tl.load(x_ptr + o), mask=m)
    else:
        tl.store(y_ptr + o, tl.load(x_ptr + o + OFF, mask=m, other=0.0), mask=o < N)


@pytest.mark.parametrize("on_store", [False, True], ids=["load", "store"])
def test_past_the_end_fails_and_masked_passes(on_store):
    x, y = torch.arange(16.0), torch.zeros(16)
    _copy[(1,)](x, y, 16, N=16, OFF=0, MASKED=False, ON_STORE=on_store)
    assert torch.equal(y, x)
    _copy[(1,)](x, y, 16, N=16, OFF=3, MASKED=True, ON_STORE=on_store)  # the 3 past the end are masked off
    with pytest.raises(Exception, match="outside the launch's tensors"):
        _copy[(1,)](x, y, 16, N=16, OFF=1, MASKED=False, ON_STORE=on_store)
