"""TileLang diag-OFT kernels (lycoris_ops/backends/tilelang/kernels/oft.py): Cayley, apply, backward
stream and chain families.

1. Compile check without a GPU: every kernel family compiles for sm_90a and sm_80
   (``execution_backend="tvm_ffi"``, nvcc on PATH); (sm_90a, bf16) and (sm_80,
   fp16) by default, the full dtype x arch matrix with
   LYCORIS_TILELANG_FULL_COMPILE=1. On sm_90a the 16-bit apply GEMM must lower to
   wgmma.
2. ``oft_fwd`` / ``oft_bwd`` end to end against the eager reference run in fp64:
   on a GPU the real kernels (fp32, fp16, bf16); without one the CPU twins (the
   same builders with ``cpu=True``: local buffers, serial loops, fp32, TileLang's
   C target) behind the same host code — this checks the per-block Gauss–Jordan
   Cayley solve, the group packing, both layouts, the partial reduction and the
   chain algebra.
"""

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.reference import oft as R_OFT  # noqa: E402
from lycoris_ops.testing import REL_TOL, rel_err  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import oft  # noqa: E402
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


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
def test_kernels_compile(arch, dtype, part):
    for builder, args in compile_part(oft.compile_specs(dtype), part):
        src = _common.compile_only(builder, arch, *args).get_kernel_source()
        assert "__global__" in src, (builder.__name__, args)
        cdt = {oft.apply_kernel: 3, oft.apply_direct_kernel: 2}.get(builder)
        cf_direct = builder is oft.apply_direct_kernel and len(args) > 7 and args[7]  # (GP, BT) = (32, ·): mma
        if arch == "sm_90a" and cdt is not None and args[cdt] != "float32" and not cf_direct:
            assert "wgmma" in src, f"the 16-bit {builder.__name__} GEMM should lower to wgmma on sm_90a"


# (K, S, x shape, weight, with rescale, shift): channels last, weight rows, conv channels;
# S = 5 (6 blocks per 32-wide group), 19 (one block, padded), 40 (64-wide group)
CASES = [
    (7, 5, (37, 35), False, True, True),
    (7, 5, (37, 35), False, False, False),
    (7, 5, (35, 19), True, True, True),
    (7, 5, (2, 35, 3, 5), False, False, True),
    (3, 19, (21, 57), False, True, False),
    (2, 40, (80, 9), True, False, True),
    # S divides the 32-wide group, channels last: the direct apply (T.copy tiles); 72 channels
    # leave the last group partial and 37 positions the last tile
    (9, 8, (37, 72), False, True, True),
    (4, 16, (50, 64), False, False, False),
    # the same, channels first: weight rows (72 channels, 40 columns: a partial last group and
    # tail tile) and conv activations (3 pre indices, 24 positions): the channels-first direct
    # kernels; 37 columns (rows of 74 bytes at 16 bits: no TMA row stride) take the gather path
    (9, 8, (72, 40), True, True, True),
    (4, 16, (3, 64, 4, 6), False, False, True),
    (9, 8, (72, 37), True, False, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[IDS[d] for d in DTYPES])
@pytest.mark.parametrize("K,S,shape,weight,has_rs,shift", sweep(CASES, quick=(0, 8)),  # gather, direct
                         ids=[f"K{c[0]}S{c[1]}-{'w' if c[3] else len(c[2])}d-{'rs' if c[4] else 'nors'}-"
                              f"{'shift' if c[5] else 'rot'}" for c in CASES])
def test_oft(K, S, shape, weight, has_rs, shift, dtype):
    g = torch.Generator().manual_seed(K * 100 + S)
    blocks = (0.2 * torch.randn(K, S, S, generator=g)).to(DEV)  # fp32 blocks (Cayley in fp32)
    rescale = (torch.rand(K * S, 1, generator=g) + 0.5).to(DEV) if has_rs else None
    x = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    if len(shape) == 2 and not weight:
        x = torch.randn(shape[1], shape[0], generator=g).to(dtype).to(DEV).t()  # non-contiguous activation
    grad = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    cscale = 0.8
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    y = oft.oft_fwd(blocks, x, rescale, cscale, shift, weight)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    check(y, R_OFT.oft_fwd(b6, x6, r6, cscale, shift, weight), dtype, "oft_fwd")
    gx, gb, gr = oft.oft_bwd(grad, blocks, x, rescale, cscale, shift, weight)
    rx, rb, rr = R_OFT.oft_bwd(g6, b6, x6, r6, cscale, shift, weight)
    assert gx.dtype == x.dtype and gb.dtype == blocks.dtype and gr.dtype == blocks.dtype
    assert gr.shape == ((K * S,) if has_rs else (0,))
    check(gx, rx, dtype, "oft_bwd gx")
    check(gb, rb, dtype, "oft_bwd g_blocks")
    if has_rs:
        check(gr, rr, dtype, "oft_bwd g_rescale")


def test_direct_kernels_need_rows_of_16_bytes():
    """The direct kernels' rows (channels last: C; channels first: the positions) must be a
    multiple of 16 bytes (TMA descriptors refuse 74-byte rows), else the gather path."""
    bf, f32 = torch.bfloat16, torch.float32
    assert oft.direct_apply(True, 32, 32, bf, bf, "sm_90a", 40)
    assert not oft.direct_apply(True, 32, 32, bf, bf, "sm_90a", 37)
    assert oft.direct_apply(False, 32, 32, bf, bf, "sm_90a", 72)
    assert not oft.direct_apply(False, 32, 32, bf, bf, "sm_90a", 36)  # S = 4, K = 9
    assert not oft.direct_apply(False, 32, 30, bf, bf, "sm_90a", 72)  # a group slot without a channel
    assert not oft.direct_apply(False, 32, 32, f32, f32, "sm_90a", 72)  # fp32: the TF32 split
    assert oft.direct_apply(False, 32, 32, f32, f32, _common.CPU_ARCH, 36)
    assert not oft.direct_apply(True, 32, 32, f32, f32, _common.CPU_ARCH, 37)


#: the direct-path cases of CASES (16-bit rows of 16-byte multiples; the CPU twins at fp32)
DIRECT_CASES = [(9, 8, (37, 72), False, True, True), (4, 16, (50, 64), False, False, False),
                (9, 8, (72, 40), True, True, True), (4, 16, (3, 64, 4, 6), False, True, False)]


def spy_kernels(monkeypatch) -> list:
    """(builder name, builder args) of every kernel ``tilelang.oft``'s launchers fetch."""
    seen, real = [], oft.kernel

    def spy(builder, arch, *args):
        seen.append((builder.__name__, args))
        return real(builder, arch, *args)

    monkeypatch.setattr(oft, "kernel", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "cayley-launch"])
@pytest.mark.parametrize("K,S,shape,weight,has_rs,shift", DIRECT_CASES,
                         ids=["cl-rs-shift", "cl-rot", "cf-w-rs-shift", "cf-conv-rs"])
def test_direct_kernels_solve_cayley(K, S, shape, weight, has_rs, shift, fuse, monkeypatch):
    """Where ``fuse_cayley`` allows (always on a CPU twin) the direct kernels solve their
    group's Cayley transform in their prologue (no F pair in memory, no Cayley launch); where
    it does not (on sm_90a, a pipeline that would not fit shared memory: forced here) the
    Cayley launch runs, then the direct kernels read the F pair. The same results as the
    reference either way, forward and backward, both layouts, a partial last group, rescale
    and shift on and off."""
    if not fuse:
        monkeypatch.setattr(oft, "fuse_cayley", lambda *a: False)
    seen = spy_kernels(monkeypatch)
    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(K * 31 + S)
    blocks = (0.2 * torch.randn(K, S, S, generator=g)).to(DEV)
    rescale = (torch.rand(K * S, 1, generator=g) + 0.5).to(DEV) if has_rs else None
    x = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    grad = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    check(oft.oft_fwd(blocks, x, rescale, 0.8, shift, weight), R_OFT.oft_fwd(b6, x6, r6, 0.8, shift, weight), dtype,
          "oft_fwd")
    got = oft.oft_bwd(grad, blocks, x, rescale, 0.8, shift, weight)
    for what, a, b in zip(("gx", "g_blocks", "g_rescale"), got, R_OFT.oft_bwd(g6, b6, x6, r6, 0.8, shift, weight)):
        if what != "g_rescale" or has_rs:
            check(a, b, dtype, f"oft_bwd {what}")
    names = [n for n, _ in seen]
    assert names == (["apply_direct_kernel", "stream_direct_kernel", "chain_kernel"] if fuse else
                     ["cayley_kernel", "apply_direct_kernel", "cayley_kernel", "stream_direct_kernel",
                      "chain_kernel"]), names
    solve = (_common.tl_dtype(blocks.dtype), "float32", S, has_rs)
    assert all((args[-1] == solve) == fuse for n, args in seen if n.endswith("direct_kernel"))


def test_fused_split_is_one_wave(monkeypatch):
    """The fused kernels' position split: one wave of ``FUSED_PER_SM`` programs an SM (at least
    one program a group, at most one a tile); the separate-launch kernels' aims at about
    ``SPLIT_PER_SM`` an SM."""
    monkeypatch.setattr(oft, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    for groups, tiles in ((128, 32), (96, 64), (40, 256), (300, 8), (4, 2)):
        nsplit, tps = oft.tiling(False, tiles * 128, 1, 128, groups, cpu, True)
        assert groups * nsplit <= max(132, groups) and nsplit * tps >= tiles > (nsplit - 1) * tps
        many, _ = oft.tiling(False, tiles * 128, 1, 128, groups, cpu)
        assert many >= nsplit
    assert oft.tiling(True, 1, 4096, 128, 128, cpu, True) == (1, 32)  # the merge shape: 128 groups of 32 tiles


def test_fuse_cayley_needs_its_pipeline_to_fit(monkeypatch):
    """``fuse_cayley``: only on the direct path; on sm_90a only where the F
    pair plus the larger of the Gauss–Jordan scratch and the pipelined tiles fit 227 KB."""
    assert oft.fuse_cayley(True, "sm_90a", 64, 256, 2, False)  # 16 + 4 x 32 + 32 KB
    assert oft.fuse_cayley(True, "sm_90a", 64, 128, 2, True)  # 16 + 3 x 2 x 16 + 16 KB
    assert not oft.fuse_cayley(False, "sm_90a", 32, 128, 2, False)
    assert oft.fuse_cayley(True, _common.CPU_ARCH, 64, 256, 2, False)
    monkeypatch.setattr(oft, "FUSED_STAGES", dict(fwd=8, bwd=8))
    assert not oft.fuse_cayley(True, "sm_90a", 64, 256, 2, False)  # 16 + 8 x 32 + 32 KB > 227 KB
    assert not oft.fuse_cayley(True, "sm_90a", 64, 128, 2, True)
    assert oft.fuse_cayley(True, "sm_90a", 32, 64, 2, False)


@pytest.mark.slow
@pytest.mark.parametrize("K,S", [(7, 5), (5, 16)], ids=["S5", "S16"])  # 6 blocks of 5 in 32; 2 of 16 in 32
def test_cayley_kernel_blocks(K, S):
    """The Cayley family alone: F (and Fᵀ, and both from one launch) of each packed block equals diag(ρ)·Rᵀ − I,
    the padding and the off-block entries are exactly zero; the Gauss–Jordan steps over the
    blocks' entries alone at S = 16 (2 x 256 >= ``_GJ_ENTRIES_MIN``), over the group at S = 5."""
    GP, NB, GC = oft.group_plan(S)
    g = torch.Generator().manual_seed(5)
    blocks = (0.3 * torch.randn(K, S, S, generator=g)).to(DEV)
    rescale = (torch.rand(K * S, generator=g) + 0.5).to(DEV)
    arch = _common.arch_of(blocks.device)
    r, _ = R_OFT.cayley(blocks.double().cpu(), 0.8, torch.float64)
    want = rescale.double().cpu().view(K, S, 1) * r.transpose(-1, -2) - torch.eye(S, dtype=torch.float64)
    for trans in (False, True, "both"):
        pairs = oft._cayley(blocks, rescale, torch.float32, S, NB, GP, False, False, trans, 0.8, 1.0, 0, 0,
                            -(-K // NB), arch)
        # "both": F's pair then Fᵀ's, from one launch
        for fh, fl, tr in ([(*pairs, trans)] if trans != "both" else [(*pairs[:2], False), (*pairs[2:], True)]):
            f = (fh.double() + fl.double()).cpu()
            mask = torch.zeros_like(f, dtype=torch.bool)
            for k in range(K):
                grp, b = divmod(k, NB)
                blk = f[grp, b * S:(b + 1) * S, b * S:(b + 1) * S]
                assert rel_err(blk.T if tr else blk, want[k]) < 1e-6
                mask[grp, b * S:(b + 1) * S, b * S:(b + 1) * S] = True
            assert f[~mask].abs().max().item() == 0.0


#: non-default (apply, stream) configs inside tuning/oft.py's TileLang spaces (TL_APPLY, TL_STREAM)
TILE_CFGS = [(dict(BT=256, threads=256), dict(BT=32, threads=128)),
             (dict(BT=64, threads=128), dict(BT=128, threads=256))]


@pytest.mark.slow
@pytest.mark.parametrize("fwd_cfg,bwd_cfg", TILE_CFGS, ids=["bt256-bt32", "bt64-bt128"])
@pytest.mark.parametrize("K,S,shape,weight", [(7, 5, (300, 35), False), (7, 5, (2, 35, 9, 17), False)],
                         ids=["cl", "cf"])
def test_tile_configs(K, S, shape, weight, fwd_cfg, bwd_cfg):
    """The launchers honour a tuned ``cfg`` (positions per tile, threads): several tiles per
    program and a tail tile, both layouts; on a GPU the real kernels, else the CPU twins."""
    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(11)
    blocks = (0.2 * torch.randn(K, S, S, generator=g)).to(DEV)
    rescale = (torch.rand(K * S, 1, generator=g) + 0.5).to(DEV)
    x = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    grad = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    b6, x6, r6, g6 = d64(blocks, x, rescale, grad)
    check(oft.oft_fwd(blocks, x, rescale, 0.8, True, weight, cfg=fwd_cfg),
          R_OFT.oft_fwd(b6, x6, r6, 0.8, True, weight), dtype, f"oft_fwd {fwd_cfg}")
    got = oft.oft_bwd(grad, blocks, x, rescale, 0.8, True, weight, cfg=bwd_cfg)
    for what, a, b in zip(("gx", "g_blocks", "g_rescale"), got, R_OFT.oft_bwd(g6, b6, x6, r6, 0.8, True, weight)):
        check(a, b, dtype, f"oft_bwd {what} {bwd_cfg}")


@pytest.mark.slow
@pytest.mark.nvcc
def test_tile_space_corners_compile_sm90a(monkeypatch):
    """The corners of tuning/oft.py's legal TileLang spaces (smallest and largest BT, each
    with its threads) compile for sm_90a: 16-bit and fp32 (TF32 split) GEMMs, 32- and
    64-channel groups; the largest tiles are the ones shared memory and registers allow."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import oft as plans_oft
    from tilelang_harness import compile_calls, corners

    monkeypatch.setattr(oft, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(oft, "num_sms", lambda d: 132)
    dev = device.synthetic()
    calls = []
    # (S, dtype, weight layout): channels last, and a bf16 weight (channels first, direct kernels)
    for S, dt, w in ((32, torch.bfloat16, False), (64, torch.bfloat16, False), (64, torch.float32, False),
                     (32, torch.bfloat16, True)):
        blocks = torch.empty(3072 // S, S, S)
        x = torch.empty((3072, 4096) if w else (8192, 3072), dtype=dt)
        GP = oft.group_plan(S)[0]
        for bwd in (False, True):
            cfgs = plans_oft.tl_configs(dev, GP, 2 if dt != torch.float32 else 4, bwd)
            for c in corners(cfgs):
                calls.append((oft.oft_bwd, (x, blocks, x, None, 1.0, False, w), c) if bwd
                            else (oft.oft_fwd, (blocks, x, None, 1.0, False, w), c))
    captured, failed = compile_calls(calls)
    assert captured >= 20 and not failed, failed


def test_shortlists_for_an_h200():
    """oft_fwd / oft_bwd: the fixed config first, eager last, at most TL_N model configs, all
    legal (inside the space, fitting shared memory: the fp32 backward's 64-channel groups
    never get BT = 128), JSON-serializable; the key keeps the positions bucketed."""
    import json

    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import oft as plans_oft
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.tuner import tune

    dev = device.synthetic()
    for S in (16, 64):
        for dt in (torch.bfloat16, torch.float32):
            blocks, x = torch.empty(3072 // S, S, S), torch.empty(8192, 3072, dtype=dt)
            GP, csize = oft.group_plan(S)[0], 2 if dt != torch.float32 else 4
            for op, args, fixed, bwd in (("oft_fwd", (blocks, x, None, 1.0, False, False), oft.APPLY, False),
                                         ("oft_bwd", (x, blocks, x, None, 1.0, False, False), oft.STREAM, True)):
                cands = list(plans_oft.TILELANG[op][0](dev, *args).candidates)
                assert cands[0] == fixed and tune.is_eager(cands[-1]), (op, cands)
                assert 3 <= len(cands) <= plans_oft.TL_N + 2 and len(set(map(str, cands))) == len(cands), (op, cands)
                for c in cands[1:-1]:
                    assert c in plans_oft.tl_configs(dev, GP, csize, bwd), (op, S, dt, c)
                json.dumps(cands)
    blocks = torch.empty(192, 16, 16)
    a = tl_pick.key_parts((blocks, torch.empty(8192, 3072), None, 1.0, False, False), "oft_fwd")
    assert a[0] == ("sizes", (192, 16, False))  # the positions only in x's bucket
    fp32_s64 = plans_oft.tl_configs(dev, 64, 4, True)
    assert fp32_s64 and all(c["BT"] < 128 for c in fp32_s64)
