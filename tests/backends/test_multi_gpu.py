"""Several devices: ops on any CUDA device index and stream, per-device backend
demotion, data-parallel training with patched adapters.

On the CPU machine: DDP and FSDP2 (two gloo processes) train LoRA and LoKr
adapters on our ops along the single-process loss curve. With two or more GPUs
also: every op with its operands on ``cuda:1`` while ``cuda:0`` is current, on a
side stream of ``cuda:1`` that the op must follow (its inputs are written there
after a GPU sleep: an op launched on any other stream reads NaNs); operands on
``cuda:0`` and ``cuda:1`` together are a clear error; a demotion on one GPU leaves
the other's choice alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lycoris_ops
from lycoris_ops.backends import registry as dispatch, select
from lycoris_ops import testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "multigpu_train.py")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def needs_two_gpus(test):
    """A CUDA test (the gpu marker) that needs a second device."""
    return pytest.mark.gpu(pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")(test))


def _run(cmd, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900, **kw)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and not TWO_GPUS, reason="one GPU: the CPU run is not the point here")
def test_ddp_and_fsdp2_follow_the_single_device_curve(tmp_path):
    ref, run = tmp_path / "ref.json", tmp_path / "dist.json"
    common = ["--adapters", "lora,lokr", "--compile", "no", "--steps", "4", "--dtype", "fp32", "--lr", "1e-2"]
    _run([sys.executable, TRAIN, *common, "--out", str(ref)])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN,
          *common, "--parallel", "ddp,fsdp2,nosync", "--out", str(run)])
    runs = json.loads(run.read_text())["runs"]
    control = [r for r in runs if r["parallel"] == "nosync"]
    runs = [r for r in runs if r["parallel"] != "nosync"]
    run.write_text(json.dumps(dict(runs=runs)))
    assert {(r["adapter"], r["parallel"]) for r in runs} == {(a, p) for a in ("lora", "lokr")
                                                             for p in ("ddp", "fsdp2")}
    assert all(r["world"] == 2 for r in runs)
    out = _run([sys.executable, TRAIN, "--compare", str(ref), str(run)])
    assert out.count(" ok") == 4, out
    # the curve moves (else there would be nothing to compare)
    assert all(max(abs(v - r["losses"][0]) for v in r["losses"]) > 1e-3 * r["losses"][0] for r in runs)
    # the negative control: ranks that never average their gradients are flagged
    nosync = tmp_path / "nosync.json"
    nosync.write_text(json.dumps(dict(runs=control)))
    p = subprocess.run([sys.executable, TRAIN, "--compare", str(ref), str(nosync)], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 1 and p.stdout.count("DIFFERS") == 2, p.stdout


def test_compare_catches_a_different_curve(tmp_path):
    ref = dict(runs=[dict(adapter="lora", compiled=False, parallel="single", world=1, losses=[1.0, 0.9])])
    run = dict(runs=[dict(adapter="lora", compiled=False, parallel="ddp", world=2, losses=[1.0, 0.8])])
    (tmp_path / "a.json").write_text(json.dumps(ref))
    (tmp_path / "b.json").write_text(json.dumps(run))
    p = subprocess.run([sys.executable, TRAIN, "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 1 and "DIFFERS" in p.stdout


# ----------------------------------------------------------------------------- two GPUs


def _backends():
    return [b for b in ("triton", "tilelang") if b in lycoris_ops.available_backends("cuda")] + ["torch"]


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


@needs_two_gpus
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", _backends() if TWO_GPUS else ["torch"])
def test_every_op_runs_on_the_operands_device_and_stream(backend, dtype):
    dev1 = torch.device("cuda", 1)
    failures = []
    with lycoris_ops.use_backend(backend):
        for case in testing.cases(dtype=dtype):
            want = _outputs(case())  # the CPU op
            final = case.to(dev1)
            buf = case.to(dev1)  # same layout, filled with NaN until the side stream writes it
            for b in buf.tensors():
                if b.is_floating_point():
                    b.fill_(float("nan"))
            side = torch.cuda.Stream(device=dev1)
            side.wait_stream(torch.cuda.default_stream(dev1))
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)  # ~10 ms: an op on another stream would run first
                for b, f in zip(buf.tensors(), final.tensors()):
                    b.copy_(f)
                torch.cuda.set_device(0)  # cuda:0 current; cuda:1's current stream stays `side`
                assert torch.cuda.current_stream(dev1) == side
                got = _outputs(buf())
                torch.cuda.set_device(1)
            side.synchronize()
            for i, (g, w) in enumerate(zip(got, want)):
                tol = 2 * max(testing.REL_TOL[dtype], testing.REL_TOL.get(w.dtype, 0.0))
                if g.device != dev1:
                    failures.append(f"{case.id}: out{i} on {g.device}")
                elif w.numel() and not (testing.rel_err(g, w) <= tol):
                    failures.append(f"{case.id}: out{i} rel_err {testing.rel_err(g, w):.2e}")
    torch.cuda.set_device(0)
    assert not failures, failures


@needs_two_gpus
@pytest.mark.parametrize("op", lycoris_ops.OP_NAMES)
def test_operands_on_two_gpus_are_a_clear_error(op):
    case = next(c for c in testing.cases() if c.op == op).to("cuda:0")
    slots = [i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor) and a.numel() > 0]
    args = list(case.args)
    args[slots[1]] = args[slots[1]].to("cuda:1")
    with pytest.raises(ValueError, match=r"cuda:1|cuda:0"):
        getattr(torch.ops.lycoris, op)(*args)


@needs_two_gpus
def test_a_demotion_is_per_device():
    if "triton" not in lycoris_ops.available_backends("cuda"):
        pytest.skip("triton is not available")
    case = next(c for c in testing.cases() if c.op == "lora_bypass_fwd")
    on0, on1 = case.to("cuda:0"), case.to("cuda:1")
    try:
        dispatch.demote("triton", torch.device("cuda", 1), "test: demoted on cuda:1 only")
        assert select.explain("lora_bypass_fwd", *on0.args) == "triton"
        assert select.explain("lora_bypass_fwd", *on1.args) != "triton"
        torch.testing.assert_close(on1().cpu(), on0().cpu(), rtol=1e-4, atol=1e-4)
    finally:
        dispatch.reset()
        select.reset()
