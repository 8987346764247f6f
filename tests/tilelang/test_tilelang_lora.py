"""TileLang LoRA/LoCon and tucker kernels (lycoris_ops/backends/tilelang/kernels/lora.py, tucker.py).

1. Compile check without a GPU: every kernel family compiles for sm_90a (bf16)
   and sm_80 (fp16) with nvcc (``execution_backend="tvm_ffi"``); skipped when
   nvcc is not on PATH. LYCORIS_TILELANG_FULL_COMPILE=1 adds the other two
   (arch, dtype) pairs.
2. CPU twins: the same builders with ``cpu=True`` (local buffers, ``T.grid``)
   compiled for TileLang's C target and driven by the same host code
   (``_common.arch_of(cpu) == "c"``): the op functions end to end on CPU
   tensors — rounding points, rank padding, partial tiles, split-K partials,
   transposed stores, dtype casts, non-contiguous operands — against the eager
   bodies (reference/lora.py), fp32 over the whole case table and fp16 for the
   core contractions (the bypass chain h = x·downᵀ, rounded, then ·upᵀ).
3. On a GPU (skipped here): the op set against the eager bodies in fp16/bf16
   at larger shapes, ranks up to 128.
"""
import inspect

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.tuner.cost import tl_threads  # noqa: E402
from lycoris_ops.reference import lora as REF  # noqa: E402
from lycoris_ops.testing import lora as CASES  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import lora
from lycoris_ops.backends.tilelang import ops
from lycoris_ops.backends.tilelang.kernels import tucker  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import CASE_PARTS, COMPILE_CASES, GPU, case_part, compile_part  # noqa: E402

OPS = ["lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd", "lora_tucker_fwd"]


def compare(op, args, dtype, tol=None):
    harness.compare(ops, REF, op, args, dtype, tol)


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
def test_kernels_compile(arch, dtype, part):
    for family in (lora, tucker):
        for builder, args in compile_part(family.compile_specs(dtype), part):
            k = _common.compile_only(builder, arch, *args)
            assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


def test_without_warp_specialization_reaches_the_compiler(monkeypatch):
    """A prim_func marked by ``_common.without_warp_specialization`` (``bypass_fwd_kernel``; and
    every kernel under ``LYCORIS_TILELANG_WS=off``: ``WARP_SPECIALIZE`` False) compiles with
    TileLang's ``tl.disable_warp_specialized``; an unmarked one (``skinny_kernel``) without it."""
    seen = []

    class Recorder:
        @staticmethod
        def compile(func, target, execution_backend, pass_configs):
            seen.append(pass_configs)

    monkeypatch.setattr(_common, "tl", lambda: Recorder)
    fwd = (45, 29, 5, "float16", None, "float16", 64, 128, 64, 2, 128, True)
    skinny = (29, None, 16, 5, True, False, False, True, "float16", "float16")
    _common.compile_only(lora.bypass_fwd_kernel, "sm_90a", *fwd)  # marked
    _common.compile_only(lora.skinny_kernel, "sm_90a", *skinny)  # unmarked
    monkeypatch.setattr(_common, "WARP_SPECIALIZE", False)
    _common.compile_only(lora.skinny_kernel, "sm_90a", *skinny)
    assert [c.get("tl.disable_warp_specialized", False) for c in seen] == [True, False, True]
    assert all(c["tl.device_compile_flags"] == _common.GPU_PASS_CONFIGS["tl.device_compile_flags"] for c in seen)


# ----------------------------------------------------------------------------- 2. CPU twins

def test_opset_signatures():
    for op in OPS:
        params = list(inspect.signature(getattr(ops, op)).parameters)
        schema = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]
        assert params == schema, op


@pytest.mark.cpu_only
@pytest.mark.parametrize("part", CASE_PARTS)
def test_twin_case_table_fp32(part):
    for case in case_part(CASES.cases(torch.float32, "cpu", False, torch.Generator().manual_seed(0)), part):
        compare(case.op, case.args, torch.float32)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_core_fp16():
    """The bypass chain (h rounded to fp16 before ·upᵀ), its backward and the hada merge in fp16."""
    keep = {"bypass", "bypass-base-nc", "bypass-mixed_fp32", "bypass_bwd", "merge-hada", "tucker-1chain"}
    n = 0
    for case in CASES.cases(torch.float16, "cpu", False, torch.Generator().manual_seed(1)):
        if case.id in keep:
            compare(case.op, case.args, torch.float16)
            n += 1
    assert n == len(keep)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_split_k():
    """Enough tokens for the split-K partial path of the skinny kernel (g_up, g_down) and
    several O ranges per token tile in the forward."""
    g = torch.Generator().manual_seed(2)
    T, I, O, r = 200, 19, 37, 5
    x, G = torch.randn(T, I, generator=g), torch.randn(T, O, generator=g)
    up, down = torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)
    compare("lora_bypass_bwd", (G, x, up, down, 0.6), torch.float32)
    compare("lora_bypass_fwd", (x, up, down, -0.9, torch.randn(T, O, generator=g)), torch.float32)
    Gw = torch.randn(O, 300, generator=g)
    compare("lora_merge_bwd", (Gw, up, torch.randn(r, 300, generator=g), 1.1), torch.float32)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_merge_bwd_steps_to_skinny(monkeypatch):
    """``merge_bwd`` runs the pair kernel, and the two skinny products where no pair tile fits
    shared memory (rank 200: Rp = 256), both against eager."""
    calls = []
    real = lora.skinny
    monkeypatch.setattr(lora, "skinny", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(6)
    for O, I, r in ((70, 45, 9), (40, 33, 200)):
        G, up, down = torch.randn(I, O, generator=g).t(), torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)
        n = len(calls)
        compare("lora_merge_bwd", (G, up, down, 0.8), torch.float32)
        assert len(calls) - n == (2 if r == 200 else 0), r


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_twin_merge_bwd_pair(dtype):
    """``lora_merge_bwd`` through the one-launch pair kernel: row bands of both products,
    partial last bands (O, I not multiples of BM), rank padding, a transposed G; the CPU twin
    without a GPU, the real kernel on one."""
    if GPU and dtype == torch.float32:
        pytest.skip("fp32 is outside the TileLang scope on a GPU (it would run as TF32)")
    g = torch.Generator().manual_seed(5)
    dev = "cuda" if GPU else "cpu"
    for O, I, r in ((37, 300, 5), (130, 70, 17), (64, 64, 16)) if not GPU else ((200, 1000, 8), (3072, 517, 64)):
        up = torch.randn(O, r, generator=g).to(dev, dtype)
        down = torch.randn(r, I, generator=g).to(dev, dtype)
        for G in (torch.randn(O, I, generator=g), torch.randn(I, O, generator=g).t()):
            compare("lora_merge_bwd", (G.to(dev, dtype), up, down, -0.7), dtype)


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("with_base", [True, False], ids=["base", "nobase"])
@pytest.mark.parametrize("per,pipe_o,built_as", [(5, True, (True, 0)), (3, True, (True, 3)), (3, False, (False, 0))],
                         ids=["one-group", "groups", "serial"])
def test_twin_bypass_fwd_o_loop(per, pipe_o, built_as, with_base, monkeypatch):
    """The forward's O loop at partial T and O tiles (5 O tiles): pipelined over all of them
    where one group holds them, over groups of a static size where they are split (2 groups of
    3: the second group's last step redoes the last tile, the clamp), serial with a config's
    ``pipe_o`` False; the built kernel's (pipelined, static group) arguments say which."""
    built = bypass_fwd_twin(monkeypatch, per, dict(BT=16, BO=8, BK=16, pipe_o=pipe_o), with_base)
    assert tuple(built[-1][-2:]) == built_as, built[-1]


def bypass_fwd_twin(monkeypatch, per, cfg, with_base):
    """``lora.bypass_fwd`` (CPU twin, x non-contiguous, partial T and O tiles, O tiles ``per``
    a group) at ``cfg`` against eager; returns the argument tuples of its ``kernel`` lookups."""
    monkeypatch.setattr(lora, "_per", lambda tiles, other, device: per if per else tiles)
    built = []
    real = lora.kernel
    monkeypatch.setattr(lora, "kernel", lambda b, *a: built.append(a) or real(b, *a))
    g = torch.Generator().manual_seed(5)
    T, I, O, r = 70, 19, 37, 5
    x = torch.randn(I, T, generator=g).t()
    up, down = torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)
    base = torch.randn(T, O, generator=g) if with_base else None
    got = lora.bypass_fwd(x, up, down, -0.9, base, cfg=cfg)
    want = REF.lora_bypass_fwd(x, up, down, -0.9, base)
    assert harness.rel_err(got, want) <= harness.REL_TOL[torch.float32]
    assert built
    return built


@pytest.mark.cpu_only
def test_twin_bypass_fwd_quick_twin(monkeypatch):
    """The cold call's quick twin of the forward (``TL_QUICK``: ``pipe_o`` off and 2 stages in
    the cfg, over ``BYPASS_FWD``): the serial O loop is built
    where the fixed form pipelines it (one group holds the 5 O tiles), and agrees with eager."""
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora

    built = bypass_fwd_twin(monkeypatch, 0, plans_lora.TL_QUICK["lora_bypass_fwd"](dict(BT=16, BO=8, BK=16)), False)
    assert (built[-1][-4], built[-1][-2]) == (2, False), built[-1]  # 2 stages, the O loop serial
    built = bypass_fwd_twin(monkeypatch, 0, dict(BT=16, BO=8, BK=16), False)
    assert built[-1][-2] is True  # the fixed config pipelines it


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("per", [3, 5], ids=["groups", "one-group"])
def test_twin_bypass_bwd_i_loop(per, monkeypatch):
    """The backward token kernel's gx loop at partial T and I tiles: 5 I tiles, in 2 serial
    groups of 3 (the clamp) or one pipelined group."""
    monkeypatch.setattr(lora, "_per", lambda tiles, other, device: per)
    g = torch.Generator().manual_seed(7)
    T, I, O, r = 70, 37, 19, 5
    x, G = torch.randn(I, T, generator=g).t(), torch.randn(T, O, generator=g)
    up, down = torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)
    got = lora.bypass_bwd(G, x, up, down, 0.6, cfg=dict(BT=16, BI=8, BK=16, sBM=16, sBK=16))
    want = REF.lora_bypass_bwd(G, x, up, down, 0.6)
    for k, (a, b) in enumerate(zip(got, want)):
        assert harness.rel_err(a, b) <= harness.REL_TOL[torch.float32], k


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", ["plain", "hada", "sum"])
def test_twin_merge_gemm(mode):
    """The merge by ``gemm_kernel`` (a tuned config with ``BK``) at partial tiles, with an fp32
    base under fp32 factors and without a base."""
    g = torch.Generator().manual_seed(6)
    O, I, r = 37, 45, 5
    f = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g))
    f2 = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)) if mode != "plain" else (None, None)
    for base in (torch.randn(O, I, generator=g), None):
        got = lora.merge_fwd(f[0], f[1], f2[0], f2[1], base, 0.8, mode, cfg=dict(BM=16, BN=16, BK=16))
        want = REF.lora_merge_fwd(f[0], f[1], f2[0], f2[1], base, 0.8, mode, None)
        assert harness.rel_err(got, want) <= harness.REL_TOL[torch.float32], (mode, base is None)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["plain", "hada", "sum"])
def test_twin_merge_stream(mode, dtype, monkeypatch):
    """The streamed merge (``merge_stream_kernel``: row tiles through a pipelined loop, a
    stripe's B tiles loaded once) at partial row and column tiles, groups of 3 row tiles of 10
    (the last group redoes the last tile), ranks 5 and 9 (sum: two different ranks), an fp32
    base, no base, an fp32 output; the CPU twin without a GPU, the real kernel on one."""
    if GPU and dtype == torch.float32:
        pytest.skip("fp32 is outside the TileLang scope on a GPU (it would run as TF32)")
    monkeypatch.setattr(lora, "MERGE_STREAM", dict(BM=16, BN=32, stages=2, threads=128))
    monkeypatch.setattr(lora, "_per", lambda tiles, other, device: 3)
    calls = []
    real = lora.kernel
    monkeypatch.setattr(lora, "kernel", lambda b, *a: calls.append(b.__name__) or real(b, *a))
    g = torch.Generator().manual_seed(9)
    dev = "cuda" if GPU else "cpu"
    O, I, r, r2 = 150, 70, 5, (9 if mode == "sum" else 5)

    def m(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dev, dt)

    f, f2 = (m(O, r), m(r, I)), ((m(O, r2), m(r2, I)) if mode != "plain" else (None, None))
    for base, odt in ((m(O, I, dt=torch.float32), None), (None, None), (m(I, O).t(), torch.float32)):
        del calls[:]
        got = lora.merge_fwd(f[0], f[1], f2[0], f2[1], base, 0.8, mode, odt)
        want = REF.lora_merge_fwd(f[0], f[1], f2[0], f2[1], base, 0.8, mode, odt)
        assert calls == ["merge_stream_kernel"], calls
        assert got.dtype == want.dtype and got.shape == want.shape
        assert harness.rel_err(got, want) <= harness.REL_TOL[dtype], (mode, base is None, odt)


@pytest.mark.cpu_only
def test_twin_merge_stream_steps_to_the_gemm(monkeypatch):
    """The streamed merge where its tile does not fit shared memory (``stream_smem``), or with a
    tuned GEMM tile (a config with ``BK``: the planner's timed GEMM form), runs ``gemm_kernel``."""
    calls = []
    real = lora.kernel
    monkeypatch.setattr(lora, "kernel", lambda b, *a: calls.append(b.__name__) or real(b, *a))
    g = torch.Generator().manual_seed(11)
    O, I, r = 70, 45, 6
    f = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g))
    base = torch.randn(O, I, generator=g)
    need = lora.stream_smem(64, 128, 2, r, None, 4, 4, 4)
    want = REF.lora_merge_fwd(f[0], f[1], None, None, base, 0.8, "plain", None)
    for limit, cfg, kern in ((need, None, "merge_stream_kernel"), (need - 1, None, "gemm_kernel"),
                             (need, dict(BM=16, BN=16, BK=16), "gemm_kernel")):
        monkeypatch.setattr(lora, "smem_limit", lambda dev, lim=limit: lim)
        del calls[:]
        got = lora.merge_fwd(f[0], f[1], None, None, base, 0.8, "plain", cfg=cfg)
        assert calls == [kern], (limit, cfg, calls)
        assert harness.rel_err(got, want) <= harness.REL_TOL[torch.float32]


#: non-default tiles of the four tuned ops, inside the spaces of tuning/lora.py (``tl_plan_*``,
#: ``TL_SKINNY``, ``TL_TOKEN``): at the sizes below every tile is partial somewhere
TILE_CFGS = {
    "lora_bypass_fwd": dict(BT=128, BO=64, BK=32, stages=3, threads=256),
    "lora_bypass_bwd": dict(BT=64, BI=64, BK=32, stages=2, threads=0, sBM=64, sBK=32),
    "lora_merge_fwd": dict(BM=64, BN=64, BK=16, stages=3, threads=128),
    "lora_merge_bwd": dict(BM=64, BK=32, stages=2, threads=128),
}


def _tile_case(op, dtype, device="cpu"):
    """(args) of ``op`` at odd sizes with a non-contiguous activation / gradient."""
    g = torch.Generator().manual_seed(11)

    def m(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype).to(device)

    T, I, O, r = 150, 45, 77, 5
    x = m(I, T).t()  # non-contiguous
    up, down = m(O, r, scale=r ** -0.5), m(r, I, scale=I ** -0.5)
    return {
        "lora_bypass_fwd": (x, up, down, 0.7, m(T, O)),
        "lora_bypass_bwd": (m(O, T).t(), x, up, down, -0.6),
        "lora_merge_fwd": (up, down, None, None, m(O, I), 1.3, "plain", None),
        "lora_merge_bwd": (m(I, O).t(), up, down, 0.9),
    }[op]


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("op", sorted(TILE_CFGS))
def test_twin_tile_configs(op):
    """The launchers honour a tuned ``cfg`` (tile sizes; threads and stages are GPU-only)."""
    _check_tile_config(op, torch.float32, "cpu")


def _check_tile_config(op, dtype, device):
    """``op``'s launcher with ``TILE_CFGS[op]`` against the eager body."""
    args = _tile_case(op, dtype, device)
    fn = getattr(lora, op.split("_", 1)[1])
    got = harness.outs(fn(*args, cfg=TILE_CFGS[op]))
    want = harness.outs(getattr(REF, op)(*args))
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (op, k)
        assert harness.rel_err(a, b) <= harness.REL_TOL[dtype], (op, k, harness.rel_err(a, b))


TUCKER_CFGS = [dict(BO=128, BI=64, threads=256), dict(BO=64, BI=256, threads=128)]


def _tucker_case(dtype, device, two):
    g = torch.Generator().manual_seed(12)

    def m(*s):
        return (torch.randn(*s, generator=g) * 0.3).to(dtype).to(device)

    O, I, Kk, r = 70, 45, 9, 5
    chain = (m(r, O).t(), m(r, r, Kk), m(r, I))  # a transposed a1 (as LoHa passes it)
    return chain + ((m(O, r), m(r, r, Kk), m(r, I)) if two else (None, None, None)) + (0.7,)


#: TUCKER_CFGS stage past ``all_k_fits`` at fp32 (the twins' dtype): the per-κ kernel runs
#: there; bi32's staged tile (72 KB at fp32) fits: the all-κ kernel
TUCKER_TWIN_CFGS = TUCKER_CFGS + [dict(BO=64, BI=32, threads=128)]


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("cfg", TUCKER_TWIN_CFGS, ids=["bo128-t256", "bi256", "bi32"])
@pytest.mark.parametrize("two", [False, True], ids=["1chain", "2chains"])
def test_twin_tucker_tile_configs(two, cfg, monkeypatch):
    """Both kernels (``tucker_pre_kernel``: every κ of a tile in one program over a·t
    precomputed, the output staged, where that fits ``all_k_fits``; else the per-κ
    ``tucker_kernel``) against the reference, partial tiles in O and I (70 x 45 x 9); a spy
    checks which kernel ran."""
    built = []
    real = tucker.kernel

    def spy(builder, arch, *a):
        built.append((builder, a))
        return real(builder, arch, *a)

    monkeypatch.setattr(tucker, "kernel", spy)
    args = _tucker_case(torch.float32, "cpu", two)
    got, want = tucker.tucker_fwd(*args, cfg=cfg), REF.lora_tucker_fwd(*args)
    assert got.shape == want.shape and harness.rel_err(got, want) <= harness.REL_TOL[torch.float32]
    (builder, a), = built
    assert builder is (tucker.tucker_pre_kernel if cfg["BI"] == 32 else tucker.tucker_kernel), a


def test_tucker_all_k_fits():
    """``all_k_fits``: the staged output tile plus the chains' operand tiles within _ALL_K_SMEM."""
    assert tucker.all_k_fits(64, 64, 9, 64, 64, 2, 2, 2)  # 64 KB + 72 KB
    assert not tucker.all_k_fits(128, 256, 9, 64, 64, 1, 2, 2)  # the staged tile alone is 576 KB
    assert not tucker.all_k_fits(64, 64, 9, 64, 64, 2, 2, 4)  # fp32 output: 64 + 144 KB


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TUCKER_CFGS + [dict(BO=64, BI=64, threads=128)], ids=["bo128-t256", "bi256", "fixed"])
def test_gpu_tucker_tile_configs(cfg):
    """The per-κ kernel (the first two tiles: their staging does not fit) and the all-κ one."""
    args = _tucker_case(torch.bfloat16, "cuda", True)
    got, want = tucker.tucker_fwd(*args, cfg=cfg), REF.lora_tucker_fwd(*args)
    assert harness.rel_err(got, want) <= harness.REL_TOL[torch.bfloat16]


@pytest.mark.slow
@pytest.mark.nvcc
def test_tucker_tile_space_corners_compile_sm90a(monkeypatch):
    """Every (BO, threads) of the tucker TileLang space with the widest and narrowest BI, one
    and two chains, compiles for sm_90a (3x3 conv, 3072 channels, rank 32): the configs whose
    staging fits take the all-κ kernel, the others the per-κ one."""
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.backends.tilelang.tuning import tucker as plans_tucker

    monkeypatch.setattr(tucker, "arch_of", lambda d: "sm_90a")
    sp = plans_tucker.TL_SPACE
    bf = torch.bfloat16
    a, t, b = torch.empty(3072, 32, dtype=bf), torch.empty(32, 32, 9, dtype=bf), torch.empty(32, 3072, dtype=bf)
    with _common.capturing() as pending:
        for chains in ((a, t, b, None, None, None), (a, t, b, a, t, b)):
            for bo in sp["BO"]:
                for th in tl_threads(sp["threads"], bo):
                    for bi in (min(sp["BI"]), max(sp["BI"])):
                        tl_pick._call(tucker.tucker_fwd, chains + (1.0,), dict(BO=bo, BI=bi, threads=th))
        # a rank below 32 with two warpgroups: the a·t GEMM's 16-wide B tile (once rejected by wgmma)
        a5, t5, b5 = torch.empty(3072, 5, dtype=bf), torch.empty(5, 5, 9, dtype=bf), torch.empty(5, 3072, dtype=bf)
        tl_pick._call(tucker.tucker_fwd, (a5, t5, b5, a5, t5, b5, 1.0), dict(BO=128, BI=64, threads=256))
    failed = harness.compile_failures(pending)
    assert len(pending) == 13 and not failed, failed
    assert {p.builder for p in pending} == {tucker.tucker_kernel, tucker.tucker_pre_kernel}


def _sm90a_bench_calls(monkeypatch):
    """op -> (launcher, args) at the first bench shape (T=8192, 3072x3072, r=32, bf16), the
    launchers seeing an H200 (sm_90a, 132 SMs) so that capturing lists its kernels."""
    monkeypatch.setattr(lora, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(lora, "num_sms", lambda d: 132)
    bf = torch.bfloat16
    T, I, O, R = 8192, 3072, 3072, 32
    x, up, down = torch.empty(T, I, dtype=bf), torch.empty(O, R, dtype=bf), torch.empty(R, I, dtype=bf)
    g, w = torch.empty(T, O, dtype=bf), torch.empty(O, I, dtype=bf)
    return {"lora_bypass_fwd": (lora.bypass_fwd, (x, up, down, 1.0, None)),
            "lora_bypass_bwd": (lora.bypass_bwd, (g, x, up, down, 1.0)),
            "lora_merge_fwd": (lora.merge_fwd, (up, down, None, None, w, 1.0, "plain", None)),
            "lora_merge_bwd": (lora.merge_bwd, (w, up, down, 1.0))}


@pytest.mark.slow
@pytest.mark.nvcc
def test_h200_shortlists_compile_sm90a(monkeypatch):
    """Every tile config the TileLang models shortlist for an H200 at the first bench shape
    (T=8192, 3072x3072, r=32, bf16) compiles for sm_90a: the kernels a cold key builds."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora
    from lycoris_ops.backends.tilelang import runner as tl_pick

    calls = _sm90a_bench_calls(monkeypatch)
    dev = device.synthetic()
    with _common.capturing() as pending:
        for op, (fn, args) in calls.items():
            for c in plans_lora.TILELANG[op][0](dev, *args).candidates[:-1]:
                tl_pick._call(fn, args, c)
    assert len(pending) >= 8
    for p in pending:
        k = _common.compile_only(p.builder, p.arch, *p.args)
        assert "__global__" in k.get_kernel_source(), (p.builder.__name__, p.args)


def _space_corners():
    """(op, cfg): per TileLang LoRA tile space (tuning/lora.py), every combination of its
    row tile, stages and threads, each with the largest and the smallest other tiles."""
    from lycoris_ops.backends.tilelang.tuning import lora as P

    out = [("lora_merge_fwd", dict(lora.MERGE_FWD))]  # the GEMM form's one config
    for op, sp, row, others in (("lora_bypass_fwd", P.TL_BYPASS_FWD, "BT", ("BO", "BK")),):
        for r in sp[row]:
            for st in sp["stages"]:
                for th in tl_threads(sp["threads"], r):
                    for pick in (max, min):
                        out.append((op, {row: r, "stages": st, "threads": th, **{k: pick(sp[k]) for k in others}}))
    ms = P.TL_MERGE_STREAM
    for bn in ms["BN"]:
        out.append(("lora_merge_fwd", dict(BM=max(ms["BM"]), BN=bn, stages=max(ms["stages"]), threads=max(ms["threads"]))))
    tok, sk = P.TL_TOKEN, P.TL_SKINNY
    for pick in (max, min):
        out.append(("lora_bypass_bwd", dict(BT=pick(tok["BT"]), BI=pick(tok["BI"]), BK=pick(tok["BK"]),
                                            stages=pick(tok["stages"]), threads=pick(tok["threads"]),
                                            sBM=pick(sk["BM"]), sBK=pick(sk["BK"]))))
        pr = P.TL_PAIR
        out.append(("lora_merge_bwd", dict(BM=pick(pr["BM"]), BK=pick(pr["BK"]), stages=pick(pr["stages"]),
                                           threads=pick(pr["threads"]))))
    return out


@pytest.mark.slow
@pytest.mark.nvcc
def test_tile_space_corners_compile_sm90a(monkeypatch):
    """Every corner of the TileLang LoRA tile spaces compiles for sm_90a at the first bench
    shape: TileLang's lowering rejects some combinations (3 stages over a runtime K loop,
    256 threads with a transposed operand), and those fail here as on the H200."""
    from lycoris_ops.backends.tilelang import runner as tl_pick

    calls = _sm90a_bench_calls(monkeypatch)
    with _common.capturing() as pending:
        for op, cfg in _space_corners():
            fn, args = calls[op]
            tl_pick._call(fn, args, cfg)
    failed = harness.compile_failures(pending)
    assert not failed, failed


# ----------------------------------------------------------------------------- 3. GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,r", [(torch.bfloat16, 8), (torch.float16, 128), (torch.bfloat16, 100)],
                         ids=["bf16-r8", "fp16-r128", "bf16-r100"])
def test_gpu_parity(dtype, r):
    """Each (dtype, rank) compiles ~15 kernels on a cold cache (3-10 s each); T is dynamic."""
    g = torch.Generator().manual_seed(r)

    def m(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt).cuda()

    for T in (1, 333, 4100):
        I, O = 320, 200
        x, up, down = m(T, I), m(O, r) / r ** 0.5, m(r, I) / I ** 0.5
        compare("lora_bypass_fwd", (x, up, down, 0.7), dtype)
        compare("lora_bypass_fwd", (x, up, down, 0.7, m(T, O, dt=torch.float32)), dtype)
        compare("lora_bypass_bwd", (m(T, O), x, up, down, 0.7), dtype)
    a1, b1, a2, b2 = m(300, r), m(r, 260), m(300, r), m(r, 260)
    for mode in ("plain", "hada", "sum"):
        compare("lora_merge_fwd", (a1, b1, a2, b2, m(300, 260), 0.5, mode), dtype)
    compare("lora_merge_fwd", (a1, b1, None, None, None, 0.5, "plain", torch.float32), dtype)
    compare("lora_merge_bwd", (m(300, 260), a1, b1, 1.3), dtype)
    R = min(r, 64)
    compare("lora_tucker_fwd", (m(48, R), m(R, R, 9), m(R, 40), None, None, None, 0.7), dtype)
    compare("lora_tucker_fwd", (m(R, 48).t(), m(R, R, 9), m(R, 40), m(48, R), m(R, R, 9), m(R, 40), 0.7), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(TILE_CFGS))
def test_gpu_tile_configs(op):
    """Each tuned op with a non-default tile config on the GPU, bf16 (the forward's: two
    warpgroups, 3 stages)."""
    _check_tile_config(op, torch.bfloat16, "cuda")
