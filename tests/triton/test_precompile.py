"""The forked precompile of a cold key's Triton kernels (lycoris_ops/backends/triton/precompile.py):
the capture hook (own thread only, the previous hook restored), the children (failures,
the deadline, round robin), the switch (LYCORIS_KERNEL_TUNE_PROCS), its place in the
tuner, and - in a process without the interpreter, no GPU needed - that kernels captured
from real JIT calls and compiled by children are cache hits for the JIT afterwards. The
GPU test tunes a cold multi-kernel key and checks the parent compiled nothing itself."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from lycoris_ops.backends import registry as dispatch
from lycoris_ops.backends.triton import precompile
from lycoris_ops.tuner import build_pool, tune

EAGER = tune.SENTINEL_EAGER
A = {"block": 64, "num_warps": 4}
B = {"block": 128, "num_warps": 8}
C = {"block": 256, "num_warps": 8}
no_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only (os.fork)")


@pytest.fixture(autouse=True)
def _fresh(fresh_tuner):
    yield


def _gpu_target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


# ----------------------------------------------------------------------------- switch

def test_procs_from_env(monkeypatch):
    monkeypatch.delenv(build_pool.ENV_PROCS, raising=False)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert build_pool.tune_procs() == max(0, min(build_pool.MAX_DEFAULT_PROCS, cpus - 1))
    monkeypatch.setenv(build_pool.ENV_PROCS, "3")
    assert build_pool.tune_procs() == 3
    for bad in ("-2", "junk"):  # an error naming the variable, never a silent default
        monkeypatch.setenv(build_pool.ENV_PROCS, bad)
        with pytest.raises(ValueError, match=f"LYCORIS_KERNEL_TUNE_PROCS='{bad}' is not valid"):
            build_pool.tune_procs()


@pytest.mark.parametrize("procs", [0, 1])
def test_zero_or_one_proc_disables(procs, monkeypatch):
    """Nothing is captured or forked: the candidates are not even run."""
    def run():
        raise AssertionError("must not run")

    assert precompile.precompile([run, run], procs=procs) is None
    monkeypatch.setenv(build_pool.ENV_PROCS, str(procs))
    assert precompile.precompile([run, run]) is None


# ----------------------------------------------------------------------------- capture

def _hook_call(jit_function, key, num_warps):
    """The keyword arguments ``JITFunction._call_hook`` passes to ``jit_cache_hook``."""
    from triton.runtime.jit import JitFunctionInfo

    options = {"num_warps": num_warps, "num_stages": 3,
               "extern_libs": [["libdevice", "/lib/libdevice.10.bc"]], "supported_fp8_dtypes": ["fp8e5"]}
    data = json.dumps({"name": "k", "signature": {"x": "*fp32"}, "options": options, "key": key})
    compile = {"key": key, "signature": {"x": "*fp32", "N": "i32", "BLOCK": "constexpr"}, "device": 0,
               "constants": {(2,): 64}, "num_warps": num_warps, "configs": [{(0,): [["tt.divisibility", 16]]}],
               "specialization_data": data, "is_warmup": False}
    return dict(key=key, repr="k[...]", fn=JitFunctionInfo("m", "k", jit_function), compile=compile,
                is_manual_warmup=False, already_compiled=False)


@pytest.mark.parametrize("with_previous", [True, False])
def test_capture_hook_own_thread_only_and_previous_restored(with_previous):
    """On the capturing thread a compile is recorded (once per kernel) and skipped (True);
    another thread's call goes to the hook installed before (None without one); that hook
    is back afterwards, also when the block raises."""
    from triton import knobs

    others = []

    def previous(**kw):
        others.append(kw["key"])
        return "previous"

    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = previous if with_previous else None
    jit_a, jit_b = object(), object()
    target = _gpu_target()
    try:
        with pytest.raises(KeyError):
            with precompile.capturing(target) as kernels:
                hook = knobs.runtime.jit_cache_hook
                assert hook(**_hook_call(jit_a, "key1", 4)) is True
                assert hook(**_hook_call(jit_a, "key1", 4)) is True  # the same kernel again: one record
                assert hook(**_hook_call(jit_b, "key1", 4)) is True  # another function, same key
                assert hook(**_hook_call(jit_a, "key2", 8)) is True
                answers = []
                t = threading.Thread(target=lambda: answers.append(hook(**_hook_call(jit_a, "key3", 4))))
                t.start()
                t.join()
                raise KeyError("out of the block")
        assert knobs.runtime.jit_cache_hook is (previous if with_previous else None)
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert answers == (["previous"] if with_previous else [None])
    assert others == (["key3"] if with_previous else [])
    assert [(k.fn, k.options["num_warps"]) for k in kernels] == [(jit_a, 4), (jit_b, 4), (jit_a, 8)]
    k = kernels[0]
    assert k.target is target and k.signature["BLOCK"] == "constexpr" and k.constants == {(2,): 64}
    assert k.attrs == {(0,): [["tt.divisibility", 16]]}
    # JSON lists back to the tuples the options held (extern_libs, the fp8 dtypes)
    assert k.options["extern_libs"] == (("libdevice", "/lib/libdevice.10.bc"),)
    assert k.options["supported_fp8_dtypes"] == ("fp8e5",)


def test_capture_runs_as_worker_without_grad_and_swallows_errors():
    """Each run once, as a tuner worker (a nested selection takes the first pick) without
    autograd; a run that raises does not stop the others; the flag is restored."""
    seen = []

    def run(name, fail=False):
        seen.append((name, tune.in_worker(), torch.is_grad_enabled()))
        if fail:
            raise RuntimeError("compile error")

    assert precompile.capture([lambda: run("a", True), lambda: run("b")], target=_gpu_target()) == []
    assert seen == [("a", True, False), ("b", True, False)]
    assert not tune.in_worker() and torch.is_grad_enabled()


# ----------------------------------------------------------------------------- children

class _Job:
    """A stand-in kernel: ``build`` writes this process's pid to a file (or raises, or hangs)."""

    def __init__(self, path, action="ok"):
        self.path, self.action = path, action

    def build(self):
        if self.action == "raise":
            raise RuntimeError("compile error")
        if self.action == "hang":
            time.sleep(60)
        with open(self.path, "w") as f:
            f.write(str(os.getpid()))


@no_fork
def test_children_share_round_robin(tmp_path):
    jobs = [_Job(tmp_path / f"job{i}") for i in range(5)]
    assert build_pool.compile_forked(jobs, 2) == (2, 0)
    pids = [int((tmp_path / f"job{i}").read_text()) for i in range(5)]
    assert os.getpid() not in pids
    assert pids[0] == pids[2] == pids[4] != pids[1] == pids[3]
    assert build_pool.compile_forked(jobs[:1], 8) == (1, 0)  # no more children than kernels


@no_fork
def test_child_failure_reported_parent_unharmed(tmp_path):
    """A kernel that raises fails its child (the child still compiles its other kernels);
    the parent just counts it."""
    jobs = [_Job(tmp_path / "a", "raise"), _Job(tmp_path / "b"), _Job(tmp_path / "c")]
    assert build_pool.compile_forked(jobs, 2) == (2, 1)
    assert (tmp_path / "b").exists() and (tmp_path / "c").exists()


@no_fork
def test_child_past_deadline_killed(tmp_path):
    jobs = [_Job(tmp_path / "a", "hang"), _Job(tmp_path / "b")]
    t0 = time.monotonic()
    assert build_pool.compile_forked(jobs, 2, timeout_s=1.0) == (2, 1)
    assert time.monotonic() - t0 < 30
    assert (tmp_path / "b").exists() and not (tmp_path / "a").exists()


@no_fork
def test_background_children_reaped_without_blocking(tmp_path):
    """``precompile.Background`` (a deferred key's builds): ``done()`` polls its children with
    the pool's non-blocking reap, counts a failed child, kills one past its deadline; ``cancel``
    kills the rest at once."""
    jobs = [_Job(tmp_path / "a"), _Job(tmp_path / "b", "raise")]
    bg = precompile.Background([pid for pid, _ in build_pool.fork_builds(jobs, 2)], timeout_s=30.0)
    assert bg.wait(30.0) and bg.done() and bg.failures == 1 and (tmp_path / "a").exists()
    hung = precompile.Background([pid for pid, _ in build_pool.fork_builds([_Job(tmp_path / "c", "hang")], 1)],
                                 timeout_s=0.5)
    t0 = time.monotonic()
    assert hung.wait(30.0) and hung.failures == 1 and time.monotonic() - t0 < 30
    idle = precompile.Background([pid for pid, _ in build_pool.fork_builds([_Job(tmp_path / "d", "hang")], 1)])
    idle.cancel()
    assert idle.done() and idle.failures == 1 and not (tmp_path / "d").exists()


@no_fork
def test_precompile_forks_for_two_kernels_not_on_disk(tmp_path, monkeypatch):
    """Children only for at least two kernels not yet in Triton's cache; the totals add up."""
    jobs = [_Job(tmp_path / "a"), _Job(tmp_path / "b"), _Job(tmp_path / "c")]
    monkeypatch.setattr(precompile, "capture", lambda runs: [r() for r in runs])
    monkeypatch.setattr(precompile, "on_disk", lambda k: k is jobs[2])
    before = precompile.stats()
    r = precompile.precompile([lambda: jobs[1], lambda: jobs[2]], procs=4)  # one left to compile: no fork
    assert (r.captured, r.compiled, r.children, r.failures) == (2, 0, 0, 0)
    assert not (tmp_path / "b").exists()
    r = precompile.precompile([lambda j=j: j for j in jobs], procs=4)
    assert (r.captured, r.compiled, r.children, r.failures) == (3, 2, 2, 0)
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    after = precompile.stats()
    assert after["keys"] - before["keys"] == 2 and after["compiled"] - before["compiled"] == 2
    assert after["children"] - before["children"] == 2


def test_precompile_failure_is_not_an_error(monkeypatch, caplog):
    """Whatever breaks in the precompile is logged once and left to the first calls."""
    def broken(runs):
        raise RuntimeError("no driver")

    monkeypatch.setattr(precompile, "capture", broken)
    monkeypatch.setattr(precompile, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="lycoris_ops.tune"):
        reports = [precompile.precompile([], procs=2) for _ in range(2)]
    assert all(r.failures == 1 and r.children == 0 for r in reports)
    assert sum("no driver" in m for m in caplog.messages) == 1


# ----------------------------------------------------------------------------- in the tuner

def test_tuner_precompiles_fused_candidates_before_worker_calls(monkeypatch):
    """On the parallel path the fused candidates (not eager) are handed to the ``prepare``
    hook (the Triton tuning passes ``precompile.precompile``) on the calling thread before
    any worker first call."""
    monkeypatch.setattr(tune, "_parallel_ok", lambda dev_id: True)
    monkeypatch.setenv(tune.ENV_THREADS, "4")
    events = []
    capturing = [False]

    def fake_precompile(runs, procs=None):
        events.append("precompile")
        capturing[0] = True
        for r in runs:
            r()
        capturing[0] = False


    def run(c):
        events.append(("captured" if capturing[0] else "run", tune.label(c), tune.in_worker()))
        return torch.ones(3)

    def timer(fn, c):
        fn()
        return 1e-6 if c == A else 2e-6

    got = tune.select_config("add_scaled", "triton", (("T", 1),), [A, B, C, EAGER], run, device="cpu",
                             version=1, timer=timer, prepare=fake_precompile)
    assert got == A
    assert events[0] == ("run", EAGER, False)  # the reference output
    assert events[1] == "precompile"
    assert events[2:5] == [("captured", "block=64,num_warps=4", False), ("captured", "block=128,num_warps=8", False),
                           ("captured", "block=256,num_warps=8", False)]
    assert sorted(e[1] for e in events[5:8]) == sorted(tune.label(c) for c in (A, B, C))
    assert all(e[0] == "run" and e[2] for e in events[5:8])  # then the worker first calls
    assert events.count("precompile") == 1


# ----------------------------------------------------------------------------- real kernels (no GPU)

_FORK_COMPILE = textwrap.dedent("""
    import json, os
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class FakeDriver:  # what JITFunction.run asks the driver for before a compile (no GPU here)
        def get_current_device(self):
            return 0
        def get_current_stream(self, device=None):
            return 0
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(FakeDriver())
    from lycoris_ops.backends.triton import common as _common, precompile as P
    from lycoris_ops.tuner import build_pool
    from lycoris_ops.backends.triton.kernels import add as A
    _common._current_device = lambda: 0  # FastJIT's key

    base, delta = torch.randn(64, 32), torch.randn(64, 32)
    runs = [lambda c=c: A.add_scaled(base, delta, 0.5, c) for c in (A.AddCfg(256, 4), A.AddCfg(512, 4),
                                                                     A.AddCfg(1024, 8))]
    out = {}
    kernels = P.capture(runs + runs[:1])  # through FastJIT and JITFunction.run; the repeat adds nothing
    out["captured"] = len(kernels)
    out["fastjit_kept"] = len(_common.fast(A._add_scaled_kernel).cache)
    out["on_disk_before"] = [P.on_disk(k) for k in kernels]
    out["forked"] = build_pool.compile_forked(kernels, 2)
    out["on_disk_after"] = [P.on_disk(k) for k in kernels]
    out["cache_exts"] = sorted({f.rsplit(".", 1)[-1] for _, _, fs in os.walk(os.environ["TRITON_CACHE_DIR"])
                                for f in fs})
    out["again"] = vars(P.precompile(runs, procs=2))  # everything on disk: nothing forked

    hits = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    K = A._add_scaled_kernel
    jit_run = type(K).run
    K.run = lambda *a, grid, warmup, **kw: jit_run(K, *a, grid=grid, warmup=True, **kw)  # compile, no launch
    for run in runs:
        run()
    out["parent_cache_hits"] = hits
    print("RESULT " + json.dumps(out))
""")


@no_fork
def test_children_compile_what_the_jit_then_loads(tmp_path):
    """Real JIT calls of one of our kernels (three configs) are captured - FastJIT keeps
    nothing -, compiled for sm_90 by two forked children into an empty Triton cache, and
    the JIT's own compile of the same calls afterwards is a cache hit every time (same
    cache key: the options went through the hook's JSON and back)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    r = subprocess.run([sys.executable, "-c", _FORK_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["captured"] == 3 and out["fastjit_kept"] == 0
    assert out["on_disk_before"] == [False] * 3 and out["on_disk_after"] == [True] * 3
    assert out["forked"] == [2, 0]
    assert "cubin" in out["cache_exts"] and "json" in out["cache_exts"]
    assert out["again"]["captured"] == 3 and out["again"]["compiled"] == 0 and out["again"]["children"] == 0
    assert out["parent_cache_hits"] == [True] * 3


# ----------------------------------------------------------------------------- GPU

_GPU_COLD_KEY = textwrap.dedent("""
    import json
    import torch, triton
    import lycoris_ops
    from lycoris_ops.backends.triton import precompile
    from lycoris_ops.tuner import tune
    from lycoris_ops.reference import lora as ref

    compiles = []  # this process's compiles only (a forked child appends to its own copy)
    triton.knobs.compilation.listener = lambda **kw: compiles.append(kw["cache_hit"])
    tune.set_tuning(True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    N, D, r, bf = 4096, 3072, 32, torch.bfloat16
    g = torch.randn(N, D, device=dev, dtype=bf, generator=gen)
    x = torch.randn(N, D, device=dev, dtype=bf, generator=gen)
    up = torch.randn(D, r, device=dev, dtype=bf, generator=gen) * 0.02
    down = torch.randn(r, D, device=dev, dtype=bf, generator=gen) * 0.02
    got = torch.ops.lycoris.lora_bypass_bwd(g, x, up, down, 1.0)
    want = ref.lora_bypass_bwd(g, x, up, down, 1.0)
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({"tune": tune.stats(), "precompile": precompile.stats(),
                                  "compiles": len(compiles), "misses": compiles.count(False),
                                  "mismatch": tune.mismatch(got, want)}))
""")


@pytest.mark.gpu
def test_gpu_cold_key_compiled_by_children(tmp_path):
    """A cold lora_bypass_bwd key (empty table, empty Triton cache): every kernel the
    tuner's first calls need was compiled by forked children - the parent's compiles are
    all cache hits - and the result equals eager."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dispatch.ENV_TUNE)}
    env.update({"TRITON_CACHE_DIR": str(tmp_path / "triton"), dispatch.ENV_CACHE_DIR: str(tmp_path / "cache"),
                dispatch.ENV_BACKEND: "triton", build_pool.ENV_PROCS: "4"})
    r = subprocess.run([sys.executable, "-c", _GPU_COLD_KEY], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    pre = out["precompile"]
    assert out["tune"]["tuned"] >= 1 and pre["children"] >= 1 and pre["failures"] == 0, out
    assert out["compiles"] >= 1 and out["misses"] == 0, out
    assert out["mismatch"] is None, out


def test_fork_limit_follows_the_parents_memory(monkeypatch):
    """Forks cost in proportion to the parent's anonymous memory: a small process gets
    every child it asks for, a large one fewer, a very large one none (threads only)."""
    assert build_pool.fork_limit(0.0) >= build_pool.MAX_DEFAULT_PROCS
    assert build_pool.fork_limit(1.0) >= build_pool.MAX_DEFAULT_PROCS
    assert 2 <= build_pool.fork_limit(8.0) < build_pool.MAX_DEFAULT_PROCS
    assert build_pool.fork_limit(64.0) < 2
    assert build_pool.anon_gib() >= 0.0
    ran = []
    monkeypatch.setattr(build_pool, "anon_gib", lambda: 64.0)
    assert precompile.precompile([lambda: ran.append(1)], procs=8) is None and ran == []
