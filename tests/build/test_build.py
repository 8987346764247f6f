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
    """Our C++ checks format numbers without streams (csrc/text.h): on the H200 an integer
    through c10::str's stream in this extension killed the process. Each kind runs in a
    fresh process, so a crash fails the test instead of the session."""
    code = textwrap.dedent("""
        from lycoris_ops import _C
        for kind, exc in ((6, ValueError), (7, RuntimeError), (0, ValueError), (4, RuntimeError)):
            try:
                _C._error_path_probe(kind)
            except exc as e:
                print(kind, str(e).splitlines()[0])
        print(_C._error_path_probe(99))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:5] == ["6 formatted 6 0.500000 string", "7 formatted 7 string",
                                          "0 a constant message", "4 a constant message", "no error"], out.stdout
