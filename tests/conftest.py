"""Test session setup.

Without a GPU, Triton kernels run under its interpreter on CPU tensors; the
variable must be set before triton is first imported (one process is either
interpreted or not, so the compile-only checks run in subprocesses).

Markers (declared in pyproject.toml): ``slow`` tests (exhaustive sweeps) run only where
``-m`` selects them (``-m slow``; pyproject's addopts deselect them otherwise); a
parametrized test marked ``quick_if(predicate)`` has its cases whose parameters fail the
predicate marked ``slow``; ``gpu``, ``cpu_only`` and ``nvcc`` tests are skipped where
``SKIPS`` says. Under the interpreter every Triton launch is bounds-checked
(``interpreter_bounds.py``).
"""
import contextlib
import importlib.util
import os
import shutil

import pytest
import torch

# no test downloads from the Hub; bitsandbytes' import otherwise spends seconds asking it for kernels
os.environ.setdefault("HF_HUB_OFFLINE", "1")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the CPU run's tensors are tiny: intra-op threads only spin (one thread halves its time on
    # 2 cores, and -n 2's workers do not fight over the cores); the tests' subprocesses too
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

#: marker -> (skip it here?, why)
SKIPS = {
    "gpu": (not CUDA, "needs a CUDA device"),
    "cpu_only": (CUDA, "CPU twins and interpreter checks: on a GPU the real kernels are checked"),
    "nvcc": (shutil.which("nvcc") is None, "nvcc is not on PATH: the CUDA compile check needs it (no GPU needed)"),
}


@pytest.hookimpl(tryfirst=True)  # before the -m selection
def pytest_collection_modifyitems(config, items):
    for item in items:
        quick = item.get_closest_marker("quick_if")
        if quick is not None and not quick.args[0](**item.callspec.params):
            item.add_marker(pytest.mark.slow)
        for name, (skip, why) in SKIPS.items():
            if skip and name in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _interpreter_bounds():
    """Every interpreted Triton load and store inside the launch's tensors (a GPU would fault)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
    if interpreted:
        from interpreter_bounds import checked
    with checked() if interpreted else contextlib.nullcontext():
        yield


@pytest.fixture
def fresh_tuner(tmp_path, monkeypatch):
    """The tuner as a new process sees it: an empty table under ``tmp_path``,
    ``LYCORIS_KERNEL_TUNE`` unset, nothing memoized, no fake timer (all restored after)."""
    from lycoris_ops.backends import registry as dispatch
    from lycoris_ops.tuner import tune

    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.ENV_TUNE, raising=False)
    tune.clear()
    tune.set_tuning(None)
    previous = tune.set_timer(None)
    yield
    tune.set_timer(previous)
    tune.clear()
    tune.set_tuning(None)
