"""The host-overhead shortcuts keep every behaviour: the per-signature cache of the
``check_<op>`` functions (``_checks.cached``) never lets a bad call through and is
bypassed by fake/symbolic tensors, and the C++ autograd kernel
(``_autograd_kernel``, ``csrc/autograd.cpp``) behaves like ``torch.library.register_autograd``."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import lycoris_ops  # noqa: F401
from lycoris_ops.reference import checks as _checks
from lycoris_ops.reference import add, boft, ia3, lokr, lora


def _lora_args(T=4, I=6, O=5, r=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype) for s in ((T, I), (O, r), (r, I), (T, O))]


def test_cache_hits_and_keeps_the_spec():
    x, up, down, base = _lora_args()
    check = lora.check_lora_bypass_fwd
    check.cache.clear()
    spec = check(x, up, down, 0.5, base)
    assert spec == (((4, 5), torch.float32),) and len(check.cache) == 1
    assert check(x.clone(), up, down, 2.0, base) is spec  # other data, other gamma: a hit
    assert len(check.cache) == 1
    check(x, up, down, 0.5)  # no base: another signature
    assert len(check.cache) == 2
    assert check.__wrapped__(x, up, down, 0.5, base) == spec


@pytest.mark.parametrize("repeat", [1, 3])
def test_bad_calls_always_raise(repeat):
    x, up, down, base = _lora_args()
    check = lora.check_lora_bypass_fwd
    check(x, up, down, 0.5, base)  # the good signature is cached
    bad = [
        ((x, up, down[:1], 0.5, base), "down.shape"),
        ((x, up.half(), down.bfloat16(), 0.5, base), "float16 and bfloat16"),
        ((x, up, down, torch.tensor(0.5), base), "gamma"),
        ((x, up, down, 0.5, base[:, :3]), "base"),
        ((x.int(), up, down, 0.5, base), "x must be float"),
        ((x, up, down.to("meta"), 0.5, base), "on meta"),
        (([1.0], up, down, 0.5, base), "x must be a Tensor"),
    ]
    for args, match in bad:
        for _ in range(repeat):
            with pytest.raises(ValueError, match=match):
                check(*args)
            with pytest.raises(ValueError, match=match):
                lora.lora_bypass_fwd(*args)


def test_type_sensitive_scalars():
    """True == 1 and hash alike, but an int axis and a bool axis are checked differently."""
    x, w = torch.randn(3, 4), torch.randn(4)
    assert ia3.check_ia3_fwd(x, w, 1, 1.0, 0.5)
    for _ in range(2):
        with pytest.raises(ValueError, match="channel_axis must be an int"):
            ia3.check_ia3_fwd(x, w, True, 1.0, 0.5)
    blocks, xb = torch.randn(1, 2, 2, 2), torch.randn(3, 4)
    assert boft.check_boft_fwd(blocks, xb, 1, 1.0, 1.0, None, False)
    with pytest.raises(ValueError, match="diff must be a bool"):
        boft.check_boft_fwd(blocks, xb, 1, 1.0, 1.0, None, 0)
    w1, w2 = torch.randn(2, 3), torch.randn(4, 5)
    assert lokr.check_lokr_merge_fwd(w1, None, w2, None, [2, 3, 4, 5], None, 1.0)
    with pytest.raises(ValueError, match="shape"):
        lokr.check_lokr_merge_fwd(w1, None, w2, None, [2, 3, 4, True], None, 1.0)
    assert add.check_add_scaled(w1, w1, 1)  # an int gamma: checked, not cached
    with pytest.raises(ValueError, match="gamma"):
        add.check_add_scaled(w1, w1, torch.tensor(1.0))


def test_fake_and_symbolic_tensors_bypass_the_cache():
    check = lora.check_lora_bypass_fwd
    check.cache.clear()
    with FakeTensorMode():
        x, up, down, base = (torch.empty(s) for s in ((4, 6), (5, 2), (2, 6), (4, 5)))
        assert check(x, up, down, 0.5, base) == (((4, 5), torch.float32),)
        with pytest.raises(ValueError, match="base"):
            check(x, up, down, 0.5, base[:, :3])
    mode = FakeTensorMode(shape_env=ShapeEnv())
    real = _lora_args(T=7)
    x, up, down, base = (mode.from_tensor(t, static_shapes=False) for t in real)
    ((shape, dtype),) = check(x, up, down, 0.5, base)
    assert isinstance(shape[0], torch.SymInt) and dtype == torch.float32
    assert len(check.cache) == 0
    with mode, pytest.raises(ValueError, match="float16 and bfloat16"):  # the fake kernel: same error
        torch.ops.lycoris.lora_bypass_fwd(x.half(), up, down.bfloat16(), 0.5, base)


def test_cached_check_keeps_name_and_signature():
    import inspect

    fn = lora.check_lora_bypass_fwd
    assert fn.__name__ == "check_lora_bypass_fwd" and fn.__doc__ == fn.__wrapped__.__doc__
    assert str(inspect.signature(fn)) == "(x, up, down, gamma, base=None)"
    _checks.clear_cached_checks()
    assert len(fn.cache) == 0


def test_lean_autograd_registration():
    x, up, down, base = _lora_args()
    op = torch.ops.lycoris.lora_bypass_fwd
    with torch.no_grad():
        assert op(x, up.requires_grad_(), down, 0.5, base).grad_fn is None
    y = op(x, up, down, 0.5)  # base left out: setup_context still sees 5 inputs
    assert y.grad_fn.name() == "lycoris::lora_bypass_fwdBackward"  # the C++ node (csrc/autograd.cpp)
    y.sum().backward()
    assert up.grad.shape == up.shape and down.grad is None
    xb, bb = x.clone().requires_grad_(), base.double().requires_grad_()
    op(xb, up.detach(), down, 0.5, bb).sum().backward()
    assert bb.grad.dtype == torch.float64 and xb.grad.shape == x.shape
    with pytest.raises(RuntimeError, match="double backward"):
        g = op(xb, up.detach(), down, 0.5, None)
        (gx,) = torch.autograd.grad(g.sum(), xb, create_graph=True)
        gx.sum().backward()


# --- the C++ Autograd kernel (csrc/autograd.cpp): the autograd.Function behaviours it replaces ---
_probe_lib = None
_seen = {}


def _probe_op():
    """lycoris_test::scale(x, w, k, tag) = k·x·w, registered with the C++ kernel; its backward
    records what it was given."""
    global _probe_lib
    if _probe_lib is None:
        from lycoris_ops._library.autograd_kernel import register_autograd

        _probe_lib = torch.library.Library("lycoris_test", "DEF")
        _probe_lib.define("scale(Tensor x, Tensor w, float k, str tag, Tensor? extra=None, ScalarType? dt=None)"
                          " -> (Tensor, Tensor)")
        _probe_lib.impl("scale", lambda x, w, k, tag, extra=None, dt=None: (k * x * w, (x * w).sum().reshape(1)),
                        "CompositeExplicitAutograd")

        def setup(ctx, inputs, output):
            x, w, k, tag, extra, dt = inputs
            ctx.save_for_backward(x, w)
            ctx.k, ctx.tag, ctx.extra, ctx.stat, ctx.dt = k, tag, extra, output[1], dt

        def backward(ctx, gy, gstat):
            x, w = ctx.saved_tensors
            _seen.update(need=ctx.needs_input_grad, tag=ctx.tag, extra=ctx.extra, stat=ctx.stat, gstat=gstat,
                         dt=ctx.dt)
            if ctx.tag == "raise":
                raise ValueError("probe backward raised")
            return gy * ctx.k * w, gy * ctx.k * x, None, None, None, None

        register_autograd("lycoris_test::scale", backward, setup_context=setup, save=("x", "w"),
                          save_outputs=(1,), nondiff_outputs=(1,))
    return torch.ops.lycoris_test.scale


def test_cpp_node_passes_arguments_and_needs():
    op = _probe_op()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    extra = torch.randn(2, 5, dtype=torch.float16)
    y, stat = op(x, w, 2.5, "t", extra, torch.bfloat16)
    assert stat.grad_fn is None and not stat.requires_grad  # the non-differentiable output
    (gx,) = torch.autograd.grad(y.sum(), x)  # only x asked for: the backward is told so
    assert _seen["need"] == (True, False, False, False, False, False)
    assert _seen["tag"] == "t" and torch.equal(_seen["stat"], stat) and _seen["dt"] is torch.bfloat16
    # an unsaved tensor argument arrives as its dtype and shape only
    assert _seen["extra"].dtype == torch.float16 and _seen["extra"].shape == (2, 5)
    assert not isinstance(_seen["extra"], torch.Tensor)
    torch.testing.assert_close(gx, 2.5 * w.detach())
    y, _ = op(x, w, 1.0, "t")
    y.backward(torch.ones_like(y))
    assert _seen["need"][:2] == (True, True) and _seen["extra"] is None and _seen["gstat"] is None
    torch.testing.assert_close(w.grad, x.detach())


def test_cpp_node_graph_rules():
    op = _probe_op()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    y, _ = op(x, w, 1.0, "t")
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # retained: a second pass works and accumulates
    torch.testing.assert_close(x.grad, 2 * w)
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()  # the saved tensors were released
    y, _ = op(x, w, 1.0, "t")
    w.add_(1)  # a saved input modified in place: refused, as for any saved tensor
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y, _ = op(x, w, 1.0, "raise")
    with pytest.raises(ValueError, match="probe backward raised"):  # the Python error, unchanged
        y.sum().backward()


def test_cpp_node_keeps_only_what_it_saves():
    import weakref

    op = torch.ops.lycoris.lora_bypass_fwd
    x, up, down, base = _lora_args()
    up.requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        y = op(x, up, down, 0.5, base)
    assert packed == [x.shape, up.shape, down.shape]  # saved through the hooks; base is not kept
    ref = weakref.ref(x)
    del x
    assert ref() is not None  # saved by the node
    del y
    assert ref() is None  # freed with the graph: no reference cycle


def test_cpp_node_refuses_forward_mode():
    import torch.autograd.forward_ad as fwAD

    x, up, down, base = _lora_args()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="lora_bypass_fwd has no forward-mode derivative"):
            torch.ops.lycoris.lora_bypass_fwd(dual, up, down, 0.5, base)


_COMPILED_AUTOGRAD = """
import torch, lycoris_ops
op = torch.ops.lycoris.lora_bypass_fwd
x = torch.randn(4, 6); up = torch.randn(5, 2, requires_grad=True); down = torch.randn(2, 6, requires_grad=True)
want = torch.autograd.grad((0.5 * (x @ down.t() @ up.t())).square().sum(), up)[0]
try:
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        op(x, up, down, 0.5).square().sum().backward()
    print("ok", torch.allclose(up.grad, want, atol=1e-5))
except NotImplementedError as e:
    print("refused", "compiled_args not implemented" in str(e))
"""


@pytest.mark.parametrize("kernel", ["cpp", "python"])
def test_compiled_autograd_needs_the_python_kernel(kernel):
    """Compiled autograd does not take the C++ node (a clear NotImplementedError);
    LYCORIS_AUTOGRAD_KERNEL=python registers the Python kernel, which it takes."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, LYCORIS_AUTOGRAD_KERNEL=kernel)
    out = subprocess.run([sys.executable, "-c", _COMPILED_AUTOGRAD], env=env, capture_output=True, text=True,
                         timeout=600)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert last == ("refused True" if kernel == "cpp" else "ok True"), last


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_reentrant", "torch.func.grad"])
def test_cpp_node_under_checkpoint_and_torch_func(how):
    """Activation checkpointing (both forms) and torch.func.grad through the C++ node."""
    from torch.utils.checkpoint import checkpoint

    op = torch.ops.lycoris.lora_bypass_fwd
    g = torch.Generator().manual_seed(3)
    x, up, down = (torch.randn(s, generator=g).requires_grad_() for s in ((4, 6), (5, 2), (2, 6)))

    def f(x, up, down):
        return op(torch.tanh(x), up, down, 0.5).square().sum()

    want = torch.autograd.grad(f(x, up, down), (x, up, down))
    if how == "checkpoint":
        got = torch.autograd.grad(checkpoint(f, x, up, down, use_reentrant=False), (x, up, down))
    elif how == "checkpoint_reentrant":
        checkpoint(f, x, up, down, use_reentrant=True).backward()
        got = (x.grad, up.grad, down.grad)
    else:
        got = torch.func.grad(f, argnums=(0, 1, 2))(x.detach(), up.detach(), down.detach())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# --- the direct backward: the C++ node calls the *_bwd op itself (no Python) ---
_direct_lib = None
_direct_calls = []


def _direct_op():
    """lycoris_test::dfwd(x, w, k, base) = k·x·w + base, whose backward is one call of
    lycoris_test::dbwd (which returns w's gradient in fp64, to be cast back). The Python
    backward registered beside it raises: a passing backward went through C++."""
    global _direct_lib
    if _direct_lib is None:
        from lycoris_ops._library.autograd_kernel import BwdCall, first_order_only, register_autograd

        _direct_lib = torch.library.Library("lycoris_test", "FRAGMENT")
        _direct_lib.define("dfwd(Tensor x, Tensor w, float k, Tensor? base=None) -> Tensor")
        _direct_lib.define("dbwd(Tensor grad, Tensor x, Tensor w, float k) -> (Tensor, Tensor)")
        _direct_lib.impl("dfwd", lambda x, w, k, base=None: k * x * w + (0 if base is None else base.to(x.dtype)),
                         "CompositeExplicitAutograd")

        def dbwd(grad, x, w, k):
            _direct_calls.append(k)
            return k * grad * w, (k * grad * x).double()

        _direct_lib.impl("dbwd", dbwd, "CompositeExplicitAutograd")
        first_order_only("lycoris_test::dbwd")

        def python_backward(ctx, grad):
            raise AssertionError("the Python backward ran")

        register_autograd("lycoris_test::dfwd", python_backward, setup_context=lambda ctx, inputs, output: None,
                          save=("x", "w"),
                          direct=BwdCall("lycoris_test::dbwd", ("grad", "x", "w", "k"), ("x", "w"), "base"))
    return torch.ops.lycoris_test.dfwd


def test_direct_backward_gradients_needs_and_dtypes():
    op = _direct_op()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    base = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = op(x, w, 1.5, base)
    assert y.grad_fn.name() == "lycoris_test::dfwdBackward"
    _direct_calls.clear()
    y.backward(torch.ones_like(y))
    assert _direct_calls == [1.5]
    torch.testing.assert_close(x.grad, 1.5 * w.detach())
    assert w.grad.dtype == torch.float32  # dbwd's fp64 result, cast to w's dtype
    torch.testing.assert_close(w.grad, 1.5 * x.detach())
    assert base.grad.dtype == torch.float64 and torch.equal(base.grad, torch.ones_like(base))
    # only base needs a gradient: the *_bwd op is not called
    _direct_calls.clear()
    (gb,) = torch.autograd.grad(op(x.detach(), w.detach(), 1.5, base).sum(), base)
    assert _direct_calls == [] and torch.equal(gb, torch.ones_like(base))
    # only w: the call happens, x's gradient is dropped
    (gw,) = torch.autograd.grad(op(x.detach(), w, 2.0).sum(), w)
    torch.testing.assert_close(gw, 2.0 * x.detach())


def test_direct_backward_graph_rules():
    op = _direct_op()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    y = op(x, w, 1.0)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * w)
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        y = op(x, w, 1.0, torch.zeros(3, 4))
    assert len(packed) == 2  # x and w, not base
    with pytest.raises(RuntimeError, match="double backward"):  # the *_bwd op is first order only
        (gx,) = torch.autograd.grad(op(x, w, 1.0).square().sum(), x, create_graph=True)
        gx.sum().backward()


def test_direct_backward_registration_is_checked():
    from lycoris_ops import _C as lycoris_C
    from lycoris_ops._library.autograd_kernel import BwdCall, register_autograd

    _direct_op()
    lib = torch.library.Library("lycoris_test", "FRAGMENT")
    lib.define("dfwd_bad(Tensor x, Tensor w, float k, Tensor? base=None) -> Tensor")
    fn = lambda *a: None  # noqa: E731
    with pytest.raises(ValueError, match="does not save"):  # w passed but not saved
        lycoris_C._register_autograd("lycoris_test::dfwd_bad", fn, [0], [], [], direct_op="lycoris_test::dbwd",
                                     direct_args=[-1, 0, 1, 2], direct_targets=[0, -1], direct_passthrough=3)
    with pytest.raises(ValueError, match="takes 4"):
        lycoris_C._register_autograd("lycoris_test::dfwd_bad", fn, [0, 1], [], [], direct_op="lycoris_test::dbwd",
                                     direct_args=[-1, 0, 1], direct_targets=[0, 1], direct_passthrough=3)
    with pytest.raises(ValueError, match="not a saved tensor argument"):
        lycoris_C._register_autograd("lycoris_test::dfwd_bad", fn, [0, 1], [], [], direct_op="lycoris_test::dbwd",
                                     direct_args=[-1, 0, 1, 2], direct_targets=[0, 3], direct_passthrough=-1)
    with pytest.raises(ValueError, match="passthrough 2 is not a tensor argument"):
        lycoris_C._register_autograd("lycoris_test::dfwd_bad", fn, [0, 1], [], [], direct_op="lycoris_test::dbwd",
                                     direct_args=[-1, 0, 1, 2], direct_targets=[0, 1], direct_passthrough=2)
    with pytest.raises(ValueError, match=r"names \['wx'\] are not arguments"):
        register_autograd("lycoris_test::dfwd_bad", fn, save=("x", "w"),
                          direct=BwdCall("lycoris_test::dbwd", ("grad", "x", "wx", "k"), ("x", "w"), "base"))


def _direct_cases():
    L = torch.ops.lycoris
    g = torch.Generator().manual_seed(7)

    def r(*s, dtype=torch.float32):
        return torch.randn(*s, generator=g).to(dtype)

    return {
        "lora_bypass_fwd": (L.lora_bypass_fwd, (r(5, 7), r(6, 3), r(3, 7), 0.5, r(5, 6, dtype=torch.float64))),
        "loha_bypass_fwd": (L.loha_bypass_fwd, (r(5, 7), r(6, 3), r(3, 7), r(6, 3), r(3, 7), 0.5, r(5, 6))),
        "lokr_bypass_fwd": (L.lokr_bypass_fwd, (r(5, 6), r(2, 3), r(4, 2), 0.5, r(5, 8))),
        "lokr_full_merge_fwd": (L.lokr_full_merge_fwd, (r(2, 3), r(4, 2), r(8, 6, dtype=torch.float64), 0.5)),
        "lokr_merge_fwd": (L.lokr_merge_fwd, (r(2, 2), r(2, 3), r(4, 2), None, [2, 3, 4, 2], r(8, 6), 0.5)),
        "ia3_fwd": (L.ia3_fwd, (r(5, 6, dtype=torch.bfloat16), r(6), 1, 1.0, 0.5)),
    }


@pytest.mark.parametrize("name", list(_direct_cases()))
def test_direct_backward_matches_the_python_formula(name):
    """The ops with a direct backward: the C++ call gives the gradients (values and dtypes)
    of the Python formula of record, for every subset of needed inputs."""
    import itertools

    from lycoris_ops._library.autograd_kernel import direct_backward

    op, args = _direct_cases()[name]
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    grad_out = None
    for k in range(1, len(where) + 1):
        for need in itertools.combinations(where, k):
            got = {}
            for direct in (True, False):
                call = [a.clone().requires_grad_(i in need) if isinstance(a, torch.Tensor) else a
                        for i, a in enumerate(args)]
                with direct_backward(direct):
                    y = op(*call)
                    grad_out = torch.randn_like(y) if grad_out is None else grad_out
                    got[direct] = torch.autograd.grad(y, [call[i] for i in need], grad_out)
            for a, b in zip(got[True], got[False]):
                assert a.dtype == b.dtype, (name, need)
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} {need}")
