"""The tuner (lycoris_ops/tuner): bucketing, keys, the table (merge under concurrent
writers, corrupt / foreign-version files), TUNE=off, the capture / compile guards,
the eager sentinel, reuse by a later process, the device table, the cost model and
the family planners, the warm-up and its CLI. CPU only: timing goes through a fake timer."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

import lycoris_ops  # noqa: F401  (registers the ops)
from lycoris_ops.backends import registry as dispatch
from lycoris_ops.testing.samples import SAMPLES, Layer, parse_layer
from lycoris_ops.tuner import cost, device, timing, tune
from lycoris_ops.tuner.store import JsonTable
from lycoris_ops.warmup import main as warmup_main, warmup

EAGER = tune.SENTINEL_EAGER
A = {"block": 64, "num_warps": 4}
B = {"block": 128, "num_warps": 8}
C = {"block": 256, "num_warps": 8}


@pytest.fixture(autouse=True)
def _fresh(fresh_tuner):
    device.clear()
    yield
    device.clear()


class FakeTimer:
    """Seconds per candidate label; counts calls."""

    def __init__(self, times):
        self.times = times
        self.calls = []

    def __call__(self, fn, cand):
        fn()
        self.calls.append(tune.label(cand))
        return self.times[tune.label(cand)]


def _run(cand):
    return torch.ones(3)


def _select(key=(("dtype", "bfloat16"), ("T", 1024)), cands=(A, B, EAGER), timer=None, op="add_scaled",
            run=_run, version=1, **kw):
    return tune.select_config(op, "triton", key, list(cands), run, device="cpu", version=version, timer=timer, **kw)


def _rows(tmp_path):
    with open(tmp_path / "cache" / "tuning.json") as f:
        data = json.load(f)
    assert data["version"] == tune.TABLE_VERSION
    return data["rows"]


# ----------------------------------------------------------------------------- keys

@pytest.mark.parametrize("n,b", [(0, 1), (1, 1), (2, 2), (3, 4), (17, 32), (4095, 4096), (4096, 4096),
                                 (4097, 6144), (4608, 6144), (6144, 6144), (6145, 8192), (8192, 8192), (8193, 12288),
                                 (100000, 102400)])
def test_bucket(n, b):
    assert tune.bucket(n) == b


def test_shape_key_and_make_key():
    k1 = tune.shape_key(torch.bfloat16, tokens={"T": 3000}, exact={"I": 4096, "O": 11008}, flags={"base": True})
    k2 = tune.shape_key(torch.bfloat16, tokens={"T": 4000}, exact={"I": 4096, "O": 11008}, flags={"base": True})
    k3 = tune.shape_key(torch.float16, tokens={"T": 4000}, exact={"I": 4096, "O": 11008}, flags={"base": True})
    k4 = tune.shape_key(torch.bfloat16, tokens={"T": 4000}, exact={"I": 4095, "O": 11008}, flags={"base": True})
    assert k1 == k2  # same token bucket
    assert k1 != k3 and k1 != k4  # dtype and weight dims are exact
    assert dict(k1) == {"dtype": "bfloat16", "T": 4096, "I": 4096, "O": 11008, "base": True}
    s = tune.make_key("NVIDIA H200", "triton", "lora_bypass_fwd", "abc123", k1)
    assert s == "NVIDIA H200|triton|lora_bypass_fwd|vabc123|dtype=bfloat16,T=4096,I=4096,O=11008,base=1"
    assert tune.make_key("NVIDIA H200", "tilelang", "lora_bypass_fwd", "abc123", k1) != s
    assert tune.make_key("NVIDIA H200", "triton", "lora_bypass_fwd", "def456", k1) != s
    assert tune.make_key("NVIDIA A100", "triton", "lora_bypass_fwd", "abc123", k1) != s


def test_source_version_changes_with_source(tmp_path):
    p = tmp_path / "k.py"
    p.write_text("a = 1\n")
    v1 = tune.source_version(str(p))
    p2 = tmp_path / "k2.py"
    p2.write_text("a = 2\n")
    assert tune.source_version(str(p2)) != v1
    assert tune.source_version(str(p)) == v1


# ----------------------------------------------------------------------------- tuning

def test_tunes_stores_and_memoizes(tmp_path, caplog):
    t = FakeTimer({"block=64,num_warps=4": 3e-6, "block=128,num_warps=8": 1e-6, EAGER: 2e-6})
    calls = []

    def plan():
        calls.append(1)
        return tune.Plan("add_scaled", [A, B, EAGER])

    with caplog.at_level("INFO", logger="lycoris_ops.tune"):
        got = tune.select_config("add_scaled", "triton", {"dtype": "float32", "n": 1024}, plan, _run,
                                 device="cpu", version=1, timer=t)
    assert got == B
    assert len(t.calls) == 3 + 2 + 2  # round one: all; A (3x the leader) dropped after it
    assert any("add_scaled" in r.message and "block=128" in r.message for r in caplog.records)
    rows = _rows(tmp_path)
    (key, row), = rows.items()
    assert key == "cpu|triton|add_scaled|v1|dtype=float32,n=1024"
    assert row["config"] == B and row["ms"] == pytest.approx(1e-3)
    n = len(t.calls)
    got = tune.select_config("add_scaled", "triton", {"dtype": "float32", "n": 1024}, plan, _run,
                             device="cpu", version=1, timer=t)
    assert got == B and len(t.calls) == n and calls == [1]  # memo: no plan, no timing


def test_best_of_three_rounds_and_drop():
    seq = {"A": [3.5e-6, 1e-6, 4e-6], "B": [2e-6, 2e-6, 2e-6], "C": [9e-6, 1e-9, 1e-9]}
    seen = []

    def timer(fn, cand):
        name = {64: "A", 128: "B", 256: "C"}[cand["block"]]
        seen.append(name)
        return seq[name][sum(1 for s in seen if s == name) - 1]

    got = _select(cands=(A, B, C), timer=timer)
    assert got == A  # best round 1e-6
    assert seen.count("C") == 1  # > 2x the leader after round one: dropped
    assert seen.count("A") == 3 and seen.count("B") == 3


def test_sentinel_eager_recorded(tmp_path):
    t = FakeTimer({"block=64,num_warps=4": 3e-6, "block=128,num_warps=8": 2e-6, EAGER: 1e-6})
    assert _select(timer=t) == EAGER
    (row,) = _rows(tmp_path).values()
    assert row["config"] == EAGER
    tune.clear()  # a later process: eager again, from the table
    t2 = FakeTimer({})
    assert _select(timer=t2) == EAGER and t2.calls == []


def test_resolve_and_front():
    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    front = tune.Front()
    got = _select(timer=t, resolve=lambda c: ("cfg", c["block"]), front=(front, "exact"))
    assert got == ("cfg", 64) and front["exact"] == ("cfg", 64)
    tune.clear()
    assert "exact" not in front  # cleared with the memo


def test_mismatch_chunked(monkeypatch):
    monkeypatch.setattr(timing, "CHECK_CHUNK", 7)
    b = torch.linspace(-1, 1, 50)
    assert tune.mismatch(b.clone(), b) is None
    assert "relative error" in tune.mismatch(b * 1.01, b)
    bad = b.clone()
    bad[33] = float("nan")
    assert "not finite" in tune.mismatch(bad, b)
    assert tune.mismatch((b, b[:3]), (b, b[:3])) is None
    assert "outputs" in tune.mismatch((b,), (b, b))


def test_failing_and_disagreeing_candidates_are_skipped(tmp_path):
    def run(c):
        if tune.is_eager(c):
            return torch.ones(8)
        if c["block"] == 64:
            raise RuntimeError("out of resources")
        if c["block"] == 128:
            return torch.full((8,), 2.0)  # wrong numbers
        return torch.ones(8)

    t = FakeTimer({"block=64,num_warps=4": 1e-9, "block=128,num_warps=8": 1e-9, "block=256,num_warps=8": 2e-6,
                   EAGER: 3e-6})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _select(cands=(A, B, C, EAGER), timer=t, run=run)
    assert got == C
    assert "block=64,num_warps=4" not in t.calls and "block=128,num_warps=8" not in t.calls
    (row,) = _rows(tmp_path).values()
    assert set(row["failed"]) == {"block=64,num_warps=4", "block=128,num_warps=8"}


def test_all_fail_not_stored(tmp_path):
    def run(c):
        raise RuntimeError("boom")

    assert _select(timer=FakeTimer({}), run=run) == A  # the planner's pick, for this process
    assert not (tmp_path / "cache" / "tuning.json").exists()


def test_oom_not_stored(tmp_path):
    def run(c):
        if isinstance(c, dict) and c["block"] == 128:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return torch.ones(3)

    t = FakeTimer({"block=64,num_warps=4": 1e-6, EAGER: 2e-6})
    assert _select(timer=t, run=run) == A
    assert not (tmp_path / "cache" / "tuning.json").exists()
    n = len(t.calls)
    assert _select(timer=t, run=run) == A and len(t.calls) == n  # kept for the process


def test_budget_skips_lower_ranked_candidates(tmp_path):
    tune.set_budget(1e-9)
    t = FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6})
    assert _select(cands=(A, B, C, EAGER), timer=t) == B
    assert "block=256,num_warps=8" not in t.calls and EAGER in t.calls
    (row,) = _rows(tmp_path).values()
    assert row["skipped"] == ["block=256,num_warps=8"]
    tune.set_budget(None)
    assert tune.tune_budget() == tune.DEFAULT_BUDGET_S


@pytest.fixture
def parallel_warm(monkeypatch):
    """The worker-thread first calls (CUDA-only in production) turned on for CPU runs (no
    ``prepare`` hook: ``test_precompile.py`` covers the Triton backend's)."""
    monkeypatch.setattr(tune, "_parallel_ok", lambda dev_id: True)
    monkeypatch.setenv(tune.ENV_THREADS, "4")


def test_parallel_first_calls_overlap_and_check(tmp_path, parallel_warm):
    """Each fused candidate's first call runs on a worker thread (all at once: a barrier
    only opens when every one has started), is checked against eager there (wrong
    numbers and errors disqualify), then timing runs on the calling thread."""
    import threading
    barrier = threading.Barrier(3, timeout=20)
    first = {}
    calls = []  # later calls, on the calling thread

    def run(c):
        if tune.is_eager(c):
            return torch.ones(8)
        name = tune.label(c)
        if name not in first:
            first[name] = threading.current_thread().name
            assert tune.in_worker()
            barrier.wait()  # deadlocks (times out) unless the three first calls overlap
        else:
            assert not tune.in_worker()
            calls.append(name)
        if c["block"] == 64:
            raise RuntimeError("out of resources")
        return torch.ones(8)

    t = FakeTimer({"block=64,num_warps=4": 1e-9, "block=128,num_warps=8": 2e-6, "block=256,num_warps=8": 1e-6,
                   EAGER: 3e-6})
    assert _select(cands=(A, B, C, EAGER), timer=t, run=run) == C
    assert all(n.startswith("lycoris-tune") for n in first.values()) and len(first) == 3
    # one untimed call of each survivor on the calling thread before the timed ones
    assert calls[:2] == ["block=128,num_warps=8", "block=256,num_warps=8"]
    (row,) = _rows(tmp_path).values()
    assert set(row["failed"]) == {"block=64,num_warps=4"} and set(row["times"]) == {
        "block=128,num_warps=8", "block=256,num_warps=8", EAGER}


def test_parallel_nested_selection_takes_first_pick(tmp_path, parallel_warm):
    """A candidate whose first call selects another key (on a worker, while the tuning
    thread holds the lock) gets that key's first pick at once: no deadlock, nothing
    stored for the nested key; timed later on the calling thread, it tunes normally."""
    nested = []

    def inner_run(c):
        return torch.ones(2)

    def run(c):
        if not tune.is_eager(c):
            nested.append(_select(key=(("dtype", "bfloat16"), ("T", 7)), cands=(B, A, EAGER),
                                  timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6,
                                                   EAGER: 3e-6}), run=inner_run, op="ia3_fwd"))
        return torch.ones(3)

    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    assert _select(cands=(A, B, EAGER), timer=t, run=run) == A
    assert nested[:2] == [B, B]  # the two worker first calls: the nested planner's first pick
    assert nested[2] == A  # the calling thread's untimed call tunes the nested key (A is faster)
    assert tune.stats()["guarded"] >= 2


def test_parallel_off_by_env(tmp_path, parallel_warm, monkeypatch):
    monkeypatch.setenv(tune.ENV_THREADS, "0")
    seen = []

    def run(c):
        seen.append(tune.in_worker())
        return torch.ones(3)

    _select(timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6}), run=run)
    assert not any(seen)


def test_budget_env(monkeypatch):
    monkeypatch.setenv(tune.ENV_BUDGET, "0")
    tune.set_budget(None)
    assert tune.tune_budget() == 0.0
    monkeypatch.setenv(tune.ENV_BUDGET, "junk")
    tune.set_budget(None)
    with pytest.raises(ValueError, match="LYCORIS_KERNEL_TUNE_BUDGET='junk' is not valid"):  # no silent default
        tune.tune_budget()


def test_kernel_version_invalidates_own_rows_only(tmp_path):
    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    _select(timer=t, version="k1")
    _select(timer=t, version="k1", op="ia3_fwd")
    tune.clear()
    t2 = FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6})
    assert _select(timer=t2, version="k2") == B  # new kernel version: retuned
    assert _select(timer=t2, version="k1", op="ia3_fwd") == A  # the other op's row still used
    rows = _rows(tmp_path)
    assert len(rows) == 3


# ----------------------------------------------------------------------------- second process

def test_fresh_process_reuses_table_without_timing(tmp_path):
    t = FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6})
    assert _select(timer=t) == B
    tune.clear()  # a fresh table object reads the file

    def plan():
        raise AssertionError("the planner must not run on a table hit")

    t2 = FakeTimer({})
    key = tune.shape_key(torch.bfloat16, tokens={"T": 600})  # 600 -> bucket 1024
    assert tune.select_config("add_scaled", "triton", key, plan, _run, device="cpu", version=1, timer=t2) == B
    assert t2.calls == [] and tune.stats()["table_hits"] == 1 and tune.stats()["tuned"] == 0


def _child_select(cache, q):
    os.environ[dispatch.ENV_CACHE_DIR] = cache
    tune.clear()
    t = FakeTimer({})
    got = _select(timer=t)
    q.put((got, t.calls, tune.stats()["tuned"]))


def test_second_real_process_does_no_timing(tmp_path):
    t = FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6})
    _select(timer=t)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_select, args=(str(tmp_path / "cache"), q))
    p.start()
    got, calls, tuned = q.get(timeout=60)
    p.join(60)
    assert got == B and calls == [] and tuned == 0


# ----------------------------------------------------------------------------- table

def _child_writer(path, tag, n, barrier):
    tab = JsonTable(path, tune.TABLE_VERSION, "rows")
    barrier.wait()
    for i in range(n):
        tab.put(f"{tag}-{i}", {"config": {"block": i}, "ms": 1.0})


def test_table_merge_two_concurrent_writers(tmp_path):
    path = str(tmp_path / "cache" / "tuning.json")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_child_writer, args=(path, tag, 25, barrier)) for tag in ("p1", "p2")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = _rows(tmp_path)
    assert len(rows) == 50
    assert {k.split("-")[0] for k in rows} == {"p1", "p2"}
    leftovers = [f for f in os.listdir(tmp_path / "cache") if ".tmp." in f]
    assert leftovers == []


def _child_tuner(cache, op, barrier):
    os.environ[dispatch.ENV_CACHE_DIR] = cache
    tune.clear()
    barrier.wait()
    for T in (16, 32, 64, 128, 256, 512):
        t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
        _select(key=(("T", T),), op=op, timer=t)


def test_two_processes_tuning_keep_each_others_rows(tmp_path):
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_child_tuner, args=(str(tmp_path / "cache"), op, barrier))
             for op in ("ia3_fwd", "add_scaled")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = _rows(tmp_path)
    assert len(rows) == 12 and all(r["config"] == A for r in rows.values())


def test_table_merge_keeps_rows_written_after_load(tmp_path):
    path = str(tmp_path / "t.json")
    a, b = JsonTable(path, 1), JsonTable(path, 1)
    assert len(a) == 0 and len(b) == 0  # both loaded before anything was written
    a.put("ka", {"config": "eager"})
    b.put("kb", {"config": "eager"})
    with open(path) as f:
        assert set(json.load(f)["rows"]) == {"ka", "kb"}


def test_corrupt_table_warns_once_and_is_replaced(tmp_path):
    os.makedirs(tmp_path / "cache")
    (tmp_path / "cache" / "tuning.json").write_text("{not json")
    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _select(timer=t) == A
        assert _select(key=(("T", 1),), timer=t) == A
    msgs = [str(x.message) for x in w if "tuning table" in str(x.message)]
    assert len(msgs) == 1 and "ignoring" in msgs[0]
    assert len(_rows(tmp_path)) == 2  # replaced by a valid table


@pytest.mark.parametrize("content", ["7", '{"version": 1, "rows": 7}', ""])
def test_other_corrupt_shapes(tmp_path, content):
    os.makedirs(tmp_path / "cache")
    (tmp_path / "cache" / "tuning.json").write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring the tuning table"):
        assert _select(timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6,
                                        EAGER: 3e-6})) == A


def test_foreign_version_rows_ignored(tmp_path):
    os.makedirs(tmp_path / "cache")
    key = tune.make_key("cpu", "triton", "add_scaled", 1, (("dtype", "bfloat16"), ("T", 1024)))
    newer = {"version": 2, "rows": {key: {"config": B}}}
    (tmp_path / "cache" / "tuning.json").write_text(json.dumps(newer))
    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _select(timer=t) == A  # the foreign row is not used: timed
    assert len(t.calls) > 0
    assert sum("format version" in str(x.message) for x in w) >= 1
    with open(tmp_path / "cache" / "tuning.json") as f:
        assert json.load(f) == newer  # a newer format is left alone


def test_older_version_replaced(tmp_path):
    os.makedirs(tmp_path / "cache")
    (tmp_path / "cache" / "tuning.json").write_text(json.dumps({"version": tune.TABLE_VERSION - 1, "rows": {}}))
    with pytest.warns(RuntimeWarning, match="format version"):
        _select(timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6}))
    assert len(_rows(tmp_path)) == 1


def test_lycoris_lora_table_left_alone(tmp_path):
    """lycoris-lora keeps its tuning table (a JSON list) at the same default path: it is left
    as it is, ours lives beside it (tuning.lycoris_ops.json), one warning names both, and a
    second process finds our rows there without timing."""
    os.makedirs(tmp_path / "cache")
    theirs = json.dumps([{"key": ["NVIDIA H200", "lora_fwd", [4096]], "plan": [128, 64, 4]}])
    (tmp_path / "cache" / "tuning.json").write_text(theirs)
    timings = {"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _select(timer=FakeTimer(timings)) == A
        assert _select(key=(("T", 1),), timer=FakeTimer(timings)) == A
    msgs = [str(x.message) for x in w if "another program's table" in str(x.message)]
    assert len(msgs) == 1 and "tuning.lycoris_ops.json" in msgs[0]
    assert (tmp_path / "cache" / "tuning.json").read_text() == theirs
    with open(tmp_path / "cache" / "tuning.lycoris_ops.json") as f:
        assert len(json.load(f)["rows"]) == 2
    tune.clear()  # a fresh process: the table is read again, from the sibling
    t = FakeTimer(timings)
    assert _select(timer=t) == A and not t.calls


def test_unwritable_dir_keeps_working(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(blocker / "sub"))  # a path under a file
    tune.clear()
    t = FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})
    with pytest.warns(RuntimeWarning, match="cannot write"):
        assert _select(timer=t) == A
    n = len(t.calls)
    assert _select(timer=t) == A and len(t.calls) == n


# ----------------------------------------------------------------------------- TUNE=off, guards

def test_tune_off_takes_first_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_TUNE, "off")
    tune.set_tuning(None)
    t = FakeTimer({})
    plans = []

    def plan():
        plans.append(1)
        return [B, A, EAGER]

    assert tune.select_config("add_scaled", "triton", (("T", 8),), plan, _run, device="cpu", version=1,
                              timer=t) == B
    assert tune.select_config("add_scaled", "triton", (("T", 8),), plan, _run, device="cpu", version=1,
                              timer=t) == B
    assert t.calls == [] and plans == [1]  # remembered for the process
    assert not (tmp_path / "cache" / "tuning.json").exists()
    tune.set_tuning(True)  # timed once tuning is back on
    t.times = {"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6}
    assert tune.select_config("add_scaled", "triton", (("T", 8),), plan, _run, device="cpu", version=1,
                              timer=t) == A
    assert len(_rows(tmp_path)) == 1


def test_tune_off_still_uses_table_rows(tmp_path, monkeypatch):
    _select(timer=FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6}))
    tune.clear()
    monkeypatch.setenv(dispatch.ENV_TUNE, "0")
    tune.set_tuning(None)
    assert _select(timer=FakeTimer({})) == B


@pytest.mark.parametrize("guard", ["compiling", "capturing"])
def test_guards_take_first_pick_not_stored_not_memoized(tmp_path, monkeypatch, guard):
    if guard == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    else:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tune.unsafe_to_time()
    t = FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6})
    assert _select(timer=t) == A and _select(timer=t) == A
    assert t.calls == []
    assert not (tmp_path / "cache" / "tuning.json").exists()
    assert tune.stats()["guarded"] == 2
    monkeypatch.undo()
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(tmp_path / "cache"))
    assert not tune.unsafe_to_time()
    assert _select(timer=t) == B  # timed at the next safe call
    assert len(t.calls) > 0 and len(_rows(tmp_path)) == 1


def test_guard_still_uses_tuned_rows(monkeypatch):
    _select(timer=FakeTimer({"block=64,num_warps=4": 2e-6, "block=128,num_warps=8": 1e-6, EAGER: 3e-6}))
    tune.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _select(timer=FakeTimer({})) == B


def test_no_timer_on_cpu_takes_first_pick(tmp_path):
    got = tune.select_config("add_scaled", "triton", (("T", 8),), [B, A], _run, device="cpu", version=1)
    assert got == B and not (tmp_path / "cache" / "tuning.json").exists()


def test_empty_candidates_raise():
    with pytest.raises(ValueError, match="empty"):
        _select(cands=(), timer=FakeTimer({}))


# ----------------------------------------------------------------------------- device facts

def test_device_facts_synthetic():
    h = device.synthetic("NVIDIA H200")
    assert h.arch == "sm_90" and h.cp_async and h.stages == (1, 2, 3, 4)
    assert h.dram_bw > 1e12 and h.mma_peak > 1e14 and not h.measured
    v = device.synthetic("Tesla V100", capability=(7, 0), sm_count=80, smem_per_block=96 << 10)
    assert not v.cp_async and v.stages == (1, 2) and v.smem_unit == 256
    u = device.synthetic("Some Future GPU", capability=(9, 0), sm_count=100)
    assert u.dram_bw <= 1e12 and u.mma_peak > 0  # unknown card: generic estimate


def _props():
    return types.SimpleNamespace(name="Fake GPU", major=9, minor=0, multi_processor_count=100,
                                 L2_cache_size=40 << 20, shared_memory_per_block_optin=200 << 10,
                                 shared_memory_per_multiprocessor=228 << 10, regs_per_multiprocessor=65536,
                                 max_threads_per_multi_processor=2048)


def test_device_measured_once_and_persisted(tmp_path, monkeypatch):
    probes = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _props())
    monkeypatch.setattr(device, "measure_bandwidth", lambda i, l2: probes.append("bw") or 3e12)
    monkeypatch.setattr(device, "measure_matmul", lambda i, cap: probes.append("mm") or 5e14)
    f = device.facts(0)
    assert f.measured and f.dram_bw == 3e12 and f.mma_peak == 5e14 and f.sm_count == 100
    assert device.facts(0) is f and probes == ["bw", "mm"]
    with open(tmp_path / "cache" / "devices.json") as fh:
        rows = json.load(fh)["devices"]
    assert rows["Fake GPU|sm_90|100sm"]["dram_bw"] == 3e12
    device.clear()  # a later process: read, not measured
    g = device.facts(0)
    assert g.measured and g.dram_bw == 3e12 and probes == ["bw", "mm"]


def test_device_not_measured_under_guard(monkeypatch):
    probes = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _props())
    monkeypatch.setattr(device, "measure_bandwidth", lambda i, l2: probes.append("bw") or 3e12)
    monkeypatch.setattr(device, "measure_matmul", lambda i, cap: probes.append("mm") or 5e14)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    f = device.facts(0)
    assert not f.measured and probes == []
    with pytest.raises(RuntimeError, match="capturing"):
        device.measure(0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert device.facts(0).measured and probes == ["bw", "mm"]  # not cached while guarded


# ----------------------------------------------------------------------------- cost model

def test_cost_model_basics():
    dev = device.synthetic()
    small = cost.estimate(cost.Work(grid=1000, warps=4, stages=2, smem=16 << 10, dram=1e8), dev)
    big = cost.estimate(cost.Work(grid=1000, warps=4, stages=2, smem=16 << 10, dram=2e8), dev)
    assert small and big and big.time > small.time and small.limiter == "dram"
    assert cost.estimate(cost.Work(grid=10, warps=4, stages=4, smem=100 << 10), dev) is None  # smem
    assert cost.estimate(cost.Work(grid=10, warps=64), dev) is None  # > 1024 threads
    mm = cost.estimate(cost.Work(grid=1056, warps=8, stages=3, acc=128 * 128, smem=32 << 10, dram=1e7,
                                 mma=2 * 4096.0 ** 3), dev)
    assert mm.limiter == "mma"
    fp32 = cost.estimate(cost.Work(grid=1056, warps=8, stages=3, acc=128 * 128, smem=32 << 10, dram=1e7,
                                   mma=2 * 4096.0 ** 3, tc=False), dev)
    assert fp32.time > 5 * mm.time
    # one wave of 132 vs 133 programs: wave quantization
    w1 = cost.estimate(cost.Work(grid=132, warps=8, acc=128 * 128, mma=1e11), dev)
    w2 = cost.estimate(cost.Work(grid=133, warps=8, acc=128 * 128, mma=1e11 * 133 / 132), dev)
    assert w2.time > 1.5 * w1.time


def test_shortlist_diversity_and_default():
    ranked = [(1.0, {"bm": 64, "bn": 64, "w": 4}), (1.01, {"bm": 64, "bn": 64, "w": 8}),
              (1.1, {"bm": 64, "bn": 128, "w": 4}), (1.2, {"bm": 128, "bn": 64, "w": 4}),
              (1.3, {"bm": 32, "bn": 32, "w": 4})]
    s = cost.shortlist(ranked, 3, ("bm", "bn"))
    assert s[0] == {"bm": 64, "bn": 64, "w": 4} and len(s) == 3
    assert {c["bm"] for c in s} >= {64, 128} and {c["bn"] for c in s} >= {64, 128}
    d = {"bm": 32, "bn": 32, "w": 4}
    p = cost.make_plan("x", ranked, tile_axes=("bm", "bn"), n=3, default=d, default_s=1.3, eager_s=2.0)
    assert p.candidates[0] == ranked[0][1] and d in p.candidates and p.candidates[-1] == EAGER
    p = cost.make_plan("x", ranked, tile_axes=("bm", "bn"), n=3, default=d, default_s=1.02, eager_s=9.0)
    assert p.candidates[0] == d and p.candidates[-1] == EAGER  # default within 5% goes first; eager always timed
    assert cost.make_plan("x", [], default=None).candidates == [EAGER]


def test_cuda_timer_holds_the_gpu_and_flushes_l2(monkeypatch):
    """cuda_timer: one untimed call (host enqueue time), then a GPU sleep before each timed
    block, so the events see the kernels (device time), not host launch gaps; every timed
    call comes after an L2 flush and has its own events; the round is their median."""
    log = []
    times = iter([0.25, 0.3, 0.1, 0.2, 0.1])  # ms: the single call, then the 4 reps

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            log.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return next(times)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(timing, "_clocked", {0})
    monkeypatch.setattr(timing, "_flush", {0: object()})
    monkeypatch.setattr(timing, "_evict_l2", lambda buf: log.append("flush"))
    t = tune.cuda_timer(lambda: log.append("fn"))
    reps = int(timing.ROUND_S / 2.5e-4)
    assert reps == 4
    assert log[0] == "fn" and log[1][0] == "sleep" and log[2:6] == ["flush", "record", "fn", "record"]
    assert log[6][0] == "sleep" and log[7:] == ["flush", "record", "fn", "record"] * reps
    assert log[6][1] >= log[1][1] > 0  # the sleep covers the enqueue of all reps
    assert t == pytest.approx(2e-4)  # min(single call, median of the reps)


def test_flush_buffer_dropped_after_timing(monkeypatch):
    """The L2 flush buffer is scratch of the timing only: gone once the key is tuned, so a
    model's peak memory after tuning does not carry it."""
    monkeypatch.setattr(timing, "_flush", {0: torch.empty(16)})
    assert _select(timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6})) == A
    assert timing._flush == {}


def test_shared_plan_structure_budget_and_default():
    """make_shared_plan: one structure (the first candidate's), the compile budget, the
    launcher default second when it shares the structure, dropped when it does not and the
    model puts it more than DEFAULT_MARGIN behind."""
    ranked = [(1.0, {"g": 2, "bp": 32, "w": 4}), (1.0, {"g": 2, "bp": 64, "w": 4}), (1.01, {"g": 4, "bp": 32, "w": 4}),
              (1.02, {"g": 2, "bp": 32, "w": 8}), (1.03, {"g": 2, "bp": 128, "w": 4}),
              (1.04, {"g": 2, "bp": 64, "w": 8}), (1.05, {"g": 2, "bp": 128, "w": 8})]

    def kernels(c):  # main kernel per config + one auxiliary kernel per structure
        return {("main", c["g"], c["bp"], c["w"]), ("aux", c["g"])}

    def structure(c):
        return c["g"]

    p = cost.make_shared_plan("x", ranked, kernels=kernels, structure=structure, tile_axes=("bp",), n=5,
                              budget=5, min_fused=3)
    fused = [c for c in p.candidates if not tune.is_eager(c)]
    assert p.candidates[0] == ranked[0][1] and p.candidates[-1] == EAGER and len(p.predicted) == len(p.candidates)
    assert all(c["g"] == 2 for c in fused) and len(fused) == 4  # 4 mains + 1 aux = the budget of 5
    assert {c["bp"] for c in fused} == {32, 64, 128}  # tile diversity first
    d_same, d_other = {"g": 2, "bp": 128, "w": 8}, {"g": 4, "bp": 64, "w": 8}
    p = cost.make_shared_plan("x", ranked, kernels=kernels, structure=structure, tile_axes=("bp",), n=5,
                              default=d_same, default_s=1.2)
    assert p.candidates[1] == d_same  # not first (1.2 > 1.05 x best), shares the structure: second
    p = cost.make_shared_plan("x", ranked, kernels=kernels, structure=structure, tile_axes=("bp",), n=5,
                              default=d_other, default_s=1.2)
    assert d_other not in p.candidates and all(c["g"] == 2 for c in p.candidates[:-1])
    p = cost.make_shared_plan("x", ranked, kernels=kernels, structure=structure, tile_axes=("bp",), n=5,
                              default=d_other, default_s=1.02)
    assert p.candidates[0] == d_other and all(c["g"] == 4 for c in p.candidates[:-1])  # its structure wins
    assert cost.make_shared_plan("x", [], kernels=kernels).candidates == [EAGER]


#: distinct Triton compilations of a cold key's shortlist (plans/compiles.py counts them through the
#: real launchers), for the keys that were over the 2 s cold-tuning target on the H200
#: diag-OFT and BOFT: + 1 each for the first config's split16 twin (plans/oft.with_split16, 16-bit streams);
#: oft_bwd + 2 more for the wide-group split16 twin (plans/oft._with_wide_split16: its stream and chain)
COLD_KEY_COMPILES = {"oft_fwd": 5, "oft_bwd": 8, "boft_fwd": 8, "boft_bwd": 8, "loha_bypass_bwd": 11,
                     "lokr_merge_bwd": 8}
#: over cost.COMPILE_BUDGET on purpose: loha_bypass_bwd's shortlist holds the launcher's default
#: as a whole (its merge backward splits: + 2 reduce kernels), which the H200 measured faster than
#: the model's shared picks (RESULTS.md, 2026-12-01), and at 16-bit large shapes a vendor twin
#: whose factor gradients take the merge's vendor path (+ its E kernel)
OVER_BUDGET = {"loha_bypass_bwd"}


@pytest.mark.parametrize("shape,tokens", [("4096x4096:r64", 32768), ("3072x3072:r32", 8192)])
def test_cold_key_compile_budget(shape, tokens):
    """The shortlists of the multi-kernel ops share their auxiliary kernels: a cold key compiles
    at most ``COLD_KEY_COMPILES[op]`` (<= cost.COMPILE_BUDGET) Triton kernels, with 5-7
    candidates (the planner's first, eager last). Fails when a shortlist is widened."""
    from lycoris_ops.backends.triton import compiles

    assert max(v for k, v in COLD_KEY_COMPILES.items() if k not in OVER_BUDGET) <= cost.COMPILE_BUDGET
    for op, bound in COLD_KEY_COMPILES.items():
        r = compiles.count(op, shape, tokens)
        assert not r.failed, (op, r.failed)
        assert 5 <= len(r.candidates) <= 7 and r.candidates[-1] == EAGER, (op, r.candidates)
        assert r.n_distinct <= bound, r.summary()
        assert all(r.per_candidate), r.summary()  # every fused candidate launches kernels


def test_compile_count_with_the_direct_launcher_on(monkeypatch):
    """``python -m lycoris_ops.backends.triton.compiles --compile`` runs without the interpreter, where
    ``fast(kernel)`` launches directly (and would look for a CUDA device): counting still
    records every candidate's kernels, and leaves the direct launcher as it found it."""
    from lycoris_ops.backends.triton import compiles
    from lycoris_ops.backends.triton import common as _common

    monkeypatch.setattr(_common, "_INTERPRETED", [False])
    r = compiles.count("lokr_bypass_bwd", "4096x4096:r64", 32768)
    assert not r.failed and all(r.per_candidate) and r.n_distinct >= 1, r.summary()
    assert _common._INTERPRETED == [False]


FAMILY_PLANS = {
    "lora": lambda m, dev, bf: [
        m.plan_bypass_fwd(dev, 4096, 4096, 4096, 16, bf, bf, bf, False),
        m.plan_bypass_fwd(dev, 37, 45, 29, 5, torch.float32, torch.float32, torch.float32, True),
        m.plan_bypass_bwd(dev, 4096, 4096, 4096, 16, bf, bf, bf),
        m.plan_merge_fwd(dev, 4096, 4096, 16, 16, "hada", bf, bf, bf),
        m.plan_merge_bwd(dev, 4096, 4096, 16, bf, bf, bf),
    ],
    "tucker": lambda m, dev, bf: [m.plan_tucker_fwd(dev, 320, 640, 9, (8, 8), bf, bf),
                                  m.plan_tucker_fwd(dev, 64, 64, 9, (4, 4, 8, 8), torch.float32, torch.float32)],
    "loha": lambda m, dev, bf: [
        m.plan_bypass_fwd(dev, 4096, 4096, 4096, 16, bf, bf, bf, False),
        m.plan_bypass_fwd(dev, 16, 4096, 4096, 200, bf, bf, bf, True),  # rank > 128: materialize only
        m.plan_bypass_bwd(dev, 2048, 4096, 4096, 16, bf, bf, bf),
        m.plan_merge_bwd(dev, 4096, 4096, 32, bf, bf),
    ],
    "lokr": lambda m, dev, bf: [
        m.plan_merge("lokr_full_merge_fwd", dev, 64, 64, 64, 64, 0, 0, bf, bf, None),
        m.plan_merge("lokr_merge_fwd", dev, 4, 4, 1024, 1024, 0, 16, bf, bf, bf),
        m.plan_merge("lokr_merge_bwd", dev, 64, 64, 64, 64, 8, 8, bf, bf, None, grad=True),
        m.plan_bypass_fwd(dev, 4096, 64, 64, 64, 64, bf, bf, bf, False),
        m.plan_bypass_bwd(dev, 4096, 16, 128, 256, 32, bf, bf, bf),
    ],
    "dora": lambda m, dev, bf: [m.plan_dora_fwd(dev, 4096, 4096, False, bf, bf),
                                m.plan_dora_fwd(dev, 11008, 4096, True, bf, None),
                                m.plan_dora_bwd(dev, 4096, 4096, False, bf, bf, bf)],
    "oft": lambda m, dev, bf: [m.plan_oft_fwd(dev, 256, 16, 4096, True, bf, torch.float32),
                               m.plan_oft_bwd(dev, 128, 32, 100000, False, bf, bf)],
    "boft": lambda m, dev, bf: [m.plan_boft_fwd(dev, 4, 512, 8, 4096, True, bf, torch.float32),
                                m.plan_boft_bwd(dev, 6, 256, 16, 8192, False, bf, bf)],
    "ia3": lambda m, dev, bf: [m.plan_ia3_fwd(dev, 4096, 4096, 4096, bf, bf),
                               m.plan_ia3_bwd(dev, 64 * 320, 4096, 320, True, bf, torch.float32, bf)],
    "add": lambda m, dev, bf: [m.plan_add_scaled(dev, 4096 * 4096, bf, torch.float32),
                               m.plan_add_scaled(dev, 37, torch.float32, torch.float32)],
}


@pytest.mark.parametrize("family", sorted(FAMILY_PLANS))
def test_family_planners(family):
    import importlib

    m = importlib.import_module(f"lycoris_ops.backends.triton.tuning.{family}")
    for dev in (device.synthetic(), device.synthetic("NVIDIA A100-SXM4-80GB", capability=(8, 0), sm_count=108,
                                                       l2_bytes=40 << 20, smem_per_block=163 << 10,
                                                       smem_per_sm=164 << 10)):
        for plan in FAMILY_PLANS[family](m, dev, torch.bfloat16):
            fused = [c for c in plan.candidates if not tune.is_eager(c)]
            assert 1 <= len(fused) <= 7, (plan.op, plan.candidates)
            assert plan.candidates.count(EAGER) <= 1 and len(plan.predicted) == len(plan.candidates)
            assert all(isinstance(c, dict) for c in fused)
            json.dumps(plan.candidates)  # rows must be JSON


@pytest.mark.parametrize("T,O,I,R", [(8192, 3072, 3072, 32), (8192, 4096, 4096, 64), (64, 3072, 3072, 32)])
def test_loha_bypass_bwd_shortlist_holds_the_default_launch(T, O, I, R):
    """The launcher's fixed default launch is a candidate as a whole (gx, GW and merge-backward
    tiles): on the H200 every candidate shared a model-picked GW tile and merge-backward split
    that made them slower than the default, and the tuner chose eager over a default that beat it."""
    from lycoris_ops.backends.triton.tuning import loha as m

    TL, bf = m.kernels, torch.bfloat16
    default = m._bypass_bwd_default(T, O, R, bf)
    plan = m.plan_bypass_bwd(device.synthetic(), T, I, O, R, bf, bf, bf, default=default)
    mine = [c for c in plan.candidates if not tune.is_eager(c) and c["cfg"] == default["cfg"] and not c.get("vendor")]
    assert mine == [default], plan.candidates  # the whole default launch: gx, GW and merge-backward tiles
    # spelled out, the default's tiles are the launch made without kwargs: same grids and meta
    view = (((1,), (1,)),) * 6
    got = TL._bypass_bwd_plan(T, O, I, R, view, bf, None, TL.ApplyCfg(**mine[0]["cfg"]),
                              TL.ApplyCfg(**mine[0]["gw_cfg"]))
    want = TL._bypass_bwd_plan(T, O, I, R, view, bf, None, TL.ApplyCfg(), None)
    assert got == want


@pytest.mark.parametrize("layer", [Layer(64, 32, 4), Layer(96, 48, 8)])
def test_warmup_samples_are_valid_calls(layer):
    from lycoris_ops import reference
    from lycoris_ops.backends import select
    from lycoris_ops.backends.triton.tuning import MODULE_OF

    gen = torch.Generator().manual_seed(0)
    seen = set()
    for samples in SAMPLES.values():
        for op, args in samples(layer, 16, torch.float32, torch.device("cpu"), gen):
            full = select._full_args(op, args)
            reference.check(op)(*full)  # raises on a bad sample
            assert op in MODULE_OF  # a Triton tuning for it (warmup --direct)
            seen.add(op)
    assert len(seen) >= 20


# ----------------------------------------------------------------------------- CLI

def test_cli_without_gpu_is_a_noop(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert warmup_main(["--shapes", "64x64:r4", "--tokens", "16"]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert warmup_main(["--show"]) == 0
    assert "0 rows" in capsys.readouterr().out
    assert warmup(["64x64"])["skipped"] == "no CUDA device"


def test_cli_module_entry(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = dict(os.environ, **{dispatch.ENV_CACHE_DIR: str(tmp_path / "c")})
    r = subprocess.run([sys.executable, "-m", "lycoris_ops.warmup", "--shapes", "64x64"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "nothing to tune" in r.stdout


def test_parse_layer():
    assert parse_layer("4096x11008") == Layer(4096, 11008, 16)
    assert parse_layer("64x32:r8") == Layer(64, 32, 8)
    assert parse_layer("64x32x4") == Layer(64, 32, 4)
    with pytest.raises(ValueError, match="layer shape"):
        parse_layer("64")


def test_warmup_exported():
    assert lycoris_ops.warmup is warmup


def test_parallel_threads_bounded_by_output_size(tmp_path, parallel_warm, monkeypatch):
    """Concurrent first calls hold one output set each: past the scratch budget the
    key falls back to one-after-the-other first calls."""
    monkeypatch.setattr(timing, "PARALLEL_SCRATCH_BYTES", 3 * 4)  # room for one 3-float output
    seen = []

    def run(c):
        seen.append(tune.in_worker())
        return torch.ones(3)

    _select(timer=FakeTimer({"block=64,num_warps=4": 1e-6, "block=128,num_warps=8": 2e-6, EAGER: 3e-6}), run=run)
    assert seen and not any(seen)


def test_a_noise_sized_lead_keeps_the_planners_earlier_candidate():
    """Timings within TIE_MARGIN of the fastest are a tie, won by the earlier candidate (the
    fixed default sits first or second); a clear lead still wins."""
    near = tune.TIE_MARGIN * 0.995
    t = FakeTimer({"block=64,num_warps=4": near * 1e-6, "block=128,num_warps=8": 1e-6, EAGER: 5e-6})
    assert _select(timer=t) == A
    far = tune.TIE_MARGIN * 1.05
    t = FakeTimer({"block=64,num_warps=4": far * 1e-6, "block=128,num_warps=8": 1e-6, EAGER: 5e-6})
    assert _select(key=(("dtype", "bfloat16"), ("T", 4096)), timer=t) == B  # another key: timed afresh


def test_tuner_core_imports_no_backend():
    """The tuner core (keys, timing, selection, store, device facts, cost and work models)
    imports only itself and ``lycoris_ops.settings``: backends call into it, never the
    other way round (a backend's launcher rule reaches a work model as an argument)."""
    import ast
    import pathlib

    root = pathlib.Path(tune.__file__).parent
    allowed = ("lycoris_ops.tuner", "lycoris_ops.settings")
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.module != "lycoris_ops" else [f"lycoris_ops.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{path.name}: {n}" for n in names if n.startswith("lycoris_ops") and not n.startswith(allowed)]
    assert not bad, bad


def test_a_ctrl_c_drops_the_first_calls_not_started():
    """A Ctrl-C while the worker threads run the candidates' first calls (each a compile on a
    GPU): the calls not yet started are cancelled and the interrupt goes on, instead of
    waiting for every candidate's compile."""
    import threading
    import time

    started, lock = [], threading.Lock()

    def run(c):
        with lock:
            started.append(c)
        if c == 0:
            raise KeyboardInterrupt  # what fut.result() then raises in the waiting thread
        time.sleep(0.2)

    with pytest.raises(KeyboardInterrupt):
        timing._warm_parallel(list(range(16)), list(range(16)), run, None, 2, {})
    assert len(started) <= 4, started


class FakeBackground:
    """A deferred shortlist's builds: done once ``finish()`` is called."""

    def __init__(self):
        self.finished = self.cancelled = False
        self.waited = 0

    def finish(self):
        self.finished = True

    def done(self):
        return self.finished

    def wait(self, timeout_s):
        self.waited += 1
        self.finished = True
        return True

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def deferring(monkeypatch):
    """Deferral on for CPU keys of backend "triton", with a fake deferrer recording its calls."""
    monkeypatch.setenv(tune.ENV_DEFER, "1")
    monkeypatch.setattr(tune, "DEFER_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(tune, "DEFER_POLL_S", 0.0)
    monkeypatch.setattr(tune, "_final_hooks", list(tune._final_hooks))  # a test's hooks end with it
    calls = []

    def deferrer(first, rest):
        bg = FakeBackground()
        calls.append((len(first), len(rest), bg))
        for run in first:  # what the real deferrer does: the first config's kernels readied
            run()
        return bg

    previous = tune._deferrers.get("triton")
    tune.register_deferrer("triton", deferrer)
    yield calls
    tune.register_deferrer("triton", previous)


def test_deferred_cold_key_runs_its_first_config_until_built(tmp_path, deferring):
    """A cold key's first call returns the planner's first config without timing; so do its
    calls while the background builds (none recorded by a launch recorder: ``deferred_calls``);
    the first call after the builds finish times the shortlist and stores the winner."""
    t = FakeTimer({"block=64,num_warps=4": 3e-6, "block=128,num_warps=8": 1e-6, EAGER: 2e-6})
    before = tune.deferred_calls()
    assert _select(timer=t) == A and t.calls == []
    (first, rest, bg), = deferring
    assert (first, rest) == (1, 1)  # B is the other fused candidate; eager is not built
    assert tune.pending() == 1 and tune.stats()["deferred"] == 1
    assert _select(timer=t) == A and t.calls == [] and not (tmp_path / "cache" / "tuning.json").exists()
    assert tune.deferred_calls() == before + 2
    finals = []
    tune.on_deferred_final(lambda: finals.append(1))
    bg.finish()
    assert _select(timer=t) == B and len(t.calls) >= 3 and finals == [1]  # timed now; the hooks told
    assert tune.pending() == 0 and len(deferring) == 1  # deferred once
    (row,) = _rows(tmp_path).values()
    assert row["config"] == B
    assert _select(timer=t) == B and tune.deferred_calls() == before + 2  # memoized: final pick


def test_settle_waits_for_the_background(deferring):
    t = FakeTimer({"block=64,num_warps=4": 3e-6, "block=128,num_warps=8": 1e-6, EAGER: 2e-6})
    assert _select(timer=t) == A
    bg = deferring[0][2]
    assert tune.settle() == 1 and bg.waited == 1
    assert _select(timer=t) == B


@pytest.mark.parametrize("case", ["stored", "off", "eager_first", "one_fused", "no_background", "env_off",
                                  "raises"])
def test_no_deferral(case, tmp_path, deferring, monkeypatch):
    """A key is timed at once (or takes its first pick untimed, tuning off) where there is
    nothing to defer: a stored row, TUNE=off, an eager first candidate, no other fused candidate,
    a deferrer with nothing left to build or that raises, LYCORIS_KERNEL_TUNE_DEFER=0."""
    t = FakeTimer({"block=64,num_warps=4": 3e-6, "block=128,num_warps=8": 1e-6, EAGER: 2e-6})
    cands, want = (A, B, EAGER), B
    if case == "stored":
        assert _select(timer=t, cands=(B, EAGER)) == B  # one fused candidate: timed, stored
        tune.clear()
        cands = (B, A, EAGER)  # the stored row answers
        t = FakeTimer({})
    elif case == "off":
        tune.set_tuning(False)
        want = A
    elif case == "eager_first":
        cands = (EAGER, A, B)
    elif case == "one_fused":
        cands, want = (A, EAGER), EAGER
    elif case == "no_background":
        tune.register_deferrer("triton", lambda first, rest: None)
    elif case == "env_off":
        monkeypatch.setenv(tune.ENV_DEFER, "0")
    elif case == "raises":
        tune.register_deferrer("triton", lambda first, rest: 1 / 0)
    try:
        got = _select(timer=t, cands=cands)
    finally:
        tune.set_tuning(None)
    assert tune.pending() == 0
    assert got == want


def test_clear_cancels_the_background(deferring):
    assert _select(timer=FakeTimer({})) == A
    bg = deferring[0][2]
    tune.clear()
    assert bg.cancelled and tune.pending() == 0


def test_triton_deferrer_times_at_once_without_children(monkeypatch):
    """Triton's deferrer (``precompile.defer``) defers nothing where fewer than two children
    may be forked: the key is timed at once, as before deferral."""
    precompile = pytest.importorskip("lycoris_ops.backends.triton.precompile")
    from lycoris_ops.tuner import build_pool

    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 1)
    assert precompile.defer([lambda: None], [lambda: None]) is None
    assert tune._deferrers.get("triton") is precompile.defer
