"""The first Ctrl-C stops a run, also when it lands in a TileLang build.

TileLang runs nvcc from a Python callback inside its C++ codegen (tvm_ffi). A terminal's
Ctrl-C reaches nvcc and Python alike; the ``KeyboardInterrupt`` raised in the callback used
to come back out of tvm_ffi as a bare ``RuntimeError``, which a compile sweep collects as
one more kernel that failed to build (and the tuner as a kernel to run eager instead): the
run went on to the next kernel and the next test. ``backends/tilelang/common._first_use`` keeps it
a ``KeyboardInterrupt``.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("tilelang")

# a kernel no other test builds, so TileLang's disk cache cannot skip the nvcc step
ADD_ARGS = ("float16", "float32", "float16", 2, 64, 96)


def test_an_interrupted_build_raises_keyboard_interrupt(tmp_path, monkeypatch):
    from tilelang.contrib import nvcc

    from lycoris_ops.backends.tilelang import common as _common
    from lycoris_ops.backends.tilelang.kernels import add

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    _common.tl()
    monkeypatch.setattr(nvcc, "compile_cuda", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _common.compile_only(add.add_kernel, "sm_90a", *ADD_ARGS)


INNER = textwrap.dedent(f"""
    import os
    import subprocess

    from tilelang.contrib import nvcc

    from lycoris_ops.backends.tilelang import common as _common
    from lycoris_ops.backends.tilelang.kernels import add


    def test_sweep(monkeypatch):
        def slow_nvcc(*args, **kwargs):  # an nvcc that takes its time: the Ctrl-C lands in it
            nvcc = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            open(os.environ["READY"], "w").close()  # the Ctrl-C comes after: it reaches sleep too
            nvcc.wait()

        _common.tl()
        monkeypatch.setattr(nvcc, "compile_cuda", slow_nvcc)
        try:
            _common.compile_only(add.add_kernel, "sm_90a", *{ADD_ARGS!r})
        except Exception:  # what a compile sweep does with a kernel that fails to build
            pass


    def test_next():
        open(os.environ["NEXT"], "w").close()
""")


def test_one_ctrl_c_stops_pytest_in_a_tilelang_build(tmp_path):
    """pytest in its own process group, SIGINT to the group once (a terminal's Ctrl-C)
    while nvcc runs: it stops within seconds, reports the interrupt and runs no further test."""
    (tmp_path / "test_inner.py").write_text(INNER)
    ready, nxt = tmp_path / "ready", tmp_path / "next"
    env = {**os.environ, "READY": str(ready), "NEXT": str(nxt), "TILELANG_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                            cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate(timeout=60)[0] if proc.poll() is not None else "no build started"
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        out = proc.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert "KeyboardInterrupt" in out and not nxt.exists(), out[-3000:]
    assert took < 20, f"{took:.1f} s from the Ctrl-C to the exit"
