"""A small model on the lycoris ops under torch.compile(fullgraph=True),
torch.export (+ save/load in a fresh process) and AOTInductor (fresh process);
every op's eager body traced whole, as the compile tier traces it."""
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from tiny_model import TinyAdapted  # noqa: E402
from sweep import firsts, sweep  # noqa: E402

import lycoris_ops  # noqa: E402,F401
from lycoris_ops import reference
from lycoris_ops import testing  # noqa: E402

LYCORIS_FWD = ("lora_bypass_fwd", "lora_merge_fwd", "lokr_bypass_fwd", "dora_fwd", "oft_fwd")
LYCORIS_BWD = ("lora_bypass_bwd", "loha_merge_bwd", "lokr_bypass_bwd", "dora_bwd", "oft_bwd")


def _inputs(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, 24, generator=g)


def _fwd_bwd(model, x):
    x = x.clone().requires_grad_(True)
    torch._dynamo.mark_dynamic(x, 0)  # the batch dim: a new batch size must not recompile
    out = model(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.slow
def test_compile_fullgraph_matches_eager_and_keeps_the_ops():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = TinyAdapted()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)

    x = _inputs(3)
    ref = _fwd_bwd(model, x)
    (got, codes) = run_and_get_code(lambda: _fwd_bwd(compiled, x))
    for a, b in zip((ref[0], ref[1], *ref[2]), (got[0], got[1], *got[2])):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    code = "\n".join(codes)
    for op in LYCORIS_FWD + LYCORIS_BWD:
        assert f"torch.ops.lycoris.{op}.default" in code, f"{op} not in the compiled graphs"
    assert counter.frame_count == 1

    # a new batch size: no recompilation (the batch dim is dynamic)
    x2 = _inputs(7, seed=2)
    ref2, got2 = _fwd_bwd(model, x2), _fwd_bwd(compiled, x2)
    torch.testing.assert_close(got2[0], ref2[0], rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1


def test_no_graph_break():
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(TinyAdapted())(_inputs(2))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


CASES = testing.cases(dtype=torch.float32)


@pytest.mark.parametrize("case", sweep(CASES, quick=firsts(CASES, lambda c: c.op), unpack=False),
                         ids=lambda c: f"{c.op}/{c.id}")
def test_compile_tier_traces_each_eager_body_whole(case):
    """The compile tier hands Dynamo an op's eager body, argument checks included: one graph
    with symbolic sizes, every case (torch 2.11's Dynamo broke it at a checked size's message,
    an int argument formatted into a message and a list's item store)."""
    body = reference.eager(case.op)
    torch._dynamo.reset()
    # dynamic=True: symbolic sizes and int arguments, as after the tier's recompiles
    compiled = torch.compile(body, backend="eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(*case.args), body(*case.args))


def _export(model):
    batch = torch.export.Dim("batch", min=1, max=1024)
    return torch.export.export(model, (_inputs(3),), dynamic_shapes={"x": {0: batch}})


def test_export_keeps_ops_and_dynamic_batch():
    ep = _export(TinyAdapted())
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for op in LYCORIS_FWD:
        assert f"lycoris.{op}.default" in targets, targets
    model = TinyAdapted()
    x = _inputs(6, seed=3)
    torch.testing.assert_close(ep.module()(x), model(x))


def _run_fresh(code: str):
    # -X faulthandler: a crash in the fresh process prints where it happened
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_export_save_load_in_fresh_process(tmp_path):
    model = TinyAdapted()
    ep = _export(model)
    path, xs = tmp_path / "tiny.pt2", tmp_path / "io.pt"
    torch.export.save(ep, str(path))
    x = _inputs(5, seed=4)
    torch.save({"x": x, "y": model(x).detach()}, xs)
    _run_fresh(f"""
        import torch, lycoris_ops
        ep = torch.export.load({str(path)!r})
        io = torch.load({str(xs)!r})
        torch.testing.assert_close(ep.module()(io["x"]), io["y"])
        print("ok")
    """)


@pytest.mark.slow
@pytest.mark.skipif(torch.__version__ < "2.13",
                    reason="torch 2.11's AOTInductor loader segfaults in _load_aoti on this CPU package "
                           "(seen on the H200 machine, 2026-11-30); CI runs it on torch 2.13")
def test_aoti_package_runs_in_fresh_process(tmp_path):
    model = TinyAdapted()
    ep = _export(model)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "tiny_aoti.pt2"))
    x = _inputs(4, seed=5)
    xs = tmp_path / "io.pt"
    torch.save({"x": x, "y": model(x).detach()}, xs)
    _run_fresh(f"""
        import torch, lycoris_ops
        runner = torch._inductor.aoti_load_package({pkg!r})
        io = torch.load({str(xs)!r})
        torch.testing.assert_close(runner(io["x"]), io["y"], rtol=1e-4, atol=1e-5)
        print("ok")
    """)
