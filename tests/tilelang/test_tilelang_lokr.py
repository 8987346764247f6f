"""TileLang LoKr kernels (lycoris_ops/backends/tilelang/kernels/lokr.py).

1. Compile check without a GPU: every kernel family compiles for sm_90a (bf16)
   and sm_80 (fp16) with nvcc (``execution_backend="tvm_ffi"``); skipped when
   nvcc is not on PATH (LYCORIS_TILELANG_FULL_COMPILE=1: all four pairs).
2. CPU twins (the same builders, ``cpu=True``, C target, same host code): the
   six LoKr op functions against the eager bodies (reference/lokr.py) over the
   case table in fp32; the core contraction w1·X_t·w2ᵀ (token blocks laid side
   by side, the fp32 intermediate carried as a hi + lo pair) and its backward
   in fp16.
3. On a GPU (skipped here): the op set against the eager bodies in fp16/bf16.
4. Tuned launch configs (tuning/lokr.py's ``TILELANG``): the launchers at non-default
   configs against the eager bodies (GPU, else CPU twins), the fixed configs as the
   default launch, the corners of the legal spaces compiled for sm_90a, the shortlists
   and legality rules on an H200's facts.
"""
import inspect
from unittest import mock

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.reference import lokr as REF  # noqa: E402
from lycoris_ops.testing import lokr as CASES  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import lokr, lokr_bypass
from lycoris_ops.backends.tilelang.tuning import lokr as lokr_tuning  # noqa: E402
from lycoris_ops.backends.tilelang import ops  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import CASE_PARTS, COMPILE_CASES, GPU, case_part, compile_part  # noqa: E402

OPS = ["lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
       "lokr_bypass_fwd", "lokr_bypass_bwd"]


def compare(op, args, dtype, tol=None):
    harness.compare(ops, REF, op, args, dtype, tol)


@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
def test_kernels_compile(arch, dtype, part):
    for builder, args in compile_part(lokr.compile_specs(dtype) + lokr_bypass.compile_specs(dtype), part):
        k = _common.compile_only(builder, arch, *args)
        assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


@pytest.mark.slow
@pytest.mark.nvcc
def test_async_one_pass_backward_compiles_for_sm90a():
    """``async_mma`` (sm_90a only: async WGMMAs): 3 waits a step instead of 8, each group's
    last GEMM synchronous (with the next stage's copies placed after it); the launcher asks
    for it only where every GEMM's M is a multiple of 64."""
    import re

    srcs = {}
    for asy in (False, True):
        k = _common.compile_only(lokr_bypass.kron_wgrads_kernel, "sm_90a", 64, 64, 64, 64, "bfloat16", "float32", False,
                                 128, 128, 4, "bfloat16", asy)
        src = k.get_kernel_source()
        srcs[asy] = (src.count("wgmma_ss<"), len(re.findall(r"warpgroup_wait<", src)))
    # 8 GEMMs a step in the three copies of the pipelined body (prologue, steady state, epilogue)
    assert srcs[False] == (24, 24) and srcs[True] == (24, 9), srcs
    assert lokr_bypass.wgrads_async_fits(64, 64, 64, 64, 128, 128) and lokr_bypass.wgrads_async_fits(48, 48, 64, 64, 128, 128)
    assert not lokr_bypass.wgrads_async_fits(3, 5, 7, 4, 128, 128)


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.parametrize("threads", [128, 256])
def test_factored_merge_kernels_compile_for_sm90a(threads):
    """Every kernel a factored merge (forward streamed, backward one pass) would build on an
    H200 at small and odd shapes compiles for sm_90a: the w2 tiles the kernels generate with
    ``T.gemm`` (16 x 16 at 4 warps, 64 x 16 at 8: TileLang refuses both, the first seen on the
    H200 on 2026-12-05) step down to the plane generated before the launch."""
    bf = torch.bfloat16
    built = {}
    with mock.patch.object(lokr, "arch_of", lambda d: "sm_90a"), mock.patch.object(lokr, "num_sms", lambda d: 132), \
            mock.patch.object(lokr_bypass, "smem_limit", lambda d: 227 * 1024):
        for a, b, c, d in ((1, 1, 9, 9), (2, 2, 33, 9), (2, 2, 65, 13), (1, 2, 17, 40)):
            w1a, w1b, w2a, w2b = (torch.randn(*s_, dtype=bf) for s_ in ((a, 3), (3, b), (c, 5), (5, d)))
            with _common.capturing() as pending:
                for elems in (2048, 4096):
                    lokr.merge_bwd(torch.randn(a * c, b * d, dtype=bf), w1a, w1b, w2a, w2b, [a, b, c, d], 0.7,
                                   cfg=dict(elems=elems, threads=threads, one_pass=True, stages=0))
                lokr.merge_fwd(w1a, w1b, w2a, w2b, [a, b, c, d], None, 0.7,
                               cfg=dict(BM=64, BN=16, threads=threads, stream=True))
            for p in pending:
                built.setdefault((p.builder, p.args), (a, b, c, d))
    assert any(bd.__name__ == "kron_grads_kernel" and args[-1] == 5 for bd, args in built), "no tile generated in-kernel"
    for (builder, args), shape in built.items():
        try:
            _common.compile_only(builder, "sm_90a", *args)
        except Exception as e:  # noqa: BLE001 - the shape and kernel in the failure
            pytest.fail(f"{builder.__name__}{args} at {shape}: {str(e).splitlines()[0]}")


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


@pytest.mark.cpu_only
def test_twin_bypass_fp16():
    """w1·X_t·w2ᵀ with the hi/lo intermediate, and its three gradients, in fp16."""
    n = 0
    for case in CASES.cases(torch.float16, "cpu", False, torch.Generator().manual_seed(1)):
        if case.op in ("lokr_bypass_fwd", "lokr_bypass_bwd") and case.id in ("bypass_fwd-plain", "bypass_bwd-plain"):
            compare(case.op, case.args, torch.float16, tol=1e-3)  # ~1 fp16 ulp: the lo term matters
            n += 1
    assert n == 2


@pytest.mark.cpu_only
def test_twin_token_split():
    """Enough tokens for the split token reduction of g_w1 / g_w2 (fp32 partials)."""
    g = torch.Generator().manual_seed(2)
    T, (a, b), (c, d) = 150, (3, 5), (7, 4)
    x, G = torch.randn(T, b * d, generator=g), torch.randn(T, a * c, generator=g)
    compare("lokr_bypass_bwd", (G, x, torch.randn(a, b, generator=g), torch.randn(c, d, generator=g), 0.8),
            torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_async_one_pass_backward(dtype):
    """The one-pass bypass backward, its GEMM groups issued as async WGMMAs on sm_90a at 64-wide
    padded factors (``wgrads_async_fits``), against the eager body, token tails and a split
    token reduction included; the 3 x 5 x 7 x 4 layer takes the synchronous form."""
    assert lokr_bypass.wgrads_async_fits(64, 64, 64, 64, 128, 128) and not lokr_bypass.wgrads_async_fits(3, 5, 7, 4, 128, 128)
    g = torch.Generator().manual_seed(11)

    def m(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dtype).cuda()

    for a, b, c, d in ((64, 64, 64, 64), (48, 48, 64, 64), (3, 5, 7, 4)):
        w1, w2 = m(a, b, scale=b ** -0.5), m(c, d, scale=d ** -0.5)
        for T in (1, 257, 9000):
            compare("lokr_bypass_bwd", (m(T, a * c), m(T, b * d), w1, w2, 0.7), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dims", [(torch.bfloat16, (16, 32, 24, 12)), (torch.float16, (128, 128, 16, 16)),
                                        (torch.bfloat16, (4, 5, 128, 128)), (torch.bfloat16, (100, 3, 2, 100))],
                         ids=["bf16-mixed", "fp16-w1_128", "bf16-w2_128", "bf16-skewed"])
def test_gpu_parity(dtype, dims):
    """Each case compiles ~15 kernels on a cold cache (3-10 s each); T is dynamic."""
    a, b, c, d = dims
    g = torch.Generator().manual_seed(sum(dims))

    def m(*s, dt=dtype, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dt).cuda()

    w1, w2 = m(a, b, scale=b ** -0.5), m(c, d, scale=d ** -0.5)
    for T in (1, 257, 4100):
        x = m(T, b * d)
        compare("lokr_bypass_fwd", (x, w1, w2, 0.7), dtype)
        compare("lokr_bypass_fwd", (x, w1, w2, 0.7, m(T, a * c, dt=torch.float32)), dtype)
        compare("lokr_bypass_bwd", (m(T, a * c), x, w1, w2, 0.7), dtype)
    compare("lokr_full_merge_fwd", (w1, w2, m(a * c, b * d), 0.5), dtype)
    compare("lokr_full_merge_bwd", (m(a * c, b * d), w1, w2, 0.5), dtype)
    r1, r2 = max(1, min(a, b) // 2), max(1, min(c, d) // 2)
    f = (m(a, r1), m(r1, b), m(c, r2), m(r2, d))
    compare("lokr_merge_fwd", (*f, [a, b, c, d], m(a * c, b * d), 0.5), dtype)
    compare("lokr_merge_bwd", (m(a * c, b * d), *f, [a, b, c, d], 0.5), dtype)
    compare("lokr_merge_fwd", (f[0], f[1], w2, None, [a, b, c, d], None, 0.5, torch.float32), dtype)


# --------------------------------------------------------------------------- tuned launch configs (tuning/lokr.py)

#: (merge forward, merge backward, bypass) configs inside tuning/lokr.py's TileLang spaces, none the fixed one
TILE_CFGS = [(dict(BM=32, BN=64, threads=256), dict(elems=2048, threads=256), dict(rows=64, threads=256)),
             (dict(BM=64, BN=128, threads=128), dict(elems=8192, threads=128), dict(rows=256, threads=128)),
             (dict(BM=16, BN=256, threads=256), dict(elems=8192, threads=256), dict(rows=256, threads=256))]
#: the trailing builder arguments a config becomes (tilelang/lokr.py's launchers)
CFG_ARGS = {"kron_kernel": ("BM", "BN", "threads"), "kron_grad1_kernel": ("elems", "threads"),
            "kron_grad2_kernel": ("elems", "threads"), "kron_apply_kernel": ("rows", "threads"),
            "kron_wgrad1_kernel": ("rows", "threads"), "kron_wgrad2_kernel": ("rows", "threads"),
            "kron_wgrads_kernel": ("rows", "threads"), "kron_grads_kernel": ("elems", "threads"),
            "kron_finish_kernel": (), "kron_stream_kernel": ("BM", "BN", "threads")}  # the one-pass backward's finishing launch: no tile of a config
#: builder flags after the config's arguments (``kron_apply_kernel``: ``staged``, ``kper``; the wgrad
#: kernels: ``kper_static``; ``kron_grads_kernel`` / ``kron_stream_kernel``: ``stages``, ``steps``, ``r2``)
TRAILING = {"kron_apply_kernel": 2, "kron_wgrad1_kernel": 1, "kron_wgrad2_kernel": 1, "kron_wgrads_kernel": 3,
            "kron_grads_kernel": 3, "kron_stream_kernel": 3}


def _listed(fn, args, cfg):
    """The kernels ``fn(*args, cfg=cfg)`` builds: (builder, arguments), built before or not."""
    with mock.patch.object(_common, "_kernels", {}), _common.capturing() as pending:
        fn(*args, cfg=cfg)
    return pending


def _with_cfg(op, cfg, args, dtype):
    """The launcher of ``op`` run with ``cfg`` against the eager body; every lokr kernel it
    builds carries the config (a launcher that drops ``cfg`` builds the fixed one)."""
    import functools
    import types

    fn = lokr_tuning.LAUNCHERS[op]
    mine = [p for p in _listed(fn, args, cfg) if p.builder.__module__ in (lokr.__name__, lokr_bypass.__name__)]
    assert mine, (op, cfg)
    for p in mine:
        names = CFG_ARGS[p.builder.__name__]
        end = len(p.args) - TRAILING.get(p.builder.__name__, 0)
        assert p.args[end - len(names):end] == tuple(cfg[k] for k in names), (op, p.builder.__name__, p.args)
    harness.compare(types.SimpleNamespace(**{op: functools.partial(fn, cfg=cfg)}), REF, op, args, dtype)


def _tile_config_cases(kron_cfg, grad_cfg, bypass_cfg, dtype, dev):
    """(op, cfg, args) of the six launchers at odd sizes: tail tiles on both output axes,
    several gradient tiles or one partial one, split and direct w_2 gradients, token tails
    and split token reductions."""
    g = torch.Generator().manual_seed(21)

    def m(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dtype).to(dev)

    a, b, c, d = 3, 2, 37, 150  # output 111 x 300; w2's gradient tiles 16/64 x 128 of 37 x 150
    w1, w2 = m(a, b), m(c, d, scale=0.1)
    G, W = m(a * c, b * d), m(a * c, b * d)
    f = (m(a, 3), m(3, b), m(c, 5, scale=0.3), m(5, d, scale=0.3))
    cases = [("lokr_full_merge_fwd", kron_cfg, (w1, w2, W, 0.7)),
             ("lokr_merge_fwd", kron_cfg, (f[0], f[1], w2, None, [a, b, c, d], None, 0.7)),
             ("lokr_full_merge_bwd", grad_cfg, (G, w1, w2, 0.7)),
             ("lokr_merge_bwd", grad_cfg, (G, *f, [a, b, c, d], 0.7))]
    for (a, b, c, d) in ((3, 5, 7, 4), (20, 3, 5, 33)):  # padded factors 16; and 32 / 16 / 16 / 64
        w1, w2 = m(a, b, scale=b ** -0.5), m(c, d, scale=d ** -0.5)
        for T in (1, 150):
            x = m(T, b * d)
            cases += [("lokr_bypass_fwd", bypass_cfg, (x, w1, w2, 0.7, m(T, a * c))),
                      ("lokr_bypass_bwd", bypass_cfg, (m(T, a * c), x, w1, w2, 0.7))]
    return cases


def one_pass_does_not_fit(monkeypatch):
    """As at wide factors: the one-pass backward with gx does not fit shared memory, so gx runs
    through the apply kernel and the weight gradients through ``kron_wgrads_kernel`` alone."""
    real = lokr_bypass.wgrads_smem
    monkeypatch.setattr(lokr_bypass, "wgrads_smem", lambda *a: real(*a) if not a[7] else 1 << 40)


def no_one_pass_fits(monkeypatch):
    """As at wide factors: no one-pass kernel fits a thread's registers, so the backward runs
    the apply kernel and the two separate wgrad kernels."""
    monkeypatch.setattr(lokr_bypass, "WGRADS_MAX_FRAGMENT_REGS", 0)


#: the backward's three paths (by the one-pass kernels' resources) -> the kernels it builds
BWD_PATHS = {"one-pass": (None, {"kron_wgrads_kernel"}),
             "wgrads": (one_pass_does_not_fit, {"kron_apply_kernel", "kron_wgrads_kernel"}),
             "separate": (no_one_pass_fits, {"kron_apply_kernel", "kron_wgrad1_kernel", "kron_wgrad2_kernel"})}


@pytest.mark.quick_if(lambda staged, path: staged and path == "one-pass")
@pytest.mark.parametrize("path", sorted(BWD_PATHS))
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "regs"])
def test_twin_bypass_paths(staged, path, monkeypatch):
    """Both epilogues of ``kron_apply_kernel`` (a config's ``staged``: output and base blocks
    through shared memory, or from the registers) in the bypass forward, and the backward's
    three paths (the one pass with gx, the weight gradients in one pass, the separate kernels),
    with small static step counts (splits past the last tile): padded factors, one token and a
    token tail, two configs (2 and 16 tokens a program). CPU twins at fp32; on a GPU the real
    kernels (bf16)."""
    monkeypatch.setattr(lokr_bypass, "WGRAD_KPER", (2, 4, 64))
    monkeypatch.setattr(lokr_bypass, "APPLY_KPER", (2, 4, 64))
    force, kernels = BWD_PATHS[path]
    if force:
        force(monkeypatch)
    dtype, dev = (torch.bfloat16, "cuda") if GPU else (torch.float32, "cpu")
    n = 0
    for cfgs in (TILE_CFGS[0], TILE_CFGS[2]):
        for op, cfg, args in _tile_config_cases(*cfgs, dtype, dev):
            if op.startswith("lokr_bypass"):
                cfg = {**cfg, "staged": staged}
                _with_cfg(op, cfg, args, dtype)
                if op == "lokr_bypass_bwd":
                    built = {p.builder.__name__ for p in _listed(lokr_bypass.bypass_bwd, args, cfg)} - {"kron_finish_kernel"}
                    assert built == kernels, (path, built)
                n += 1
    assert n == 16


@pytest.mark.slow
@pytest.mark.parametrize("kron_cfg,grad_cfg,bypass_cfg", TILE_CFGS, ids=["small-tiles", "big-tiles", "wide-256"])
def test_tile_configs(kron_cfg, grad_cfg, bypass_cfg):
    """The six launchers honour a tuned ``cfg`` at odd sizes (``_tile_config_cases``); on a
    GPU the real kernels (bf16), else the CPU twins (fp32)."""
    dtype = torch.bfloat16 if GPU else torch.float32
    for op, cfg, args in _tile_config_cases(kron_cfg, grad_cfg, bypass_cfg, dtype, "cuda" if GPU else "cpu"):
        _with_cfg(op, cfg, args, dtype)


@pytest.mark.slow
@pytest.mark.nvcc
# cpu_only: the GPU run builds these kernels for real (test_tile_configs); there, kernels an earlier
# test of the worker built for sm_90a are cached, so fewer are captured
@pytest.mark.cpu_only
@pytest.mark.parametrize("fused_bwd", [True, False], ids=["one-pass-bwd", "separate-bwd"])
@pytest.mark.parametrize("cfgs", [({}, {}, {}), TILE_CFGS[2]], ids=["fixed", "wide-256"])
def test_tile_config_cases_compile_sm90a(monkeypatch, cfgs, fused_bwd):
    """The kernels of test_tile_configs' odd sizes compile for sm_90a (bf16), the fixed
    configs too: a GPU run found the Kronecker build's W1 gather at d = 150 ('__pack_bfloat162'
    is undefined), which the bench-shape corners never reach. Both backward paths: the
    one-pass kernel and (where it does not fit) the separate gx / weight-gradient ones."""
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    for mod in (lokr, lokr_bypass, tl_lora):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(lokr, "num_sms", lambda d: 132)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 132)
    if not fused_bwd:
        no_one_pass_fits(monkeypatch)
    calls = [(lokr_tuning.LAUNCHERS[op], args, cfg)
             for op, cfg, args in _tile_config_cases(*cfgs, torch.bfloat16, "cpu")]
    captured, failed = harness.compile_calls(calls)
    # distinct kernels built: the one-pass backward is one kernel where the separate form is three
    assert captured >= (12 if fused_bwd else 20) and not failed, failed


def test_the_fixed_configs_are_the_default_launch():
    """cfg None, ``{}`` and the spelled-out fixed config build the same kernels (the shortlist's
    untimed first pick is the launch the parity tests run), and the fixed configs are the
    builders' own defaults."""
    from lycoris_ops.backends.tilelang.tuning import lokr as plans_lokr

    defaults = {name: inspect.signature(getattr(lokr, name, None) or getattr(lokr_bypass, name)).parameters
                for name in CFG_ARGS}
    for name, keys in CFG_ARGS.items():
        fixed = {"kron_kernel": lokr.KRON, "kron_grad1_kernel": lokr.GRADS, "kron_grad2_kernel": lokr.GRADS,
                 "kron_grads_kernel": lokr.GRADS, "kron_stream_kernel": lokr.KRON}.get(name, lokr_bypass.BYPASS)
        spelled = [defaults[name]["max_threads" if k == "threads" and "max_threads" in defaults[name] else k].default
                   for k in keys]
        assert spelled == [fixed[k] for k in keys], name
    g = torch.Generator().manual_seed(3)
    w1, w2, x = torch.randn(3, 5, generator=g), torch.randn(7, 4, generator=g), torch.randn(9, 20, generator=g)
    G, y = torch.randn(21, 20, generator=g), torch.randn(9, 21, generator=g)
    f = (torch.randn(3, 2, generator=g), torch.randn(2, 5, generator=g), w2, None, [3, 5, 7, 4])
    calls = {"lokr_full_merge_fwd": (w1, w2, None, 1.0), "lokr_full_merge_bwd": (G, w1, w2, 1.0),
             "lokr_merge_fwd": (*f, None, 1.0), "lokr_merge_bwd": (G, *f, 1.0),
             "lokr_bypass_fwd": (x, w1, w2, 1.0), "lokr_bypass_bwd": (y, x, w1, w2, 1.0)}
    for op, args in calls.items():
        fn = lokr_tuning.LAUNCHERS[op]
        built = [[(p.builder.__name__, p.args) for p in _listed(fn, args, cfg)]
                 for cfg in (None, {}, plans_lokr.tl_fixed(op))]
        assert built[0] and built[0] == built[1] == built[2], (op, built)


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.parametrize("op", ["lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_bypass_fwd", "lokr_bypass_bwd"])
def test_tile_space_corners_compile_sm90a(monkeypatch, op):
    """The corners of tuning/lokr.py's legal TileLang spaces compile for sm_90a (bf16): the
    smallest and largest merge tiles, gradient tiles and token rows, each with its threads,
    at the bench layers' factors (3072: 48 x 48 (x) 64 x 64; 4096 as 128 x 128 (x) 32 x 32, the
    bypass kernels' two warpgroups) and at 128-wide factors (gradient tiles of 16-64 x 128;
    the bypass's whole 128 x 128 factors with 256 threads). The merges' factored forms
    build the same kernels with fp32 sides."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lokr as plans_lokr
    from tilelang_harness import compile_calls, corners

    monkeypatch.setattr(lokr, "arch_of", lambda d: "sm_90a")

    monkeypatch.setattr(lokr_bypass, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(lokr, "num_sms", lambda d: 132)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 132)
    dev = device.synthetic()
    bf = torch.bfloat16
    key = {"lokr_full_merge_fwd": lambda c: c["BM"] * c["BN"], "lokr_full_merge_bwd": lambda c: c["elems"]}.get(
        op, lambda c: c["rows"])
    fn = lokr_tuning.LAUNCHERS[op]
    shapes = {"lokr_full_merge_fwd": [((48, 48, 64, 64), 0)], "lokr_full_merge_bwd": [((48, 48, 64, 64), 0),
                                                                                       ((2, 2, 128, 128), 0)]}.get(
        op, [((48, 48, 64, 64), 8192), ((128, 128, 32, 32), 8192), ((128, 128, 128, 128), 1024)])
    calls = []
    for (a, b, c, d), T in shapes:
        w1, w2, W = torch.empty(a, b, dtype=bf), torch.empty(c, d, dtype=bf), torch.empty(a * c, b * d, dtype=bf)
        x, y = torch.empty(T, b * d, dtype=bf), torch.empty(T, a * c, dtype=bf)
        args = {"lokr_full_merge_fwd": (w1, w2, W, 1.0), "lokr_full_merge_bwd": (W, w1, w2, 1.0),
                "lokr_bypass_fwd": (x, w1, w2, 1.0, y), "lokr_bypass_bwd": (y, x, w1, w2, 1.0)}[op]
        # with the fixed config: the fused backward's space may add no other build (``tl_built``)
        cfgs = plans_lokr.tl_configs(dev, op, (a, b, c, d), 2) + [plans_lokr.tl_fixed(op)]
        assert len(cfgs) > 1 or op == "lokr_bypass_bwd", (op, a, b, c, d)
        calls += [(fn, args, cfg) for cfg in corners(cfgs, key)]
    if op == "lokr_bypass_bwd":  # the 4096 layer's backward with both warpgroups on every GEMM of 128 rows
        assert any(cfg["threads"] == 256 for _, _, cfg in calls)
    captured, failed = compile_calls(calls)
    assert captured >= len(calls) and not failed, failed


def _h200_args(dims, T, dt):
    """Schema arguments of the six ops on LoKr factors dims = (a, b, c, d) (factored merges:
    a rank-8 w2), T tokens."""
    a, b, c, d = dims
    w1, w2, W = torch.empty(a, b, dtype=dt), torch.empty(c, d, dtype=dt), torch.empty(a * c, b * d, dtype=dt)
    x, y = torch.empty(T, b * d, dtype=dt), torch.empty(T, a * c, dtype=dt)
    f = (w1, None, torch.empty(c, 8, dtype=dt), torch.empty(8, d, dtype=dt), list(dims))
    return {"lokr_full_merge_fwd": (w1, w2, W, 1.0), "lokr_full_merge_bwd": (W, w1, w2, 1.0),
            "lokr_merge_fwd": (*f, W, 1.0), "lokr_merge_bwd": (W, *f, 1.0),
            "lokr_bypass_fwd": (x, w1, w2, 1.0, y), "lokr_bypass_bwd": (y, x, w1, w2, 1.0)}


def test_bypass_bwd_shortlist_builds_distinct_kernels(monkeypatch):
    """Each config the backward bypass's shortlist times builds kernels no other candidate
    builds (what the launcher really builds, captured): the one-pass backward's
    token step ignores the rows 64 / 128 difference at the bench layers' factors, which the
    unfused kernels' geometry would count as two configs (a timed tie of one kernel)."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lokr as plans_lokr
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.tuner import tune

    monkeypatch.setattr(lokr, "arch_of", lambda d: "sm_90a")

    monkeypatch.setattr(lokr_bypass, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(lokr, "num_sms", lambda d: 132)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 132)
    dev = device.synthetic()
    for dims in ((48, 48, 64, 64), (64, 64, 64, 64), (128, 128, 32, 32)):
        args = _h200_args(dims, 8192, torch.bfloat16)["lokr_bypass_bwd"]
        builds = []
        for c in plans_lokr.TILELANG["lokr_bypass_bwd"][0](dev, *args).candidates:
            if tune.is_eager(c):
                continue
            with _common.capturing() as pending:
                tl_pick._call(lokr_bypass.bypass_bwd, args, c)
            # the program each builds (its TIR; the keys differ by the rows argument alone)
            builds.append(frozenset(p.builder(*p.args).script() for p in pending))
        assert all(builds) and len(set(builds)) == len(builds), (dims, builds)


def test_shortlists_for_an_h200():
    """The six ops at the bench layers' factors on an H200's facts: the fixed config first,
    eager last, 1..TL_N model configs, all legal and distinct, JSON-serializable; the bypass
    forward also the fixed config with the other apply epilogue, second (timed, never modelled);
    the key's exact sizes are the factors (and ranks), never the token count."""
    import json

    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lokr as plans_lokr
    from lycoris_ops.backends.tilelang import runner as tl_pick
    from lycoris_ops.tuner import tune

    dev = device.synthetic()
    fixed = {"lokr_full_merge_fwd": lokr.KRON, "lokr_merge_fwd": lokr.KRON, "lokr_full_merge_bwd": lokr.GRADS,
             "lokr_merge_bwd": lokr.GRADS, "lokr_bypass_fwd": lokr_bypass.BYPASS, "lokr_bypass_bwd": lokr_bypass.BYPASS}
    assert set(plans_lokr.TILELANG) == set(OPS) and set(OPS) <= set(tl_pick.models())
    for dims in ((48, 48, 64, 64), (64, 64, 64, 64), (128, 128, 32, 32)):
        for dt in (torch.bfloat16, torch.float16):
            calls, other_t = _h200_args(dims, 8192, dt), _h200_args(dims, 8000, dt)
            for op, args in calls.items():
                cands = list(plans_lokr.TILELANG[op][0](dev, *args).candidates)
                assert cands[0] == fixed[op] and tune.is_eager(cands[-1]), (op, dims, cands)
                twin = op == "lokr_bypass_fwd"
                # the one-pass backward: rows 64 and 128 build one kernel at these factors,
                # so its space may add nothing to the fixed config (``tl_built``)
                least = 2 if op == "lokr_bypass_bwd" else 3
                assert least <= len(cands) <= plans_lokr.TL_N + 2 + twin, (op, cands)
                assert len(set(map(str, cands))) == len(cands), (op, cands)
                if twin:
                    assert cands[1] == {**fixed[op], "staged": False}, (op, dims, cands)
                legal = plans_lokr.tl_configs(dev, op, dims, 2)
                for c in cands[1 + twin:-1]:
                    assert c in legal, (op, dims, dt, c)
                json.dumps(cands)
                sizes = tl_pick.key_parts(args, op)[0]
                assert sizes == tl_pick.key_parts(other_t[op], op)[0], op  # the token count only in the buckets
                assert sizes[0] == "sizes" and sizes[1][:4] == dims, (op, sizes)
    k = _h200_args((48, 48, 64, 64), 3, torch.bfloat16)["lokr_bypass_fwd"]
    k4 = _h200_args((48, 48, 64, 64), 4, torch.bfloat16)["lokr_bypass_fwd"]
    assert tl_pick.key_parts(k, "lokr_bypass_fwd") == tl_pick.key_parts(k4, "lokr_bypass_fwd")  # one token bucket
    swapped = _h200_args((64, 64, 48, 48), 3, torch.bfloat16)["lokr_bypass_fwd"]  # same sizes, other factors
    assert tl_pick.key_parts(k, "lokr_bypass_fwd") != tl_pick.key_parts(swapped, "lokr_bypass_fwd")


def test_tile_space_legality():
    """tuning/lokr.py's legality rules on an H200: merge tiles of 2048-8192 elements no larger
    than the output; one config per distinct gradient tile; the bypass's 256 threads only
    where every GEMM of a kernel has 128 rows, its fp32 fragments within the registers and its
    tiles within shared memory."""
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lokr as plans_lokr

    dev = device.synthetic()
    kron = plans_lokr.tl_configs(dev, "lokr_full_merge_fwd", (48, 48, 64, 64), 2)
    assert all(2048 <= c["BM"] * c["BN"] <= 8192 for c in kron)
    # output tiles: 7 tiles x 2 threads - the fixed config; streamed: the w2 tiles of 2048-8192 elements
    # within its 64 x 64 (32 x 64, 64 x 64), x 2 threads x 2 stages
    assert len([c for c in kron if not c.get("stream")]) == 13
    assert sorted((c["BM"], c["BN"]) for c in kron if c.get("stream")) == sorted([(32, 64), (64, 64)] * 4)
    assert plans_lokr.tl_configs(dev, "lokr_full_merge_fwd", (3, 5, 7, 4), 2) == [
        dict(BM=32, BN=64, threads=128), dict(BM=32, BN=64, threads=256)]  # output 21 x 20; w2 7 x 4: no stream
    # c = d = 64: elems 4096 and 8192 give one 64 x 64 tile; 4096 / 128 threads is the fixed config;
    # each tile and threads also in one pass (GRADS one_pass), registers or pipelined
    two_pass = [dict(elems=2048, threads=128), dict(elems=2048, threads=256), dict(elems=4096, threads=256)]
    one_pass = [dict(elems=e, threads=t, one_pass=True, stages=s) for e in (2048, 4096) for t in (128, 256)
                for s in (0, 3)]
    got = plans_lokr.tl_configs(dev, "lokr_full_merge_bwd", (48, 48, 64, 64), 2)
    assert sorted(map(str, got)) == sorted(map(str, two_pass + one_pass))
    assert plans_lokr.tl_configs(dev, "lokr_merge_bwd", (9, 9, 8, 8), 2) == []  # an 8 x 8 tile: nothing to tune
    fwd_3072 = plans_lokr.tl_configs(dev, "lokr_bypass_fwd", (48, 48, 64, 64), 2)
    assert fwd_3072 == [dict(rows=64, threads=128)]  # 64-row w1 GEMM: no 256; rows 256: 256 fp32 a thread
    fwd_4096 = plans_lokr.tl_configs(dev, "lokr_bypass_fwd", (128, 128, 32, 32), 2)
    assert dict(rows=64, threads=256) in fwd_4096 and dict(rows=256, threads=256) in fwd_4096
    for c in fwd_4096:
        (_, (_, bt), threads), = plans_lokr.tl_kernels("lokr_bypass_fwd", (128, 128, 32, 32), c)
        assert threads == c["threads"] and bt == max(1, c["rows"] // 128), c
    assert plans_lokr.tl_configs(dev, "lokr_bypass_fwd", (128,) * 4, 2) == [dict(rows=64, threads=256)]
    assert plans_lokr.tl_configs(dev, "lokr_bypass_fwd", (128,) * 4, 4) == []  # fp32 128 x 128 factors: smem


def test_generated_w2_tiles_need_warps_to_share_them():
    """A factored w2's tile is generated by ``T.gemm`` in the kernel only where the program's
    warps can share it (16 rows x 8 columns a warp): a 16 x 16 tile at 4 warps is refused
    by TileLang (the H200 run of 2026-12-05), so there the plane is generated before the
    launch; at 2 warps, or 16 x 32 at 4, it is shared. The C twin has no warps."""
    assert not lokr._warps_cover(16, 16, 128)
    assert lokr._warps_cover(16, 16, 64) and lokr._warps_cover(16, 32, 128) and lokr._warps_cover(64, 8, 128)
    assert lokr._warps_cover(32, 128, 256) and not lokr._warps_cover(16, 8, 256)
    # sm_90a's WGMMA over two warpgroups: 16 columns a warpgroup at least (sweep of 2026-12-05)
    assert lokr._warps_cover(64, 16, 256) and not lokr._warps_cover(64, 16, 256, wgmma=True)
    assert not lokr._warps_cover(128, 16, 256, wgmma=True) and lokr._warps_cover(64, 16, 128, wgmma=True)
    assert lokr._warps_cover(64, 32, 256, wgmma=True) and lokr._warps_cover(32, 16, 128, wgmma=True)
    w2a, w2b = torch.zeros(9, 5, dtype=torch.bfloat16), torch.zeros(5, 9, dtype=torch.bfloat16)
    cuda = torch.device("cuda")
    with mock.patch.object(lokr, "arch_of", lambda d: "sm_90a"):
        assert not lokr._generated(w2a, w2b, torch.bfloat16, (16, 16), cuda, 128)
        assert lokr._generated(w2a, w2b, torch.bfloat16, (16, 32), cuda, 128)
    assert lokr._generated(w2a, w2b, torch.bfloat16, (16, 16), torch.device("cpu"), 128)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [0, 3], ids=["registers", "pipelined"])
def test_one_pass_merge_bwd(stages, monkeypatch):
    """The merge backwards in one pass over G (``kron_grads_kernel``, ``GRADS["one_pass"]``) and
    one finishing launch (``kron_finish_kernel``: partial sums, casts, factor chains), the G tiles
    in registers or through a 3-stage pipeline, against the eager bodies: gradient
    tiles past w2's edge (37 x 150), several tiles (g_w1 partials) or one (direct), splits of the
    a·b entries with a tail (7 x 11 entries over 4 splits of 20: g_w2 partials) or one split
    (direct), factored and whole sides. And an inf in one (u, v) block of G stays there: the
    tile rows past w2's edge, which the pipelined copy reads from the next block, count as
    zeros (else inf·0 = nan in the other blocks' g_w1). CPU twins at fp32 (GPU: bf16)."""
    monkeypatch.setattr(lokr, "num_sms", lambda d: 64)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 64)
    dtype, dev = (torch.bfloat16, "cuda") if GPU else (torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)

    def m(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dtype).to(dev)

    cfg = dict(elems=2048, threads=128, one_pass=True, stages=stages)
    splits = []
    for (a, b, c, d) in ((3, 2, 37, 150), (7, 11, 3, 5), (1, 1, 9, 9)):
        tiles = lokr.cdiv(c, lokr._grad_tile(c, d, 2048)[0]) * lokr.cdiv(d, lokr._grad_tile(c, d, 2048)[1])
        splits.append((tiles,) + lokr.one_pass_split(a, b, tiles, dev))
        G, w1, w2 = m(a * c, b * d), m(a, b), m(c, d, scale=0.1)
        f = (m(a, 3), m(3, b), m(c, 5, scale=0.3), m(5, d, scale=0.3))
        _with_cfg("lokr_full_merge_bwd", cfg, (G, w1, w2, 0.7), dtype)
        _with_cfg("lokr_merge_bwd", cfg, (G, *f, [a, b, c, d], 0.7), dtype)
    assert splits == [(6, 1, 6), (1, 4, 20), (1, 1, 1)]  # (tiles, splits, entries a split)
    # the finishing launch's jobs (kron_finish_kernel): a chain of rank 70 (chunks of 32) with
    # several row and column chunks beside a whole side; a chain on the loop side; both chains;
    # w2's tiles generated in the pass (T.gemm, ranks 70 and 6) or read from the plane
    for (a, b, c, d), (r1, r2) in (((2, 3, 150, 300), (0, 70)), ((130, 140, 2, 3), (9, 0)),
                                   ((17, 19, 33, 35), (5, 6))):
        G = m(a * c, b * d, scale=0.1)
        f = ((m(a, r1), m(r1, b, scale=r1 ** -0.5)) if r1 else (m(a, b), None)) + (
            (m(c, r2), m(r2, d, scale=r2 ** -0.5)) if r2 else (m(c, d), None))
        _with_cfg("lokr_merge_bwd", cfg, (G, *f, [a, b, c, d], 0.7), dtype)
        # a factored w2 with tiles of at least 16 x 16: the pass generates them (r2, its last argument)
        grads = [p for p in _listed(lokr.merge_bwd, (G, *f, [a, b, c, d], 0.7), cfg)
                 if p.builder is lokr.kron_grads_kernel]
        assert [p.args[-1] for p in grads] == [r2 if r2 and min(lokr._grad_tile(c, d, 2048)) >= 16 else 0], (a, b, c, d)
    a, b, c, d = 3, 2, 37, 150
    G, w1, w2 = m(a * c, b * d), m(a, b), m(c, d, scale=0.1)
    G[c:2 * c, :d] = float("inf")  # block (u, v) = (1, 0)
    got, want = lokr.full_merge_bwd(G, w1, w2, 0.7, cfg=cfg)[0], REF.lokr_full_merge_bwd(G, w1, w2, 0.7)[0]
    assert torch.isfinite(got[[0, 2]]).all() and not torch.isfinite(got[1, 0])
    assert harness.rel_err(got[[0, 2]], want[[0, 2]]) <= harness.REL_TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [0, 3], ids=["registers", "pipelined"])
def test_streamed_merge_fwd(stages, monkeypatch):
    """The merges streamed per tile of w2 (``kron_stream_kernel``, ``KRON["stream"]``) against the
    eager bodies: w2 tiles past its edge (the output blocks' rows and columns there belong to the
    next block: masked), splits of the a·b entries with a tail (7 x 11 entries over splits of 7),
    with and without a base (its blocks in registers or a 3-stage pipeline), whole and factored
    sides, w2's tiles generated in the kernel (T.gemm; ranks 70 and 6) or read from the plane
    (tiles below 16 x 16). CPU twins at fp32 (GPU: bf16)."""
    monkeypatch.setattr(lokr, "num_sms", lambda d: 3)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 3)
    dtype, dev = (torch.bfloat16, "cuda") if GPU else (torch.float32, "cpu")
    g = torch.Generator().manual_seed(6)

    def m(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dtype).to(dev)

    assert lokr.stream_split(7, 11, 1, dev) == (11, 7)  # 12 programs wanted: 11 splits of 7, the last 7 of 77
    for (a, b, c, d), (r1, r2), tile in (((7, 11, 3, 5), (0, 0), (16, 64)), ((2, 3, 150, 300), (0, 70), (16, 128)),
                                         ((3, 4, 37, 45), (5, 6), (32, 64)), ((5, 2, 9, 9), (0, 3), (16, 64))):
        cfg = dict(BM=tile[0], BN=tile[1], threads=128, stream=True, stages=stages)
        w1, w2 = m(a, b), m(c, d, scale=0.1)
        f = ((m(a, r1), m(r1, b, scale=r1 ** -0.5)) if r1 else (w1, None)) + (
            (m(c, r2), m(r2, d, scale=r2 ** -0.5)) if r2 else (w2, None))
        for base in (None, m(a * c, b * d)):
            _with_cfg("lokr_full_merge_fwd", cfg, (w1, w2, base, 0.7), dtype)
            _with_cfg("lokr_merge_fwd", cfg, (*f, [a, b, c, d], base, 0.7), dtype)
        streams = [p for p in _listed(lokr.merge_fwd, (*f, [a, b, c, d], None, 0.7), cfg)
                   if p.builder is lokr.kron_stream_kernel]
        assert [p.args[-1] for p in streams] == [r2 if r2 and min(tile) >= 16 else 0], (a, b, c, d)


@pytest.mark.slow
@pytest.mark.cpu_only  # the GPU run checks the real kernels (test_one_pass_merge_bwd, test_streamed_merge_fwd)
@pytest.mark.parametrize("stages", [0, 3], ids=["registers", "pipelined"])
def test_new_forms_on_the_case_table(stages):
    """The streamed merges and the one-pass merge backwards over the whole case table (every
    factorization, layout, base and out_dtype it has), CPU twins at fp32 against the eager bodies."""
    forms = {"lokr_full_merge_fwd": dict(BM=16, BN=64, threads=128, stream=True, stages=stages),
             "lokr_merge_fwd": dict(BM=16, BN=64, threads=128, stream=True, stages=stages),
             "lokr_full_merge_bwd": dict(elems=2048, threads=128, one_pass=True, stages=stages),
             "lokr_merge_bwd": dict(elems=2048, threads=128, one_pass=True, stages=stages)}
    n = 0
    for case in CASES.cases(torch.float32, "cpu", False, torch.Generator().manual_seed(7)):
        if case.op in forms:
            _with_cfg(case.op, forms[case.op], case.args, torch.float32)
            n += 1
    assert n >= 10, n


@pytest.mark.slow
def test_twin_fused_bwd_staged_gx(monkeypatch):
    """The one-pass backward where its gx block goes through shared memory (16-wide factors: 4
    tokens a step, 1024 elements a block) against the reference, a token tail included. CPU
    twin at fp32; on a GPU the real kernel (bf16)."""
    monkeypatch.setattr(lokr_bypass, "WGRAD_KPER", (2, 4))
    dtype, dev = (torch.bfloat16, "cuda") if GPU else (torch.float32, "cpu")
    assert lokr_bypass.wgrads_gx_stageable(16, 16, 16, 16, 128, 128, dtype.itemsize)
    assert not lokr_bypass.wgrads_gx_stageable(3, 5, 7, 4, 128, 128, dtype.itemsize)  # the odd cases: from registers
    # the one-pass kernels fit sm_90's shared memory at the bench factors and at 128 x 64, not at
    # 256 (where bypass_bwd keeps the separate kernels)
    limit = lokr_bypass.smem_limit(torch.device("cpu")) / lokr_bypass._SMEM_MARGIN
    assert lokr_bypass.wgrads_smem(64, 64, 64, 64, 128, 128, 2, 2) <= limit
    assert lokr_bypass.wgrads_smem(128, 128, 64, 64, 128, 128, 2, 2) <= limit
    assert lokr_bypass.wgrads_smem(256, 256, 64, 64, 128, 128, 2, 0) > limit
    g = torch.Generator().manual_seed(5)

    def m(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=g)).to(dtype).to(dev)

    w1, w2 = m(16, 16, scale=0.25), m(16, 16, scale=0.25)
    for T in (1, 150):
        _with_cfg("lokr_bypass_bwd", dict(rows=128, threads=128), (m(T, 256), m(T, 256), w1, w2, 0.7), dtype)


def test_staged_apply_fits_its_pipeline():
    """The staged apply epilogue (the default, a config's ``staged`` False turns it off) only
    where its shared memory fits with the pipelined loop's two stages of X and base
    (``apply_smem``): at 64-wide factors (the bench) it runs; at 128-wide factors with a
    16-bit base the two base stages would not fit sm_90's 227 KiB (294 KiB with the planners'
    margin), so the register epilogue runs there."""
    cpu, bf = torch.device("cpu"), torch.bfloat16
    p = dict(lokr_bypass.BYPASS)
    assert lokr_bypass._apply_staged(p, 64, 64, 64, 64, bf, bf, bf, cpu)
    assert not lokr_bypass._apply_staged({**p, "staged": False}, 64, 64, 64, 64, bf, bf, bf, cpu)
    assert not lokr_bypass._apply_staged(p, 128, 128, 128, 128, bf, bf, bf, cpu)
    assert lokr_bypass._apply_staged(p, 128, 128, 128, 128, bf, bf, None, cpu)  # no base: one block staged
    # two stages of the 128 x 128 base block: 2 · 128² · 2 bytes more than with none
    assert (lokr_bypass.apply_smem(128, 128, 128, 128, 128, 2, 2, 2) - lokr_bypass.apply_smem(128, 128, 128, 128, 128, 2, 2, 0)
            == 2 * 128 * 128 * 2)


@pytest.mark.slow
@pytest.mark.nvcc
@pytest.mark.cpu_only  # on the GPU, kernels an earlier test built are cached and not captured
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-bwd"])
def test_factor_128_kernels_fit_shared_memory(monkeypatch, fused):
    """At the scope's largest factors (128) with a 16-bit base, every kernel the bypass
    launchers build compiles for sm_90a within its 227 KiB of shared memory
    (``harness.compile_failures`` reads the launch's size from the host code): the persistent
    form's staged epilogue asked for 256 KiB there until ``apply_smem`` counted its two base
    stages, and the fused backward kernels would ask for up to 448 KiB (they step aside)."""
    from lycoris_ops.backends.tilelang import common as _common
    from lycoris_ops.backends.tilelang.kernels import lora as tl_lora

    for mod in (lokr, lokr_bypass, tl_lora):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(lokr, "num_sms", lambda d: 132)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 132)
    if not fused:
        no_one_pass_fits(monkeypatch)
    bf = torch.bfloat16
    x, base, w = torch.empty(300, 128 * 128, dtype=bf), torch.empty(300, 128 * 128, dtype=bf), torch.empty(128, 128, dtype=bf)
    calls = [(lokr_bypass.bypass_fwd, (x, w, w, 0.7, base), {}), (lokr_bypass.bypass_fwd, (x, w, w, 0.7, None), {}),
             (lokr_bypass.bypass_bwd, (base, x, w, w, 0.7), {})]
    captured, failed = harness.compile_calls(calls)
    assert captured >= 4 and not failed, failed
    # the check itself: the staged epilogue with two base stages at 128 is over the limit
    over = _common.Pending(lokr_bypass.kron_apply_kernel, "sm_90a", (128, 128, 128, 128, "bfloat16", "bfloat16", "bfloat16",
                                                               128, 128, True, 16))  # staged
    (why,) = harness.compile_failures([over])
    assert "256 KiB of shared memory" in why[2], why


@pytest.mark.parametrize("run,ns", [(0, 12), (4, 12), (4, 6), (8, 12), (3, 3)])
def test_sum_partials_runs(run, ns, monkeypatch):
    """``lokr_bypass._sum_partials`` (``PARTIAL_SUM_RUN``: runs of k partials summed first where k
    divides ns and leaves two runs, else one sum) equals the plain sum of the ns partials."""
    monkeypatch.setattr(lokr_bypass, "PARTIAL_SUM_RUN", run)
    g = torch.Generator().manual_seed(11)
    part = torch.randn(ns * 5, 7, generator=g)
    got = lokr_bypass._sum_partials(part, ns, 5, 7)
    assert got.shape == (5, 7)
    torch.testing.assert_close(got, part.view(ns, 5, 7).double().sum(0).float(), rtol=1e-6, atol=1e-5)


def test_bypass_bwd_routes_by_the_one_pass_kernels_resources():
    """``bypass_bwd`` takes the one-pass kernel where its shared memory fits and its fp32
    accumulators fit a thread's registers (160 at the bench's 64-wide factors); w1 (64, 64)
    with w2 (128, 128) (D = 8192) holds 352 a thread: gx, g_w1 and g_w2 by the separate kernels."""
    assert lokr_bypass.wgrads_fragment_regs(64, 64, 64, 64, 128, 128, True) == 160
    assert lokr_bypass.wgrads_fragment_regs(64, 64, 128, 128, 128, 128, True) > lokr_bypass.WGRADS_MAX_FRAGMENT_REGS

    def built(a, c):
        x, g = torch.zeros(8, a * c), torch.zeros(8, a * c)
        with _common.capturing() as pending:
            lokr_bypass.bypass_bwd(g, x, torch.zeros(a, a), torch.zeros(c, c), 1.0)
        return sorted({p.builder.__name__ for p in pending})

    assert built(64, 64) == ["kron_finish_kernel", "kron_wgrads_kernel"]  # + the partials' sum
    assert built(64, 128) == ["kron_apply_kernel", "kron_wgrad1_kernel", "kron_wgrad2_kernel"]


@pytest.mark.slow
@pytest.mark.parametrize("gx", [True, False], ids=["one-pass-bwd", "wgrads"])
def test_wgrads_finish_launch(monkeypatch, gx):
    """The one-pass weight gradients' fp32 partials (padded planes, Ap x Bp
    and Cp x Dp) summed and cast by one ``kron_finish_kernel`` launch of two whole jobs, against
    the reference: odd factors (3 x 5, 7 x 4 in 16 x 16 planes; 20 x 3, 5 x 33 in 32 x 16, 16 x 64),
    a token tail, several splits, and a w1 of another dtype than w2 (two output dtypes in the
    launch). CPU twin at fp32 (the fp32 w1 beside fp16 operands); on a GPU the real kernel (bf16)."""
    if not gx:
        one_pass_does_not_fit(monkeypatch)
    monkeypatch.setattr(lokr_bypass, "WGRAD_KPER", (2,))
    monkeypatch.setattr(lokr, "num_sms", lambda d: 2)
    monkeypatch.setattr(lokr_bypass, "num_sms", lambda d: 2)
    dtype, dev = (torch.bfloat16, "cuda") if GPU else (torch.float16, "cpu")
    g = torch.Generator().manual_seed(13)

    def m(*s, scale=1.0, dt=dtype):
        return (scale * torch.randn(*s, generator=g)).to(dt).to(dev)

    for (a, b, c, d), T in (((3, 5, 7, 4), 150), ((20, 3, 5, 33), 333)):
        for w1_dtype in (dtype, torch.float32):
            args = (m(T, a * c), m(T, b * d), m(a, b, scale=b ** -0.5, dt=w1_dtype), m(c, d, scale=d ** -0.5), 0.7)
            built = {p.builder.__name__ for p in _listed(lokr_bypass.bypass_bwd, args, None)}
            assert {"kron_wgrads_kernel", "kron_finish_kernel"} <= built, built
            compare("lokr_bypass_bwd", args, dtype)
