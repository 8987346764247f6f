"""TileLang add_scaled, IA3 and DoRA kernels (lycoris_ops/backends/tilelang/kernels/add.py, ia3.py, dora.py).

1. Compile check without a GPU: every kernel family of the three files compiles
   for sm_90a and sm_80 (``execution_backend="tvm_ffi"``, nvcc on PATH). By
   default (sm_90a, bf16) and (sm_80, fp16); LYCORIS_TILELANG_FULL_COMPILE=1 adds
   (sm_90a, fp16) and (sm_80, bf16).
2. The op functions end to end, checked against the eager reference run in fp64:
   on a GPU the real kernels (fp32, fp16, bf16); without one the CPU twins — the
   same builders with ``cpu=True`` (local buffers, serial loops, fp32) compiled
   for TileLang's C target, driven by the same host code (``arch_of(cpu) == "c"``).
3. The op set imports without compiling and exposes the schema signatures.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.reference import add as R_ADD  # noqa: E402
from lycoris_ops.reference import dora as R_DORA  # noqa: E402
from lycoris_ops.reference import ia3 as R_IA3  # noqa: E402
from lycoris_ops.testing import REL_TOL, rel_err  # noqa: E402
from lycoris_ops.backends.tilelang import common as _common
from lycoris_ops.backends.tilelang.kernels import add, dora, ia3  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import COMPILE_CASES, IDS, compile_part  # noqa: E402
from sweep import sweep  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _gen(seed=0):
    g = torch.Generator().manual_seed(seed)
    return g


def rnd(*shape, dtype=torch.float32, gen=None, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)


def check(actual, expected, dtype, what):
    tol = REL_TOL[dtype]
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def d64(*ts):
    return [None if t is None else t.detach().double().cpu() for t in ts]


# ----------------------------------------------------------------------------- 1. compile for the GPU

@pytest.mark.nvcc
@pytest.mark.parametrize("arch,dtype,part", COMPILE_CASES)
@pytest.mark.parametrize("family", [add, ia3, dora], ids=["add", "ia3", "dora"])
def test_kernels_compile(family, arch, dtype, part):
    for builder, args in compile_part(family.compile_specs(dtype), part):
        k = _common.compile_only(builder, arch, *args)
        assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


@pytest.mark.nvcc
def test_gpu_builds_drop_the_line_info_sections(tmp_path, monkeypatch):
    """TileLang always passes nvcc ``-lineinfo``; ``GPU_PASS_CONFIGS`` has ptxas drop the PTX
    text and line tables that embeds (4x the cubin, compiled again as a C array into the disk
    cache's library). The library in TileLang's cache holds the kernel without them."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    _common.compile_only(add.add_kernel, "sm_90a", "float16", "float32", "float16", 2, 64, 64)  # built by no other test
    libs = list(tmp_path.rglob("executable.so"))
    assert len(libs) == 1, libs
    blob = libs[0].read_bytes()
    assert b".text.add_scaled_kernel" in blob  # the cubin is in it
    assert b".nv_debug_ptx_txt" not in blob and b".nv_debug_line_sass" not in blob


# ----------------------------------------------------------------------------- 2. numerics

@pytest.mark.parametrize("dtype", DTYPES, ids=[IDS[d] for d in DTYPES])
def test_add_scaled(dtype):
    g = _gen(1)
    cases = [
        (rnd(37, 5, dtype=dtype, gen=g), rnd(5, 37, dtype=dtype, gen=g).t(), 0.3),  # non-contiguous delta
        (rnd(64, dtype=dtype, gen=g), rnd(8, 8, dtype=torch.float32, gen=g), -1.25),  # fp32 delta, reshaped
        (rnd(3, 7, 11, dtype=dtype, gen=g), rnd(3, 7, 11, dtype=dtype, gen=g), 2.0),  # odd numel: VEC 1
    ]
    for base, delta, gamma in cases:
        out = add.add_scaled(base, delta, gamma)
        assert out.shape == base.shape and out.dtype == base.dtype and out.is_contiguous()
        b, d = d64(base, delta)
        check(out, R_ADD.add_scaled(b, d.reshape(b.shape), gamma), dtype, f"add_scaled {tuple(base.shape)}")


IA3_CASES = [  # (x shape, channel_axis): channel last (split / direct), channel inside, weight axes
    ((37, 19), -1),
    ((5, 16), -1),
    ((3, 5, 4, 6), 1),
    ((19, 37), 0),
    ((4, 8), 0),
    ((3, 5, 7), 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[IDS[d] for d in DTYPES])
@pytest.mark.parametrize("shape,axis", sweep(IA3_CASES, quick=(0, 2)), ids=[f"{s}-ax{a}" for s, a in IA3_CASES])
def test_ia3(shape, axis, dtype):
    g = _gen(2)
    x = rnd(*shape, dtype=dtype, gen=g)
    w = rnd(shape[axis], dtype=torch.float32, gen=g)  # fp32 vector on a (maybe) 16-bit x
    grad = rnd(*shape, dtype=dtype, gen=g)
    for alpha, gamma in ((1.0, 0.5), (0.0, -1.5)):
        y = ia3.ia3_fwd(x, w, axis, alpha, gamma)
        assert y.dtype == torch.promote_types(x.dtype, w.dtype) and y.shape == x.shape
        x6, w6, g6 = d64(x, w, grad)
        check(y, R_IA3.ia3_fwd(x6, w6, axis, alpha, gamma), y.dtype, "ia3_fwd")
        gx, gw = ia3.ia3_bwd(grad, x, w, axis, alpha, gamma)
        rx, rw = R_IA3.ia3_bwd(g6, x6, w6, axis, alpha, gamma)
        assert gx.dtype == x.dtype and gw.dtype == w.dtype and gw.shape == w.shape
        check(gx, rx, dtype, "ia3_bwd gx")
        check(gw, rw, dtype, "ia3_bwd gw")


@pytest.mark.slow
@pytest.mark.parametrize("per_sm", [2, 16])
@pytest.mark.parametrize("shape", [(37, 19), (1000, 48), (5, 16)], ids=["tail", "split", "direct"])
def test_ia3_bwd_pipelined(shape, per_sm, monkeypatch):
    """The channel-last backward (the G and x tiles through shared memory in a pipelined loop)
    at row tails, a token split whose last split runs past the rows (per_sm 16) and one direct
    program; fp32 weights on the 16-bit activations."""
    monkeypatch.setattr(ia3, "BWD_PER_SM", per_sm)
    g = _gen(9)
    dtype = DTYPES[-1]
    x, grad = rnd(*shape, dtype=dtype, gen=g), rnd(*shape, dtype=dtype, gen=g)
    w = rnd(shape[-1], dtype=torch.float32, gen=g)
    gx, gw = ia3.ia3_bwd(grad, x, w, -1, 1.0, 0.5)
    x6, w6, g6 = d64(x, w, grad)
    rx, rw = R_IA3.ia3_bwd(g6, x6, w6, -1, 1.0, 0.5)
    check(gx, rx, dtype, "ia3_bwd gx (pipelined)")
    check(gw, rw, dtype, "ia3_bwd gw (pipelined)")


#: non-default configs inside the TileLang spaces of tuning/add.py and tuning/ia3.py (``TL_SPACE``)
ADD_CFGS = [dict(BV=128, threads=256), dict(BV=1024, threads=128)]
IA3_CFGS = [dict(vecs=256, threads=256), dict(vecs=2048, threads=128)]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", ADD_CFGS, ids=["bv128-t256", "bv1024-t128"])
def test_add_scaled_tile_configs(cfg):
    """The launcher honours a tuned ``cfg``; a tail tile and a non-contiguous delta."""
    g = _gen(5)
    dtype = DTYPES[-1]
    base, delta = rnd(301, 7, dtype=dtype, gen=g), rnd(7, 301, dtype=dtype, gen=g).t()
    out = add.add_scaled(base, delta, -0.7, cfg=cfg)
    b, d = d64(base, delta)
    check(out, R_ADD.add_scaled(b, d, -0.7), dtype, f"add_scaled {cfg}")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", IA3_CFGS, ids=["v256-t256", "v2048-t128"])
@pytest.mark.parametrize("shape,axis", [((131, 40), -1), ((3, 5, 9, 7), 1)], ids=["cols", "rows"])
def test_ia3_tile_configs(shape, axis, cfg):
    g = _gen(6)
    dtype = DTYPES[-1]
    x, grad = rnd(*shape, dtype=dtype, gen=g), rnd(*shape, dtype=dtype, gen=g)
    w = rnd(shape[axis], dtype=dtype, gen=g)
    x6, w6, g6 = d64(x, w, grad)
    check(ia3.ia3_fwd(x, w, axis, 1.0, 0.5, cfg=cfg), R_IA3.ia3_fwd(x6, w6, axis, 1.0, 0.5), dtype, "ia3_fwd")
    gx, gw = ia3.ia3_bwd(grad, x, w, axis, 1.0, 0.5, cfg=cfg)
    rx, rw = R_IA3.ia3_bwd(g6, x6, w6, axis, 1.0, 0.5)
    check(gx, rx, dtype, "ia3_bwd gx")
    check(gw, rw, dtype, "ia3_bwd gw")


DORA_CFGS = [dict(vecs=256, threads=256), dict(vecs=2048, threads=128)]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", DORA_CFGS, ids=["v256-t256", "v2048-t128"])
@pytest.mark.parametrize("row_axis", [0, 1])
def test_dora_tile_configs(row_axis, cfg):
    """DoRA's launchers honour a tuned ``cfg``: odd sizes, with delta, against the eager body."""
    g = _gen(7)
    dtype = DTYPES[-1]
    w, delta, grad = rnd(37, 45, dtype=dtype, gen=g), rnd(37, 45, dtype=dtype, gen=g, scale=0.1), rnd(37, 45, dtype=dtype, gen=g)
    ds = rnd(w.shape[row_axis], dtype=torch.float32, gen=g).abs() + 0.5
    y, n = dora.dora_fwd(w, ds, 0.8, row_axis, delta, cfg=cfg)
    ry, rn = R_DORA.dora_fwd(w, ds, 0.8, row_axis, delta)
    check(y, ry, dtype, f"dora_fwd y {cfg}")
    check(n, rn, torch.float32, f"dora_fwd norms {cfg}")
    gm, gd = dora.dora_bwd(grad, w, ds, rn, 0.8, row_axis, delta, cfg=cfg)
    rm, rd = R_DORA.dora_bwd(grad, w, ds, rn, 0.8, row_axis, delta)
    check(gm, rm, dtype, f"dora_bwd g_M {cfg}")
    check(gd, rd, dtype, f"dora_bwd g_dscale {cfg}")


@pytest.mark.slow
@pytest.mark.nvcc
def test_tile_space_corners_compile_sm90a(monkeypatch):
    """Every (tile, threads) of add_scaled's TileLang space and the extremes of IA3's and
    DoRA's (both layouts, forward and backward) compile for sm_90a: the kernels a tuned key
    may build."""
    from lycoris_ops.backends.tilelang.tuning import add as plans_add, dora as plans_dora, ia3 as plans_ia3
    from lycoris_ops.backends.tilelang import runner as tl_pick

    for mod in (add, ia3, dora):
        monkeypatch.setattr(mod, "arch_of", lambda d: "sm_90a")
    monkeypatch.setattr(ia3, "num_sms", lambda d: 132)
    monkeypatch.setattr(dora, "num_sms", lambda d: 132)
    bf = torch.bfloat16
    sp_a, sp_i = plans_add.TL_SPACE, plans_ia3.TL_SPACE
    w = torch.empty(3072, 3072, dtype=bf)
    calls = [(add.add_scaled, (w, w, 1.0), dict(BV=b, threads=t)) for b in sp_a["BV"] for t in sp_a["threads"]]
    for shape, axis in (((8192, 3072), -1), ((16, 320, 32, 32), 1)):
        x, v = torch.empty(shape, dtype=bf), torch.empty(shape[axis], dtype=bf)
        for vecs in (min(sp_i["vecs"]), max(sp_i["vecs"])):
            for t in sp_i["threads"]:
                calls.append((ia3.ia3_fwd, (x, v, axis, 1.0, 1.0), dict(vecs=vecs, threads=t)))
                calls.append((ia3.ia3_bwd, (x, x, v, axis, 1.0, 1.0), dict(vecs=vecs, threads=t)))
    sp_d = plans_dora.TL_SPACE
    ds = torch.empty(3072, dtype=bf)
    for row_axis in (0, 1):
        for vecs in (min(sp_d["vecs"]), max(sp_d["vecs"])):
            for t in sp_d["threads"]:
                calls.append((dora.dora_fwd, (w, ds, 1.0, row_axis, w), dict(vecs=vecs, threads=t)))
                calls.append((dora.dora_bwd, (w, w, ds, ds.float(), 1.0, row_axis, None), dict(vecs=vecs, threads=t)))
    with _common.capturing() as pending:
        for fn, args, cfg in calls:
            tl_pick._call(fn, args, cfg)
    assert len(pending) >= 16
    failed = harness.compile_failures(pending)
    assert not failed, failed


DORA_CASES = [(0, False), (0, True), (1, False), (1, True)]


def o_dora_fwd(w, ds, mult, row_axis, delta, eps):
    """fp64 oracle with the ε of the magnitude's real dtype (norm via sqrt of a sum of squares)."""
    m = w if delta is None else w + delta
    red = 1 - row_axis
    n = (m * m).sum(dim=red, keepdim=True).sqrt() + eps
    d = ds.reshape(-1).unsqueeze(red)
    return m * (mult * (d / n - 1) + 1), n.reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=[IDS[d] for d in DTYPES])
@pytest.mark.parametrize("row_axis,has_delta", sweep(DORA_CASES, quick=(1, 2)), ids=[f"ax{a}-{'delta' if d else 'plain'}" for a, d in DORA_CASES])
def test_dora(row_axis, has_delta, dtype):
    g = _gen(3)
    w = rnd(19, 12, dtype=dtype, gen=g)
    delta = rnd(19, 12, dtype=dtype, gen=g, scale=0.1) if has_delta else None
    # a zero norm vector: the exact-derivative term must vanish. Not at fp16: there g_M of
    # that row is grad·mult·ds/eps(fp32) ~ 1e7, past fp16's range (inf is its rounding)
    if row_axis == 0 and dtype != torch.float16:
        w[4] = 0
        if delta is not None:
            delta[4] = 0
    ds = rnd(w.shape[row_axis], dtype=torch.float32, gen=g).abs() + 0.5
    grad = rnd(19, 12, dtype=dtype, gen=g)
    w6, ds6, d6, g6 = d64(w, ds, delta, grad)
    y, n = dora.dora_fwd(w, ds, 0.7, row_axis, delta)
    yr, nr = o_dora_fwd(w6, ds6, 0.7, row_axis, d6, torch.finfo(ds.dtype).eps)
    assert y.dtype == w.dtype and n.dtype == torch.float32 and n.shape == (w.shape[row_axis],)
    check(n, nr, dtype, "dora_fwd norms")
    check(y, yr, dtype, "dora_fwd y")
    gm, gd = dora.dora_bwd(grad, w, ds, n, 0.7, row_axis, delta)
    rm, rd = R_DORA.dora_bwd(g6, w6, ds6, n.double().cpu(), 0.7, row_axis, d6)
    assert gm.dtype == w.dtype and gd.dtype == ds.dtype
    check(gm, rm, dtype, "dora_bwd g_M")
    check(gd, rd, dtype, "dora_bwd g_dscale")


# ----------------------------------------------------------------------------- 3. the op set

MY_OPS = ["add_scaled", "ia3_fwd", "ia3_bwd", "dora_fwd", "dora_bwd", "oft_fwd", "oft_bwd", "boft_fwd", "boft_bwd"]


def test_opset_import_compiles_nothing_and_signatures():
    code = (
        "import lycoris_ops, inspect\n"
        "import lycoris_ops.backends.tilelang.ops as o\n"
        "import lycoris_ops.backends.tilelang.common as c\n"
        "assert not c._kernels, 'compiled at import'\n"
        f"for op in {MY_OPS!r}:\n"
        "    fn = getattr(o, op)\n"
        "    import torch\n"
        "    want = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]\n"
        "    got = list(inspect.signature(fn).parameters)\n"
        "    assert got == want, (op, got, want)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_arch_strings():
    assert _common.arch_of(torch.device("cpu")) == "c"
    if DEV == "cuda":
        major, minor = torch.cuda.get_device_capability()
        want = "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"
        assert _common.arch_of(torch.device("cuda")) == want


def test_kernel_cache_no_recompile():
    """A repeated call with the same key returns the cached compiled kernel."""
    arch = _common.arch_of(torch.device(DEV))
    k1 = _common.kernel(add.add_kernel, arch, "float32", "float32", "float32", 4)
    k2 = _common.kernel(add.add_kernel, arch, "float32", "float32", "float32", 4)
    assert k1 is k2


# ----------------------------------------------------------------------------- 4. the macro memo (_common)

MEMO_OFF = os.environ.get(_common.MACRO_MEMO_ENV, "1").strip().lower() in ("0", "off", "false", "no")


def _memo_builder():
    _common.tl()  # the lazy import installs it
    from tilelang.language.eager import builder
    return builder


def _fill_macro(n, value):
    T = _common.lang()

    @T.macro
    def fill(B):
        for i in T.serial(n):
            B[i] = value
    return fill


def _fill_func(n, value, kernel=None):
    T = _common.lang()
    fill, K = _fill_macro(n, value), kernel or T.Kernel

    @T.prim_func
    def main(B: T.Tensor((8,), "int32")):
        with K(1) as _:
            fill(B)
    return main


@pytest.mark.skipif(MEMO_OFF, reason="LYCORIS_TILELANG_MACRO_MEMO=0 in this environment")
def test_macro_memo_installed_by_the_lazy_import():
    builder = _memo_builder()
    assert getattr(builder.mutate, "_lycoris_memo", False) and _common.macro_memo_stats()["installed"]
    code = ("import lycoris_ops.backends.tilelang.common as c\n"
            "c.tl()\n"
            "from tilelang.language.eager import builder, ast\n"
            "assert not getattr(builder.mutate, '_lycoris_memo', False) and builder.mutate is ast.mutate\n"
            "assert not c.macro_memo_stats()['installed']\n"
            "print('ok')\n")
    env = dict(os.environ, **{_common.MACRO_MEMO_ENV: "0"})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(MEMO_OFF, reason="LYCORIS_TILELANG_MACRO_MEMO=0 in this environment")
def test_macro_memo_binds_each_closure(monkeypatch):
    """A memo hit gets the calling closure's values (not the first one's): the programs equal
    TileLang's own mutate's, and a with-head that resolves to another object is a miss."""
    import threading
    builder = _memo_builder()
    if not _common.macro_memo_stats()["installed"]:  # an earlier test of this worker ran TileLang with it off
        monkeypatch.delenv(_common.MACRO_MEMO_ENV, raising=False)
        monkeypatch.setitem(_common._memo, "tried", False)
        assert _common._install_macro_memo()
    cases = [(3, 7), (5, 11), (3, 7), (6, 2)]
    before = _common.macro_memo_stats()
    got = [_fill_func(n, v).script() for n, v in cases]
    assert _common.macro_memo_stats()["hits"] > before["hits"]
    assert "range(5)" in got[1] and "= 11" in got[1] and got[0] == got[2] and got[0] != got[3]
    threaded = [None] * 8
    def build(i):
        threaded[i] = _fill_func(*cases[i % 4]).script()
    ts = [threading.Thread(target=build, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert threaded == got + got
    misses = _common.macro_memo_stats()["misses"]
    kernel = _common.lang().Kernel
    _fill_func(3, 7, lambda *a, **k: kernel(*a, **k))  # `with K(1)` no longer a kernel launch: re-parsed
    assert _common.macro_memo_stats()["misses"] == misses + 1
    monkeypatch.setattr(builder, "mutate", builder.mutate.__wrapped__)  # TileLang's own
    assert [_fill_func(n, v).script() for n, v in cases] == got


@pytest.mark.slow
@pytest.mark.skipif(MEMO_OFF, reason="LYCORIS_TILELANG_MACRO_MEMO=0 in this environment")
@pytest.mark.nvcc
def test_macro_memo_same_kernel_source(monkeypatch):
    """A T.gemm kernel (its lowering's ldmatrix/mma macros go through the memo) built twice with
    the memo and once without (no disk cache: each build lowers): the same CUDA source."""
    from lycoris_ops.backends.tilelang.kernels import lora
    builder, tilelang = _memo_builder(), _common.tl()
    fn, args = lora.compile_specs(torch.bfloat16)[0]  # bypass_fwd_kernel: 3 T.gemm
    was = tilelang.is_cache_enabled()
    tilelang.disable_cache()
    try:
        sources = []
        for _ in range(2):
            hits = _common.macro_memo_stats()["hits"]
            sources.append(_common.compile_only(fn, "sm_90a", *args).get_kernel_source())
            assert _common.macro_memo_stats()["hits"] - hits >= 8  # its lowerings lowered (11-23 hits; a cache load: 3)
        monkeypatch.setattr(builder, "mutate", builder.mutate.__wrapped__)
        sources.append(_common.compile_only(fn, "sm_90a", *args).get_kernel_source())
    finally:
        if was:
            tilelang.enable_cache()
    assert "mma" in sources[0] and sources[0] == sources[1] == sources[2]
