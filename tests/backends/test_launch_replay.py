"""The CUDA key's C++ kernel replays a seen call signature's recorded Triton launches
(csrc/launch.cpp, lycoris_ops/_library/launch_record.py).

On CPU (CI): the recorder's rules: which aten ops a recorded call may run, how device
addresses map to inputs and allocations, how outputs map to allocations. On CUDA,
with the kernel built: every op's replayed calls against eager, the plans made where
the Triton tier serves a call and only there, CUDA graph capture of replayed calls,
and a backend change dropping the plans."""
from __future__ import annotations

import functools
import importlib
import os
import sys

import pytest
import torch

import lycoris_ops
from lycoris_ops import _C
from lycoris_ops import reference
from lycoris_ops._library import launch_record as _launch_record, register as registry
from lycoris_ops.testing import cases, check_bf16_against_eager


def needs_replay(test):
    """A CUDA test (the gpu marker) of _C's CUDA launch path (skipped where _C was built without it)."""
    return pytest.mark.gpu(pytest.mark.skipif(not registry.replay_enabled(),
                                              reason="_C is built without its CUDA launch path")(test))


def _watched(fn):
    watch = _launch_record._Watch()
    with watch:
        out = fn()
    return watch, out


def test_recorder_allows_allocations_zero_fills_and_views_only():
    x = torch.randn(6, 4)
    watch, out = _watched(lambda: (torch.empty(3, 4), torch.zeros(5), torch.empty(8).zero_(), x.t()[1:],
                                   torch.promote_types(x.dtype, torch.float16), torch.result_type(x, 2)))
    assert watch.refusal is None  # dtype arithmetic touches no tensor
    assert [(tuple(t.shape), z) for t, z in watch.allocs] == [((3, 4), False), ((5,), True), ((8,), True)]
    watch, _ = _watched(lambda: torch.empty(8)[2:].zero_())  # a part: the plan cannot say so
    assert watch.refusal and "part" in watch.refusal
    for compute in (lambda: x @ x.t(), lambda: x + 1, lambda: x.contiguous().t().contiguous(), lambda: x.sum().item()):
        watch, _ = _watched(compute)
        assert watch.refusal is not None


def test_every_triton_kernel_fits_a_replayed_launch():
    """csrc/launch.cpp replays a launch of at most ``MAX_LAUNCH_PARAMS`` parameters (the kernel's
    runtime ones and Triton's two scratch pointers); the recorder refuses more, which would
    leave that call in Python. Every Triton kernel of ours fits (a count of its non-constexpr
    parameters: an upper bound, since a launch also specializes ints equal to 1)."""
    import inspect
    import pkgutil

    import lycoris_ops.backends.triton.kernels as package

    counts = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a @triton.jit kernel, compiled or interpreted
            if callable(fn) and hasattr(obj, "arg_names") and fn.__module__ == module.__name__:
                params = inspect.signature(fn).parameters.values()
                counts[f"{info.name}.{name}"] = sum("constexpr" not in str(p.annotation) for p in params)
    assert len(counts) > 40 and "lokr._kron_grad_kernel" in counts
    over = {k: n + 2 for k, n in counts.items() if n + 2 > _launch_record.MAX_LAUNCH_PARAMS}
    assert not over, over


def test_foreign_work_refuses_the_plan():
    """A call that puts work on the GPU through a library the recorder cannot see (cuBLASLt by
    ctypes, ``_cublaslt.addmm``) gets no plan: a replay would skip that work."""
    def kernel(x):
        _launch_record.foreign_work("cublasLtMatmul")
        return torch.empty_like(x)

    record = _launch_record.recorder("test_foreign", kernel, lambda *a: "triton")
    out, plan = record(torch.randn(3))
    assert plan is None and out.shape == (3,)
    assert "cublasLtMatmul" in _launch_record.refusals["test_foreign"]
    _launch_record.foreign_work("outside a recording")  # no recording: nothing to refuse, no state left
    out, plan = _launch_record.recorder("test_plain", lambda x: torch.empty_like(x), lambda *a: "triton")(torch.randn(2))
    assert plan is not None


def test_a_deferred_tuning_defers_the_plan():
    """A recorded call that ran a deferred key's first config (the tuner counts it:
    ``tune.deferred_calls``) gets no plan (a replay would keep a config that is not the key's
    final pick); the key's final pick clears every plan (``register.py`` hooks
    ``_C._clear_launch_plans`` on ``tune.on_deferred_final``), so the signature is recorded again."""
    from lycoris_ops.tuner import tune

    def kernel(x):
        tune._count_deferred()  # what select_config does when it answers with a first config
        return torch.empty_like(x)

    out, plan = _launch_record.recorder("test_deferred", kernel, lambda *a: "triton")(torch.randn(3))
    assert plan is None and out.shape == (3,)
    assert "deferred" in _launch_record.refusals["test_deferred"]
    out, plan = _launch_record.recorder("test_settled", lambda x: torch.empty_like(x), lambda *a: "triton")(torch.randn(2))
    assert plan is not None
    if registry.replay_enabled():
        assert _C._clear_launch_plans in tune._final_hooks


def test_plan_maps_outputs_and_refuses_strangers():
    x = torch.randn(5, 3)
    watch, out = _watched(lambda: torch.empty(4, 6)[:, 2:])
    plan, why = _launch_record.plan_of((x, 0.5), out, watch, [], x.device)
    assert why is None
    device, allocs, outs, launches = plan
    assert allocs == [([4, 6], [6, 1], torch.float32, 96, [])] and launches == []
    assert outs == [(0, 2, [4, 4], [6, 1])]  # a view of allocation 0 at element offset 2
    stranger = torch.empty(3)
    plan, why = _launch_record.plan_of((x,), stranger, _launch_record._Watch(), [], x.device)
    assert plan is None and "output" in why
    # device addresses: inside an input (by its own extent) or an allocation, else nothing
    view = x[1:, 1:]
    inputs = [(0, view)]
    assert _launch_record._pointer(view.data_ptr() + 4, inputs, []) == (0, 0, 4)
    assert _launch_record._pointer(x.data_ptr(), inputs, []) is None  # before the view's first element
    assert _launch_record._pointer(watch.allocs[0][0].data_ptr() + 8, [], watch.allocs) == (1, 0, 8)


def test_plan_drops_unused_allocations_and_packs_workspaces():
    """One allocation per output; what no output or launch uses is not allocated; the
    workspaces ride past the largest output's end (512-byte aligned) when small, else in
    one allocation of their own; zero fills become byte ranges of the allocation."""
    R = _launch_record
    # a launcher's discarded empty side output and an unused scratch: no allocation
    watch, out = _watched(lambda: (torch.empty(3, 4), torch.empty(0), torch.zeros(7)))
    plan, why = R.plan_of((), out[0], watch, [], torch.device("cpu"))
    assert why is None and plan[1] == [([3, 4], [4, 1], torch.float32, 48, [])] and plan[2] == [(0, 0, [3, 4], [4, 1])]
    big, small, ws1, ws2 = torch.empty(64, 8), torch.empty(5, dtype=torch.float16), torch.zeros(10), torch.empty(3)
    allocs = [[big, False], [small, False], [ws1, True], [ws2, False]]
    kept, where = R._layout(allocs, {0, 1}, {0, 1, 2, 3})
    assert kept == [[0, 2048 + 512 + 12], [1, 10]]  # past big's 2048 bytes: ws1 at 2048, ws2 at 2560
    assert where == {0: (0, 0), 1: (1, 0), 2: (0, 2048), 3: (0, 2560)}
    # too large for a tail (over PACK_TAIL_BYTES and over the largest output): one pack of their own
    huge = torch.empty(R.PACK_TAIL_BYTES // 4 + 1)
    kept, where = R._layout([[small, False], [huge, True], [ws2, False]], {0}, {0, 1, 2})
    assert kept == [[0, 10], [1, R._align(huge.nbytes) + 12]] and where == {0: (0, 0), 1: (1, 0), 2: (1, R._align(huge.nbytes))}
    # an empty side output that a launch is passed (0 bytes, sorted first) never carries the pack
    empty = torch.empty(0)
    kept, where = R._layout([[small, False], [empty, False], [huge, True]], {0}, {0, 1, 2})
    assert kept == [[0, 10], [2, R._align(huge.nbytes)]] and where == {0: (0, 0), 2: (1, 0), 1: (1, R._align(huge.nbytes))}
    # no output at all (every result a view of inputs is refused earlier): the pack stands alone
    kept, where = R._layout([[ws1, True], [ws2, False]], set(), {0, 1})
    assert kept == [[0, 512 + 12]] and where == {0: (0, 0), 1: (0, 512)}


@needs_replay
@pytest.mark.parametrize("case", [c for c in cases() if c.tensors()], ids=lambda c: f"{c.op}-{c.id}")
def test_replayed_calls_match_eager(case):
    """Each op called five times with fresh data of one signature (bf16): Python twice,
    recorded once, then replayed from the plan (or Python again where no plan was
    made); every result against the eager body."""
    torch.manual_seed(0)
    base = case.to(device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        check_bf16_against_eager(base.to())  # same geometry, new buffers
    seen, planned, python_only = _C._launch_plan_stats(f"lycoris::{case.op}")
    assert seen >= 1 and planned + python_only >= 1  # the third call decided


@needs_replay
@pytest.mark.parametrize("factored", [False, True], ids=["full", "factored"])
def test_replayed_workspace_pack_of_its_own(factored, monkeypatch):
    """A LoKr merge backward whose fp32 partials outgrow its outputs: the workspaces get an
    allocation of their own, and the launch is also passed the empty (0,) gradient of an
    absent factor. Replayed, the pack's address is its storage's (an H200 bench faulted when
    the empty tensor carried the pack and its null data_ptr() was used)."""
    plans = []
    real = _launch_record.plan_of

    def spy(*a, **k):
        plan, why = real(*a, **k)
        plans.append(plan)
        return plan, why

    monkeypatch.setattr(_launch_record, "plan_of", spy)
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    op = "lokr_merge_bwd" if factored else "lokr_full_merge_bwd"
    _C._clear_launch_plans()  # the counts are per process: another test's plan of this op (xdist) is not this one
    w1 = torch.randn(32, 32, device=dev, dtype=dt)
    w2a, w2b = torch.randn(32, 4, device=dev, dtype=dt), torch.randn(4, 32, device=dev, dtype=dt)
    for _ in range(5):
        g = torch.randn(1024, 1024, device=dev, dtype=dt)
        args = (g, w1, None, w2a, w2b, [32, 32, 32, 32], 1.5) if factored else (g, w1, w2a @ w2b, 1.5)
        got = getattr(torch.ops.lycoris, op)(*args)
        want = reference.eager(op)(*args)
        for a, b in zip(got, want):
            if b.numel():
                torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * b.float().abs().max().item())
    assert _C._launch_plan_stats(f"lycoris::{op}")[1] == 1, _launch_record.refusals.get(op)
    (plan,) = [p for p in plans if p is not None]
    assert len(plan[1]) > len(plan[2])  # an allocation beyond the outputs': the pack of its own


@functools.lru_cache(maxsize=None)
def _bench_specs():
    """bench/specs.py, imported as the bench scripts import it (bench/ on sys.path, ``specs``):
    the same module object that bench.py's ``S`` is in a session that also loads bench.py."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("specs")


@needs_replay
@pytest.mark.parametrize("name", [s.name for s in _bench_specs().SPECS])
def test_replayed_bench_specs_at_a_middle_shape(name):
    """Every bench spec's forward and forward+backward, five calls each at 2048 tokens x
    1024 channels (bf16, launcher defaults): the replayed calls' workspaces outgrow the
    test cases' (packs of their own), and every result matches the first (Python) call's
    and the eager formula's. The test cases alone missed a replay fault at 4096²."""
    from lycoris_ops.tuner import tune

    S = _bench_specs()
    spec = next(s for s in S.SPECS if s.name == name)
    gen = torch.Generator().manual_seed(0)
    inp = spec.build(S.Geo(2048, 1024, 16), torch.bfloat16, torch.device("cuda"), gen)
    ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
    targets = [t for k, t in zip(inp, ts) if k in spec.grads]
    out = spec.eager(*ts)
    G = torch.randn(out.shape, generator=gen).to(device="cuda", dtype=out.dtype)
    want = [out.detach().float()] + [g.float() for g in torch.autograd.grad(out, targets, G)]
    prev = tune.set_tuning(False)
    try:
        with lycoris_ops.use_backend("triton"):
            runs = []
            for _ in range(5):
                y = spec.ours(*ts)
                runs.append([y.detach().float()] + [g.float() for g in torch.autograd.grad(y, targets, G)])
            torch.cuda.synchronize()
    finally:
        tune.set_tuning(prev)
    for k, (got, ref) in enumerate(zip(runs[-1], want)):
        scale = ref.abs().max().item() or 1.0
        # replayed against the Python call (atomics may reorder a sum), and against eager bf16
        assert (got - runs[0][k]).abs().max().item() <= 1e-2 * scale, (name, k)
        assert (got - ref).abs().max().item() <= 1e-1 * scale, (name, k)


@needs_replay
def test_plans_follow_the_tier_and_graph_capture():
    op = torch.ops.lycoris.lora_bypass_fwd
    x, up, down, base = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((37, 96), (80, 8), (8, 96),
                                                                                       (37, 80)))
    want = reference.eager("lora_bypass_fwd")(x, up, down, 0.5, base)
    name = "lycoris::lora_bypass_fwd"
    with lycoris_ops.use_backend("torch"):  # eager: no plan, ever
        for _ in range(4):
            torch.testing.assert_close(op(x, up, down, 0.5, base), want)
        assert _C._launch_plan_stats(name)[1] == 0
    with lycoris_ops.use_backend("triton"):
        for _ in range(4):
            got = op(x, up, down, 0.5, base)
        assert _C._launch_plan_stats(name)[1] == 1, _launch_record.refusals.get("lora_bypass_fwd")
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(x, up, down, 0.5, base)  # a replay on a side stream
            with torch.cuda.graph(g, stream=stream):
                captured = op(x, up, down, 0.5, base)
        torch.cuda.current_stream().wait_stream(stream)
        x.normal_()
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, reference.eager("lora_bypass_fwd")(x, up, down, 0.5, base),
                                   rtol=2e-2, atol=2e-2)
        lycoris_ops.set_backend("triton")  # a backend change forgets every plan
        assert _C._launch_plan_stats(name)[1] == 0
    lycoris_ops.set_backend(None)
