"""The TileLang tier's measured step-down (lycoris_ops/backends/tilelang/runner.py): each TileLang
op function against the op's eager body, timed once per key by the tuner, eager used
where it won. CPU: a stand-in kernel and a fake timer (TileLang kernels need a GPU)."""
from __future__ import annotations

import pytest
import torch

import lycoris_ops  # noqa: F401  (registers the ops)
from lycoris_ops.tuner import build_pool
from lycoris_ops.backends.tilelang import runner as tl_pick
from lycoris_ops.tuner import tune
from lycoris_ops.reference.add import add_scaled as eager_add_scaled


@pytest.fixture(autouse=True)
def _fresh(fresh_tuner, monkeypatch):
    monkeypatch.setenv(build_pool.ENV_PROCS, "0")  # the stand-in kernels build nothing (see the last tests)
    yield


def _kernel(calls):
    """A stand-in TileLang op function: the right values, its calls counted."""
    def add_scaled(base, delta, gamma):
        calls.append(base.shape)
        return eager_add_scaled(base, delta, gamma)
    add_scaled.__module__ = __name__  # the version hashes this file
    return add_scaled


def _timer(kernel_s, eager_s, seen):
    def timer(fn, c):
        seen.append("eager" if tune.is_eager(c) else "kernel")
        fn()
        return eager_s if tune.is_eager(c) else kernel_s
    return timer


@pytest.mark.parametrize("kernel_wins", [True, False])
def test_the_faster_runs_and_the_choice_is_kept(kernel_wins):
    calls, seen = [], []
    tune.set_timer(_timer(1.0, 2.0, seen) if kernel_wins else _timer(2.0, 1.0, seen))
    kernel = _kernel(calls)
    base, delta = torch.randn(33, 17), torch.randn(33, 17)
    got = tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
    torch.testing.assert_close(got, eager_add_scaled(base, delta, 0.5))
    assert set(seen) == {"kernel", "eager"}  # both timed, once per key
    n_timed, n_calls = len(seen), len(calls)
    for gamma in (0.5, -2.0):  # another gamma: the same key (floats are not in it)
        got = tl_pick.run("add_scaled", (base, delta, gamma), kernel)
        torch.testing.assert_close(got, eager_add_scaled(base, delta, gamma))
    assert len(seen) == n_timed  # not timed again
    assert len(calls) == n_calls + (2 if kernel_wins else 0)  # eager won: the kernel no longer runs
    rows = tune.table().rows
    (key, row), = [(k, r) for k, r in rows.items() if "|tilelang|add_scaled|" in k]
    assert (row["config"] == tl_pick.KERNEL) if kernel_wins else tune.is_eager(row["config"])


def test_keys_bucket_sizes_and_keep_flags():
    a = tl_pick.key_parts((torch.zeros(1000, 8), torch.zeros(8, dtype=torch.bfloat16), 1, 0.3, "sum", None, [2, 3]))
    b = tl_pick.key_parts((torch.zeros(1020, 8), torch.zeros(8, dtype=torch.bfloat16), 1, 0.9, "sum", None, [2, 3]))
    c = tl_pick.key_parts((torch.zeros(3000, 8), torch.zeros(8, dtype=torch.bfloat16), 1, 0.3, "sum", None, [2, 3]))
    assert a == b and a != c  # 8000 and 8160 elements share the bucket 8192; 24000 does not
    assert ("t1", ("bfloat16", 1, 8)) in a and ("a4", "sum") in a and ("a6", (2, 3)) in a
    assert not any(k == "a3" for k, _ in a)  # the float


def test_tuning_off_and_guards_take_the_kernel(monkeypatch):
    calls = []
    kernel = _kernel(calls)
    base, delta = torch.randn(5, 7), torch.randn(5, 7)
    tune.set_timer(_timer(2.0, 1.0, []))  # eager would win a timing
    tune.set_tuning(False)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert len(calls) == 1  # no timing: the kernel
    tune.set_tuning(None)
    tune.clear()
    monkeypatch.setattr(tune, "unsafe_to_time", lambda: True)  # compiling / capturing
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert len(calls) == 2 and not tune.table().rows  # the kernel, nothing stored


def test_every_tilelang_op_goes_through_the_step_down(monkeypatch):
    """Each op set function hands its own op name and its arguments to the runner (which
    runs the op's launcher or its step-down body)."""
    pytest.importorskip("tilelang")
    from lycoris_ops import OP_NAMES
    from lycoris_ops.backends.tilelang import ops

    seen = []
    monkeypatch.setattr(tl_pick, "run", lambda op, args: seen.append((op, args)) or op)
    for op in OP_NAMES:
        x = torch.empty(3)
        assert getattr(ops, op)(x, 1.5) == op
        assert seen[-1][0] == op and seen[-1][1][0] is x and seen[-1][1][1] == 1.5
    # every op has its launcher and its tuning space (backends/tilelang/tuning)
    assert set(tl_pick.LAUNCHERS) == set(tl_pick.models()) == set(OP_NAMES)


def test_capture_lists_the_kernels_a_call_would_build():
    pytest.importorskip("tilelang")
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels.add import add_kernel

    def op_function():
        for vec in (4, 8, 4):  # two distinct kernels, one asked twice
            C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", vec)(None, None, None)
        return "ran"

    built = C.stats()["kernels"]
    with C.capturing() as pending:
        assert op_function() == "ran"  # the launches did nothing
    assert [p.args for p in pending] == [("float16", "float16", "float16", 4), ("float16", "float16", "float16", 8)]
    assert C.stats()["kernels"] == built  # nothing was built


_FORKED_BUILD = """
import os, sys
import lycoris_ops
from lycoris_ops.backends.tilelang import runner as tl_pick
from lycoris_ops.backends.tilelang import common as C
from lycoris_ops.backends.tilelang.kernels.add import add_kernel

specs = [("float16", "float16", "float16", 4), ("bfloat16", "bfloat16", "bfloat16", 8)]

def op_function():
    for a in specs:
        C.kernel(add_kernel, "sm_90a", *a)(None, None, None)

cache = os.environ["TILELANG_CACHE_DIR"]
def files():
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs)

assert tl_pick.precompile_call(op_function, ()) == 2
st = tl_pick.stats()
after_children = files()
for a in specs:  # the parent: both load from the disk cache the children filled
    C.kernel(add_kernel, "sm_90a", *a)
print("children", st["children"], "failures", st["failures"], "files", len(after_children) > 0,
      "parent wrote", len(set(files()) - set(after_children)))
"""


def test_children_build_what_the_call_then_loads(tmp_path):
    """Two TileLang kernels built for sm_90a in two forked children (no GPU: nvcc only);
    the parent's build of the same kernels then writes nothing new to the disk cache."""
    pytest.importorskip("tilelang")
    if not hasattr(__import__("os"), "fork"):
        pytest.skip("POSIX only")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tl"), LYCORIS_KERNEL_TUNE_PROCS="2")
    out = subprocess.run([sys.executable, "-c", _FORKED_BUILD], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "children 2 failures 0 files True parent wrote 0", out.stdout


def test_a_cold_shortlist_keeps_what_one_round_of_children_builds(monkeypatch):
    """A child builds its share one kernel after the other: a config whose new kernels would
    take the count past the children is left out (the first config and eager stay)."""
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels.add import add_kernel

    vecs = {None: (4, 8), "a": (4, 16), "b": (32, 64), "c": (2,), "big": (1, 2, 4, 8, 16)}

    def op_function(cfg=None):
        for v in vecs[cfg["v"] if cfg else None]:
            C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", v)(None, None, None)

    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 3)
    forked = []
    monkeypatch.setattr(build_pool, "compile_forked",
                        lambda ks, procs, timeout_s=0: forked.append([p.args[-1] for p in ks]) or (len(ks), 0))
    a, b, c, big = ({"v": k} for k in ("a", "b", "c", "big"))
    kept = []
    n = tl_pick.precompile_call(op_function, (), [tl_pick.KERNEL, a, b, c, tune.SENTINEL_EAGER], kept=kept)
    # {}: 4, 8; a: + 16 (3 kernels); b: + 32, 64 (5 > 3) out; c: + 2 (4 > 3) out
    assert kept == [tl_pick.KERNEL, a, tune.SENTINEL_EAGER] and forked == [[4, 8, 16]] and n == 3
    kept.clear()
    tl_pick.precompile_call(op_function, (), [big, a, tune.SENTINEL_EAGER], kept=kept)
    assert kept == [big, tune.SENTINEL_EAGER] and forked[-1] == [1, 2, 4, 8, 16]  # the first stays
    kept.clear()
    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 0)  # no children: nothing left out
    tl_pick.precompile_call(op_function, (), [tl_pick.KERNEL, a, b, tune.SENTINEL_EAGER], kept=kept)
    assert kept == [tl_pick.KERNEL, a, b, tune.SENTINEL_EAGER] and len(forked) == 2


# ----------------------------------------------------------------------------- tile configs

def _planned_kernel(calls):
    """A stand-in TileLang op function with a ``cfg``: the right values, its configs recorded."""
    from lycoris_ops.reference.lora import lora_bypass_fwd as eager_fwd

    def bypass_fwd(x, up, down, gamma, base=None, cfg=None):
        calls.append(cfg)
        return eager_fwd(x, up, down, gamma, base)
    bypass_fwd.__module__ = __name__
    return bypass_fwd


def test_tile_configs_are_timed_and_the_winner_runs(monkeypatch):
    """A model's shortlist (tile configs, the fixed default ``{}``, eager): all timed once,
    built first in one precompile of every config, the fastest stored and run with
    ``cfg=``; a fresh process takes it from the table without planning or timing."""
    small, big = dict(BT=64, BO=64), dict(BT=128, BO=256)
    shortlist = [small, tl_pick.KERNEL, big, tune.SENTINEL_EAGER]
    planned, built = [], []
    monkeypatch.setattr(tl_pick, "candidates", lambda op, args: planned.append(op) or list(shortlist))
    def precompile_call(kernel, args, cands=(), kept=None, ahead=(), background=()):
        built.append(list(cands))
        if kept is not None:
            kept.extend(cands)
        return 0
    monkeypatch.setattr(tl_pick, "precompile_call", precompile_call)
    cost = {str(small): 3.0, str(tl_pick.KERNEL): 2.0, str(big): 1.0, tune.SENTINEL_EAGER: 4.0}
    seen = []

    def timer(fn, c):
        seen.append(c)
        fn()
        return cost[str(c)]

    tune.set_timer(timer)
    calls = []
    kernel = _planned_kernel(calls)
    g = torch.Generator().manual_seed(3)
    x, up, down = torch.randn(40, 24, generator=g), torch.randn(16, 4, generator=g), torch.randn(4, 24, generator=g)
    from lycoris_ops.reference.lora import lora_bypass_fwd as eager_fwd

    got = tl_pick.run("lora_bypass_fwd", (x, up, down, 0.5, None), kernel)
    torch.testing.assert_close(got, eager_fwd(x, up, down, 0.5, None))
    assert planned == ["lora_bypass_fwd"] and built == [shortlist]  # every config listed for the children
    assert {str(c) for c in seen} == set(cost)  # each candidate timed
    assert calls[-1] == big  # the winner runs with its config
    (row,) = [r for k, r in tune.table().rows.items() if "|tilelang|lora_bypass_fwd|" in k]
    assert row["config"] == big
    n_timed = len(seen)
    tune.clear(tables=True)  # a fresh process: the table file stays
    calls.clear()
    tl_pick.run("lora_bypass_fwd", (x, up, down, 0.5, None), kernel)
    assert len(seen) == n_timed and planned == ["lora_bypass_fwd"]  # no timing, no planning
    assert calls == [big] and built[-1] == [big]  # the stored winner's kernels only


def test_tuning_off_takes_the_models_first_pick(monkeypatch):
    first = dict(BT=128, BO=64)
    monkeypatch.setattr(tl_pick, "candidates", lambda op, args: [first, tl_pick.KERNEL, tune.SENTINEL_EAGER])
    tune.set_timer(lambda fn, c: 1.0)
    tune.set_tuning(False)
    calls = []
    x, up, down = torch.randn(8, 6), torch.randn(5, 2), torch.randn(2, 6)
    tl_pick.run("lora_bypass_fwd", (x, up, down, 1.0, None), _planned_kernel(calls))
    assert calls == [first]


def test_planned_ops_key_on_their_weight_sizes():
    """Two layers whose weights fall in one size bucket get separate tile choices."""
    x = torch.zeros(64, 3072)
    a = tl_pick.key_parts((x, torch.zeros(3072, 32), torch.zeros(32, 3072), 1.0, None), "lora_bypass_fwd")
    b = tl_pick.key_parts((x, torch.zeros(3000, 32), torch.zeros(32, 3072), 1.0, None), "lora_bypass_fwd")
    assert a != b
    assert tl_pick.key_parts((x, torch.zeros(3072, 32)), "add_scaled") == tl_pick.key_parts(
        (x, torch.zeros(3000, 32)), "add_scaled")  # no model: buckets only


def test_lora_shortlists_for_an_h200():
    """The TileLang LoRA models on an H200's facts at the bench shapes: tile configs (the
    fixed default among them), eager last, every config legal for the kernels (threads a
    multiple of 128, two warpgroups only with 128-row tiles, stages 2-4)."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    dev = device.synthetic()
    bf = torch.bfloat16
    for T, I, O, R in ((8192, 3072, 3072, 32), (32768, 4096, 4096, 64)):
        x, up, down = torch.empty(T, I, dtype=bf), torch.empty(O, R, dtype=bf), torch.empty(R, I, dtype=bf)
        g, w = torch.empty(T, O, dtype=bf), torch.empty(O, I, dtype=bf)
        for op, args, default, rows in (
                ("lora_bypass_fwd", (x, up, down, 1.0, None), tl_lora.BYPASS_FWD, "BT"),
                ("lora_bypass_bwd", (g, x, up, down, 1.0), tl_lora.BYPASS_BWD, "BT"),
                ("lora_merge_fwd", (up, down, None, None, w, 1.0, "plain", None),
                 tl_lora.MERGE_STREAM, "BM"),
                ("lora_merge_bwd", (w, up, down, 1.0), tl_lora.MERGE_BWD, "BM")):
            plan = plans_lora.TILELANG[op][0](dev, *args)
            cands = list(plan.candidates)
            assert tune.is_eager(cands[-1]) and cands[0] == default, (op, cands)  # untimed: the fixed config
            # the forward's second: the fixed tile with the deepest x loop (the model picks tiles, not depths)
            # the forward's fixed config runs its x loop at the deepest pipeline (measured);
            # no candidate twice
            assert op != "lora_bypass_fwd" or default["stages"] == 4, default
            assert len({tuple(sorted(c.items())) for c in cands[:-1]}) == len(cands) - 1, (op, cands)
            assert 3 <= len(cands) <= plans_lora.TL_N + 2, (op, cands)
            assert all(p > 0 for p in plan.predicted[:-1])
            if op == "lora_merge_fwd":
                # the stream configs, then the GEMM form's fixed tile timed against them
                assert cands[-2] == tl_lora.MERGE_FWD and "BK" not in cands[0], cands
                cands = cands[:-2] + cands[-1:]
            for c in cands[:-1]:
                assert set(c) == set(default), (op, c)
                assert c["threads"] in (0, 128) or (c["threads"] == 256 and c[rows] >= 128), (op, c)
                assert 2 <= c["stages"] <= 4, (op, c)
                if op == "lora_merge_bwd":  # the pair kernel: a static K loop, every tile in shared memory
                    assert c["threads"] == 128 and tl_lora.pair_smem(c["BM"], c["BK"], c["stages"], R, 2) <= 227 * 1024
                elif op.endswith("_bwd"):  # the spaces that compile for sm_90a (tuning/lora.py)
                    assert c["stages"] == 2 and c["threads"] in (0, 128), (op, c)


def test_lora_bypass_fwd_shortlist_times_the_deep_twin(monkeypatch):
    """With a shallower fixed config, the LoRA bypass forward's shortlist times the fixed tile
    at the device's deepest pipeline second (the model picks tiles, not depths)."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    monkeypatch.setattr(tl_lora, "BYPASS_FWD", {**tl_lora.BYPASS_FWD, "stages": 2})
    bf = torch.bfloat16
    x, up, down = torch.empty(8192, 3072, dtype=bf), torch.empty(3072, 32, dtype=bf), torch.empty(32, 3072, dtype=bf)
    cands = list(plans_lora.TILELANG["lora_bypass_fwd"][0](device.synthetic(), x, up, down, 1.0, None).candidates)
    assert cands[0] == tl_lora.BYPASS_FWD and cands[1] == {**tl_lora.BYPASS_FWD, "stages": 4}, cands
    assert tune.is_eager(cands[-1])


def test_tucker_shortlist_runs_the_all_k_program():
    """Every config the TileLang tucker shortlist offers at the bench
    shapes stages its output tile within ``all_k_fits`` (the per-κ program, about 5x slower,
    never reaches the timing), one and two chains."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import tucker as plans_tucker
    from lycoris_ops.backends.tilelang.kernels import tucker as tl_tucker

    dev = device.synthetic()
    bf = torch.bfloat16
    for D, r in ((3072, 32), (4096, 64)):
        a, t, b = torch.empty(D, r, dtype=bf), torch.empty(r, r, 9, dtype=bf), torch.empty(r, D, dtype=bf)
        for two in (False, True):
            second = (a, t, b) if two else (None, None, None)
            plan = plans_tucker.TILELANG["lora_tucker_fwd"][0](dev, a, t, b, *second, 1.0)
            cands = [c for c in plan.candidates if not tune.is_eager(c)]
            rp = max(16, r)
            assert cands and all(tl_tucker.all_k_fits(c["BO"], c["BI"], 9, rp, rp, 1 + two, 2, 2) for c in cands), cands


def test_elementwise_shortlists_for_an_h200():
    """add_scaled, IA3, DoRA, the tucker rebuild, LoHa, LoKr, diag-OFT and BOFT: the fixed config first, eager last, configs inside TL_SPACE; IA3's
    key keeps the token rows bucketed (a new token count is not a new key). The forms the
    model cannot rank (LoKr's forward apply epilogue, LoHa's cuBLAS GEMMs) come second: the
    fixed config with that one key, timed only."""
    from lycoris_ops.backends.tilelang.tuning import add as plans_add
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import dora as plans_dora, ia3 as plans_ia3
    from lycoris_ops.backends.tilelang.tuning import (boft as plans_boft, loha as plans_loha, lokr as plans_lokr, oft as plans_oft)
    from lycoris_ops.backends.tilelang.tuning import tucker as plans_tucker

    dev = device.synthetic()
    bf = torch.bfloat16
    w = torch.empty(3072, 3072, dtype=bf)
    x, v = torch.empty(8192, 3072, dtype=bf), torch.empty(3072, dtype=bf)
    lh = (torch.empty(3072, 32, dtype=bf), torch.empty(32, 3072, dtype=bf)) * 2
    ob, bb = torch.empty(96, 32, 32), torch.empty(4, 384, 8, 8)
    streaming = {"oft_fwd": plans_oft.TL_APPLY, "oft_bwd": plans_oft.TL_STREAM, "boft_fwd": plans_oft.TL_APPLY,
                 "boft_bwd": plans_oft.TL_STREAM}  # the streaming spaces diag-OFT and BOFT share
    kw1, kw2 = torch.empty(48, 48, dtype=bf), torch.empty(64, 64, dtype=bf)  # LoKr: the 3072 bench layer's factors
    kf = (kw1, None, torch.empty(64, 8, dtype=bf), torch.empty(8, 64, dtype=bf), [48, 48, 64, 64])
    kron, grads, byp = dict(BM=32, BN=128, threads=128), dict(elems=4096, threads=128), dict(rows=128, threads=128)
    spaces = {**streaming, "lokr_full_merge_fwd": plans_lokr.TL_KRON, "lokr_merge_fwd": plans_lokr.TL_KRON,
              "lokr_full_merge_bwd": plans_lokr.TL_GRADS, "lokr_merge_bwd": plans_lokr.TL_GRADS,
              "lokr_bypass_fwd": plans_lokr.TL_BYPASS, "lokr_bypass_bwd": plans_lokr.TL_BYPASS}
    timed_twins = {"lokr_bypass_fwd": {"staged": False}, "loha_bypass_fwd": {"vendor": True}}
    for mod, op, args, fixed in ((plans_add, "add_scaled", (w, w, 1.0), dict(BV=256, threads=128)),
                                 (plans_ia3, "ia3_fwd", (x, v, -1, 1.0, 1.0), dict(vecs=512, threads=128)),
                                 (plans_ia3, "ia3_bwd", (x, x, v, -1, 1.0, 1.0), dict(vecs=512, threads=128)),
                                 (plans_dora, "dora_fwd", (w, v, 1.0, 0, None), dict(vecs=512, threads=128)),
                                 (plans_dora, "dora_bwd", (w, w, v, v.float(), 1.0, 1, w), dict(vecs=512, threads=128)),
                                 (plans_tucker, "lora_tucker_fwd",
                                  (torch.empty(3072, 32, dtype=bf), torch.empty(32, 32, 9, dtype=bf),
                                   torch.empty(32, 3072, dtype=bf), None, None, None, 1.0),
                                  dict(BO=64, BI=64, threads=128)),
                                 (plans_loha, "loha_bypass_fwd", (x, *lh, 1.0, None),
                                  dict(BM=128, BN=128, BK=64, stages=2, threads=256)),
                                 (plans_loha, "loha_merge_bwd", (w, *lh, 1.0), dict(BM=32, BK=64, stages=2)),
                                 (plans_oft, "oft_fwd", (ob, x, None, 1.0, False, False), dict(BT=128, threads=128)),
                                 (plans_oft, "oft_bwd", (x, ob, x, None, 1.0, False, False), dict(BT=64, threads=128)),
                                 (plans_boft, "boft_fwd", (bb, x, -1, 1.0, 1.0, None, False), dict(BT=128, threads=128)),
                                 (plans_boft, "boft_bwd", (x, bb, x, -1, 1.0, 1.0), dict(BT=64, threads=128)),
                                 (plans_lokr, "lokr_full_merge_fwd", (kw1, kw2, w, 1.0), kron),
                                 (plans_lokr, "lokr_full_merge_bwd", (w, kw1, kw2, 1.0), grads),
                                 (plans_lokr, "lokr_merge_fwd", (*kf, w, 1.0), kron),
                                 (plans_lokr, "lokr_merge_bwd", (w, *kf, 1.0), grads),
                                 (plans_lokr, "lokr_bypass_fwd", (x, kw1, kw2, 1.0, x), byp),
                                 (plans_lokr, "lokr_bypass_bwd", (x, x, kw1, kw2, 1.0), byp)):
        cands = list(mod.TILELANG[op][0](dev, *args).candidates)
        twin = timed_twins.get(op)
        assert cands[0] == fixed and tune.is_eager(cands[-1]), (op, cands)
        # the one-pass LoKr backward: no config of the space builds another kernel than the fixed one
        # at these factors (its token step is the same at rows 64 and 128): the fixed and eager
        least = 2 if op == "lokr_bypass_bwd" else 3
        assert least <= len(cands) <= mod.TL_N + 2 + bool(twin), (op, cands)
        if twin:
            assert cands[1] == {**fixed, **twin}, (op, cands)
        space = (getattr(mod, "TL_SPACE", None) or spaces.get(op)
                 or (mod.TL_GRADS_PAIR if op == "loha_merge_bwd" else mod.TL_GEMM))
        for c in cands[1 + bool(twin):-1]:
            assert all(c[k] in space[k] for k in c), (op, c)
    a = tl_pick.key_parts((x, v, -1, 1.0, 1.0), "ia3_fwd")
    assert a[0] == ("sizes", (3072, 3072, False))  # (N, C, layout): the 8192 rows only in t0's bucket


@pytest.mark.parametrize("guarded", [False, True], ids=["tune-off", "capturing"])
def test_a_kernel_tilelang_cannot_build_runs_eager(monkeypatch, caplog, guarded):
    """A config whose kernel TileLang refuses (its lowering or nvcc: the H200 met both) is
    not an error for the caller: the untimed pick (TUNE=off, or while compiling / capturing)
    steps down to the eager body, logs once, and never tries that build again; the op
    function itself raises BuildError naming the builder and arch."""
    import logging

    from lycoris_ops.backends.tilelang import common as _common
    from lycoris_ops.backends.tilelang.kernels import add as tl_add

    tries = []

    def refuse(builder, arch, *args, **kw):
        tries.append(builder.__name__)
        raise RuntimeError("Compilation error:\nkernel.cu(27): error: identifier \"__pack_bfloat162\" is undefined")

    monkeypatch.setattr(_common, "compile_only", refuse)
    monkeypatch.setattr(_common, "_kernels", {})
    monkeypatch.setattr(_common, "_failed", {})
    monkeypatch.setattr(tl_pick, "_build_warned", set())
    if guarded:
        monkeypatch.setattr(tune, "unsafe_to_time", lambda: True)
    else:
        tune.set_tuning(False)
    base, delta = torch.randn(33, 17), torch.randn(33, 17)
    with caplog.at_level(logging.WARNING, logger="lycoris_ops.tune"):
        for gamma in (0.5, -2.0, 0.5):
            got = tl_pick.run("add_scaled", (base, delta, gamma), tl_add.add_scaled)
            torch.testing.assert_close(got, eager_add_scaled(base, delta, gamma))
    assert len(tries) == 1, tries  # one build attempt: the failure is remembered
    assert sum("add_scaled runs its eager body" in r.getMessage() for r in caplog.records) == 1
    assert "__pack_bfloat162" in caplog.text
    with pytest.raises(_common.BuildError, match=r"could not build .* for c: RuntimeError: .*__pack_bfloat162"):
        tl_add.add_scaled(base, delta, 0.5)
    assert len(tries) == 1
    assert not tune.table().rows  # nothing stored


def _bench_args(large: bool) -> dict:
    """Schema arguments of the TileLang-modelled ops at a bench shape (bf16, empty tensors)."""
    bf = torch.bfloat16
    T, D, r = (32768, 4096, 64) if large else (8192, 3072, 32)
    x, w, v = torch.empty(T, D, dtype=bf), torch.empty(D, D, dtype=bf), torch.empty(D, dtype=bf)
    up, down = torch.empty(D, r, dtype=bf), torch.empty(r, D, dtype=bf)
    kw1, kw2 = torch.empty(*((64, 64) if large else (48, 48)), dtype=bf), torch.empty(64, 64, dtype=bf)
    ob = torch.empty(D // 32, 32, 32)
    bb = torch.empty(5, 256, 16, 16) if large else torch.empty(4, 384, 8, 8)
    return {"lora_bypass_fwd": (x, up, down, 1.0, x), "lora_bypass_bwd": (x, x, up, down, 1.0),
            "lora_merge_fwd": (up, down, None, None, w, 1.0, "plain", None), "lora_merge_bwd": (w, up, down, 1.0),
            "loha_bypass_fwd": (x, up, down, up, down, 1.0, None), "loha_bypass_bwd": (x, x, up, down, up, down, 1.0),
            "loha_merge_bwd": (w, up, down, up, down, 1.0), "lokr_bypass_fwd": (x, kw1, kw2, 1.0, x),
            "lokr_bypass_bwd": (x, x, kw1, kw2, 1.0), "lokr_full_merge_fwd": (kw1, kw2, w, 1.0),
            "lokr_full_merge_bwd": (w, kw1, kw2, 1.0), "ia3_fwd": (x, v, -1, 1.0, 1.0),
            "ia3_bwd": (x, x, v, -1, 1.0, 1.0), "dora_fwd": (w, v, 1.0, 0, None), "add_scaled": (w, w, 1.0),
            "oft_fwd": (ob, x, None, 1.0, False, False), "oft_bwd": (x, ob, x, None, 1.0, False, False),
            "boft_fwd": (bb, x, -1, 1.0, 1.0, None, False), "boft_bwd": (x, bb, x, -1, 1.0, 1.0)}


@pytest.mark.slow
@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_h200_shortlists_time_distinct_programs(large, monkeypatch):
    """Every candidate of an H200 shortlist at a bench shape builds TileLang programs no other
    candidate builds (their TIR, captured from the launcher the tuner calls): a config the
    launcher maps onto another's program would be timed twice for nothing (the fused LoKr
    backward's rows 64 / 128 did, 32c3170)."""
    pytest.importorskip("tilelang")
    import hashlib
    import sys

    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang import common as _common

    for name, mod in list(sys.modules.items()):
        if name.startswith("lycoris_ops.backends.tilelang.") and hasattr(mod, "arch_of"):
            monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
            if hasattr(mod, "num_sms"):
                monkeypatch.setattr(mod, "num_sms", lambda d: 132)
    calls, launcher = _bench_args(large), tl_pick.LAUNCHERS  # the launcher each op function runs
    dev = device.synthetic()
    for op, args in calls.items():
        programs = []
        for c in tl_pick.models()[op][0](dev, *args).candidates:
            if tune.is_eager(c):
                continue
            with _common.capturing() as pending:
                tl_pick._call(launcher[op], args, c)
            programs.append(frozenset(hashlib.sha1(p.builder(*p.args).script().encode()).hexdigest()
                                      for p in pending))
        assert programs and all(programs), (op, programs)
        assert len(set(programs)) == len(programs), (op, [sorted(p) for p in programs])


# ----------------------------------------------------------------------------- kernels built ahead

def _bwd_calls_made(case):
    """The ``*_bwd`` op calls autograd makes for ``case`` (every floating input requiring a
    gradient, a random gradient of the first output): [(op, args with the schema's defaults)]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.startswith("lycoris::") and name.endswith("_bwd"):
                schema = func._schema.arguments
                full = list(args) + [kwargs.get(a.name, a.default_value) if kwargs else a.default_value
                                     for a in schema[len(args):]]
                self.calls.append((name.split("::")[1], tuple(full)))
            return func(*args, **(kwargs or {}))

    run = case.to(requires_grad=True)
    out = run()
    y = out[0] if isinstance(out, tuple) else out
    if not y.requires_grad:
        return None, out
    with Recorder() as rec:
        y.backward(torch.randn_like(y))
    return rec.calls, out


def _signature(args):
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def test_backward_calls_are_what_autograd_calls():
    """``autograd.backward_calls`` (what runner.py builds kernels for ahead of a first
    backward) names, for every forward case of the test tables, the ``*_bwd`` calls autograd
    then makes: the same ops, operand shapes and dtypes (the gradient a stand-in of the
    output's) and non-tensor arguments; none for the ops whose backward is its own rule."""
    from lycoris_ops._library import autograd
    from lycoris_ops.testing import cases

    checked, ops = 0, set()
    for case in cases():
        if case.op.endswith("_bwd"):
            continue
        made, out = _bwd_calls_made(case)
        if made is None:
            continue
        names = [a.name for a in getattr(torch.ops.lycoris, case.op).default._schema.arguments]
        outs = [torch.empty_like(o) for o in (out if isinstance(out, tuple) else (out,))]
        predicted = autograd.backward_calls(case.op, dict(zip(names, case.args)), outs)
        assert [(op, _signature(a)) for op, a in predicted] == [(op, _signature(a)) for op, a in made], case.id
        checked += 1
        ops.add(case.op)
    assert checked >= 30 and {"lora_bypass_fwd", "lokr_merge_fwd", "dora_fwd", "oft_fwd", "boft_fwd",
                              "lora_merge_fwd", "ia3_fwd", "loha_bypass_fwd"} <= ops, (checked, ops)


def _stand_in_op_function(vecs):
    """A stand-in TileLang op function building add_kernel variants (vector widths ``vecs``)."""
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels.add import add_kernel

    def op_function(cfg=None):
        for v in vecs:
            C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", v)(None, None, None)
    return op_function


def _pending(vecs):
    from lycoris_ops.backends.tilelang import common as C

    with C.capturing() as listed:
        _stand_in_op_function(vecs)()
    return listed


def test_ahead_children_are_not_waited_for_and_their_kernels_not_built_twice(monkeypatch):
    """``precompile_call(ahead=...)`` forks the ahead kernels' children without waiting (on the
    cores, once its own kernels are built); a later call needing those kernels waits for exactly those
    children, then builds none of them again (they load from the disk cache); a child that
    failed leaves its kernels to the call."""
    pytest.importorskip("tilelang")
    import os

    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 4)
    monkeypatch.setattr(build_pool, "cpus", lambda: 8)
    monkeypatch.setattr(tl_pick, "_ahead", {})
    monkeypatch.setattr(tl_pick, "_built_ahead", set())
    forks, waits, built, order = [], [], [], []
    monkeypatch.setattr(build_pool, "fork_builds",
                        lambda ks, procs, nice=0: order.append("fork") or forks.append((procs, [p.args[-1] for p in ks]))
                        or [(1000 + i, list(ks[i::procs])) for i in range(min(procs, len(ks)))])
    monkeypatch.setattr(build_pool, "compile_forked",
                        lambda ks, procs, timeout_s=0: order.append("build") or built.append([p.args[-1] for p in ks])
                        or (len(ks), 0))
    exits = {1000: 0, 1001: 1}  # the second ahead child failed

    def waitpid(pid, flags):
        waits.append(pid)
        return (pid, exits[pid] << 8) if pid in exits else (0, 0)

    monkeypatch.setattr(os, "waitpid", waitpid)
    forward, backward = _stand_in_op_function((4, 8)), _stand_in_op_function((16, 32, 64))
    n = tl_pick.precompile_call(forward, (), [tl_pick.KERNEL], ahead=_pending((16, 32, 64)))
    # its own 2 kernels in children (waited for), alone; then the 3 ahead on 8 - 1 = 7 cores, capped at 4
    assert n == 2 and built == [[4, 8]] and forks == [(4, [16, 32, 64])] and not waits
    assert order == ["build", "fork"]
    assert set(tl_pick._ahead) == {1000, 1001, 1002}
    exits[1002] = 0
    n = tl_pick.precompile_call(backward, (), [tl_pick.KERNEL])
    # waited for the three children; 16 and 64 built (exit 0), 32's child failed: built here
    assert set(waits) >= {1000, 1001, 1002} and not tl_pick._ahead
    assert n == 0 and built == [[4, 8]]  # one kernel left: the call builds it itself (no child)
    assert {k[-1][-1] for k in tl_pick._built_ahead} == {16, 64}


def test_a_forward_call_lists_its_backwards_kernels(monkeypatch):
    """``backward_pending``: a cold forward call whose inputs need gradients lists the kernels of
    its backward op's cold shortlist (the ``*_bwd`` call taking the TileLang tier), through the
    op's launcher with ``run`` in listing mode, as (the first config's, the rest's): the
    backward's cold call waits for the first, defers the rest (``DEFER``; off: all first, one
    round of children; TUNE=off: the first config's only). Nothing where the backward's key is
    stored, where the call would take another tier, or where its kernels are being built ahead."""
    pytest.importorskip("tilelang")
    from lycoris_ops.backends import select

    seen = []
    vecs = {None: (2, 4), 8: (4, 8), 16: (16,), 32: (32, 64)}

    def stand_in(grad, x, up, down, gamma, cfg=None):
        seen.append((grad.shape, grad.dtype, x.shape, gamma))
        _stand_in_op_function(vecs[cfg["v"] if cfg else None])()

    monkeypatch.setitem(tl_pick.LAUNCHERS, "lora_bypass_bwd", stand_in)
    monkeypatch.setattr(select, "explain", lambda op, *a: "tilelang")
    monkeypatch.setattr(tl_pick, "candidates",
                        lambda op, args: [tl_pick.KERNEL, {"v": 8}, {"v": 16}, {"v": 32}, tune.SENTINEL_EAGER])
    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 4)
    monkeypatch.setattr(tl_pick, "_ahead", {})
    monkeypatch.setattr(tl_pick, "_built_ahead", set())
    x, up, down = torch.randn(6, 8), torch.randn(8, 2), torch.randn(2, 8)
    args = (x, up, down, 0.5, None)

    def listed():
        first, rest = tl_pick.backward_pending("lora_bypass_fwd", args)
        return [p.args[-1] for p in first], [p.args[-1] for p in rest]

    assert listed() == ([2, 4], [8, 16, 32, 64])  # 4 is the first config's
    assert seen[0] == ((6, 8), torch.float32, (6, 8), 0.5)  # the stand-in gradient: the output's geometry
    first, _ = tl_pick.backward_pending("lora_bypass_fwd", args)
    tl_pick._ahead[7] = (frozenset(p.key for p in first[:1]), 0.0)  # one being built ahead
    tl_pick._built_ahead.add(_pending((16,))[0].key)  # one built
    assert listed() == ([4], [8, 32, 64])
    tl_pick._ahead.clear()
    tl_pick._built_ahead.clear()
    monkeypatch.setattr(tl_pick, "DEFER", False)  # all at once, as many configs as one round of 4 children builds
    assert listed() == ([2, 4, 8, 16], [])
    tune.set_tuning(False)  # the first pick only
    assert listed() == ([2, 4], [])
    tune.set_tuning(None)
    monkeypatch.setattr(tune, "stored", lambda *a, **k: True)  # the backward's choice is known
    assert listed() == ([], [])
    monkeypatch.setattr(tune, "stored", lambda *a, **k: False)
    monkeypatch.setattr(select, "explain", lambda op, *a: "triton")  # the backward goes elsewhere
    assert listed() == ([], [])


@pytest.mark.parametrize("grad,ahead_on,procs", [(True, True, 4), (False, True, 4), (True, False, 4), (True, True, 1)],
                         ids=["needs-grad", "no-grad", "ahead-off", "no-children"])
def test_a_cold_forward_starts_its_backwards_kernels(monkeypatch, grad, ahead_on, procs):
    """``run``: a cold call whose inputs need gradients hands its backward's kernels
    (``backward_pending``) to its precompile as ``ahead``; none under ``no_grad``, with
    ``LYCORIS_TILELANG_AHEAD=0`` or where no children may be forked (nor, by the same test,
    while compiling or capturing: ``tune.unsafe_to_time``)."""
    got = []
    monkeypatch.setattr(tl_pick, "AHEAD", ahead_on)
    monkeypatch.setattr(build_pool, "usable_procs", lambda procs_=None: procs)
    monkeypatch.setattr(tl_pick, "backward_pending", lambda op, args: ([f"{op}-bwd-kernels"], []))
    monkeypatch.setattr(tl_pick, "candidates", lambda op, args: [tl_pick.KERNEL, tune.SENTINEL_EAGER])

    def precompile_call(kernel, args, cands=(), kept=None, ahead=(), background=()):
        got.append(list(ahead))
        kept.extend(cands)
        return 0

    monkeypatch.setattr(tl_pick, "precompile_call", precompile_call)
    tune.set_timer(_timer(1.0, 2.0, []))
    x, up, down = torch.randn(6, 8, requires_grad=grad), torch.randn(8, 2), torch.randn(2, 8)
    tl_pick.run("lora_bypass_fwd", (x, up, down, 0.5, None), _planned_kernel([]))
    assert got == [["lora_bypass_fwd-bwd-kernels"] if grad and ahead_on and procs > 1 else []]


_AHEAD_BUILD = """
import os
import lycoris_ops
from lycoris_ops.backends.tilelang import runner as tl_pick
from lycoris_ops.backends.tilelang import common as C
from lycoris_ops.backends.tilelang.kernels.add import add_kernel

fwd_specs = [("float16", "float16", "float16", 4), ("bfloat16", "bfloat16", "bfloat16", 8)]
bwd_specs = [("float16", "float16", "float16", 8), ("bfloat16", "bfloat16", "bfloat16", 4)]

def op_function(specs):
    def run():
        for a in specs:
            C.kernel(add_kernel, "sm_90a", *a)(None, None, None)
    return run

cache = os.environ["TILELANG_CACHE_DIR"]
def files():
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs)

with C.capturing() as ahead:
    op_function(bwd_specs)()
assert tl_pick.precompile_call(op_function(fwd_specs), (), ahead=ahead) == 2
running = len(tl_pick._ahead)
assert tl_pick.precompile_call(op_function(bwd_specs), ()) == 0  # waited for the ahead children
before = files()
for a in bwd_specs:  # the parent loads what the ahead children built
    C.kernel(add_kernel, "sm_90a", *a)
st = tl_pick.stats()
print("ahead", st["ahead_kernels"], st["ahead_children"] >= 1, "waits", st["ahead_waits"], "left", len(tl_pick._ahead),
      "built", len(tl_pick._built_ahead), "parent wrote", len(set(files()) - set(before)), "running", running > 0)
"""


@pytest.mark.slow
def test_kernels_built_ahead_load_in_the_backward(tmp_path):
    """Real forks (no GPU: nvcc only): a forward-like precompile builds its two kernels and
    leaves children (as many as the spare cores allow) building the 'backward' kernels ahead;
    the backward-like precompile waits for them and builds nothing; the parent then loads
    both from the disk cache they filled (writes nothing)."""
    pytest.importorskip("tilelang")
    import os
    import subprocess
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("POSIX only")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tl"), LYCORIS_KERNEL_TUNE_PROCS="2")
    out = subprocess.run([sys.executable, "-c", _AHEAD_BUILD], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "ahead 2 True waits 1 left 0 built 2 parent wrote 0 running True", out.stdout


# ----------------------------------------------------------------------------- deferred shortlists

#: the add_kernel vector widths a stand-in op function builds per config (None: the fixed one)
_DEFER_VECS = {None: (4, 8), "a": (8, 16), "b": (32,), "q": (2,)}
_DEFER_COST = {None: 3.0, "a": 1.0, "b": 2.0, "eager": 4.0}


def _configured_op_function(calls):
    """A stand-in TileLang op function with configs: under ``capturing`` it lists the add_kernel
    variants of its config (``_DEFER_VECS``), else it records the config and computes the sum."""
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels.add import add_kernel

    def add_scaled(base, delta, gamma, cfg=None):
        v = cfg["v"] if cfg else None
        keys = [C.kernel_key(add_kernel, "sm_90a", ("float16",) * 3 + (w,)) for w in _DEFER_VECS[v]]
        if getattr(C._capture, "active", None) is not None:
            for w in _DEFER_VECS[v]:
                C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", w)(None, None, None)
            return None
        for key in keys:  # its kernels "load" (from the disk cache the children filled)
            C._kernels.setdefault(key, object())
        calls.append(v)
        return eager_add_scaled(base, delta, gamma)
    add_scaled.__module__ = __name__
    return add_scaled


@pytest.fixture
def deferring(monkeypatch):
    """Children allowed (4 of 8 CPUs), forks / waits / builds recorded (no process is forked): the
    shortlist [fixed, a, b, eager] of ``_DEFER_VECS``; returns the record."""
    pytest.importorskip("tilelang")
    import os
    import types

    from lycoris_ops.backends.tilelang import common as C

    rec = types.SimpleNamespace(forks=[], built=[], exits={}, timed=[], calls=[])
    monkeypatch.setattr(C, "_kernels", {})
    monkeypatch.setattr(tl_pick, "DEFER", True)
    monkeypatch.setattr(tl_pick, "DEFER_POLL_S", 0.0)
    monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 4)
    monkeypatch.setattr(build_pool, "cpus", lambda: 8)
    monkeypatch.setattr(tl_pick, "_ahead", {})
    monkeypatch.setattr(tl_pick, "_built_ahead", set())
    monkeypatch.setattr(tl_pick, "candidates",
                        lambda op, args: [tl_pick.KERNEL, {"v": "a"}, {"v": "b"}, tune.SENTINEL_EAGER])

    def fork_builds(ks, procs, nice=0):
        pids = [2000 + len(rec.forks) * 10 + i for i in range(min(procs, len(ks)))]
        rec.forks.append((nice, sorted(p.args[-1] for p in ks)))
        return [(pid, list(ks[i::procs])) for i, pid in enumerate(pids)]

    monkeypatch.setattr(build_pool, "fork_builds", fork_builds)
    monkeypatch.setattr(build_pool, "compile_forked",
                        lambda ks, procs, timeout_s=0: rec.built.append(sorted(p.args[-1] for p in ks)) or (len(ks), 0))
    monkeypatch.setattr(os, "waitpid", lambda pid, flags: (pid, rec.exits[pid] << 8) if pid in rec.exits else (0, 0))

    def timer(fn, c):
        rec.timed.append("eager" if tune.is_eager(c) else (c or {}).get("v"))
        fn()
        return _DEFER_COST[rec.timed[-1]]

    tune.set_timer(timer)
    return rec


def test_a_cold_key_runs_its_first_config_while_the_rest_builds(deferring):
    """``DEFER``: the cold call builds the fixed config's two kernels (in children), forks the
    rest of the shortlist's (16, 32; 8 is the first's) at a lower priority without waiting, and
    runs the fixed config, untimed; so do the key's calls while those children run. The first
    call after they exit times the whole shortlist without building anything, stores the winner
    and runs it; the next calls take it from the front cache."""
    rec = deferring
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(33, 17), torch.randn(33, 17)
    for _ in range(3):
        got = tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
        torch.testing.assert_close(got, eager_add_scaled(base, delta, 0.5))
    assert rec.calls == [None, None, None] and not rec.timed and not tune.table().rows
    assert rec.built == [[4, 8]] and rec.forks == [(tl_pick.BACKGROUND_NICE, [16, 32])]
    pids = list(tl_pick._ahead)
    rec.exits[pids[0]] = 0  # one of the two children is done: still the first config
    tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
    assert rec.calls[-1] is None and not rec.timed
    rec.exits[pids[1]] = 0
    got = tl_pick.run("add_scaled", (base, delta, 2.0), kernel)
    torch.testing.assert_close(got, eager_add_scaled(base, delta, 2.0))
    assert sorted(map(str, set(rec.timed))) == ["None", "a", "b", "eager"]  # the whole shortlist, timed once
    assert rec.built == [[4, 8]] and len(rec.forks) == 1  # nothing built again: all on disk
    assert rec.calls[-1] == "a"  # the winner
    (row,) = [r for k, r in tune.table().rows.items() if "|tilelang|add_scaled|" in k]
    assert row["config"] == {"v": "a"}
    n = len(rec.timed)
    tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
    assert len(rec.timed) == n and rec.calls[-1] == "a" and not tl_pick._deferred
    assert tl_pick.stats()["deferred_keys"] >= 1


def test_a_cold_key_runs_a_quick_twin_while_the_whole_shortlist_builds(deferring, monkeypatch):
    """``quick_twin`` (``TL_QUICK``): the deferred cold call builds and runs its first config's
    twin (its own kernel, 2) instead, while the whole shortlist, the first config's kernels (4, 8)
    too, builds in the background; the timing call picks among the shortlist, never the twin."""
    rec = deferring
    tl_pick.models()
    monkeypatch.setitem(tl_pick._quick, "add_scaled", lambda c: {**(c or {}), "v": "q"})
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(19, 7), torch.randn(19, 7)
    got = tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
    torch.testing.assert_close(got, eager_add_scaled(base, delta, 0.5))
    # the twin's one kernel in a child (children follow it), then the shortlist's four behind it
    assert rec.calls == ["q"] and not rec.timed
    assert rec.built == [[2]] and rec.forks == [(tl_pick.BACKGROUND_NICE, [4, 8, 16, 32])]
    for pid in list(tl_pick._ahead):
        rec.exits[pid] = 0
    tl_pick.run("add_scaled", (base, delta, 0.5), kernel)
    assert sorted(map(str, set(rec.timed))) == ["None", "a", "b", "eager"] and rec.calls[-1] == "a"
    (row,) = [r for k, r in tune.table().rows.items() if "|tilelang|add_scaled|" in k]
    assert row["config"] == {"v": "a"}


def test_a_quick_twin_sets_a_form_key_of_the_lora_forward():
    """lora_bypass_fwd's twin (tuning/lora.py ``TL_QUICK``): the fixed config's tiles with the O loop
    serial and the x·downᵀ loop 2 deep, keys the TileLang launcher reads (``stages`` of
    ``BYPASS_FWD``, ``pipe_o`` of ``bypass_fwd``)."""
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    twin = plans_lora.TL_QUICK["lora_bypass_fwd"](tl_pick.KERNEL)
    assert twin == {"pipe_o": False, "stages": 2} and set(twin) <= set(tl_lora.BYPASS_FWD) | {"pipe_o"}
    assert tl_pick.quick_twin("lora_bypass_fwd") is plans_lora.TL_QUICK["lora_bypass_fwd"]


def test_a_deferred_key_is_not_timed_while_capturing(deferring, monkeypatch):
    """Its children done, a deferred key's call under CUDA-graph capture / compile runs the
    first config and stays deferred: the first call outside times it."""
    rec = deferring
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(8, 5), torch.randn(8, 5)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    for pid in tl_pick._ahead:
        rec.exits[pid] = 0
    monkeypatch.setattr(tune, "unsafe_to_time", lambda: True)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert rec.calls == [None, None] and not rec.timed and tl_pick._deferred
    monkeypatch.setattr(tune, "unsafe_to_time", lambda: False)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert rec.calls[-1] == "a" and rec.timed and not tl_pick._deferred


def test_a_failed_background_child_leaves_its_kernels_to_the_timing_call(deferring):
    rec = deferring
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(8, 5), torch.randn(8, 5)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    (first_pid, second_pid) = list(tl_pick._ahead)
    rec.exits[first_pid], rec.exits[second_pid] = 0, 1  # 16's child built it, 32's failed
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert rec.timed and rec.calls[-1] == "a"
    # 32 is left to the timing call's own first call of "b" (one kernel: no children)
    assert rec.built == [[4, 8]] and {k[-1][-1] for k in tl_pick._built_ahead} == {16}


@pytest.mark.parametrize("why", ["defer-off", "tuning-off", "no-children", "capturing", "stored", "built"])
def test_when_a_cold_key_does_not_defer(deferring, monkeypatch, why):
    """No deferral: ``LYCORIS_TILELANG_DEFER=0`` (the shortlist one round of children builds, timed
    at once), TUNE=off (the first pick's kernels only, nothing timed), no children, compiling /
    capturing (the first pick, nothing built ahead), a stored key (its choice's kernels only),
    and a shortlist whose other kernels are built already (timed at once)."""
    from lycoris_ops.backends.tilelang import common as C

    rec = deferring
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(8, 5), torch.randn(8, 5)
    if why == "defer-off":
        monkeypatch.setattr(tl_pick, "DEFER", False)
        monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 3)
    elif why == "tuning-off":
        tune.set_tuning(False)
    elif why == "no-children":
        monkeypatch.setattr(build_pool, "usable_procs", lambda procs=None: 1)
    elif why == "capturing":
        monkeypatch.setattr(tune, "unsafe_to_time", lambda: True)
    elif why == "stored":
        tl_pick.run("add_scaled", (base, delta, 1.0), kernel)  # deferred, then timed
        for pid in tl_pick._ahead:
            rec.exits[pid] = 0
        tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
        tune.clear(tables=False)  # a fresh process: the table row stays
        for record in (rec.built, rec.forks, rec.timed, rec.calls, tl_pick._built_ahead, C._kernels):
            record.clear()
    elif why == "built":
        tl_pick._built_ahead.update(p.key for p in _pending((16, 32)))
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert not tl_pick._deferred and not any(nice for nice, _ in rec.forks)
    expect = {"defer-off": ([[4, 8, 16]], ["None", "a", "eager"], "a"),  # b's 32: a 4th kernel on 3 children
              "tuning-off": ([[4, 8]], [], None),
              "no-children": ([], ["None", "a", "b", "eager"], "a"),  # the tuner's first calls build in-process
              "capturing": ([], [], None),
              "stored": ([[8, 16]], [], "a"),
              "built": ([[4, 8]], ["None", "a", "b", "eager"], "a")}[why]
    built, timed, ran = expect
    assert rec.built == built and sorted(map(str, set(rec.timed))) == timed and rec.calls[-1] == ran


def test_settle_waits_for_the_background_children(deferring, monkeypatch):
    """``settle``: waits for the children (here: they exit while it waits) and makes the next
    call of each deferred key look at them at once (no poll interval left)."""
    rec = deferring
    monkeypatch.setattr(tl_pick, "DEFER_POLL_S", 3600.0)
    kernel = _configured_op_function(rec.calls)
    base, delta = torch.randn(8, 5), torch.randn(8, 5)
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    polls = []
    import time as _time

    def sleep(s):
        polls.append(s)
        for pid in tl_pick._ahead:
            rec.exits[pid] = 0

    monkeypatch.setattr(_time, "sleep", sleep)
    assert tl_pick.settle(5.0) == 1 and not tl_pick._ahead and polls
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert rec.timed and rec.calls[-1] == "a" and tl_pick.settle() == 0


def test_background_children_run_at_a_lower_priority(tmp_path):
    """``fork_builds(nice=)``: a child adds ``nice`` to its niceness before building."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("POSIX only")

    class Probe:
        def __init__(self, path):
            self.path = path

        def build(self):
            with open(self.path, "w") as f:
                f.write(str(os.nice(0)))

    base = os.nice(0)
    forked = build_pool.fork_builds([Probe(tmp_path / "n0"), Probe(tmp_path / "n1")], 2, nice=5)
    for pid, _ in forked:
        os.waitpid(pid, 0)
    assert [int((tmp_path / f"n{i}").read_text()) for i in range(2)] == [min(base + 5, 19)] * 2


_DEFERRED_BUILD = """
import os, time
import torch
import lycoris_ops
from lycoris_ops.backends.tilelang import runner as tl_pick
from lycoris_ops.tuner import tune
from lycoris_ops.backends.tilelang import common as C
from lycoris_ops.backends.tilelang.kernels.add import add_kernel

vecs = {None: (4, 8), 16: (16,)}
tl_pick.candidates = lambda op, args: [tl_pick.KERNEL, {"v": 16}, tune.SENTINEL_EAGER]
ran = []

def op_function(base, delta, gamma, cfg=None):
    v = cfg["v"] if cfg else None
    for w in vecs[v]:  # built or loaded (listed while capturing); never launched: no GPU here
        C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", w)
    ran.append(v)
    return base + gamma * delta
op_function.__module__ = "lycoris_ops.backends.tilelang.kernels.add"  # the version: that file's hash

cache = os.environ["TILELANG_CACHE_DIR"]
def files():
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs)

def timer(fn, c):
    fn()
    return 3.0 if tune.is_eager(c) else {None: 2.0, 16: 1.0}[(c or {}).get("v")]
tune.set_timer(timer)
base, delta = torch.randn(8, 8), torch.randn(8, 8)
tl_pick.run("add_scaled", (base, delta, 0.5), op_function)
first_wrote = len(files())
waiting = tl_pick.settle(600)
before = files()
out = tl_pick.run("add_scaled", (base, delta, 0.5), op_function)
assert torch.allclose(out, base + 0.5 * delta)
(row,) = [r for k, r in tune.table().rows.items() if "|tilelang|add_scaled|" in k]
st = tl_pick.stats()
print("ran", ran[0], ran[-1], "waiting", waiting, "deferred", st["deferred_keys"], "background", st["background_kernels"],
      "row", row["config"], "parent wrote", len(set(files()) - set(before)), "first wrote", first_wrote > 0)
"""


@pytest.mark.slow
def test_a_deferred_shortlist_builds_in_the_background_and_loads(tmp_path):
    """Real forks (no GPU: nvcc only): the cold call builds the first config's two kernels in
    children and runs it; a low-priority child builds the other config's kernel; after
    ``settle`` the next call times both configs (the fake timer), loading that kernel from the
    disk cache (the parent writes nothing), and stores the winner."""
    pytest.importorskip("tilelang")
    import os
    import subprocess
    import sys

    if not hasattr(os, "fork"):
        pytest.skip("POSIX only")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tl"), LYCORIS_KERNEL_TUNE_PROCS="2",
               LYCORIS_KERNEL_CACHE_DIR=str(tmp_path / "tuning"), LYCORIS_TILELANG_DEFER="1")
    out = subprocess.run([sys.executable, "-c", _DEFERRED_BUILD], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == \
        "ran None 16 waiting 1 deferred 1 background 1 row {'v': 16} parent wrote 0 first wrote True", out.stdout


def test_background_children_are_capped_and_the_rest_queued(deferring, monkeypatch):
    """At most ``usable_procs()`` background children run at once however many cold keys defer
    (a model's first step meets dozens); the other kernels wait in a queue, forked as children
    exit, and a key waits for its queued kernels too; ``settle`` drains the queue."""
    from lycoris_ops.backends.tilelang import common as C
    from lycoris_ops.backends.tilelang.kernels.add import add_kernel

    rec = deferring
    alive_at_fork = []
    fork = build_pool.fork_builds

    def counted(ks, procs, nice=0):
        forked = fork(ks, procs, nice)
        if nice:
            alive_at_fork.append(len(tl_pick._background) + len(forked))
        return forked

    monkeypatch.setattr(build_pool, "fork_builds", counted)

    def op_function(base, delta, gamma, cfg=None):  # distinct kernels per row count: nothing shared
        n, v = base.shape[0], (cfg or {}).get("v")
        widths = {None: (n,), "a": (n + 100, n + 200), "b": (n + 300,)}[v]
        if getattr(C._capture, "active", None) is not None:
            for w in widths:
                C.kernel(add_kernel, "sm_90a", "float16", "float16", "float16", w)
            return None
        for w in widths:
            C._kernels.setdefault(C.kernel_key(add_kernel, "sm_90a", ("float16",) * 3 + (w,)), object())
        rec.calls.append((n, v))
        return eager_add_scaled(base, delta, gamma)
    op_function.__module__ = __name__

    shapes = [torch.randn(n, 3) for n in range(1, 6)]
    for b in shapes:  # five cold keys, three background kernels each
        tl_pick.run("add_scaled", (b, b, 1.0), op_function)
    assert len(tl_pick._deferred) == 5 and max(alive_at_fork) == 4 == len(tl_pick._background)
    assert len(tl_pick._queue) == 15 - sum(len(k) for k, _ in tl_pick._ahead.values()) > 0
    last = shapes[-1]
    for pid in list(tl_pick._ahead):  # the first children exit: queued kernels take their place
        rec.exits[pid] = 0
    tl_pick.run("add_scaled", (last, last, 1.0), op_function)  # its kernels were queued: still waiting
    assert rec.calls[-1] == (5, None) and not rec.timed and max(alive_at_fork) == 4
    import time as _time

    monkeypatch.setattr(_time, "sleep", lambda s: rec.exits.update({pid: 0 for pid in tl_pick._ahead}))
    assert tl_pick.settle(5.0) == 5 and not tl_pick._ahead and not tl_pick._queue
    assert max(alive_at_fork) == 4
    # each cold call's one first-config kernel built in a child, before its background children
    assert rec.built == [[1], [2], [3], [4], [5]]
    tl_pick.run("add_scaled", (last, last, 1.0), op_function)
    assert rec.calls[-1] == (5, "a") and rec.timed and len(rec.built) == 5  # timed; nothing built by the call


def test_a_deferred_first_config_that_cannot_build_runs_eager_until_the_timing(deferring, monkeypatch, caplog):
    """The first config's kernel fails to build (``BuildError``): the deferred key's calls run
    the eager body meanwhile, and its timing call still picks among the configs that build."""
    from lycoris_ops.backends.tilelang.common import BuildError

    rec = deferring
    inner = _configured_op_function(rec.calls)

    def kernel(base, delta, gamma, cfg=None):
        from lycoris_ops.backends.tilelang import common as C

        if not cfg and getattr(C._capture, "active", None) is None:
            raise BuildError("TileLang could not build the fixed config (test)")
        return inner(base, delta, gamma, cfg)
    kernel.__module__ = __name__

    base, delta = torch.randn(8, 5), torch.randn(8, 5)
    for _ in range(2):
        torch.testing.assert_close(tl_pick.run("add_scaled", (base, delta, 1.0), kernel),
                                   eager_add_scaled(base, delta, 1.0))
    assert rec.calls == [] and tl_pick._deferred  # eager meanwhile, still deferred
    for pid in tl_pick._ahead:
        rec.exits[pid] = 0
    tl_pick.run("add_scaled", (base, delta, 1.0), kernel)
    assert rec.calls[-1] == "a" and "None" not in map(str, rec.timed)  # the fixed config failed its first call
    (row,) = [r for k, r in tune.table().rows.items() if "|tilelang|add_scaled|" in k]
    assert row["config"] == {"v": "a"} and row.get("failed")
