"""The CUDA key's C++ kernel replays a seen call signature's recorded Triton launches
(csrc/launch.cpp, lycoris_ops/_launch_record.py).

On CPU (CI): the recorder's rules: which aten ops a recorded call may run, how device
addresses map to inputs and allocations, how outputs map to allocations. On CUDA,
with the kernel built: every op's replayed calls against eager, the plans made where
the Triton tier serves a call and only there, CUDA graph capture of replayed calls,
and a backend change dropping the plans."""
from __future__ import annotations

import pytest
import torch

import lycoris_ops
from lycoris_ops import _C, _launch_record, registry
from lycoris_ops.testing import cases, check_bf16_against_eager

REPLAY = torch.cuda.is_available() and registry.replay_enabled()
needs_replay = pytest.mark.skipif(not REPLAY, reason="needs CUDA and _C built with its CUDA launch path")


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


def test_plan_maps_outputs_and_refuses_strangers():
    x = torch.randn(5, 3)
    watch, out = _watched(lambda: torch.empty(4, 6)[:, 2:])
    plan, why = _launch_record.plan_of((x, 0.5), out, watch, [], x.device)
    assert why is None
    device, allocs, outs, launches = plan
    assert allocs == [([4, 6], [6, 1], torch.float32, False)] and launches == []
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
def test_plans_follow_the_tier_and_graph_capture():
    op = torch.ops.lycoris.lora_bypass_fwd
    x, up, down, base = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((37, 96), (80, 8), (8, 96),
                                                                                       (37, 80)))
    want = registry.eager("lora_bypass_fwd")(x, up, down, 0.5, base)
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
        torch.testing.assert_close(captured, registry.eager("lora_bypass_fwd")(x, up, down, 0.5, base),
                                   rtol=2e-2, atol=2e-2)
        lycoris_ops.set_backend("triton")  # a backend change forgets every plan
        assert _C._launch_plan_stats(name)[1] == 0
    lycoris_ops.set_backend(None)
