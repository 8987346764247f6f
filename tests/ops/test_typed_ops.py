"""lycoris_ops.ops: one typed entry per op, each equal to its raw op call."""
import inspect
import re

import pytest
import torch

import lycoris_ops
from lycoris_ops import ops

R = torch.randn


def test_every_op_has_exactly_one_typed_entry():
    called = re.findall(r"_ops\.(\w+)\(", inspect.getsource(ops))
    assert sorted(called) == sorted(lycoris_ops.OP_NAMES)
    assert sorted(ops.__all__) == sorted(n for n, f in vars(ops).items() if inspect.isfunction(f)
                                         and not n.startswith("_"))


def _same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


L = torch.ops.lycoris
x, up, down, base = R(7, 5), R(6, 3), R(3, 5), R(7, 6)
a1, b1, a2, b2 = R(6, 2), R(2, 5), R(6, 2), R(2, 5)
w1, w2 = R(2, 3), R(3, 4)
xk = R(7, 12)
wi = R(5)
CALLS = {
    "lora_merge": (lambda: ops.lora_merge(up, down, 0.5, base=R(6, 5)), None),
    "lora_merge hada": (lambda: ops.lora_merge(a1, b1, 0.5, a2=a2, b2=b2, mode="hada"),
                        lambda: L.lora_merge_fwd(a1, b1, a2, b2, None, 0.5, "hada")),
    "lora_bypass": (lambda: ops.lora_bypass(x, up, down, 0.5, base), lambda: L.lora_bypass_fwd(x, up, down, 0.5, base)),
    "lora_tucker": (lambda: ops.lora_tucker(R(6, 2), R(2, 2, 9), R(2, 5), 0.5), None),
    "loha_bypass": (lambda: ops.loha_bypass(x, a1, b1, a2, b2, 0.5, base),
                    lambda: L.loha_bypass_fwd(x, a1, b1, a2, b2, 0.5, base)),
    "lokr_full_merge": (lambda: ops.lokr_full_merge(w1, w2, 0.5), lambda: L.lokr_full_merge_fwd(w1, w2, None, 0.5)),
    "lokr_merge": (lambda: ops.lokr_merge(R(2, 1), w2, (2, 3, 3, 4), 0.5, w1b=R(1, 3)), None),
    "lokr_bypass": (lambda: ops.lokr_bypass(xk, w1, w2, 0.5), lambda: L.lokr_bypass_fwd(xk, w1, w2, 0.5)),
    "dora": (lambda: ops.dora(R(6, 5), R(6), 0.8, 0), None),
    "oft": (lambda: ops.oft(R(2, 3, 3) * 0.1, R(7, 6), None, 1.0), None),
    "boft": (lambda: ops.boft(R(2, 2, 2, 2) * 0.1, R(7, 4), -1), None),
    "ia3": (lambda: ops.ia3(x, wi, -1, 1.0, 0.5), lambda: L.ia3_fwd(x, wi, -1, 1.0, 0.5)),
    "add_scaled": (lambda: ops.add_scaled(x, x, 0.5), lambda: L.add_scaled(x, x, 0.5)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_typed_entry_equals_the_op(name):
    typed, raw = CALLS[name]
    got = typed()
    if raw is not None:
        _same(got, raw())
    else:  # no raw twin written: at least a fresh, finite result
        for t in got if isinstance(got, tuple) else (got,):
            assert torch.isfinite(t).all()


@pytest.mark.parametrize("fn, args", [
    (ops.lora_bypass, (up, down)),
    (ops.lokr_bypass, (w1, w2)),
])
def test_bypass_entries_take_leading_token_dims(fn, args):
    xs = R(2, 3, args[-1].shape[1] * (args[0].shape[1] if fn is ops.lokr_bypass else 1))
    y = fn(xs, *args, 0.5)
    flat = fn(xs.reshape(-1, xs.shape[-1]), *args, 0.5)
    assert y.shape[:2] == (2, 3)
    torch.testing.assert_close(y.reshape(-1, y.shape[-1]), flat)


def test_typed_entries_differentiate_and_compile():
    xr = x.clone().requires_grad_()
    ops.lora_bypass(xr, up, down, 0.5, base).sum().backward()
    torch.testing.assert_close(xr.grad, torch.ones(7, 6) @ up @ down * 0.5)
    fn = torch.compile(lambda t: ops.lora_bypass(t, up, down, 0.5), fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(x), ops.lora_bypass(x, up, down, 0.5))


def test_bad_arguments_raise_the_ops_error():
    with pytest.raises(ValueError, match="lycoris.lora_bypass_fwd"):
        ops.lora_bypass(x, up, R(3, 4))
