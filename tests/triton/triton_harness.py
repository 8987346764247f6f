"""Shared by the Triton kernel tests: the sm_90 compile-only check of a test file.

Each ``test_triton_<family>.py`` has a ``_compile_all(dtype_names)`` that builds its
kernels for sm_90 and prints ``ok <kernel> <dtype>`` per kernel; it runs when the
file is executed as ``python <file> --compile <dtypes...>``. One process is either
interpreted or not (TRITON_INTERPRET is read at import), so the check runs the file
in a fresh process without the interpreter.
"""
import os
import subprocess
import sys

import pytest

from lycoris_ops.backends.triton.common import ptxas_path


def run_compile_check(test_file: str, dtype_names):
    """Run ``test_file``'s ``_compile_all`` in a fresh process without the interpreter;
    its stdout (skips when Triton's ptxas is unavailable)."""
    if ptxas_path(90) is None:
        pytest.skip("triton's ptxas is unavailable")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.abspath(test_file)
    proc = subprocess.run([sys.executable, here, "--compile", *dtype_names], env=env, capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(here)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc.stdout
