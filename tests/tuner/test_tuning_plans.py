"""The family planners end to end on CPU: every op's ``<op>_kwargs`` glue runs its whole
shortlist through the real Triton launcher under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 without a GPU), each candidate's output checked against the eager
body by the tuner, with a fake timer. Catches config dicts the launchers do not accept
and candidates that compute wrong numbers. One fp32 case per op (the first in scope of
``lycoris_ops.testing``)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

triton = pytest.importorskip("triton")

# every candidate runs on CPU tensors under the Triton interpreter; on a GPU machine
# bench/gpu_tuning.py tunes the real shapes and checks them against eager instead
pytestmark = pytest.mark.cpu_only

from lycoris_ops import reference
from lycoris_ops.backends import registry as dispatch, scope, select
from lycoris_ops import testing  # noqa: E402
from lycoris_ops.backends.triton import ops as triton_ops  # noqa: E402
from lycoris_ops.tuner import device, tune  # noqa: E402
from lycoris_ops.testing.samples import Layer  # noqa: E402
from lycoris_ops.tuner.keys import as_dict  # noqa: E402
from lycoris_ops.warmup import _warm_all  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

FAMILIES = ("lora", "tucker", "loha", "lokr", "dora", "oft", "boft", "ia3", "add")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(dispatch.ENV_TUNE, raising=False)
    tune.clear()
    tune.set_tuning(None)
    tune.set_budget(0)  # every candidate (interpreted warm-ups are slow)
    prev = tune.set_timer(lambda fn, c: (len(tune.label(c)) % 7 + 1) * 1e-6)  # no call: warm-up ran it
    yield
    tune.set_timer(prev)
    tune.clear()


def _tuned_family(family, monkeypatch):
    """The family's Triton tuning module, tuning CPU calls with synthetic device facts, and
    (op, full arguments) of each op's first fp32 test case in Triton's scope."""
    pm = importlib.import_module(f"lycoris_ops.backends.triton.tuning.{family}")
    monkeypatch.setattr(pm, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(pm, "facts", lambda d: device.synthetic())
    if family == "tucker":  # the test cases are one-launch calls, which are not timed
        monkeypatch.setattr(importlib.import_module("lycoris_ops.backends.triton.kernels.tucker"), "CORE_FUSE_TILES", 0)
    calls, seen = [], set()
    for case in testing.cases("lora" if family == "tucker" else family, dtype=torch.float32, device="cpu"):
        if case.op not in pm.KWARGS or case.op in seen:
            continue
        args = select._full_args(case.op, case.args)
        if scope.why_not(case.op, "triton", args) is None:
            seen.add(case.op)
            calls.append((case.op, args))
    return pm, calls


@pytest.mark.parametrize("family", FAMILIES)
def test_every_candidate_runs_and_matches_eager(family, monkeypatch):
    pm, calls = _tuned_family(family, monkeypatch)
    done = set()
    for op, args in calls:
        done.add(op)
        got = pm.KWARGS[op](*args)
        assert tune.is_eager(got) or (isinstance(got, dict) and set(got) <= {"cfg", "grad_cfg", "gw_cfg", "vendor", "merge_vendor"}), got
        # the exact-argument front cache answers the next call
        assert pm.KWARGS[op](*args) is got
        # the op-set function (picked config or eager) and the launcher with the picked kwargs
        # (where a fused config won), both equal to eager
        ref = reference.eager(op)(*args)
        assert tune.mismatch(getattr(triton_ops, op)(*args), ref) is None
        if not tune.is_eager(got):
            assert tune.mismatch(pm.LAUNCHERS[op](*args, **got), ref) is None
    assert done == set(pm.KWARGS) == set(pm.LAUNCHERS), f"no in-scope case for {set(pm.KWARGS) - done}"
    rows = tune.table().rows
    assert len(rows) == len(done)
    for key, row in rows.items():
        assert not row.get("failed"), (key, row.get("failed"))
        assert len(row["times"]) >= 2, (key, row)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32", "bf16"])
def test_tucker_one_launch_call_is_not_timed(dtype, monkeypatch):
    """A rebuild small enough for one program that builds its own AT keeps the launcher's
    default (one launch) instead of a timed tile; a larger one is timed."""
    from lycoris_ops.backends.triton.tuning import tucker as pm
    from lycoris_ops.backends.triton.kernels import tucker as TT

    monkeypatch.setattr(pm, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(pm, "facts", lambda d: device.synthetic())
    g = torch.Generator().manual_seed(3)

    def call(O, I, r):
        a, t, b = (torch.randn(s, generator=g).to(dtype) for s in ((O, r), (r, r, 9), (r, I)))
        return (a, t, b, None, None, None, 0.7)

    small = call(13, 7, 4)
    assert TT.one_launch(13, 7, 9, (4,), dtype)
    assert pm.tucker_fwd_kwargs(*small) == {} and tune.stats()["tuned"] == 0
    assert pm.tucker_fwd_kwargs(*small) is pm._FRONT[next(iter(pm._FRONT))]  # the front cache answers
    big = call(80, 150, 4)  # 80 rows x 150 columns: more than one program at every default tile
    assert not TT.one_launch(80, 150, 9, (4,), dtype)
    got = pm.tucker_fwd_kwargs(*big)
    assert tune.stats()["tuned"] == 1 and (tune.is_eager(got) or set(got) == {"cfg"})


def test_non_cuda_calls_get_launcher_defaults():
    from lycoris_ops.backends.triton.tuning import lora

    x, up, down = torch.randn(4, 8), torch.randn(6, 2), torch.randn(2, 8)
    assert lora.bypass_fwd_kwargs(x, up, down, 1.0) == {}


def test_warmup_direct_path(monkeypatch):
    from lycoris_ops.backends.triton.tuning import add, ia3

    for pm in (add, ia3):
        monkeypatch.setattr(pm, "DEVICE_TYPES", ("cpu", "cuda"))
        monkeypatch.setattr(pm, "facts", lambda d: device.synthetic())
    summary = {"calls": 0, "errors": []}
    gen = torch.Generator().manual_seed(0)
    _warm_all([Layer(48, 32, 4)], [8], torch.float32, torch.device("cpu"), gen, ["add_scaled", "ia3_fwd"], True,
              summary, True)
    assert summary == {"calls": 2, "errors": []}
    assert tune.stats()["tuned"] == 2 and len(tune.table().rows) == 2


@pytest.mark.parametrize("family", ["oft", "boft"])
@pytest.mark.parametrize("bwd", [False, True], ids=["fwd", "bwd"])
def test_split16_twin_only_for_16bit_streams(family, bwd):
    """A 16-bit x gets the first config's ``split16`` twin (timed, one more compile) before
    eager; the untimed pick stays the first config; fp32 x gets none (it would not split)."""
    from lycoris_ops.backends.triton.tuning import boft as PB
    from lycoris_ops.backends.triton.tuning import oft as P
    from lycoris_ops.backends.triton.kernels.oft import SPLIT16

    dev = device.synthetic()
    if family == "oft":
        plan_of = lambda xd: (P.plan_oft_bwd if bwd else P.plan_oft_fwd)(dev, 96, 32, 8192, True, xd,  # noqa: E731
                                                                          torch.float32)
    else:
        plan_of = lambda xd: (PB.plan_boft_bwd if bwd else PB.plan_boft_fwd)(dev, 4, 96, 8, 8192, True, xd,  # noqa: E731
                                                                             torch.float32)
    for x_dtype, want in ((torch.bfloat16, 1), (torch.float16, 1), (torch.float32, 0)):
        plan = plan_of(x_dtype)
        fused = [c for c in plan.candidates if isinstance(c, dict)]
        split = [c for c in fused if c["dot_prec"] == SPLIT16]
        wide = [c for c in split if family == "oft" and bwd and c["group"] == P.WIDE_GROUP]
        assert len(split) - len(wide) == want and plan.candidates[-1] == tune.SENTINEL_EAGER
        assert len(wide) == (want if family == "oft" and bwd else 0)  # the 16-bit backward's second twin
        assert fused[0]["dot_prec"] == "tf32x3" and len(plan.predicted) == len(plan.candidates)
        if want:
            assert split[0] == dict(fused[0], dot_prec=SPLIT16)
        if wide:
            assert wide[0] == dict(fused[0], dot_prec=SPLIT16, group=P.WIDE_GROUP, num_stages=3)


@pytest.mark.parametrize("bwd", [False, True], ids=["fwd", "bwd"])
def test_boft_bf16x3_twin_only_when_everything_is_16bit(bwd):
    """BOFT with x and blocks 16-bit gets the first config's ``bf16x3`` twin in place of
    split16 (same compile count); 16-bit x with fp32 blocks keeps split16 (g_blocks fp32)."""
    from lycoris_ops.backends.triton.tuning import boft as PB
    from lycoris_ops.backends.triton.kernels.oft import BF16X3, SPLIT16

    dev = device.synthetic()
    plan_of = PB.plan_boft_bwd if bwd else PB.plan_boft_fwd
    for blocks_dtype, want in ((torch.bfloat16, BF16X3), (torch.float32, SPLIT16)):
        plan = plan_of(dev, 8, 128, 32, 32768, True, torch.bfloat16, blocks_dtype)
        fused = [c for c in plan.candidates if isinstance(c, dict)]
        assert [c["dot_prec"] for c in fused].count(want) == 1
        assert {c["dot_prec"] for c in fused} == {"tf32x3", want}
        assert fused[-1] == dict(fused[0], dot_prec=want) and plan.candidates[-1] == tune.SENTINEL_EAGER


def test_loha_bypass_bwd_vendor_candidate_at_large_16bit_shapes():
    """The vendor-GEMM twin (cuBLAS for the two T·O·I GEMMs) is offered where both are long
    (16-bit compute, T·O·I >= VENDOR_MIN_MACS), before eager and never first."""
    from lycoris_ops.backends.triton.tuning import loha as P

    dev = device.synthetic()
    for T, D, R, dt, want in ((32768, 4096, 64, torch.bfloat16, 1), (8192, 3072, 32, torch.float16, 1),
                              (64, 256, 8, torch.bfloat16, 0), (8192, 3072, 32, torch.float32, 0)):
        d = P._bypass_bwd_default(T, D, R, dt)
        plan = P.plan_bypass_bwd(dev, T, D, D, R, dt, dt, dt, default=d)
        vendor = [c for c in plan.candidates if isinstance(c, dict) and c.get("vendor") and not c.get("merge_vendor")]
        assert len(vendor) == want and plan.candidates[-1] == tune.SENTINEL_EAGER
        assert not plan.candidates[0].get("vendor") and len(plan.predicted) == len(plan.candidates)
        if want:
            assert vendor[0]["cfg"]["strategy"] == "materialize"


def test_loha_bypass_vendor_candidates_at_large_16bit_shapes():
    """The forward's vendor twin (ΔW by the tile kernel, the T·O·I GEMM by cuBLAS) where that
    GEMM is long (16-bit, T·O·I >= VENDOR_MIN_MACS), materializing, before eager and never
    first, its launch kwargs carrying ``vendor``; the backward's second vendor twin also takes
    the merge's vendor path where O·I·R >= MERGE_VENDOR_MIN_MACS."""
    from lycoris_ops.backends.triton.tuning import loha as P
    from lycoris_ops.backends.triton.kernels import loha as TL

    dev = device.synthetic()
    for T, D, R, dt, want, want_merge in ((32768, 4096, 64, torch.bfloat16, 1, 1), (8192, 3072, 32, torch.float16, 1, 1),
                                          (8192, 1024, 8, torch.bfloat16, 1, 0), (64, 256, 8, torch.bfloat16, 0, 0),
                                          (8192, 3072, 32, torch.float32, 0, 0)):
        plan = P.plan_bypass_fwd(dev, T, D, D, R, dt, dt, dt, True, default=P._apply_default(T, R, dt))
        vendor = [c for c in plan.candidates if isinstance(c, dict) and c.get("vendor")]
        assert len(vendor) == want and plan.candidates[-1] == tune.SENTINEL_EAGER
        assert not plan.candidates[0].get("vendor") and len(plan.predicted) == len(plan.candidates)
        if want:
            assert vendor[0]["strategy"] == "materialize"
            kw = P._vendor_launch(TL.ApplyCfg, vendor[0])
            assert kw["vendor"] is True and kw["cfg"].strategy == "materialize"
            assert "vendor" not in P._vendor_launch(TL.ApplyCfg, plan.candidates[0])
        d = P._bypass_bwd_default(T, D, R, dt)
        bwd = P.plan_bypass_bwd(dev, T, D, D, R, dt, dt, dt, default=d)
        merge = [c for c in bwd.candidates if isinstance(c, dict) and c.get("merge_vendor")]
        assert len(merge) == want_merge and all(c["vendor"] for c in merge)
        assert bwd.candidates[-1] == tune.SENTINEL_EAGER and len(bwd.predicted) == len(bwd.candidates)


def test_loha_merge_bwd_vendor_candidate():
    """The merge backward's vendor twin (one E pass, four cuBLAS contractions): 16-bit compute
    from MERGE_VENDOR_MIN_MACS multiply-adds per contraction, the first config plus
    ``vendor``, before eager and never first; its launch kwargs carry ``vendor``."""
    from lycoris_ops.backends.triton.tuning import loha as P
    from lycoris_ops.backends.triton.kernels import loha as TL

    dev = device.synthetic()
    for D, R, dt, want in ((4096, 64, torch.bfloat16, 1), (3072, 32, torch.float16, 1), (256, 8, torch.bfloat16, 0),
                           (3072, 32, torch.float32, 0)):
        plan = P.plan_merge_bwd(dev, D, D, R, dt, dt, default=as_dict(TL.default_grad_cfg(R, dt)))
        vendor = [c for c in plan.candidates if isinstance(c, dict) and c.get("vendor")]
        assert len(vendor) == want and plan.candidates[-1] == tune.SENTINEL_EAGER
        assert not plan.candidates[0].get("vendor") and len(plan.predicted) == len(plan.candidates)
        if want:
            assert vendor[0] == {**plan.candidates[0], "vendor": True}
            kw = P._vendor_launch(TL.GradCfg, vendor[0])
            assert kw["vendor"] is True and isinstance(kw["cfg"], TL.GradCfg)
            assert "vendor" not in P._vendor_launch(TL.GradCfg, plan.candidates[0])


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_oft_forward_shortlist_times_the_neumann_rebuild(x_dtype):
    """The diag-OFT forward's shortlist holds a config with the Cayley factor by
    ``neumann_inverse`` (the launcher's default FWD_CFG, or the first config's twin when the
    plan starts elsewhere), and Gauss-Jordan configs beside it; the backward offers none
    (measured slower there: its registers halve the resident stream programs)."""
    from lycoris_ops.backends.triton.tuning import oft as P
    from lycoris_ops.backends.triton.kernels.oft import FWD_CFG

    dev = device.synthetic()
    with_default = P.plan_oft_fwd(dev, 128, 32, 32768, True, x_dtype, torch.float32, default=as_dict(FWD_CFG))
    fused = [c for c in with_default.candidates if isinstance(c, dict)]
    assert fused[0] == as_dict(FWD_CFG) and any(not c.get("neumann") for c in fused)
    bare = P.plan_oft_fwd(dev, 128, 32, 32768, True, x_dtype, torch.float32)
    fused = [c for c in bare.candidates if isinstance(c, dict)]
    assert not fused[0].get("neumann") and dict(fused[0], neumann=True, num_stages=3) in fused
    assert bare.candidates[-1] == tune.SENTINEL_EAGER and len(bare.predicted) == len(bare.candidates)
    bwd = P.plan_oft_bwd(dev, 128, 32, 32768, True, x_dtype, torch.float32)
    assert not any(isinstance(c, dict) and c.get("neumann") for c in bwd.candidates)


def test_oft_boft_plans_past_block_32():
    """Blocks of 33 to 64 (padded 64): the diag-OFT forward's default and shortlist take
    Gauss-Jordan only (the series' 64-wide dots spill), and every BOFT candidate, the
    launcher's default first, streams tiles within ``STREAM_TILE_MAX`` of its 64-row groups."""
    from lycoris_ops.backends.triton.kernels import boft as TB, oft as TO
    from lycoris_ops.backends.triton.tuning import boft as PB, oft as P
    from lycoris_ops.tuner.cost import STREAM_TILE_MAX

    dev = device.synthetic()
    assert TO.fwd_cfg(32).neumann and not TO.fwd_cfg(48).neumann and not TO.fwd_cfg(33).neumann
    plan = P.plan_oft_fwd(dev, 64, 48, 8192, True, torch.bfloat16, torch.float32, default=as_dict(TO.fwd_cfg(48)))
    fused = [c for c in plan.candidates if isinstance(c, dict)]
    assert fused and not any(c.get("neumann") for c in fused)
    for bwd in (False, True):
        plan_of = PB.plan_boft_bwd if bwd else PB.plan_boft_fwd
        default = as_dict(TB.default_boft_cfg(48))
        plan = plan_of(dev, 7, 64, 48, 8192, True, torch.bfloat16, torch.float32, default=default)
        fused = [c for c in plan.candidates if isinstance(c, dict)]
        assert fused[0] == default and plan.candidates[-1] == tune.SENTINEL_EAGER
        for c in fused:
            assert (2 * 64 * c["bwd_block_p"] if bwd else 64 * c["block_p"]) <= STREAM_TILE_MAX, c
    assert TB.default_boft_cfg(32) == TB.BoftCfg()


def test_lokr_bypass_shortlists_offer_rounded_intermediates_at_16_bits():
    """The LoKr bypass forward and backward shortlists hold ``split=False`` candidates (the
    fp32 intermediates rounded to 16 bits where eager rounds them) at 16-bit compute only;
    the first config keeps them unrounded when it is the launcher's default."""
    from lycoris_ops.backends.triton.tuning import lokr as P

    dev = device.synthetic()
    bf, f32 = torch.bfloat16, torch.float32
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TK

    for plan_of in (lambda cd: P.plan_bypass_fwd(dev, 32768, 64, 64, 64, 64, cd, cd, cd, True,
                                                 default=as_dict(TK.BypassFwdCfg())),
                    lambda cd: P.plan_bypass_bwd(dev, 32768, 64, 64, 64, 64, cd, cd, cd)):
        fused = [c for c in plan_of(bf).candidates if isinstance(c, dict)]
        assert any(c["split"] is False for c in fused), fused
        assert all(c["split"] is True for c in plan_of(f32).candidates if isinstance(c, dict))
    # the forward's twin goes second (timed even past a cold key's tune budget), the default first
    plan = P.plan_bypass_fwd(dev, 32768, 64, 64, 64, 64, bf, bf, bf, True, default=as_dict(TK.BypassFwdCfg()))
    assert plan.candidates[0] == as_dict(TK.BypassFwdCfg()) and plan.candidates[1]["split"] is False
    assert len(plan.predicted) == len(plan.candidates) and plan.candidates[-1] == tune.SENTINEL_EAGER


def test_lokr_bypass_bwd_caps_block_t_where_factor_dims_are_padded(monkeypatch):
    """A padded factor dim caps the bypass backward's token tile at PADDED_BWD_ROWS G-tile rows
    (its sm_90 build was wrong past it; exact under the interpreter): the plan clamps any
    config, the shortlist holds none above the cap, power-of-two dims keep block_t up to 16."""
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TK
    from lycoris_ops.backends.triton.tuning import lokr as P

    monkeypatch.setattr(TK, "num_sms", lambda device: 132)
    TK._bypass_bwd_plan.cache_clear()
    bf = torch.bfloat16
    assert TK.max_bwd_block_t(40, 16, 64, 20) == 1  # a=40 pads to 64: 64 rows at block_t 1
    assert TK.max_bwd_block_t(7, 2, 4, 11) == 4
    assert TK.max_bwd_block_t(64, 64, 64, 64) == TK.max_bwd_block_t(16, 16, 16, 16) == 16
    for cfg in (TK.BypassBwdCfg(block_t=4, passes=1), TK.BypassBwdCfg(block_t=8, swap=True, passes=2)):
        meta = TK._bypass_bwd_plan(8192, 40, 16, 64, 20, (), bf, "cpu", cfg)[-1]
        assert meta["BT"] * meta["BA"] <= TK.PADDED_BWD_ROWS, (cfg, meta["BT"], meta["BA"])
    assert TK.default_bypass_bwd_cfg(8192, 7, 2, 4, 11, bf).block_t <= 4
    dev = device.synthetic()
    for a, b, c, d in ((40, 16, 64, 20), (7, 2, 4, 11)):
        plan = P.plan_bypass_bwd(dev, 8192, a, b, c, d, bf, bf, bf)
        for cand in (c_ for c_ in plan.candidates if isinstance(c_, dict)):
            dims = (c, d, a, b) if cand["swap"] else (a, b, c, d)
            assert cand["block_t"] <= TK.max_bwd_block_t(*dims), cand
    assert max(c_["block_t"] for c_ in P.plan_bypass_bwd(dev, 8192, 16, 16, 16, 16, bf, bf, bf).candidates
               if isinstance(c_, dict)) > 1
    TK._bypass_bwd_plan.cache_clear()


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_candidate_is_the_step_down_body(family, monkeypatch):
    """What the tuner times as ``eager`` is what a win of eager runs: the op's step-down body
    (``reference.step_down``), not the exact body where the two differ (LoHa's tuner timed the
    exact body, whose fp32 O·I passes lost to fused candidates the step-down body beats)."""
    import sys

    pm, calls = _tuned_family(family, monkeypatch)
    seen = {}

    def fake_select(op, backend, key_parts, candidates, run_candidate, **kw):
        seen[op] = run_candidate
        return tune.SENTINEL_EAGER

    monkeypatch.setattr(tune, "select_config", fake_select)
    checked = set()
    for op, args in calls:
        seen.clear()
        pm.KWARGS[op](*args)
        if op not in seen:  # a call the launcher's default serves untimed (one launch)
            continue
        body = reference.step_down(op)
        hits = []
        with monkeypatch.context() as mp:  # the body's module attribute, which the candidate looks up
            mp.setattr(sys.modules[body.__module__], body.__name__,
                       lambda *a, _b=body, **k: hits.append(1) or _b(*a, **k))
            seen[op](tune.SENTINEL_EAGER)
        assert hits, f"{op}: the tuner's eager candidate is not {body.__module__}.{body.__name__}"
        checked.add(op)
    assert checked, family
