"""bench/e2e.py keeps working: the CPU smoke run (tiny dims, no compile) with the
per-step profile, whose categories must see our ops in our rows only; the unet model with
new adapters and lycoris-lora's rows; bench/plot.py's
row selection; bench/host_overhead.py --layers."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_e2e_smoke_with_profile(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--profile",
                        "--adapters", "lora,lokr", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert not [r for r in rows if r["error"]], rows
    assert [r["variant"] for r in rows].count("base-eager") == 1
    for r in rows:
        if r["variant"].startswith("lyco"):  # measured in lycoris-lora's own process, not profiled
            assert r["profile"] is None, r
            continue
        prof = r["profile"]
        assert prof["total"] > 0 and prof["GEMM"] > 0, r
        ours = r["variant"].startswith("ours") or "ops" in r["variant"]
        assert (prof["lycoris ops"] > 0) == ours, r
    assert "One profiled step per row" in (tmp_path / "e2e.md").read_text()


def test_e2e_smoke_unet_new_adapters(tmp_path):
    """The unet model with LoKr factor 8 and BOFT: ours and lycoris-lora's rows measured, PEFT's
    BOFT n/a with its reason (one split for every layer: the 32-wide context's to_k/to_v)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--model", "unet",
                        "--adapters", "lokr8,boft", "--variants", "base-eager,peft-eager,ours-eager,lyco-eager",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads((tmp_path / "e2e.json").read_text())
    assert out["meta"]["model"] == "unet"
    rows = {(r["adapter"], r["variant"]): r for r in out["rows"]}
    assert not [r for r in rows.values() if r["error"]], rows
    for a in ("lokr8", "boft"):
        ours = rows[(a, "ours-eager")]
        # at the smoke widths LoKr's conv w2 is narrow: those layers build ΔW by the merge op
        assert ours["ms"] > 0 and ours["note"].startswith("14/14 layers on our ops"), ours
        lyco = rows[(a, "lyco-eager")]
        assert lyco["ms"] > 0 or lyco["note"] == "n/a: lycoris-lora is not importable", lyco
    assert rows[("lokr8", "peft-eager")]["ms"] > 0
    assert rows[("boft", "peft-eager")]["note"].startswith("n/a: PEFT's BOFT"), rows[("boft", "peft-eager")]
    assert "| boft | peft-eager | nan |" in (tmp_path / "e2e.md").read_text()


def test_plot_rows_merge_runs(tmp_path):
    """bench/plot.py: a later e2e file replaces a model/adapter/variant row, NaN rows drop; per-op
    rows are the CSV's ``ours == yes`` rows, a later CSV replacing the same key."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import plot

    nan = float("nan")
    (tmp_path / "a.json").write_text(json.dumps({"rows": [
        {"adapter": "lora", "variant": "base-eager", "x_eager": nan},
        {"adapter": "lora", "variant": "ours-compiled", "x_eager": 1.0},
        {"adapter": "lokr", "variant": "ours-compiled", "x_eager": 1.5}]}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": [{"adapter": "lora", "variant": "ours-compiled",
                                                            "x_eager": 1.2}]}))
    rows = {(r["adapter"], r["variant"]): r["x_eager"]
            for r in plot.e2e_rows([str(tmp_path / "a.json"), str(tmp_path / "b.json")])}
    assert rows == {("lora", "ours-compiled"): 1.2, ("lokr", "ours-compiled"): 1.5}
    # another model's run keeps its own rows beside them
    (tmp_path / "u.json").write_text(json.dumps({"meta": {"model": "unet"}, "rows": [
        {"adapter": "lora", "variant": "ours-compiled", "x_eager": 0.9}]}))
    rows = {(r["model"], r["adapter"], r["variant"]): r["x_eager"]
            for r in plot.e2e_rows([str(tmp_path / n) for n in ("a.json", "b.json", "u.json")])}
    assert rows == {("transformer", "lora", "ours-compiled"): 1.2, ("transformer", "lokr", "ours-compiled"): 1.5,
                    ("unet", "lora", "ours-compiled"): 0.9}
    head = "kind,spec,shape,dtype,column,ours,phase,x_eager\n"
    (tmp_path / "a.csv").write_text(head + "time,lora_bypass,large,bf16,triton,yes,fwd,2.0\n"
                                    "time,lora_bypass,large,bf16,eager,,fwd,1\n"
                                    "time,lora_bypass,large,bf16,tilelang,,fwd,1.5\n"
                                    "host,lora_bypass,tiny,bf16,triton,yes,host_fwd,\n")
    (tmp_path / "b.csv").write_text(head + "time,lora_bypass,large,bf16,triton,yes,fwd,2.5\n"
                                    "time,boft,large,bf16,triton,yes,fwdbwd,3.0\n")
    per_op = plot.per_op_rows([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert [(r["spec"], r["phase"], r["x_eager"]) for r in per_op] == [("boft", "fwdbwd", "3.0"),
                                                                        ("lora_bypass", "fwd", "2.5")]


@pytest.mark.slow
def test_host_overhead_layers_runs():
    """bench/host_overhead.py --layers (the adapter layers' host time quoted in RESULTS)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "host_overhead.py"), "--layers", "--device", "cpu",
                        "--calls", "10"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [ln for ln in p.stdout.splitlines() if ln.strip().endswith(" us")]
    assert any("DoRALinear" in r for r in rows) and any("nn.Linear" in r for r in rows), p.stdout


def test_lyco_rows_find_lycoris_on_the_peer_path(tmp_path, monkeypatch):
    """lycoris-lora installed with ``--target`` (LYCORIS_PEER_PATH, as on the GPU machine) is
    found, and its process gets that path; without it anywhere the rows are n/a."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import argparse
    import importlib.util
    import e2e

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lycoris" else real(name, *a))
    args = argparse.Namespace(model="transformer", dim=64, heads=4, tokens=8, batch=1, layers=1, rank=4, spatial=8,
                              ctx_dim=32, ctx_tokens=7, dtype="fp32", device="cpu", reps=1, warmup=1)
    monkeypatch.delenv("LYCORIS_PEER_PATH", raising=False)
    assert "not importable" in e2e.lyco_rows(args, ["lora"], ["lyco-eager"])[("lora", "lyco-eager")]["note"]
    (tmp_path / "lycoris").mkdir()
    monkeypatch.setenv("LYCORIS_PEER_PATH", str(tmp_path))
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["path"] = env["PYTHONPATH"].split(os.pathsep)
        row = dict(adapter="lora", variant="lyco-eager", ms=1.0, peak_gib=0.0, cold_s=0.1)
        return subprocess.CompletedProcess(cmd, 0, stdout="ROW " + json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    row = e2e.lyco_rows(args, ["lora"], ["lyco-eager"])[("lora", "lyco-eager")]
    assert row["ms"] == 1.0 and not row["note"] and seen["path"][0] == str(tmp_path)
