"""Backend selection (dispatch.py, select.py, scope.py) on CPU.

Fused backends are mocked: op-set modules registered at run time that declare
``DEVICE_TYPES = ("cpu",)``, so ordering, narrowing, demotion and the compile
tier are exercised on CPU tensors through ``select.kernel`` (the same function
registry.py registers for CUDA). CUDA routing is checked with fake CUDA tensors
(``FakeTensorMode``), which ``choose`` can inspect without a GPU.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import types
import warnings
from contextlib import redirect_stdout

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lycoris_ops
from lycoris_ops.backends import registry as dispatch, scope, select

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Each test: no env setting, fresh probes/caches/demotions; restored afterwards."""
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    select.reset()
    yield
    select.reset()


class Calls:
    def __init__(self):
        self.log = []

    def make(self, tag, fn):
        def wrapped(*args):
            self.log.append(tag)
            return fn(*args)
        return wrapped


def _add(base, delta, gamma):
    return base + gamma * delta


def _bypass(x, up, down, gamma, base=None):
    y = gamma * (x @ down.T) @ up.T
    return y if base is None else y + base


def _ia3(x, w, channel_axis, alpha, gamma):
    shape = [1] * x.dim()
    shape[channel_axis] = -1
    return x * (alpha + gamma * w.reshape(shape))


def _oft(blocks, x, rescale, cscale, shift, weight):
    return x.clone()


def register(monkeypatch, name, ops, *, position=0, device_types=("cpu",), probe="torch", **attrs):
    """Register a mock fused backend ``name``: _PROBE, ORDER, FUSED and the op-set module."""
    pkg = types.ModuleType(f"lycoris_ops.backends.{name}")
    pkg.__path__ = []
    mod = types.ModuleType(f"lycoris_ops.backends.{name}.ops")
    mod.DEVICE_TYPES = device_types
    for k, v in {**ops, **attrs}.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, pkg.__name__, pkg)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(dispatch._PROBE, name, probe)
    order = list(dispatch.ORDER)
    order.insert(position, name)
    monkeypatch.setattr(dispatch, "ORDER", tuple(order))
    monkeypatch.setattr(dispatch, "FUSED", tuple(dispatch.FUSED) + (name,))
    dispatch.refresh()
    return mod


@pytest.fixture
def mocks(monkeypatch):
    """Only two mock fused backends (mocka before mockb), then compile and torch."""
    monkeypatch.setattr(dispatch, "ORDER", ("compile", "torch"))
    monkeypatch.setattr(dispatch, "FUSED", ())
    calls = Calls()
    register(monkeypatch, "mockb", {
        "add_scaled": calls.make("mockb", _add),
        "ia3_fwd": calls.make("mockb", _ia3),
        "oft_fwd": calls.make("mockb", _oft),
        "lora_bypass_fwd": calls.make("mockb", _bypass),
    }, position=0)
    register(monkeypatch, "mocka", {
        "add_scaled": calls.make("mocka", _add),
        "ia3_fwd": calls.make("mocka", _ia3),
        "oft_fwd": calls.make("mocka", _oft),
    }, position=0)
    assert dispatch.ORDER == ("mocka", "mockb", "compile", "torch")
    return calls


def kern(op, eager, calls=None, check=None):
    return select.kernel(op, calls.make("torch", eager) if calls else eager, check=check)


def tier_of(k):
    """The tiers the kernel's cache entries were chosen as."""
    return [t for t, _ in k._lycoris_state.meta.values()]


def bd(shape=(5, 7), dtype=torch.float32):
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


# ----------------------------------------------------------------------------- order and narrowing

def test_first_fused_backend_wins(mocks):
    k = kern("add_scaled", _add, mocks)
    b, d = bd()
    torch.testing.assert_close(k(b, d, 0.5), b + 0.5 * d)
    assert mocks.log == ["mocka"] and tier_of(k) == ["mocka"]
    assert select.choose([b, d], op="add_scaled") == "mocka"


def test_later_tiers_not_probed_when_the_first_takes_the_call(mocks, monkeypatch):
    """The walk probes a tier only when it reaches it: a call the first fused tier takes
    never imports the later ones (TileLang, torch._dynamo cost seconds at first use)."""
    probed = []
    real = dispatch.serves
    monkeypatch.setattr(dispatch, "serves", lambda n, dev, **kw: probed.append(n) or real(n, dev, **kw))
    b, d = bd()
    assert select.choose([b, d], op="add_scaled") == "mocka"
    assert probed == ["mocka"]
    assert dispatch.candidates(b.device) == ("mocka", "mockb", "torch")  # the eager list still has them all


def test_op_absent_steps_to_the_other_fused_backend(mocks):
    k = kern("lora_bypass_fwd", _bypass, mocks)
    x, up, down = torch.randn(6, 8), torch.randn(9, 4), torch.randn(4, 8)
    torch.testing.assert_close(k(x, up, down, 2.0), _bypass(x, up, down, 2.0))
    assert mocks.log == ["mockb"]


def test_rank_past_register_budget_steps_down(mocks):
    k = kern("lora_bypass_fwd", _bypass, mocks)
    x = torch.randn(3, 8)
    k(x, torch.randn(9, 128), torch.randn(128, 8), 1.0)  # padded rank 128: in scope
    k(x, torch.randn(9, 129), torch.randn(129, 8), 1.0)  # padded rank 256: eager (CPU: no compile)
    assert mocks.log == ["mockb", "torch"]


def test_per_backend_limit_steps_to_the_other_fused_backend(mocks, monkeypatch):
    monkeypatch.setitem(scope._OFT_LIMITS["block"], "mocka", 32)
    assert scope.limit("oft_fwd", "block", "mocka") == 32
    assert scope.limit("oft_fwd", "block", "mockb") == 64
    assert scope.limit("oft_fwd", "block", "triton") == 64
    assert scope.limit("oft_fwd", "block", "tilelang") == 64
    assert scope.limit("boft_fwd", "block", "triton") == 64
    k = kern("oft_fwd", _oft, mocks)
    x = torch.randn(2 * 48, 5)
    k(torch.randn(2, 20, 20), torch.randn(40, 5), None, 1.0, True, True)  # S=20 -> 32: mocka
    k(torch.randn(2, 48, 48), x, None, 1.0, True, True)  # S=48 -> 64: mockb
    k(torch.randn(1, 96, 96), torch.randn(96, 5), None, 1.0, True, True)  # S=96 -> 128: eager
    assert mocks.log == ["mocka", "mockb", "torch"]


def test_conv_layout_where_the_kernel_is_written_for_linear(mocks, monkeypatch):
    s = scope.SCOPE["ia3_fwd"]
    monkeypatch.setitem(scope.SCOPE, "ia3_fwd", dataclasses.replace(
        s, layouts={"mocka": frozenset({"linear"})}))
    k = kern("ia3_fwd", _ia3, mocks)
    w = torch.randn(6)
    k(torch.randn(4, 6), w, -1, 1.0, 0.5)  # linear: mocka
    k(torch.randn(2, 6, 3, 3), w, 1, 1.0, 0.5)  # conv (channels on dim 1): mocka skipped
    assert mocks.log == ["mocka", "mockb"]
    assert "conv layout" in scope.why_not("ia3_fwd", "mocka", (torch.randn(2, 6, 3), w, 1, 1.0, 0.5))


def test_tucker_rank_limit_is_checked():
    a1, t1, b1 = torch.randn(5, 65), torch.randn(65, 65, 9), torch.randn(65, 4)
    assert "tucker_rank 65 > 64" in scope.why_not("lora_tucker_fwd", "triton", (a1, t1, b1, None, None, None, 1.0))
    t1 = torch.randn(64, 64, 9)
    assert scope.supported("lora_tucker_fwd", "triton", (a1[:, :64], t1, b1[:64], None, None, None, 1.0))


def test_every_op_has_a_scope_entry_and_a_schema_signature():
    assert set(scope.SCOPE) == set(lycoris_ops.OP_NAMES)
    for op in lycoris_ops.OP_NAMES:
        k = select.kernel(op, lambda *a: None, check=None)
        names = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]
        assert list(inspect.signature(k).parameters) == names
        assert k.__name__ == op


def test_named_backend_is_narrowed_and_never_jumps_to_the_other(mocks):
    dispatch.set_backend("mockb")
    assert dispatch.candidates(CPU) == ("mockb", "torch")
    k = kern("add_scaled", _add, mocks)
    b, d = bd()
    k(b, d, 1.0)
    dispatch.set_backend("mocka")
    assert dispatch.candidates(CPU) == ("mocka", "torch")
    k2 = kern("lora_bypass_fwd", _bypass, mocks)  # mocka lacks it; mockb has it
    k2(torch.randn(3, 8), torch.randn(5, 4), torch.randn(4, 8), 1.0)
    assert mocks.log == ["mockb", "torch"]


def test_named_torch_and_compile_tiers(mocks):
    dispatch.set_backend("torch")
    assert dispatch.candidates(CPU) == ("torch",)
    assert select.choose(bd()) == "torch"
    dispatch.set_backend("compile")
    assert dispatch.candidates(CPU) == ("compile", "torch")
    assert select.choose(bd()) == "compile"


# ----------------------------------------------------------------------------- generic scope rules

def test_cpu_tensors_go_eager_with_the_real_backends():
    b, d = bd()
    for name in dispatch.FUSED:  # an op set serving CPU (e.g. a Triton interpreter build) would take them
        module = dispatch.opset(name)
        if module is not None and "cpu" in dispatch.device_types(module):
            pytest.skip(f"the {name} op set serves CPU tensors in this process")
    assert select.choose([b, d]) == "torch"
    assert select.choose([b, d], op="add_scaled", args=(b, d, 1.0)) == "torch"
    assert dispatch.resolve_backend("cpu") == "torch"
    assert dispatch.available_backends("cpu") == ("torch",)


def test_mixed_fp16_bf16_steps_down(mocks):
    h, b = torch.randn(3, dtype=torch.float16), torch.randn(3, dtype=torch.bfloat16)
    assert select.choose([h, b]) == "torch"
    assert select.choose([h, h.clone()]) == "mocka"
    assert select.choose([b, b.clone()]) == "mocka"
    assert select.choose([h, torch.randn(3)]) == "mocka"  # fp32 with a 16-bit type is fine


def test_float64_and_empty_operands_step_down(mocks):
    assert select.choose([torch.randn(3, dtype=torch.float64)]) == "torch"
    assert select.choose([torch.randn(0, 4)]) == "torch"
    mocks_mod = sys.modules["lycoris_ops.backends.mocka.ops"]
    mocks_mod.DTYPES = (torch.float32, torch.float64)  # an op set may widen its dtypes
    try:
        assert select.choose([torch.randn(3, dtype=torch.float64)]) == "mocka"
    finally:
        del mocks_mod.DTYPES


def test_scale_with_grad_goes_eager(mocks):
    ts = bd()
    g = torch.tensor(0.5, requires_grad=True)
    assert select.choose(ts, scales=(g,)) == "torch"
    assert select.choose(ts, scales=(torch.tensor(0.5),)) == "mocka"  # no grad: fine
    assert select.choose(ts, scales=(0.5,)) == "mocka"
    assert not scope.static_scale(0.5, g) and scope.static_scale(0.5, torch.tensor(1.0))
    dispatch.set_backend("compile")
    assert select.choose(ts, scales=(g,)) == "torch"  # never the compile tier either


def test_callers_supported_test(mocks):
    ts = bd()
    assert select.choose(ts, False) == "torch"
    assert select.choose(ts, lambda b: b != "mocka") == "mockb"
    assert select.choose(ts, True) == "mocka"


def test_compile_tier_on_cpu_only_when_named(mocks):
    ts = bd()
    assert select.choose(ts, False) == "torch"
    dispatch.set_backend("compile")
    assert select.choose(ts, False) == "compile"
    assert "compile" in dispatch.available_backends("cpu")
    dispatch.set_backend("auto")
    assert "compile" not in dispatch.available_backends("cpu")


def test_cuda_routing_with_fake_cuda_tensors(monkeypatch):
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setitem(dispatch._capability, cuda0, (9, 0))
    calls = Calls()
    monkeypatch.setattr(dispatch, "ORDER", ("compile", "torch"))
    monkeypatch.setattr(dispatch, "FUSED", ())
    register(monkeypatch, "mockcuda", {"add_scaled": calls.make("mockcuda", _add)}, device_types=("cuda",))
    with FakeTensorMode():
        b, d = torch.empty(4, 5, device="cuda"), torch.empty(4, 5, device="cuda")
        h = torch.empty(4, 5, device="cuda", dtype=torch.float16)
        z = torch.empty(4, 5, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(4, 5)
    assert select.choose([b, d], op="add_scaled") == "mockcuda"
    assert select.choose([b, d], op="ia3_fwd") == "compile"  # op absent: compile tier on CUDA
    assert select.choose([h, z]) == "compile"
    assert select.choose([b, c]) == "torch"  # mixed devices
    monkeypatch.setitem(dispatch._capability, cuda0, (7, 5))
    dispatch.refresh()
    assert select.choose([z, z]) == "compile"  # bf16 before sm_80
    assert select.choose([h, h]) == "mockcuda"


def test_triton_needs_sm80_unless_named(monkeypatch):
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setitem(dispatch._capability, cuda0, (7, 5))
    register(monkeypatch, "triton", {"add_scaled": _add}, device_types=("cuda",), position=0)
    monkeypatch.setattr(dispatch, "ORDER", ("triton", "compile", "torch"))
    monkeypatch.setattr(dispatch, "FUSED", ("triton",))
    dispatch.refresh()
    assert dispatch.candidates(cuda0) == ("compile", "torch")
    dispatch.set_backend("triton")
    assert dispatch.candidates(cuda0) == ("triton", "compile", "torch")


# ----------------------------------------------------------------------------- env and settings

def test_env_var_parsing(monkeypatch):
    for value, expect in (("auto", "auto"), ("", "auto"), (" Torch ", "torch"), ("compile", "compile"),
                          ("TRITON", "triton")):
        monkeypatch.setenv(dispatch.ENV_BACKEND, value)
        dispatch.refresh()
        if expect != "auto" and not dispatch._probe(expect):
            continue
        assert dispatch.backend_setting() == expect
    monkeypatch.setenv(dispatch.ENV_BACKEND, "cuda")
    dispatch.refresh()
    with pytest.raises(ValueError, match="LYCORIS_KERNEL_BACKEND='cuda'.*valid values: auto, triton, tilelang, "
                                         "compile, torch"):
        dispatch.backend_setting()
    with pytest.raises(ValueError, match="valid values"):
        select.kernel("add_scaled", _add, check=None)(*bd(), 1.0)


def test_env_is_read_once(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    dispatch.refresh()
    assert dispatch.backend_setting() == "torch"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "compile")
    assert dispatch.backend_setting() == "torch"
    dispatch.set_backend(None)  # re-read
    assert dispatch.backend_setting() == "compile"


def test_unavailable_named_backend(monkeypatch):
    monkeypatch.setitem(dispatch._PROBE, "tilelang", "no_such_module_for_lycoris_tests")
    dispatch.refresh()
    assert "tilelang" not in dispatch.available_backends()
    assert "tilelang" not in dispatch.fused_backends()
    with pytest.raises(ValueError, match=r"'tilelang' is not available.*installed: .*torch"):
        dispatch.set_backend("tilelang")
    with pytest.warns(RuntimeWarning, match="installed"):
        dispatch.set_backend("tilelang", strict=False)
    assert dispatch.backend_setting() == "auto"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "tilelang")
    dispatch.refresh()
    with pytest.warns(RuntimeWarning, match=r"LYCORIS_KERNEL_BACKEND=tilelang.*installed: .*Using auto"):
        assert dispatch.backend_setting() == "auto"
    with pytest.raises(ValueError, match="valid values"):
        dispatch.set_backend("cuda")


def test_use_backend_restores_and_clears_caches(mocks):
    check_calls = []
    k = select.kernel("add_scaled", _add, check=lambda *a: check_calls.append(1))
    b, d = bd()
    k(b, d, 1.0)
    with dispatch.use_backend("mockb") as name:
        assert name == "mockb"
        k(b, d, 1.0)
    k(b, d, 1.0)
    assert mocks.log == ["mocka", "mockb", "mocka"]
    assert len(check_calls) == 3  # every setting change drops the cached choice
    assert dispatch.backend_setting() == "auto"


def test_public_api():
    for name in ("available_backends", "fused_backends", "resolve_backend", "set_backend", "use_backend"):
        assert getattr(lycoris_ops, name) is getattr(dispatch, name)
    assert dispatch.ORDER[-1] == "torch" and set(dispatch.FUSED) <= set(dispatch.ORDER)
    assert set(dispatch._PROBE) >= set(dispatch.ORDER)
    assert dispatch.resolve_backend() == dispatch.available_backends()[0]


# ----------------------------------------------------------------------------- the cached hot path

def test_validation_and_choice_cached_per_key(mocks):
    checks = []
    k = select.kernel("add_scaled", mocks.make("torch", _add), check=lambda *a: checks.append(a))
    b, d = bd()
    for gamma in (0.5, 1.0, 2.0):  # floats are not part of the key
        torch.testing.assert_close(k(b, d, gamma), b + gamma * d)
    assert len(checks) == 1
    k(b[:, ::2], d[:, ::2], 1.0)  # another shape and layout: a new key
    k(b.double(), d.double(), 1.0)  # another dtype: a new key (eager: fp64)
    assert len(checks) == 3
    assert mocks.log == ["mocka"] * 4 + ["torch"]


def test_validation_errors_come_from_the_check(mocks):
    def check(base, delta, gamma):
        if base.shape != delta.shape:
            raise ValueError("lycoris.add_scaled: delta must match base")
    k = select.kernel("add_scaled", _add, check=check)
    with pytest.raises(ValueError, match="delta must match"):
        k(torch.randn(3), torch.randn(4), 1.0)
    assert mocks.log == []


def test_default_check_is_the_familys():
    from lycoris_ops import reference
    check = reference.check("add_scaled")
    k = select.kernel("add_scaled", _add)
    assert k._lycoris_state.check is check


# ----------------------------------------------------------------------------- demotion

def test_fused_failure_demotes_with_one_warning(mocks):
    def broken(*args):
        mocks.log.append("broken")
        raise RuntimeError("no kernel image is available for execution on the device")
    sys.modules["lycoris_ops.backends.mocka.ops"].add_scaled = broken
    k = kern("add_scaled", _add, mocks)
    b, d = bd()
    with pytest.warns(RuntimeWarning, match=r"'mocka' failed in lycoris.add_scaled on cpu .*no kernel image"):
        out = k(b, d, 3.0)
    torch.testing.assert_close(out, b + 3.0 * d)
    assert mocks.log == ["broken", "mockb"]
    assert ("mocka", CPU) in dispatch.demotions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k(b, d, 3.0)
        k2 = kern("ia3_fwd", _ia3, mocks)  # the whole backend is demoted on this device
        k2(torch.randn(4, 6), torch.randn(6), -1, 1.0, 1.0)
    assert mocks.log == ["broken", "mockb", "mockb", "mockb"]
    assert "mocka" not in dispatch.available_backends("cpu")
    select.reset()
    assert ("mocka", CPU) not in dispatch.demotions()


def test_every_fused_tier_failing_ends_in_eager(mocks):
    def broken(*args):
        raise RuntimeError("launch failed")
    sys.modules["lycoris_ops.backends.mocka.ops"].add_scaled = broken
    sys.modules["lycoris_ops.backends.mockb.ops"].add_scaled = broken
    k = kern("add_scaled", _add, mocks)
    b, d = bd()
    with pytest.warns(RuntimeWarning) as rec:
        torch.testing.assert_close(k(b, d, 1.0), b + d)
    assert sorted(str(w.message).split("'")[1] for w in rec) == ["mocka", "mockb"]
    assert mocks.log == ["torch"]


def test_out_of_memory_and_eager_errors_are_not_demotions(mocks):
    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")
    sys.modules["lycoris_ops.backends.mocka.ops"].add_scaled = oom
    k = kern("add_scaled", _add, mocks)
    with pytest.raises(torch.OutOfMemoryError):
        k(*bd(), 1.0)
    assert not dispatch.demotions()

    def bad(*args):
        raise RuntimeError("eager body error")
    dispatch.set_backend("torch")
    k2 = select.kernel("add_scaled", bad, check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="eager body error"):
            k2(*bd(), 1.0)
    assert not dispatch.demotions()


# ----------------------------------------------------------------------------- the compile tier

@pytest.fixture
def fake_compile(monkeypatch):
    """Replace torch.compile by a counting wrapper (no Inductor on 2 shared cores)."""
    log = {"compiles": 0, "calls": 0}

    def compile_(fn):
        log["compiles"] += 1

        def compiled(*args):
            log["calls"] += 1
            return fn(*args)
        return compiled
    monkeypatch.setattr(select, "_torch_compile", compile_)
    return log


def _fresh_body():
    def body(base, delta, gamma):
        return base + gamma * delta
    return body


def test_compile_tier_compiles_once_per_op(mocks, fake_compile):
    dispatch.set_backend("compile")
    body = _fresh_body()
    k = select.kernel("add_scaled", body, check=None)
    b, d = bd()
    torch.testing.assert_close(k(b, d, 2.0), b + 2 * d)
    k(b, d, 1.0)
    k(*bd((3, 3)), 1.0)  # a new key reuses the op's compiled body
    k2 = select.kernel("add_scaled", body, check=None)  # the cache lives on the function object
    k2(b, d, 1.0)
    assert fake_compile == {"compiles": 1, "calls": 4}
    assert callable(body._lycoris_compiled)
    assert mocks.log == []


def test_compile_not_started_while_compiling_or_capturing(mocks, fake_compile, monkeypatch):
    dispatch.set_backend("compile")
    k = select.kernel("add_scaled", _fresh_body(), check=None)
    b, d = bd()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(k(b, d, 2.0), b + 2 * d)
    assert fake_compile["calls"] == 0  # eager ran
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    k(b, d, 2.0)
    assert fake_compile["calls"] == 1
    monkeypatch.setattr(select, "_capturing", lambda device: True)
    k(*bd((2, 2)), 1.0)  # a new key first met under capture: eager
    assert fake_compile["calls"] == 1
    k(b, d, 1.0)  # a warm key keeps the compiled body
    assert fake_compile["calls"] == 2


def test_compile_tier_returns_contiguous_outputs(mocks, monkeypatch):
    """Inductor on CUDA can pad an output's row stride (19 -> 20); the tier hands back what
    the fake promises, contiguous, so a compiled graph's stride assertion holds."""
    def padded(t):
        store = t.new_zeros(t.shape[0], t.shape[1] + 1)
        store[:, : t.shape[1]] = t
        return store[:, : t.shape[1]]

    def compile_(fn):
        def compiled(*args):
            out = fn(*args)
            return tuple(padded(o) for o in out) if isinstance(out, tuple) else padded(out)
        return compiled
    monkeypatch.setattr(select, "_torch_compile", compile_)
    dispatch.set_backend("compile")
    b, d = bd((5, 19))
    out = select.kernel("add_scaled", _fresh_body(), check=None)(b, d, 2.0)
    assert out.is_contiguous() and out.stride() == (19, 1)
    torch.testing.assert_close(out, b + 2 * d)

    def pair(base, delta, gamma):
        return base + gamma * delta, base - delta
    outs = select.kernel("add_scaled", pair, check=None)(b, d, 2.0)
    assert isinstance(outs, tuple) and all(o.is_contiguous() for o in outs)
    torch.testing.assert_close(outs[1], b - d)


def test_compile_failure_demotes_the_tier(mocks, monkeypatch):
    def compile_(fn):
        def compiled(*args):
            raise RuntimeError("BackendCompilerFailed: inductor exploded")
        return compiled
    monkeypatch.setattr(select, "_torch_compile", compile_)
    dispatch.set_backend("compile")
    k = select.kernel("add_scaled", _fresh_body(), check=None)
    b, d = bd()
    with pytest.warns(RuntimeWarning, match="'compile' failed.*inductor exploded"):
        torch.testing.assert_close(k(b, d, 2.0), b + 2 * d)
    assert ("compile", CPU) in dispatch.demotions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(k(b, d, 2.0), b + 2 * d)
    assert tier_of(k) == ["torch"]


def _scratch_lib(name, kernel_fn):
    lib = torch.library.Library(name, "DEF")
    lib.define("add_scaled(Tensor base, Tensor delta, float gamma) -> Tensor")
    lib.impl("add_scaled", kernel_fn, "CPU")
    torch.library.register_fake(f"{name}::add_scaled", lambda base, delta, gamma: torch.empty_like(base), lib=lib)
    return lib


def test_real_compile_tier_inside_a_dispatcher_kernel(monkeypatch):
    """torch.compile (backend eager: Dynamo without Inductor) of an eager body, run
    from inside an op's kernel, with inputs that require grad."""
    monkeypatch.setattr(select, "_torch_compile", lambda fn: torch.compile(fn, backend="eager"))
    body = _fresh_body()
    lib = _scratch_lib("lycoris_test_compile", select.cpu_kernel("add_scaled", body))
    try:
        dispatch.set_backend("compile")
        b, d = bd()
        out = torch.ops.lycoris_test_compile.add_scaled(b, d, 2.0)
        torch.testing.assert_close(out, b + 2 * d)
        assert hasattr(body, "_lycoris_compiled")
        dispatch.set_backend("auto")
        assert not select._routes_cpu()
    finally:
        lib._destroy()


def test_choice_stays_at_run_time_under_torch_compile(mocks):
    """A compiled graph keeps the op opaque: switching the backend after compiling
    changes which tier runs, without a recompile."""
    lib = _scratch_lib("lycoris_test_opaque", select.kernel("add_scaled", mocks.make("torch", _add), check=None))
    try:
        op = torch.ops.lycoris_test_opaque.add_scaled
        f = torch.compile(lambda b, d: op(b, d, 0.5) * 2, fullgraph=True, backend="eager")
        b, d = bd()
        torch.testing.assert_close(f(b, d), (b + 0.5 * d) * 2)
        dispatch.set_backend("mockb")
        f(b, d)
        dispatch.set_backend("torch")
        f(b, d)
        assert mocks.log == ["mocka", "mockb", "torch"]
    finally:
        lib._destroy()


# ----------------------------------------------------------------------------- adding a backend

def test_registering_a_backend_is_all_it_takes(monkeypatch):
    calls = Calls()
    register(monkeypatch, "newbk", {"add_scaled": calls.make("newbk", _add)}, position=0)
    assert dispatch.available_backends()[0] == "newbk"
    assert "newbk" in dispatch.fused_backends()
    assert "newbk" in dispatch.fused_backends("cpu")
    assert dispatch.resolve_backend() == "newbk"
    assert dispatch.resolve_backend("cpu") == "newbk"
    assert "newbk" in dispatch.valid_values()
    k = select.kernel("add_scaled", _add, check=None)
    b, d = bd()
    torch.testing.assert_close(k(b, d, 1.5), b + 1.5 * d)
    assert calls.log == ["newbk"]
    dispatch.set_backend("newbk")
    assert select.explain("add_scaled", b, d, 1.0) in ("newbk", "torch")  # torch unless CPU calls are routed
    select.route_cpu(True)
    try:
        assert select.explain("add_scaled", b, d, 1.0) == "newbk"
        steps = select.trace("lora_bypass_fwd", torch.randn(2, 3), torch.randn(4, 2), torch.randn(2, 3), 1.0)
        assert steps[0] == ("newbk", "the op set has no lora_bypass_fwd") and steps[-1] == ("torch", None)
    finally:
        select.route_cpu(False)


def test_a_backend_whose_import_fails_is_absent(monkeypatch):
    register(monkeypatch, "brokenbk", {"add_scaled": _add}, probe="no_such_module_for_lycoris_tests")
    assert "brokenbk" not in dispatch.available_backends()
    assert "brokenbk" not in dispatch.fused_backends()
    assert "no_such_module" in dispatch.probe_error("brokenbk")
    assert select.choose(bd()) == "torch"


# ----------------------------------------------------------------------------- python -m lycoris_ops

def test_main_prints_the_diagnostics():
    from lycoris_ops.__main__ import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--why"]) == 0
    text = out.getvalue()
    for needle in ("torch ", "triton ", "tilelang ", "lycoris_ops ", "devices:", "available:", "tuning table:",
                   "LYCORIS_KERNEL_BACKEND", "lora_bypass_fwd", "add_scaled"):
        assert needle in text, needle
    assert sum(op in text for op in lycoris_ops.OP_NAMES) == len(lycoris_ops.OP_NAMES)


# ----------------------------------------------------------------------------- the shared case tables

def _table_cases():
    from lycoris_ops import testing

    out = []
    for fam in testing.FAMILIES:
        try:
            out += testing.cases(fam)
        except Exception:  # a family's table being written: its own tests report it
            continue
    return out


def test_scope_rules_run_on_every_shared_case():
    for case in _table_cases():
        args = select._full_args(case.op, case.args)
        for backend in ("triton", "tilelang"):
            why = scope.why_not(case.op, backend, args)
            assert why is None or isinstance(why, str)


def test_selecting_kernel_equals_the_cpu_op_on_every_shared_case():
    """The generated kernel (what CUDA registers), run on CPU tensors with the real
    eager bodies and checks: takes the eager tier and returns the CPU op's result."""
    from lycoris_ops import reference

    kernels = {}
    for case in _table_cases():
        body = reference.eager(case.op)
        if body is None:
            continue
        k = kernels.setdefault(case.op, select.kernel(case.op, body))
        got, want = k(*case.args), case()
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert set(tier_of(k)) == {"torch"}


def test_use_backend_restores_the_env_setting(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_BACKEND, "torch")
    dispatch.refresh()
    with dispatch.use_backend("auto"):
        assert dispatch.backend_setting() == "auto"
    assert dispatch.backend_setting() == "torch"
    monkeypatch.setenv(dispatch.ENV_BACKEND, "bogus")
    dispatch.refresh()
    with dispatch.use_backend("torch"):  # overriding an invalid env works
        assert dispatch.backend_setting() == "torch"
    with pytest.raises(ValueError, match="valid values"):
        dispatch.backend_setting()  # and the invalid value is back afterwards


def test_clear_caches_forgets_the_cached_choices():
    """lycoris_ops.clear_caches(): the per-call choices, the tuner's memo and each loaded op
    set's caches are empty after it, and the next call answers as before."""
    import lycoris_ops
    from lycoris_ops.tuner import tune

    b, d = bd()
    want = torch.ops.lycoris.add_scaled(b, d, 0.5)
    k = select.kernel("add_scaled", _add)
    k(b, d, 0.5)
    assert k._lycoris_state.cache
    lycoris_ops.clear_caches()
    assert not k._lycoris_state.cache and not tune._memo
    torch.testing.assert_close(torch.ops.lycoris.add_scaled(b, d, 0.5), want)
