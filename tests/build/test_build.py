"""Both builds of csrc: the Python extension (imported here) and the CMake
shared library that torch.ops.load_library loads without the Python package."""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_compiles_nothing():
    # `import lycoris_ops` loads the prebuilt _C: no JIT build (torch.utils.cpp_extension.load) anywhere.
    code = textwrap.dedent("""
        import torch.utils.cpp_extension as ext
        def boom(*a, **k): raise AssertionError("import compiled something")
        ext.load = ext.load_inline = boom
        import lycoris_ops
        print(len(lycoris_ops.OP_NAMES))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "23"


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_library_loads_with_load_library(tmp_path):
    build = tmp_path / "build"
    subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
        check=True, capture_output=True, timeout=600,
    )
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True, capture_output=True, timeout=900)
    lib = next(build.glob("liblycoris_ops*.so"))
    # a fresh process that never imports lycoris_ops: the library alone defines the schemas
    code = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({str(lib)!r})
        print(torch.ops.lycoris.lora_bypass_fwd.default._schema)
        print(torch.ops.lycoris.add_scaled.default._schema)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "lycoris::lora_bypass_fwd(Tensor x, Tensor up, Tensor down, float gamma, Tensor? base=None) -> Tensor" in out.stdout
    assert "lycoris::add_scaled(Tensor base, Tensor delta, float gamma) -> Tensor" in out.stdout


def test_extension_errors_with_numbers_reach_python():
    """The C++ checks format their numbers without streams (csrc/text.h): an integer formatted
    through c10::str's stream in this extension once killed the process instead of raising.
    The real paths, each in a fresh process so a crash fails the test instead of the session:
    the autograd node's double-backward check and a registration's argument error."""
    code = textwrap.dedent("""
        import torch, lycoris_ops
        from lycoris_ops import _C
        x = torch.randn(4, 3, requires_grad=True)
        up, down = torch.randn(5, 2, requires_grad=True), torch.randn(2, 3, requires_grad=True)
        y = torch.ops.lycoris.lora_bypass_fwd(x, up, down, 0.5)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        try:
            gx.sum().backward()
        except RuntimeError as e:
            print("double:", str(e).splitlines()[0][:60])
        try:
            _C._register_autograd("lycoris::no_such_op", None, [], [], [])
        except (ValueError, RuntimeError, TypeError) as e:
            print("register:", type(e).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("double: lycoris.lora_bypass_bwd is a first-order backward op"), out.stdout
    assert lines[1].startswith("register: "), out.stdout
