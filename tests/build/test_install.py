"""Install paths and import-time safety (issues #57 and #58 item 1).

Every import here runs in a fresh process: what is checked is that the process survives
(exit code 0, a caught ImportError), where loading a mismatched or clashing _C would abort it.
"""
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


BACKEND = ROOT / "build_backend"
HOOK = "import torch_matched; print(torch_matched.get_requires_for_build_wheel())"


def test_build_backend_requires_the_installed_torch():
    out = run_python(HOOK, env={**os.environ, "PYTHONPATH": str(BACKEND)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == repr([f"torch=={TORCH_DIST}"])


def test_build_backend_stops_at_once_without_torch(tmp_path):
    # The hook asks the interpreter that runs it (pip's: the target environment's) for torch;
    # here that is a bare virtual environment, with setuptools reachable through PYTHONPATH.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    setuptools_site = pathlib.Path(__import__("setuptools").__file__).parents[1]
    out = run_python(HOOK, python=bare / "bin" / "python",
                     env={**os.environ, "PYTHONPATH": f"{BACKEND}{os.pathsep}{setuptools_site}"})
    assert out.returncode == 1
    assert "has no torch" in out.stderr and "-m pip install torch==" in out.stderr, out.stderr[-3000:]


def copy_source(dest):
    """The source tree as a fresh checkout has it: no build outputs, no environments."""
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                  "_build_info.py", ".pytest_cache", "out")
    shutil.copytree(ROOT, dest, ignore=skip)
    return dest


@pytest.mark.slow
def test_pip_install_with_build_isolation(tmp_path):
    """`pip install .` (pip's default isolated build) in a fresh virtual environment: without
    torch it stops at once with what to do; with torch it builds against that torch and imports;
    after a torch change it refuses with a command that, run, makes it import again."""
    src = copy_source(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"

    def pip(*args):
        start = time.monotonic()
        out = subprocess.run([str(python), "-m", "pip", *args], cwd=src, capture_output=True, text=True,
                             timeout=1800, env={**os.environ, "MAX_JOBS": "2"})
        return out, time.monotonic() - start

    out, seconds = pip("install", ".")
    assert out.returncode != 0
    assert "has no torch" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    assert seconds < 120, seconds  # setuptools, wheel and ninja into the build environment, then the hook

    out, _ = pip("install", f"torch=={TORCH_DIST}")
    assert out.returncode == 0, out.stderr[-3000:]
    out, seconds = pip("install", ".")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    print(f"pip install . took {seconds:.0f} s")

    check = """
        import importlib.metadata, torch, lycoris_ops
        print(len(lycoris_ops.OP_NAMES), lycoris_ops._build_info.TORCH_VERSION == torch.__version__)
        print([r for r in importlib.metadata.requires("lycoris_ops") if r.startswith("torch")])
        print(torch.ops.lycoris.add_scaled(torch.ones(2), torch.ones(2), 0.5).tolist())
    """
    out = run_python(check, python=python, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # the wheel's metadata (installed as is) pins the torch it was compiled against
    assert out.stdout.split("\n")[:3] == ["23 True", repr([f"torch=={TORCH_DIST}"]), "[1.5, 1.5]"], out.stdout

    # torch changed under it (the record edited stands in for another torch installed)
    site = run_python("import lycoris_ops, os; print(os.path.dirname(lycoris_ops.__file__))", python=python,
                      cwd=tmp_path).stdout.strip()
    record = pathlib.Path(site, "_build_info.py")
    record.write_text(record.read_text().replace(torch.__version__, "2.99.0+cu999"))
    out = run_python("import lycoris_ops", python=python, cwd=tmp_path)
    assert out.returncode == 1 and "ImportError: lycoris_ops._C was compiled against torch 2.99.0+cu999" in out.stderr
    fix = next(line.strip() for line in out.stderr.splitlines() if line.strip().startswith("pip install"))
    out, _ = pip(*fix.split()[1:])
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    out = run_python(check, python=python, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("23 True"), out.stderr[-3000:]
