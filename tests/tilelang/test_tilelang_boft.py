"""TileLang BOFT (lycoris_ops/backends/tilelang/kernels/boft.py, built on the diag-OFT kernel families
of oft.py with the stage permutation as the channel map and fp32 GEMMs).

1. Compile check without a GPU of the BOFT-specific configurations (permuted
   channel map, 16-bit in / fp32 out and fp32 in / 16-bit out stages, diff,
   rescale folded into the last stage, BOFT chain) for sm_90a and sm_80
   (``execution_backend="tvm_ffi"``, nvcc on PATH).
2. ``boft_fwd`` / ``boft_bwd`` end to end against the eager reference in fp64: on a
   GPU the real kernels, without one the CPU twins (``cpu=True`` builders, fp32,
   TileLang's C target) behind the same host code: the permutation π_i of every
   stage, groups of several blocks per stage, the three layouts, rescale and diff.
"""

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.reference import boft as R_BOFT  # noqa: E402
from lycoris_ops.testing import REL_TOL, rel_err  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import boft, boft_compose  # noqa: E402
from lycoris_ops.backends.tilelang.kernels import oft as _oft  # noqa: E402
from tilelang_harness import COMPILE_CASES, IDS, compile_part  # noqa: E402
from sweep import sweep  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def check(actual, expected, dtype, what):
    tol = REL_TOL[dtype]
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def d64(*ts):
    return [None if t is None else t.detach().double().cpu() for t in ts]


def inputs(seed, m, nb, s, shape, has_rs, dtype):
    """(blocks, rescale or None, x, grad) of a case, on DEV."""
    g = torch.Generator().manual_seed(seed)
    blocks = (0.2 * torch.randn(m, nb, s, s, generator=g)).to(DEV)
    rescale = (torch.rand(nb * s, generator=g) + 0.5).to(DEV) if has_rs else None
    x = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    grad = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    return blocks, rescale, x, grad


def check_channels_last(blocks, rescale, x, grad, diff, dtype, what):
    """boft_fwd / boft_bwd (axis −1, cscale 0.9, scale 0.7) against the fp64 reference."""
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    check(boft.boft_fwd(blocks, x, -1, 0.9, 0.7, rescale, diff), R_BOFT.boft_fwd(b6, x6, -1, 0.9, 0.7, r6, diff),
          dtype, f"boft_fwd{what}")
    gx, gb = boft.boft_bwd(grad, blocks, x, -1, 0.9, 0.7)
    rx, rb = R_BOFT.boft_bwd(g6, b6, x6, -1, 0.9, 0.7)
    check(gx, rx, dtype, f"boft_bwd gx{what}")
    check(gb, rb, dtype, f"boft_bwd g_blocks{what}")


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
def test_kernels_compile(arch, dtype, part):
    for builder, args in compile_part(boft.compile_specs(dtype), part):
        src = _common.compile_only(builder, arch, *args).get_kernel_source()
        assert "__global__" in src, (builder.__name__, args)


def test_groups():
    assert boft.boft_groups(4, 4) == (32, 4, 16)   # the whole stage in one group
    assert boft.boft_groups(4, 16) == (32, 8, 32)  # two groups per stage
    assert boft.boft_groups(6, 2) == (32, 2, 12)   # NB must divide nb
    assert boft.boft_groups(40, 4) == (64, 1, 40)


# (m, nb, s, x shape, axis, with rescale, diff)
CASES = [
    (3, 4, 4, (23, 16), -1, True, True),     # channels last, m = log2(nb) + 1
    (2, 16, 4, (9, 64), -1, False, False),   # two groups per stage
    (3, 4, 4, (16, 7), 0, False, True),      # weight rows
    (2, 4, 4, (2, 16, 3, 3), 1, True, False),  # conv channels
    (1, 2, 6, (11, 12), -1, True, True),     # one stage
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[IDS[d] for d in DTYPES])
@pytest.mark.parametrize("m,nb,s,shape,axis,has_rs,diff", sweep(CASES),
                         ids=[f"m{c[0]}nb{c[1]}s{c[2]}-ax{c[4]}-{'rs' if c[5] else 'nors'}-{'diff' if c[6] else 'plain'}"
                              for c in CASES])
def test_boft(m, nb, s, shape, axis, has_rs, diff, dtype):
    blocks, rescale, x, grad = inputs(m * 100 + nb * 10 + s, m, nb, s, shape, has_rs, dtype)
    cscale, scale = 0.9, 0.7
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    y = boft.boft_fwd(blocks, x, axis, cscale, scale, rescale, diff)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    check(y, R_BOFT.boft_fwd(b6, x6, axis, cscale, scale, r6, diff), dtype, "boft_fwd")
    gx, gb = boft.boft_bwd(grad, blocks, x, axis, cscale, scale)
    rx, rb = R_BOFT.boft_bwd(g6, b6, x6, axis, cscale, scale)
    assert gx.dtype == x.dtype and gb.dtype == blocks.dtype and gb.shape == blocks.shape
    check(gx, rx, dtype, "boft_bwd gx")
    check(gb, rb, dtype, "boft_bwd g_blocks")


def test_run_groups():
    assert boft.run_groups(32, 128, 2) == (32, 1, 32)  # the bench's 4096 channels: runs of 16
    assert boft.run_groups(24, 128, 2) == (48, 2, 64)  # 3072 channels: 24-channel runs, GEMMs at 64
    assert boft.run_groups(8, 16, 4) == (32, 4, 32)
    assert boft.run_groups(4, 4, 2) is None            # at most 16 channels a group
    assert boft.run_groups(40, 4, 2) is None           # 20-element runs are 40 bytes; 80 channels is too many
    assert boft.run_groups(6, 16, 2) == (48, 8, 64)


def test_runs_plan():
    """Which calls take the run kernels: channels last, 16-bit x on a GPU (fp32 there would
    mean TF32 GEMMs; the CPU twins' fp32 GEMMs are exact), and a tile that fits in shared memory."""
    x = torch.empty(64, 4096, dtype=torch.bfloat16)
    assert boft._runs_plan(x, False, 32, 128, "sm_90a", 128, True) == (32, 1, 32)
    assert boft.runs_smem(32, 32, 256, 2, 2, True) > 227 * 1024
    assert boft._runs_plan(x, False, 32, 128, "sm_90a", 256, True) is None  # the gather kernels instead
    assert boft._runs_plan(x, True, 32, 128, "sm_90a", 64, True) is None    # channels first
    assert boft._runs_plan(x.float(), False, 32, 128, "sm_90a", 64, True) is None
    assert boft._runs_plan(x.float(), False, 32, 128, _common.CPU_ARCH, 64, True) == (32, 1, 32)


# (m, nb, s, x shape, with rescale, diff): channels last, shapes the run kernels take. Stage i's
# group is GC contiguous channels while 2κ_i <= GC, else two runs κ_i apart: m = 5, s = 8 has
# both (GC = 32, κ = 4 … 64); 37 / 21 positions leave a partial tile
RUN_CASES = [
    (5, 16, 8, (37, 128), True, True),
    (3, 4, 24, (21, 96), False, False),   # GC = 48: two 24-channel runs from stage 2
    (1, 2, 32, (5, 64), True, True),      # one stage
]


@pytest.mark.slow
@pytest.mark.parametrize("m,nb,s,shape,has_rs,diff", RUN_CASES,
                         ids=[f"m{c[0]}nb{c[1]}s{c[2]}-{'rs' if c[4] else 'nors'}-{'diff' if c[5] else 'plain'}"
                              for c in RUN_CASES])
def test_boft_runs(m, nb, s, shape, has_rs, diff):
    """The run kernels (one box per group and tile, stage values as 16-bit (hi, lo) pairs, run
    basis in the Cayley and chain kernels; the last unit with rescale and diff) against the
    fp64 reference. The CPU twins run the run kernels at fp32 (exact GEMMs)."""
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(7 * m + s, m, nb, s, shape, has_rs, dtype)
    taken = boft._runs_plan(x, False, s, nb, _common.arch_of(x.device), boft.APPLY["BT"], False)
    assert taken is not None, taken
    check_channels_last(blocks, rescale, x, grad, diff, dtype, "")


def test_boft_gather_channels_last():
    """Channels last without a run size (``run_groups`` None: 16 channels a group at most) takes
    the gather kernels (the stage permutation as a channel map), against the fp64 reference."""
    m, nb, s, shape = 3, 4, 4, (37, 16)
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(29, m, nb, s, shape, True, dtype)
    assert boft._runs_plan(x, False, s, nb, _common.arch_of(x.device), boft.APPLY["BT"], False) is None
    check_channels_last(blocks, rescale, x, grad, True, dtype, " (gather)")


#: non-default (forward, backward) configs inside tuning/oft.py's TileLang spaces (BOFT shares them)
TILE_CFGS = [(dict(BT=256, threads=256), dict(BT=32, threads=128)),
             (dict(BT=64, threads=128), dict(BT=128, threads=256))]


@pytest.mark.slow
@pytest.mark.parametrize("fwd_cfg,bwd_cfg", TILE_CFGS, ids=["bt256-bt32", "bt64-bt128"])
@pytest.mark.parametrize("m,nb,s,shape,axis", [(3, 4, 4, (300, 16), -1), (2, 4, 4, (2, 16, 9, 17), 1)],
                         ids=["cl", "cf"])
def test_tile_configs(m, nb, s, shape, axis, fwd_cfg, bwd_cfg):
    """The launchers honour a tuned ``cfg`` on every stage (several tiles per program, a
    tail tile, both layouts); on a GPU the real kernels, else the CPU twins."""
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(12, m, nb, s, shape, True, dtype)
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    check(boft.boft_fwd(blocks, x, axis, 0.9, 0.7, rescale, True, cfg=fwd_cfg),
          R_BOFT.boft_fwd(b6, x6, axis, 0.9, 0.7, r6, True), dtype, f"boft_fwd {fwd_cfg}")
    gx, gb = boft.boft_bwd(grad, blocks, x, axis, 0.9, 0.7, cfg=bwd_cfg)
    rx, rb = R_BOFT.boft_bwd(g6, b6, x6, axis, 0.9, 0.7)
    check(gx, rx, dtype, f"boft_bwd gx {bwd_cfg}")
    check(gb, rb, dtype, f"boft_bwd g_blocks {bwd_cfg}")


@pytest.mark.slow
@pytest.mark.nvcc
def test_tile_space_corners_compile_sm90a(monkeypatch):
    """The corners of the legal TileLang spaces of boft_fwd / boft_bwd (smallest and largest
    BT, each with its threads; the permuted channel map, fp32 GEMMs) compile for sm_90a at
    32- and 64-channel groups."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import oft as plans_oft
    from lycoris_ops.backends.tilelang.kernels import oft
    from tilelang_harness import compile_calls, corners

    for mod in (boft, oft):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(oft, "num_sms", lambda d: 132)
    dev = device.synthetic()
    bf = torch.bfloat16
    x = torch.empty(8192, 3072, dtype=bf)
    calls = []
    for m, s in ((4, 8), (2, 64)):
        blocks = torch.empty(m, 3072 // s, s, s)
        GP = boft.boft_groups(s, 3072 // s)[0]
        for bwd in (False, True):
            cfgs = plans_oft.tl_configs(dev, GP, 4, bwd)
            for c in corners(cfgs):
                calls.append((boft.boft_bwd, (x, blocks, x, -1, 1.0, 1.0), c) if bwd
                            else (boft.boft_fwd, (blocks, x, -1, 1.0, 1.0, None, False), c))
    captured, failed = compile_calls(calls)
    assert captured >= 12 and not failed, failed


def test_shortlists_for_an_h200():
    """boft_fwd / boft_bwd: the fixed config first, eager last, at most TL_N legal model
    configs (fp32 GEMMs: no BT = 128 backward at 64-channel groups), JSON-serializable."""
    import json

    from lycoris_ops.backends.tilelang.tuning import boft as plans_boft
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import oft as plans_oft
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.tuner import tune
    from lycoris_ops.backends.tilelang.kernels import oft

    dev = device.synthetic()
    for m, s in ((4, 8), (2, 64)):
        for dt in (torch.bfloat16, torch.float32):
            blocks, x = torch.empty(m, 3072 // s, s, s), torch.empty(8192, 3072, dtype=dt)
            GP = boft.boft_groups(s, 3072 // s)[0]
            for op, args, fixed, bwd in (("boft_fwd", (blocks, x, -1, 1.0, 1.0, None, False), oft.APPLY, False),
                                         ("boft_bwd", (x, blocks, x, -1, 1.0, 1.0), oft.STREAM, True)):
                cands = list(plans_boft.TILELANG[op][0](dev, *args).candidates)
                assert cands[0] == fixed and tune.is_eager(cands[-1]), (op, cands)
                assert 3 <= len(cands) <= plans_oft.TL_N + 2 and len(set(map(str, cands))) == len(cands), (op, cands)
                for c in cands[1:-1]:
                    assert c in plans_oft.tl_configs(dev, GP, 4, bwd), (op, s, dt, c)
                json.dumps(cands)
    a = tl_pick.key_parts((torch.empty(4, 384, 8, 8), torch.empty(8192, 3072), -1, 1.0, 1.0, None, False), "boft_fwd")
    assert a[0] == ("sizes", (4, 384, 8, False))  # the positions only in x's bucket


def test_shortlist_keeps_run_tiles():
    """Where the run kernels take the call (the small bench shape: 48-channel groups), the
    TileLang shortlist holds only tiles whose run kernels fit in shared memory: a larger one
    would build and run the gather kernels (the BT = 256 forward did, before)."""
    from lycoris_ops.backends.tilelang.tuning import boft as plans_boft
    from lycoris_ops.tuner import device, tune
    from lycoris_ops.backends.tilelang.kernels import oft

    dev = device.synthetic()
    blocks, x = torch.empty(8, 128, 24, 24), torch.empty(8192, 3072, dtype=torch.bfloat16)
    for op, args, fixed, bwd in (("boft_fwd", (blocks, x, -1, 1.0, 1.0, None, False), oft.APPLY, False),
                                 ("boft_bwd", (x, blocks, x, -1, 1.0, 1.0), oft.STREAM, True)):
        cands = [c for c in plans_boft.TILELANG[op][0](dev, *args).candidates if not tune.is_eager(c)]
        assert len(cands) >= 2, (op, cands)
        for c in cands:
            bt = {**fixed, **c}["BT"]
            assert boft._runs_plan(x, False, 24, 128, "sm_90a", bt, bwd) is not None, (op, c)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` / ``empty_like`` fill floating buffers with NaN: a buffer the launchers read
    before writing (a partials split left unzeroed) fails the check instead of passing on fresh,
    zeroed host memory."""
    def poison(real):
        def empty(*a, **k):
            t = real(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return empty

    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))


def spy_units(monkeypatch, name):
    """The (first stage, L) of every call of ``boft.<name>`` (a unit launcher), in call order."""
    seen, real = [], getattr(boft, name)

    def spy(*a):
        seen.append((a[4], a[5]))
        return real(*a)

    monkeypatch.setattr(boft, name, spy)
    return seen


# (m, nb, s, x shape, with rescale, diff, the units)
COMPOSE_CASES = [
    (3, 4, 32, (37, 128), True, True, [(0, 3)]),              # one 128-wide unit: rescale, diff
    (2, 8, 32, (21, 256), True, False, [(0, 2)]),             # a 64-wide unit
    (4, 8, 32, (21, 256), False, False, [(0, 3), (3, 1)]),    # a last single stage after a composed unit
    (4, 8, 24, (13, 192), False, True, [(0, 2), (2, 2)]),     # GC = 48: the leading box, then 96 wide
]


@pytest.mark.slow
@pytest.mark.parametrize("m,nb,s,shape,has_rs,diff,units", COMPOSE_CASES,
                         ids=[f"m{c[0]}nb{c[1]}s{c[2]}" for c in COMPOSE_CASES])
def test_boft_composed(m, nb, s, shape, has_rs, diff, units, monkeypatch, poisoned_empty):
    """Up to ``COMPOSE_MOST`` consecutive stages as one matrix J = E_{L-1}···E_0 on a 2^L-run
    box (``composed_matrices``, built in fp64 from the gathered stage matrices), forward,
    backward replay and stream (each stage's partials formed from the unit's Σ gᵀ·u on the
    host); units at least ``COMPOSE_BWD_SPLIT`` wide stream in two launches (gx by the
    forward's composed kernel with Jᵀ, then the partials alone), narrower ones (64, and 96 at
    GC = 48: mma.sync on a GPU) in one. Which stages compose, and gx, g_blocks and y against
    the fp64 reference; spies count the composed launches."""
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(13 * m + s, m, nb, s, shape, has_rs, dtype)
    runs = boft.run_groups(s, nb, x.element_size())
    assert boft_compose.compose_units(m, s, runs, boft_compose.COMPOSE_MOST) == units
    seen = spy_units(monkeypatch, "_launch_composed")
    streamed = spy_units(monkeypatch, "_stream_composed")
    check_channels_last(blocks, rescale, x, grad, diff, dtype, " (composed)")
    composed = [u for u in units if u[1] > 1 and not boft_compose.one_box(*u, s, runs[0])]
    # the forward's composed units, then the replay's (all but the last unit) and the stream's, last first
    replay = [u for u in composed if u != units[-1]]
    stream = composed[::-1]
    # a split stream's gx is a composed launch too, inside the spied stream call
    split = [u for u in stream if runs[0] << (u[1] - 1) >= boft_compose.COMPOSE_BWD_SPLIT]
    assert seen == composed + replay + split, seen
    assert streamed == stream, streamed


# (m, nb, s, x shape, with rescale, diff, the forward's units and the backward's)
LEADING_CASES = [
    (3, 4, 24, (21, 96), True, True, [(0, 2), (2, 1)], [(0, 2), (2, 1)]),        # κ 12, 24 <= GC/2 = 24
    (2, 2, 24, (17, 48), True, True, [(0, 2)], [(0, 2)]),                        # the whole butterfly: rescale, diff
    (5, 16, 8, (19, 128), False, True, [(0, 3), (3, 2)], [(0, 3), (3, 2)]),      # GC = 32: κ 4, 8, 16
    (4, 8, 24, (13, 192), False, False, [(0, 2), (2, 2)], [(0, 2), (2, 2)]),     # then a 96-wide unit
]


@pytest.mark.slow
@pytest.mark.parametrize("m,nb,s,shape,has_rs,diff,fwd_units,bwd_units", LEADING_CASES,
                         ids=[f"m{c[0]}nb{c[1]}s{c[2]}" for c in LEADING_CASES])
def test_boft_leading_box(m, nb, s, shape, has_rs, diff, fwd_units, bwd_units, monkeypatch, poisoned_empty):
    """The leading stages whose κ_i <= GC/2 share one box (each stage's
    group is the same GC channels in order), so they run as one GC x GC matrix through the
    single stage kernels, forward, replay and stream (``_stream_box``: the stages' partials
    from the unit's Σ gᵀ·u on the host). The units, and y, gx, g_blocks against the fp64
    reference; a spy counts the box streams."""
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(7 * m + s, m, nb, s, shape, has_rs, dtype)
    runs = boft.run_groups(s, nb, x.element_size())
    assert boft_compose.compose_units(m, s, runs, 3) == fwd_units
    assert boft_compose.compose_units(m, s, runs, 3) == bwd_units
    boxes = spy_units(monkeypatch, "_stream_box")
    check_channels_last(blocks, rescale, x, grad, diff, dtype, " (leading stages as one box)")
    assert boxes == [bwd_units[0]], boxes


@pytest.mark.slow
@pytest.mark.parametrize("m,nb,s,shape", [(4, 8, 32, (300, 256)), (3, 4, 24, (300, 96)), (4, 8, 24, (300, 192))],
                         ids=["composed+single", "box+single", "box+composed"])
def test_boft_bwd_partials_over_splits(m, nb, s, shape, monkeypatch, poisoned_empty):
    """The backward's partials with the positions in several splits (``oft.SPLIT_PER_SM`` raised:
    a CPU has one "SM"): single stages keep theirs per split, a composed unit's stages go to split 0
    with the other splits' rows zeroed (``boft._bwd_runs``; one split in all where every stage is in a
    unit), under NaN-filled fresh buffers. gx and g_blocks against the fp64 reference."""
    monkeypatch.setattr(_oft, "SPLIT_PER_SM", 64)
    splits = []
    real = boft.batch_partials

    def spy(b, part, *a):
        splits.append(part.shape[0])
        return real(b, part, *a)

    monkeypatch.setattr(boft, "batch_partials", spy)
    dtype = DTYPES[-1]
    blocks, rescale, x, grad = inputs(5 * m + s, m, nb, s, shape, False, dtype)
    check_channels_last(blocks, None, x, grad, False, dtype, " (partials over splits)")
    units = boft_compose.compose_units(m, s, boft.run_groups(s, nb, x.element_size()), 3)
    singles = any(k == 1 for _, k in units)
    assert splits and all(n > 1 if singles else n == 1 for n in splits), (units, splits)


def test_composed_matrices_are_the_stage_product():
    """``composed_matrices`` of a 3-stage unit against the product of the three stages'
    permuted block-diagonal matrices built densely from the run-basis group matrices: applied
    to every unit group's box of a random x, the same values as the stages one by one (fp64)."""
    m, nb, s = 3, 8, 32
    runs = boft.run_groups(s, nb, 4)
    GC, gps = runs[0], nb // runs[1]
    g = torch.Generator().manual_seed(3)
    f = torch.randn(m * gps, GC, GC, generator=g, dtype=torch.float64)
    hi = f.float()
    lo = (f - hi.double()).float()
    jh, jl = boft_compose.composed_matrices(hi, lo, 0, 3, s, GC, gps, torch.float32)
    C, H = nb * s, GC // 2
    x = torch.randn(5, C, generator=g, dtype=torch.float64)
    u = x.clone()
    for i in range(m):  # stage i on the run view (NP, C/2κ, 2, κ): group q is the box [seg, 0:2, j0:j0+H]
        kappa = (s // 2) << i
        v = u.view(5, C // (2 * kappa), 2, kappa).clone()
        for q in range(gps):
            seg, j0 = (q * GC) // (2 * kappa), ((q * GC) % (2 * kappa)) // 2
            box = v[:, seg, :, j0:j0 + H].reshape(5, GC)
            v[:, seg, :, j0:j0 + H] = (box @ f[i * gps + q].T).view(5, 2, H)
        u = v.view(5, C)
    W, kappa = 8 * H, s // 2
    v = x.view(5, C // (8 * kappa), 8, kappa).clone()
    j = jh.double() + jl.double()
    for q in range(j.shape[0]):
        seg, j0 = (q * W) // (8 * kappa), ((q * W) % (8 * kappa)) // 8
        v[:, seg, :, j0:j0 + H] = (v[:, seg, :, j0:j0 + H].reshape(5, W) @ j[q].T).view(5, 8, H)
    assert torch.allclose(v.view(5, C), u, rtol=0, atol=1e-9), (v.view(5, C) - u).abs().max()
