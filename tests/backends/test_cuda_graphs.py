"""CUDA graphs (GPU only): a model whose adapters run on our ops, compiled with
``mode="reduce-overhead"`` (CUDA-graph trees), forward+backward replayed on new
inputs, equal to eager on every replay; and a manual ``torch.cuda.graph`` capture of
ops whose tuning keys are cold: no timing during capture (the tuner takes the
planner's first pick and stores nothing), replays equal to eager.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

import lycoris_ops
from lycoris_ops import nn as lnn
from lycoris_ops import testing
from lycoris_ops.tuner import tune

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))


def _model(kind, dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 96)).cuda().to(dtype)
    kw = {"block_size": 16} if kind in ("oft", "boft") else {"rank": 8}
    lnn.add_adapters(m, kind, **kw)
    with torch.no_grad():  # non-zero "up" factors: the adapters change the output
        for _, a in lnn.adapters(m):
            for n, p in a.named_parameters():
                if not n.startswith("base.") and p.abs().sum() == 0:
                    p.normal_(0, 0.05)
    return m


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "dora", "oft", "ia3"])
def test_reduce_overhead_replays_match_eager(kind):
    dtype = torch.bfloat16
    eager = _model(kind, dtype)
    graphed = _model(kind, dtype)
    graphed.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):  # warm-up, record, then replays
        x = torch.randn(64, 96, device="cuda", dtype=dtype, generator=g)
        want = eager(x)
        want.float().square().mean().backward()
        got = compiled(x)
        got.float().square().mean().backward()
        tol = 2 * testing.REL_TOL[dtype]
        assert testing.rel_err(got, want) <= tol, (kind, step)
        for (n, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
            if pe.requires_grad:
                assert testing.rel_err(pg.grad, pe.grad) <= tol, (kind, step, n)
                pe.grad = pg.grad = None


def test_capture_with_cold_keys_times_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCORIS_KERNEL_CACHE_DIR", str(tmp_path))
    from lycoris_ops.backends import registry as dispatch, select
    dispatch.refresh()
    select.reset()
    tune.clear()
    tune.set_tuning(True)
    try:
        gen = torch.Generator().manual_seed(3)
        x = testing.make((77, 96), torch.bfloat16, "cuda", gen=gen)
        up = testing.make((80, 8), torch.bfloat16, "cuda", gen=gen, scale=0.1)
        down = testing.make((8, 96), torch.bfloat16, "cuda", gen=gen, scale=0.1)
        base = testing.make((77, 80), torch.bfloat16, "cuda", gen=gen)
        a, b = testing.make((77, 80), torch.float32, "cuda", gen=gen), base.clone()
        before = tune.stats()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            y = torch.ops.lycoris.lora_bypass_fwd(x, up, down, 0.5, base)
            z = torch.ops.lycoris.add_scaled(a, b, 0.25)
        after = tune.stats()
        assert after["timer_calls"] == before["timer_calls"] and after["tuned"] == before["tuned"]
        assert not os.path.exists(os.path.join(tmp_path, "tuning.json")), "nothing is stored during capture"
        assert not dispatch.demotions(), dispatch.demotions()  # the fused kernels themselves were captured
        for _ in range(3):  # replays on new data written into the captured inputs
            for t in (x, up, down, base, a):
                t.normal_()
            graph.replay()
            torch.cuda.synchronize()
            with lycoris_ops.use_backend("torch"):
                want_y = torch.ops.lycoris.lora_bypass_fwd(x, up, down, 0.5, base)
                want_z = torch.ops.lycoris.add_scaled(a, b, 0.25)
            assert testing.rel_err(y, want_y) <= 2 * testing.REL_TOL[torch.bfloat16]
            assert testing.rel_err(z, want_z) <= 2 * testing.REL_TOL[torch.bfloat16]
    finally:
        tune.set_tuning(None)
        tune.clear()
        dispatch.refresh()
        select.reset()
