"""Install paths and import-time safety (issues #57 and #58 item 1).

Every import here runs in a fresh process: what is checked is that the process survives
(exit code 0, a caught ImportError), where loading a mismatched or clashing _C would abort it.
"""
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_DIST = importlib.metadata.version("torch")


def run_python(code, python=sys.executable, **kwargs):
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, **kwargs)


def test_torch_mismatch_refused_before_C_loads():
    out = run_python("""
        import sys, torch
        torch.__version__ = "2.99.0+cu999"   # as if torch changed after lycoris_ops was built
        try:
            import lycoris_ops
        except ImportError as exc:
            print(exc)
        print("C loaded:", "lycoris_ops._C" in sys.modules)
        print("ops:", [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("lycoris::")])
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"compiled against torch {torch.__version__}, but this process runs torch 2.99.0+cu999" in out.stdout
    assert "pip install --no-deps --force-reinstall ." in out.stdout
    assert "C loaded: False" in out.stdout and "ops: []" in out.stdout


def test_build_record_names_the_running_torch():
    from lycoris_ops import _build_info

    assert _build_info.TORCH_VERSION == torch.__version__


# What user code can do to the lycoris namespace before lycoris_ops is imported; each once
# aborted the process as _C loaded (exit 134), or raised from inside torch.
CLAIMS = {
    "library_def": ('lib = torch.library.Library("lycoris", "DEF")',
                    "the namespace, claimed at <string>:"),
    "fragment_schema": ('torch.library.define("lycoris::lora_merge_fwd", "(Tensor a) -> Tensor")',
                        "1 operator(s) (lycoris::lora_merge_fwd), registered at"),
    "custom_op": ('@torch.library.custom_op("lycoris::add_scaled", mutates_args=())\n'
                  'def add_scaled(base: torch.Tensor, delta: torch.Tensor, gamma: float) -> torch.Tensor:\n'
                  '    return base + gamma * delta',
                  "1 operator(s) (lycoris::add_scaled), registered at"),
    "other_op_of_namespace": ('torch.library.define("lycoris::not_ours", "(Tensor a) -> Tensor")',
                              "1 operator(s) (lycoris::not_ours), registered at"),
}


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_namespace_held_by_user_code_gives_import_error(claim):
    setup, expected = CLAIMS[claim]
    out = run_python("import torch\n" + setup + textwrap.dedent("""
        try:
            import lycoris_ops
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
    """))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "code that ran before already registered that namespace" in out.stdout, out.stdout
    assert expected in out.stdout, out.stdout
    assert "Import lycoris_ops before that code, or run them in separate processes." in out.stdout


def lycoris_lora_path():
    """Where lycoris-lora is importable from: this environment, or LYCORIS_PEER_PATH (as
    tests/test_lycoris_peer.py); None: nowhere."""
    peer = os.environ.get("LYCORIS_PEER_PATH", "")
    found = run_python("import importlib.util; print(importlib.util.find_spec('lycoris') is not None)",
                       env={**os.environ, "PYTHONPATH": peer})
    return peer if found.stdout.strip() == "True" else None


def test_lycoris_lora_imported_first_gives_import_error():
    peer = lycoris_lora_path()
    if peer is None:
        pytest.skip("lycoris-lora not installed (pip install lycoris-lora, or set LYCORIS_PEER_PATH)")
    out = run_python("""
        import lycoris
        try:
            import lycoris_ops
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
    """, env={**os.environ, "PYTHONPATH": peer})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lycoris-lora" in out.stdout and "imported before lycoris_ops, already registered" in out.stdout, out.stdout
    assert "operator(s) (lycoris::" in out.stdout
    assert "Import lycoris_ops before lycoris" in out.stdout
