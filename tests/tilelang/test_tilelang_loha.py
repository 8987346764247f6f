"""TileLang LoHa kernels (lycoris_ops/backends/tilelang/kernels/loha.py).

1. Compile check without a GPU: every kernel family compiles for sm_90a (bf16)
   and sm_80 (fp16) with nvcc (``execution_backend="tvm_ffi"``); skipped when
   nvcc is not on PATH (LYCORIS_TILELANG_FULL_COMPILE=1: all four pairs).
2. CPU twins (the same builders, ``cpu=True``, C target, same host code): the
   LoHa op functions against the eager bodies (reference/loha.py) over the case
   table in fp32, the core contraction - the ΔW tile regenerated inside the K
   loop, rounded, then multiplied - in fp16, and the materialized-ΔW and
   split-reduction paths.
3. On a GPU (skipped here): the op set against the eager bodies in fp16/bf16.
"""
import inspect

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.tuner.cost import tl_threads  # noqa: E402
from lycoris_ops.reference import loha as REF  # noqa: E402
from lycoris_ops.testing import loha as CASES  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import loha
from lycoris_ops.backends.tilelang import ops  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import CASE_PARTS, COMPILE_CASES, GPU, case_part, compile_part  # noqa: E402

OPS = ["loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd"]


def compare(op, args, dtype, tol=None):
    harness.compare(ops, REF, op, args, dtype, tol)


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
def test_kernels_compile(arch, dtype, part):
    for builder, args in compile_part(loha.compile_specs(dtype), part):
        k = _common.compile_only(builder, arch, *args)
        assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


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
def test_twin_regen_fp16():
    """The regenerated ΔW tile, rounded to fp16 before it multiplies x (forward and gx)."""
    keep = {"bypass", "bypass-mixed_fp32", "bypass_bwd"}
    n = 0
    for case in CASES.cases(torch.float16, "cpu", False, torch.Generator().manual_seed(1)):
        if case.id in keep:
            compare(case.op, case.args, torch.float16)
            n += 1
    assert n == len(keep)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_materialized_and_split(monkeypatch):
    """ΔW materialized once (many tokens) and the split reductions of the factor grads (the
    merge backward's two-job form, taken by gradients past ``PAIR_MAX_ELEMS``)."""
    monkeypatch.setattr(loha, "REGEN_BUDGET", -1)
    monkeypatch.setattr(loha, "PAIR_MAX_ELEMS", 0)
    g = torch.Generator().manual_seed(2)
    T, I, O, r = 11, 19, 37, 5
    f = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g),
         torch.randn(O, r, generator=g), torch.randn(r, I, generator=g))
    x = torch.randn(T, I, generator=g)
    compare("loha_bypass_fwd", (x, *f, 0.8, torch.randn(T, O, generator=g)), torch.float32)
    compare("loha_bypass_bwd", (torch.randn(T, O, generator=g), x, *f, -0.7), torch.float32)
    # a merge gradient with several K tiles on both reductions -> split partials
    O2, I2 = 150, 140
    f2 = (torch.randn(O2, r, generator=g), torch.randn(r, I2, generator=g),
          torch.randn(O2, r, generator=g), torch.randn(r, I2, generator=g))
    compare("loha_merge_bwd", (torch.randn(O2, I2, generator=g), *f2, 0.9), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_twin_merge_bwd_pair(dtype, monkeypatch):
    """``loha_merge_bwd`` through the one-launch pair kernel: bands of both
    gradients with partial last bands (O, I not multiples of BM), rank padding, a transposed G,
    mixed output dtypes, 32- and 64-wide bands, K steps wider than the band; the CPU twin without
    a GPU, the real kernel on one."""
    if GPU and dtype == torch.float32:
        pytest.skip("fp32 is outside the TileLang scope on a GPU (it would run as TF32)")
    calls = []
    real = loha.kernel
    monkeypatch.setattr(loha, "kernel", lambda b, *a: calls.append(b.__name__) or real(b, *a))
    g = torch.Generator().manual_seed(7)
    dev = "cuda" if GPU else "cpu"
    sizes = ((37, 150, 5), (130, 70, 17)) if not GPU else ((200, 1000, 8), (3072, 517, 64), (300, 260, 128))
    # (band, K step): K steps as wide as the band (shared G / E tiles) and wider (each branch its own)
    tiles = ((64, 64), (32, 64)) if not GPU else ((64, 64), (32, 128), (32, 64))
    for (O, I, r), (bm, bk) in zip(sizes, tiles):
        monkeypatch.setattr(loha, "GRADS_PAIR", dict(BM=bm, BK=bk, stages=2))
        f = [torch.randn(O, r, generator=g), torch.randn(r, I, generator=g),
             torch.randn(O, r, generator=g), torch.randn(r, I, generator=g)]
        f = [t.to(dev, dtype) for t in f]
        f[3] = f[3].float()  # an fp32 factor: its gradient leaves in fp32
        for G in (torch.randn(O, I, generator=g), torch.randn(I, O, generator=g).t()):
            del calls[:]
            compare("loha_merge_bwd", (G.to(dev, dtype), *f, -0.7), dtype)
            # one build here; on a GPU the tuner times its pair configs too
            assert set(calls) == {"hada_grad_pair_kernel"} and (GPU or len(calls) == 1), calls


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_merge_bwd_pair_steps_down(monkeypatch):
    """Where no pair tile fits the device's shared memory, the pair form takes fewer stages,
    then the two split jobs (fixed tile), and still matches eager."""
    monkeypatch.setattr(loha, "GRADS_PAIR", dict(BM=64, stages=2))
    calls = []
    real = loha.kernel
    monkeypatch.setattr(loha, "kernel", lambda b, *a: calls.append((b.__name__, a[-1])) or real(b, *a))
    g = torch.Generator().manual_seed(8)
    O, I, r = 70, 90, 9  # Rp 16, fp32: BM 64 takes 114688 B at 2 stages, 81920 at 1
    f = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g),
         torch.randn(O, r, generator=g), torch.randn(r, I, generator=g))
    G = torch.randn(O, I, generator=g)
    assert loha.grads_pair_smem(64, 2, r, 4) > loha.grads_pair_smem(64, 1, r, 4)
    for limit, want in ((loha.grads_pair_smem(64, 1, r, 4), [("hada_grad_pair_kernel", 1)]),
                        (loha.grads_pair_smem(64, 1, r, 4) - 1, ["hada_grad_a_kernel", "hada_grad_b_kernel"])):
        monkeypatch.setattr(loha, "smem_limit", lambda dev, lim=limit: lim)
        del calls[:]
        compare("loha_merge_bwd", (G, *f, 1.3), torch.float32)
        names = [c if isinstance(w, tuple) else c[0] for c, w in zip(calls, want)]
        assert names == want and len(calls) == len(want), calls


@pytest.mark.slow
@pytest.mark.cpu_only
def test_pair_form_by_size(monkeypatch):
    """``PAIR_MAX_ELEMS``: gradients above it take the split jobs (where the two tie and the
    pair kernel's build is the longer), at or below it the pair; the planner shortlists the
    form the launcher takes."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import loha as plans_loha

    assert loha.pair_form(3072, 3072) and not loha.pair_form(4096, 4096)  # the defaults: as timed
    g = torch.Generator().manual_seed(10)
    O, I, r = 40, 30, 6
    f = (torch.randn(O, r, generator=g), torch.randn(r, I, generator=g),
         torch.randn(O, r, generator=g), torch.randn(r, I, generator=g))
    G = torch.randn(O, I, generator=g)
    calls = []
    real = loha.kernel
    monkeypatch.setattr(loha, "kernel", lambda b, *a: calls.append(b.__name__) or real(b, *a))
    dev = device.synthetic()
    for limit, want in ((O * I, ["hada_grad_pair_kernel"]), (O * I - 1, ["hada_grad_a_kernel", "hada_grad_b_kernel"])):
        monkeypatch.setattr(loha, "PAIR_MAX_ELEMS", limit)
        del calls[:]
        compare("loha_merge_bwd", (G, *f, 0.6), torch.float32)
        assert calls == want, (limit, calls)
        cands = list(plans_loha.TILELANG["loha_merge_bwd"][0](dev, G, *f, 0.6).candidates)
        assert cands[0] == loha.grads_fixed(O, I) == (loha.GRADS_PAIR if limit == O * I else loha.GRADS), cands


#: non-default configs inside tuning/loha.py's TileLang spaces (TL_GEMM, TL_GRADS / TL_GRADS_PAIR)
GEMM_CFG = dict(BM=64, BN=256, BK=32, stages=3, threads=128)
GRADS_CFG = dict(BO=128, BI=32)


def _tile_cases(dtype, device):
    g = torch.Generator().manual_seed(4)

    def m(*s):
        return torch.randn(*s, generator=g).to(dtype).to(device)

    T, I, O, r, O2, I2 = 11, 19, 37, 5, 150, 140
    f = (m(O, r), m(r, I), m(O, r), m(r, I))
    x = m(I, T).t()  # non-contiguous
    f2 = (m(O2, r), m(r, I2), m(O2, r), m(r, I2))
    vendor = {**GEMM_CFG, "vendor": True}  # the T·O·I GEMMs by torch's, ΔW and the grads by the kernels
    return [("loha_bypass_fwd", (x, *f, 0.8, m(T, O)), GEMM_CFG), ("loha_bypass_bwd", (m(T, O), x, *f, -0.7), GEMM_CFG),
            ("loha_bypass_fwd", (x, *f, 0.8, m(T, O)), vendor), ("loha_bypass_fwd", (x, *f, 0.8, None), vendor),
            ("loha_bypass_bwd", (m(T, O), x, *f, -0.7), vendor), ("loha_merge_bwd", (m(O2, I2), *f2, 0.9), GRADS_CFG)]


def _check_tile_configs(dtype, device, monkeypatch):
    monkeypatch.setattr(loha, "REGEN_BUDGET", -1)  # the materialized path, whose GEMM the config tiles
    for op, args, cfg in _tile_cases(dtype, device):
        got = harness.outs(getattr(loha, op.split("_", 1)[1])(*args, cfg=cfg))
        want = harness.outs(getattr(REF, op)(*args))
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape, (op, k)
            assert harness.rel_err(a, b) <= harness.REL_TOL[dtype], (op, k, harness.rel_err(a, b))


@pytest.mark.slow
@pytest.mark.cpu_only
def test_twin_tile_configs(monkeypatch):
    """The launchers honour a tuned ``cfg`` (the GEMM tile, the gradient kernels' tile, the
    bypass ops' ``vendor`` form)."""
    _check_tile_configs(torch.float32, "cpu", monkeypatch)


@pytest.mark.gpu
def test_gpu_tile_configs(monkeypatch):
    _check_tile_configs(torch.bfloat16, "cuda", monkeypatch)


@pytest.mark.slow
@pytest.mark.nvcc
def test_tile_space_corners_compile_sm90a(monkeypatch):
    """The corners of tuning/loha.py's TileLang spaces compile for sm_90a at the first bench
    shape: the GEMM (row tile x stages x threads, the widest tiles) of both bypass ops,
    the gradient kernels at the extremes of their tile."""
    from lycoris_ops.backends.tilelang.tuning import loha as plans_loha
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    for mod in (loha, tl_lora):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(loha, "num_sms", lambda d: 132)
    bf = torch.bfloat16
    x, a, b = torch.empty(8192, 3072, dtype=bf), torch.empty(3072, 32, dtype=bf), torch.empty(32, 3072, dtype=bf)
    w = torch.empty(3072, 3072, dtype=bf)
    sp, gp = plans_loha.TL_GEMM, plans_loha.TL_GRADS
    calls = []
    for bm in sp["BM"]:
        for th in tl_threads(sp["threads"], bm):
            for st in sp["stages"]:
                cfg = dict(BM=bm, BN=max(sp["BN"]), BK=max(sp["BK"]), stages=st, threads=th)
                calls += [(loha.bypass_fwd, (x, a, b, a, b, 1.0, None), cfg), (loha.bypass_bwd, (x, x, a, b, a, b, 1.0), cfg)]
    calls = [(False, *c) for c in calls]
    for bo in (min(gp["BO"]), max(gp["BO"])):
        for bi in (min(gp["BI"]), max(gp["BI"])):
            calls.append((False, loha.merge_bwd, (w, a, b, a, b, 1.0), dict(BO=bo, BI=bi)))
    # the pair form: both band widths at the deepest pipeline, and rank 128 (stages step down to fit)
    a128, b128 = torch.empty(3072, 128, dtype=bf), torch.empty(128, 3072, dtype=bf)
    pp = plans_loha.TL_GRADS_PAIR
    for bm in pp["BM"]:
        for args in ((w, a, b, a, b, 1.0), (w, a128, b128, a128, b128, 1.0)):
            calls.append((True, loha.merge_bwd, args, dict(BM=bm, stages=max(pp["stages"]))))
    pair_max = loha.PAIR_MAX_ELEMS
    with _common.capturing() as pending:
        for pair, fn, args, cfg in calls:
            monkeypatch.setattr(loha, "PAIR_MAX_ELEMS", pair_max if pair else 0)
            tl_pick._call(fn, args, cfg)
    failed = harness.compile_failures(pending)
    assert len(pending) >= 16 and not failed, failed
    assert sum(p.builder is loha.hada_grad_pair_kernel for p in pending) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,r", [(torch.bfloat16, 16), (torch.float16, 128), (torch.bfloat16, 5)],
                         ids=["bf16-r16", "fp16-r128", "bf16-r5"])
def test_gpu_parity(dtype, r):
    """Each (dtype, rank) compiles ~12 kernels on a cold cache (3-10 s each); T is dynamic."""
    g = torch.Generator().manual_seed(r)

    def m(*s, dt=dtype, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dt).cuda()

    I, O = 320, 200
    s = r ** -0.5
    f = (m(O, r, scale=s), m(r, I), m(O, r, scale=s), m(r, I))
    for T in (1, 333, 4100):  # regenerated ΔW for small T, materialized above
        x = m(T, I)
        compare("loha_bypass_fwd", (x, *f, 0.7), dtype)
        compare("loha_bypass_fwd", (x, *f, 0.7, m(T, O, dt=torch.float32)), dtype)
        compare("loha_bypass_bwd", (m(T, O), x, *f, 0.7), dtype)
    compare("loha_merge_bwd", (m(O, I), *f, 1.3), dtype)
    compare("loha_merge_bwd", (m(2048, 1536), m(2048, r, scale=s), m(r, 1536), m(2048, r, scale=s), m(r, 1536), 0.4),
            dtype)
