"""The example scripts keep working (each runs as a user would run it)."""
import pathlib
import subprocess
import sys

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.11's AOTInductor loader segfaults in _load_aoti "
                                                       "(tests/test_compile_export.py: the same skip)")
def test_export_aoti_example(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / "export_aoti.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "adapted:" in out.stdout and "lycoris.lora_bypass_fwd.default" in out.stdout
    assert "merged:" in out.stdout and "holds 0 lycoris ops" in out.stdout


def test_host_overhead_script():
    bench = EXAMPLES.parent / "bench" / "host_overhead.py"
    out = subprocess.run([sys.executable, str(bench), "--device", "cpu", "--calls", "20"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lycoris.lora_bypass_fwd" in out.stdout and "torch.add" in out.stdout
