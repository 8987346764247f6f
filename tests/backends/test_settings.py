"""The LYCORIS_* environment variables (lycoris_ops/settings.py): one table, every reader
through it, an invalid value is a ValueError naming the variable, its value and the valid
values (at `import lycoris_ops` and where the variable is read), never a silent default."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lycoris_ops  # noqa: F401
from lycoris_ops.backends import registry as dispatch
from lycoris_ops import settings
from lycoris_ops.tuner import build_pool
from lycoris_ops.tuner import tune

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SWITCHES = [n for n, s in settings.SETTINGS.items() if s.parse is settings._switch]
COUNTS = ["LYCORIS_KERNEL_TUNE_THREADS", "LYCORIS_KERNEL_TUNE_PROCS"]


def test_every_reader_goes_through_the_table():
    """No module of the package reads a LYCORIS_* variable from os.environ itself, and every
    name the package mentions in a read is declared."""
    offenders = []
    for base, _, files in os.walk(os.path.join(ROOT, "lycoris_ops")):
        for f in files:
            if not f.endswith(".py") or f == "settings.py":
                continue
            text = open(os.path.join(base, f), encoding="utf-8").read()
            for line in text.splitlines():
                reads = "environ.get(" in line or "getenv(" in line or ("environ[" in line and "] =" not in line)
                if reads and ("LYCORIS" in line or "ENV_" in line):
                    offenders.append(f"{f}: {line.strip()}")
    assert offenders == []
    for name, s in settings.SETTINGS.items():
        assert name.startswith("LYCORIS_") and s.meaning and s.shown_default and s.valid_values()


@pytest.mark.parametrize("name", SWITCHES)
def test_switches(name, monkeypatch):
    for text, value in (("1", True), ("on", True), ("TRUE", True), (" yes ", True),
                        ("0", False), ("Off", False), ("false", False), ("no", False)):
        monkeypatch.setenv(name, text)
        assert settings.get(name) is value
    monkeypatch.setenv(name, "")  # empty: the default
    assert settings.get(name) is settings.SETTINGS[name].default
    for bad in ("maybe", "2", "enable"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}' is not valid; valid values: 1/0, on/off, "
                                             "true/false, yes/no"):
            settings.get(name)


def test_tune_maybe_is_an_error_not_on(monkeypatch):
    """LYCORIS_KERNEL_TUNE=maybe used to mean "on" silently."""
    monkeypatch.setenv(dispatch.ENV_TUNE, "maybe")
    with pytest.raises(ValueError, match="LYCORIS_KERNEL_TUNE='maybe'"):
        dispatch.tuning_enabled()
    monkeypatch.setenv(dispatch.ENV_TUNE, "off")
    assert dispatch.tuning_enabled() is False


@pytest.mark.parametrize("bad", ["-1", "abc", "nan", "inf", "-0.5"])
def test_budget_rejects_nonsense(bad, monkeypatch):
    """-1 used to become "no limit" and abc the default, silently."""
    monkeypatch.setenv(tune.ENV_BUDGET, bad)
    previous = tune._budget[0]
    tune._budget[0] = None
    try:
        with pytest.raises(ValueError, match=f"LYCORIS_KERNEL_TUNE_BUDGET='{bad}' is not valid; valid values: "
                                             r"a number of seconds >= 0 \(0: no limit\) \(unset: 1.5\)"):
            tune.tune_budget()
    finally:
        tune._budget[0] = previous


def test_budget_values(monkeypatch):
    previous = tune._budget[0]
    try:
        for text, value in (("0", 0.0), ("2.5", 2.5), (" 3 ", 3.0)):
            monkeypatch.setenv(tune.ENV_BUDGET, text)
            tune._budget[0] = None
            assert tune.tune_budget() == value
        monkeypatch.delenv(tune.ENV_BUDGET)
        tune._budget[0] = None
        assert tune.tune_budget() == 1.5
    finally:
        tune._budget[0] = previous


@pytest.mark.parametrize("name", COUNTS)
def test_counts(name, monkeypatch):
    read = tune.tune_threads if name == tune.ENV_THREADS else build_pool.tune_procs
    monkeypatch.setenv(name, "3")
    assert read() == 3
    monkeypatch.setenv(name, "0")
    assert read() == 0
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}' is not valid; valid values: an integer >= 0"):
            read()


def test_autograd_kernel_and_backend_names(monkeypatch):
    monkeypatch.setenv("LYCORIS_AUTOGRAD_KERNEL", "Python")
    assert settings.get("LYCORIS_AUTOGRAD_KERNEL") == "python"
    monkeypatch.setenv("LYCORIS_AUTOGRAD_KERNEL", "pyhton")
    with pytest.raises(ValueError, match="LYCORIS_AUTOGRAD_KERNEL='pyhton' is not valid; valid values: cpp, python"):
        settings.get("LYCORIS_AUTOGRAD_KERNEL")
    monkeypatch.setenv(dispatch.ENV_BACKEND, "cuda")
    with pytest.raises(ValueError, match="LYCORIS_KERNEL_BACKEND='cuda' is not valid; valid values: auto, triton"):
        settings.get(dispatch.ENV_BACKEND)


def test_warp_specialize_words(monkeypatch):
    name = "LYCORIS_TILELANG_WS"
    for text, value in (("auto", True), ("AUTO", True), ("on", True), ("off", False), ("0", False)):
        monkeypatch.setenv(name, text)
        assert settings.get(name) is value
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match="LYCORIS_TILELANG_WS='sometimes' is not valid; valid values: auto or off"):
        settings.get(name)


def test_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(tmp_path / "not-yet"))
    assert dispatch.cache_dir() == str(tmp_path / "not-yet")  # created on the first write
    afile = tmp_path / "a_file"
    afile.write_text("x")
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(afile))
    with pytest.raises(ValueError, match="LYCORIS_KERNEL_CACHE_DIR=.*a_file' is not valid; valid values: a "
                                         "directory, not an existing file"):
        dispatch.cache_dir()


def test_unwritable_cache_dir_warns_once_naming_the_variable(tmp_path, fresh_tuner, monkeypatch):
    """A cache directory that cannot be created (its parent is a file): one warning naming
    LYCORIS_KERNEL_CACHE_DIR, and the tuned pick still answers (kept in memory)."""
    import warnings

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(tmp_path / "file" / "cache"))
    pick = {"block": 64, "num_warps": 4}

    def timer(fn, cand):
        fn()
        return 1e-6 if cand == pick else 2e-6

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = tune.select_config("add_scaled", "triton", (("T", 64),), [pick, tune.SENTINEL_EAGER],
                                     lambda c: None, device="cpu", version=1, timer=timer)
            assert got == pick
    ours = [str(w.message) for w in caught if "cannot write the tuning table" in str(w.message)]
    assert len(ours) == 1 and "set LYCORIS_KERNEL_CACHE_DIR to a writable directory" in ours[0]


def _import(env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LYCORIS_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", "import lycoris_ops"], capture_output=True, text=True,
                          env=full, timeout=300)


def test_import_reports_every_invalid_variable_at_once():
    """Lazily read variables fail at import too (before a run starts), all in one message."""
    out = _import({"LYCORIS_KERNEL_TUNE": "maybe", "LYCORIS_KERNEL_TUNE_BUDGET": "abc",
                   "LYCORIS_TILELANG_DEFER": "later", "LYCORIS_KERNEL_REPLAY": " "})
    assert out.returncode != 0
    err = out.stderr
    assert "ValueError: lycoris_ops: LYCORIS_KERNEL_TUNE='maybe' is not valid" in err
    assert "LYCORIS_KERNEL_TUNE_BUDGET='abc' is not valid" in err
    assert "LYCORIS_TILELANG_DEFER='later' is not valid" in err
    assert "LYCORIS_KERNEL_REPLAY" not in err  # empty: unset


def test_import_accepts_valid_values():
    out = _import({"LYCORIS_KERNEL_TUNE": "no", "LYCORIS_KERNEL_TUNE_BUDGET": "0", "LYCORIS_CUBLASLT": "off",
                   "LYCORIS_AUTOGRAD_KERNEL": "python", "LYCORIS_TILELANG_WS": "auto"})
    assert out.returncode == 0, out.stderr
