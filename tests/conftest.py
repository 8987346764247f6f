"""Test session setup.

Without a GPU, Triton kernels run under its interpreter on CPU tensors; the
variable must be set before triton is first imported (one process is either
interpreted or not, so the compile-only checks run in subprocesses).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
