"""The shape matrix keeps working: ``bench/matrix.py --smoke`` in-process on CPU.

Every algorithm's cells (tiny stand-in layers, every setting on one of them, fp32 and bf16)
run through ours and the eager formula and agree (output and gradients) before anything is
timed; the JSON, the summary and the RESULTS entry are written, the heat map is drawn where
matplotlib is installed; the peer column comes back from its subprocess where lycoris-lora is
installed. No timing claims.
"""
import importlib.util
import json

import pytest
import torch

from test_bench_smoke import bench_script


@pytest.fixture(scope="module")
def matrix():
    return bench_script("matrix.py", "lycoris_bench_matrix")


def test_matrix_smoke(tmp_path, capsys, matrix):
    rc = matrix.main(["--smoke", "--no-peer", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "smoke: OK" in out
    doc = json.load(open(tmp_path / "matrix.json"))
    cells = doc["cells"]
    assert {c["algo"] for c in cells} == set(matrix.SETTINGS)
    assert {c["dtype"] for c in cells} == {"fp32", "bf16"}
    for c in cells:  # every cell compared with its formula, then timed
        tol = matrix.B.SMOKE_TOL[matrix.S.DTYPES[c["dtype"]]]
        assert c["ours"]["rel_err"] <= tol and c["ours"]["grad_err"] <= tol, c
        assert c["ours"]["fwd"] and c["ours"]["fwdbwd"] and c["eager"]["fwd"] and c["eager"]["fwdbwd"], c
    # every setting of every algorithm ran on the sweep layer (where it applies there)
    swept = {(c["algo"], c["setting"]) for c in cells if (c["model"], c["layer"]) in matrix.SMOKE_SWEEP.values()}
    assert ("lokr", "f4 w2r16") in swept and ("boft", "dim8") in swept and ("lora", "r128") in swept
    summary = (tmp_path / "matrix-summary.md").read_text()
    assert all(f"\n{a:<20}" in summary for a in matrix.SETTINGS)
    assert (tmp_path / "RESULTS.md").read_text().count("shape matrix") == 1
    assert (tmp_path / "matrix_heatmap.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
    # the summary again from the saved JSON (what a run killed at its time limit leaves)
    assert matrix.main(["--report", str(tmp_path / "matrix.json"), "--out", str(tmp_path / "again"),
                        "--results", ""]) == 0
    assert (tmp_path / "again" / "matrix-summary.md").read_text() == summary


def test_matrix_profile_smoke(capsys, matrix):
    """``--profile``: per selected cell, ours and the eager formula under torch.profiler, our
    op in ours' table."""
    assert matrix.main(["--profile", "--smoke", "--device", "cpu", "--algo", "lora", "--limit", "1",
                        "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("3 steps fwd+bwd") == 2 and "lycoris::lora_bypass_fwd" in out and "failed" not in out, out


def test_matrix_flagged_selects_the_cells_under_one(tmp_path, capsys, matrix):
    """``--flagged JSON`` keeps the planned cells that JSON measured below 1.0x, fwd or f+b,
    worst first (so ``--limit`` keeps the cells furthest under the contract)."""
    args = matrix.parse_args(["--smoke"])
    ids = [c["id"] for c in matrix.select_cells(args)][:4]
    ms = {"fwd": 1.0, "fwdbwd": 2.0}
    cells = [dict(id=ids[0], ours=ms, eager={"fwd": 0.9, "fwdbwd": 3.0}),  # fwd 0.9x: flagged
             dict(id=ids[1], ours=ms, eager={"fwd": 1.5, "fwdbwd": 3.0}),  # faster in both
             dict(id=ids[2], ours=ms, eager={"fwd": 1.5, "fwdbwd": 3.0}, compile={"fwd": 1.2, "fwdbwd": 1.9}),
             dict(id=ids[3], ours=ms, eager={"fwd": 1.5, "fwdbwd": 1.0})]  # f+b 0.5x: the worst
    (tmp_path / "m.json").write_text(json.dumps({"cells": cells}))
    picked = matrix.select_cells(matrix.parse_args(["--smoke", "--flagged", str(tmp_path / "m.json")]))
    assert [c["id"] for c in picked] == [ids[3], ids[0], ids[2]]
    limited = matrix.select_cells(matrix.parse_args(["--smoke", "--flagged", str(tmp_path / "m.json"), "--limit", "1"]))
    assert [c["id"] for c in limited] == [ids[3]]


@pytest.mark.slow
def test_matrix_peer_smoke(tmp_path, capsys, matrix):
    """The lycoris-lora column: its subprocess runs the cells' forms and their readings match
    (slow: most of it is the subprocess importing torch and lycoris-lora)."""
    if importlib.util.find_spec("lycoris") is None:
        pytest.skip("lycoris-lora is not installed")
    assert matrix.main(["--smoke", "--algo", "lora", "--layer", "square", "--dtype", "fp32", "--limit", "2",
                        "--out", str(tmp_path)]) == 0, capsys.readouterr().out[-3000:]
    cells = json.load(open(tmp_path / "matrix.json"))["cells"]
    assert len(cells) == 2
    for c in cells:
        assert c["peer"]["match"] and c["peer"]["fwd"] and c["peer"]["fwdbwd"], c


@pytest.mark.slow
def test_matrix_peer_only_adds_the_column(tmp_path, capsys, matrix):
    """``--peer-only JSON``: a saved run without the peer gets its lycoris-lora column (ours not
    re-timed), and a JSON from another GPU model is refused."""
    if importlib.util.find_spec("lycoris") is None:
        pytest.skip("lycoris-lora is not installed")
    assert matrix.main(["--smoke", "--no-peer", "--algo", "lora", "--layer", "square", "--dtype", "fp32",
                        "--limit", "2", "--out", str(tmp_path)]) == 0
    saved = json.load(open(tmp_path / "matrix.json"))
    assert not any(c.get("peer") for c in saved["cells"])
    capsys.readouterr()
    assert matrix.main(["--smoke", "--peer-only", str(tmp_path / "matrix.json"), "--json", str(tmp_path / "p.json"),
                        "--out", str(tmp_path), "--seconds", "100"]) == 0, capsys.readouterr().out[-3000:]
    doc = json.load(open(tmp_path / "p.json"))
    for before, c in zip(saved["cells"], doc["cells"]):
        assert c["ours"] == before["ours"] and c["peer"]["match"] and c["peer"]["fwdbwd"], c
    assert any("--peer-only" in n for n in doc["notes"])
    saved["env"]["gpu"] = "another GPU"
    (tmp_path / "other.json").write_text(json.dumps(saved))
    assert matrix.main(["--smoke", "--peer-only", str(tmp_path / "other.json"), "--out", str(tmp_path)]) == 2
    assert "another GPU" in capsys.readouterr().err


def test_matrix_shapes(matrix):
    """LyCORIS's factorizations give the sizes issue #60 names; the known-bad cells run first."""
    assert matrix.butterfly_blocks(3072, 32) == (24, 128)
    assert matrix.butterfly_blocks(3072, 64) == (48, 64)
    assert matrix.butterfly_blocks(1280, 32) == (20, 64)
    assert matrix.butterfly_blocks(14336, 32) == (28, 512)
    assert matrix.butterfly_blocks(3072, 4) is None  # 3072 = 3·1024: no even block ≤ 4
    cells = matrix.plan(matrix.LAYERS, matrix.SWEEP, matrix.HEADLINE, "bf16", ("fp16", "fp32"), full=True)
    ids = [c["id"] for c in cells]
    assert len(ids) == len(set(ids))
    assert [c["prio"] for c in cells[:len(matrix.KNOWN_BAD)]] == [0] * len(matrix.KNOWN_BAD)
    by_id = {c["id"]: c for c in cells}
    assert by_id["lokr|bench|small|f8|bf16"]["sizes"] == "w1 8x8 w2 384x384"
    assert by_id["lokr|bench|large|f8|bf16"]["sizes"] == "w1 8x8 w2 512x512"
    assert by_id["boft|bench|small|dim64|bf16"]["sizes"] == "s48 nb64 m7"
    assert by_id["oft|flux|attn.to_q|dim64|bf16"]["sizes"] == "S48 K64"
    w2_sides = {c["dims"][k] for c in cells if c["algo"] == "lokr" and c["setting"] == "f8" for k in ("c", "d")}
    assert min(w2_sides) == 40 and max(w2_sides) == 1792
    # a factored w2 only where LyCORIS factors it (rank < max(c, d) / 2)
    assert all(c["dims"]["r"] < max(c["dims"]["c"], c["dims"]["d"]) / 2 for c in cells if c["form"].endswith("factored"))
    assert {c["algo"] for c in cells if c["dtype"] == "fp16"} == set(matrix.SETTINGS)
    # --setting: the cells of those setting labels only (the blocks past 32, say)
    args = matrix.argparse.Namespace(smoke=False, full=True, algo="oft,boft", model="", layer="", dtype="bf16",
                                     setting="dim64", limit=0, flagged=None)
    picked = matrix.select_cells(args)
    assert picked and {c["setting"] for c in picked} == {"dim64"}
    assert {c["id"] for c in picked} == {c["id"] for c in cells if c["setting"] == "dim64" and c["dtype"] == "bf16"
                                         and c["algo"].split("-")[0] in ("oft", "boft")}


def test_matrix_gpu_plan_on_meta(matrix, monkeypatch):
    """Every cell of the default GPU plan (real model shapes) builds, and ours and the eager
    formula agree in output and gradient shapes and dtypes (meta tensors: no memory, no time)."""

    monkeypatch.setattr(matrix.S, "_rand", lambda gen, shape, dt, dev, scale=1.0: torch.empty(shape, dtype=dt,
                                                                                               device="meta"))
    cells = matrix.plan(matrix.LAYERS, matrix.SWEEP, matrix.HEADLINE, "bf16", ("fp16", "fp32"), full=False)
    for c in cells:
        form = matrix.FORMS[c["form"]]
        inp = form.build(c["dims"], matrix.S.DTYPES[c["dtype"]], torch.device("meta"), None)
        ts = [t.requires_grad_(k in form.grads) for k, t in inp.items()]
        trained = [inp[k] for k in form.grads]
        outs = [fn(*ts) for fn in (form.eager, form.ours)]
        grads = [torch.autograd.grad(o, trained, torch.empty_like(o)) for o in outs]
        assert outs[0].shape == outs[1].shape and outs[0].dtype == outs[1].dtype == inp[next(iter(inp))].dtype, c
        assert [(g.shape, g.dtype) for g in grads[0]] == [(g.shape, g.dtype) for g in grads[1]], c


def test_wrong_column_is_not_timed(matrix):
    """A column that disagrees with the reference is reported and never timed."""
    T = matrix.T
    x = torch.randn(8, 4, requires_grad=True)
    G = torch.ones(8, 4)
    timer = T.DeviceTimer("cpu", min_reps=1, max_reps=1, warmup=0)
    ref = (x.detach() * 2, (torch.full((8, 4), 2.0),))
    good = T.measure_column(lambda t: t * 2, [x], [0], G, timer, "cpu", ref=ref, tol=1e-6)
    assert good["rel_err"] == 0 and good["grad_err"] == 0 and good["fwd"] and good["fwdbwd"]
    bad = T.measure_column(lambda t: t * 3, [x], [0], G, timer, "cpu", ref=ref, tol=1e-6)
    assert bad["error"].startswith("disagrees with the reference: rel_err") and "fwd" not in bad and "fwdbwd" not in bad
    grad_bad = T.measure_column(lambda t: t.detach() * 2 + t * 0.5 - t.detach() * 0.5, [x], [0], G, timer, "cpu",
                                ref=ref, tol=1e-6)
    assert grad_bad["error"].startswith("disagrees with the reference: grad_err") and "fwdbwd" not in grad_bad
