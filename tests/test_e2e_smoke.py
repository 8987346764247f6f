"""bench/e2e.py keeps working: the CPU smoke run (tiny dims, no compile) with the
per-step profile, whose categories must see our ops in our rows only."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_smoke_with_profile(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--smoke", "--profile",
                        "--adapters", "lora,lokr", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert not [r for r in rows if r["error"]], rows
    assert [r["variant"] for r in rows].count("base-eager") == 1
    for r in rows:
        prof = r["profile"]
        assert prof["total"] > 0 and prof["GEMM"] > 0, r
        ours = r["variant"].startswith("ours") or "ops" in r["variant"]
        assert (prof["lycoris ops"] > 0) == ours, r
    assert "One profiled step per row" in (tmp_path / "e2e.md").read_text()
