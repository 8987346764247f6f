"""Triton IA3 and add_scaled kernels (lycoris_ops/backends/triton/kernels/ia3.py, add.py) against
an fp64 oracle, under the Triton interpreter on CPU (tests/conftest.py) or on a
GPU; plus a compile-only check for sm_90 in a subprocess.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from lycoris_ops.reference import add as REF_ADD  # noqa: E402
from lycoris_ops.reference import ia3 as REF_IA3  # noqa: E402
from lycoris_ops.testing import REL_TOL, Case, cases, check_bf16_against_eager, make, rel_err  # noqa: E402
from lycoris_ops.testing import add as CASES_ADD  # noqa: E402
from lycoris_ops.testing import ia3 as CASES_IA3  # noqa: E402
from lycoris_ops.backends.triton.kernels import add as TA  # noqa: E402
from lycoris_ops.backends.triton.kernels import ia3 as TI  # noqa: E402
from lycoris_ops.backends.triton import ops  # noqa: E402
from triton_harness import run_compile_check  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and __name__ != "__main__":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _tol(*dts):
    """Tolerance of the narrowest float among the operands / output."""
    return max(REL_TOL[d] for d in dts)


def close(actual, expected, tol, what):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


# ----------------------------------------------------------------------------- oracles (fp64)


def o_ia3(x, w, ax, alpha, gamma):
    ax = ax % x.dim()
    x64 = x.double().cpu()  # no detach: the grads oracle differentiates this
    shape = [1] * x.dim()
    shape[ax] = x.shape[ax]
    return x64 * (alpha + gamma * w.double().cpu().reshape(shape))


def o_ia3_grads(grad, x, w, ax, alpha, gamma):
    xs = x.detach().double().cpu().requires_grad_()
    ws = w.detach().double().cpu().requires_grad_()
    return torch.autograd.grad(o_ia3(xs, ws, ax, alpha, gamma), (xs, ws), grad.detach().double().cpu())


def o_add(base, delta, gamma):
    return base.detach().double().cpu() + gamma * delta.detach().double().cpu().reshape(base.shape)


# ----------------------------------------------------------------------------- shared case tables


def _cases(module, dtype, op):
    gen = torch.Generator().manual_seed(0)
    return [c for c in module.cases(dtype=dtype, device=DEV, requires_grad=False, gen=gen) if c.op == op]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_ia3_fwd_cases(dtype):
    for case in _cases(CASES_IA3, dtype, "ia3_fwd"):
        x, w, ax, alpha, gamma = case.args
        y = ops.ia3_fwd(*case.args)
        ((shape, dt),) = REF_IA3.check_ia3_fwd(*case.args)
        assert y.shape == shape and y.dtype == dt and y.is_contiguous(), case.id
        tol = _tol(x.dtype, w.dtype, y.dtype)
        close(y, o_ia3(x, w, ax, alpha, gamma), tol, case.id)
        close(y, REF_IA3.ia3_fwd(*case.args), tol, case.id + " vs eager")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_ia3_bwd_cases(dtype):
    for case in _cases(CASES_IA3, dtype, "ia3_bwd"):
        grad, x, w, ax, alpha, gamma = case.args
        out = ops.ia3_bwd(*case.args)
        spec = REF_IA3.check_ia3_bwd(*case.args)
        eager = REF_IA3.ia3_bwd(*case.args)
        for name, got, (shape, dt), want, ref in zip(("gx", "gw"), out, spec,
                                                      o_ia3_grads(grad, x, w, ax, alpha, gamma), eager):
            assert got.shape == shape and got.dtype == dt and got.is_contiguous(), (case.id, name)
            tol = _tol(grad.dtype, x.dtype, w.dtype)
            close(got, want, tol, f"{case.id} {name}")
            close(got, ref, tol, f"{case.id} {name} vs eager")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_add_scaled_cases(dtype):
    for case in _cases(CASES_ADD, dtype, "add_scaled"):
        base, delta, gamma = case.args
        y = ops.add_scaled(*case.args)
        ((shape, dt),) = REF_ADD.check_add_scaled(*case.args)
        assert y.shape == shape and y.dtype == dt and y.is_contiguous(), case.id
        tol = _tol(base.dtype, delta.dtype)
        close(y, o_add(base, delta, gamma), tol, case.id)
        close(y, REF_ADD.add_scaled(*case.args), tol, case.id + " vs eager")


# ----------------------------------------------------------------------------- layouts / splits


def _mk(shape, dtype, seed, nc=False):
    return make(shape, dtype, DEV, gen=torch.Generator().manual_seed(seed), noncontiguous=nc)


# (id, x shape, channel axis, permutation applied to a contiguous tensor or None, cfg)
IA3_LAYOUTS = [
    # channel on the columns, rows split in 3 spans + column-sum reduce
    ("cols_split", (37, 19), -1, None, TI.Ia3Cfg(block_m=4, block_n=8, split=3)),
    # channel on the rows with A > 1: per-row partials + reduce over (split, A)
    ("rows_A_split", (3, 6, 5, 7), 1, None, TI.Ia3Cfg(block_m=4, block_n=8, split=2)),
    # channel on the rows with A == 1, one span: gw stored directly
    ("rows_direct", (6, 5, 7), 0, None, TI.Ia3Cfg(block_m=2, block_n=64, split=1)),
    # channels-last activations (N, C, H, W) with C stride 1: read in place
    ("nhwc_view", (2, 6, 5, 3), 1, (0, 2, 3, 1), None),
    # outer dims that do not collapse: copied contiguous (fallback)
    ("gappy", (4, 3, 5, 6), 3, (1, 0, 2, 3), TI.Ia3Cfg(block_m=8, block_n=8, split=2)),
]


@pytest.mark.parametrize("case", IA3_LAYOUTS, ids=[c[0] for c in IA3_LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_ia3_layouts(dtype, case):
    cid, shape, ax, perm, cfg = case
    if perm is None:
        x, g = _mk(shape, dtype, 1, nc=True), _mk(shape, dtype, 2)
    else:  # a permuted view whose logical shape is ``shape``
        inv = [perm.index(i) for i in range(len(perm))]
        src = tuple(shape[p] for p in perm)
        x = _mk(src, dtype, 1).permute(*inv)
        g = _mk(src, dtype, 2).permute(*inv)
        assert tuple(x.shape) == shape and not x.is_contiguous()
        in_place = TI._abc(tuple(x.shape), x.stride(), ax % x.dim()) is not None
        assert in_place == (cid != "gappy")
    w = _mk((shape[ax],), torch.float32, 3)
    alpha, gamma = 1.0, 0.6
    y = TI.ia3_fwd(x, w, ax, alpha, gamma, cfg=cfg)
    tol = _tol(dtype)
    close(y, o_ia3(x, w, ax, alpha, gamma), tol, "fwd")
    gx, gw = TI.ia3_bwd(g, x, w, ax, alpha, gamma, cfg=cfg)
    wx, ww = o_ia3_grads(g, x, w, ax, alpha, gamma)
    assert gx.dtype == dtype and gw.dtype == torch.float32
    close(gx, wx, tol, "gx")
    close(gw, ww, tol, "gw")


def test_add_scaled_layouts():
    f, h = torch.float32, torch.float16
    base = _mk((7, 6, 5), h, 4).permute(2, 0, 1)  # (5, 7, 6): 3 strided runs
    delta = _mk((5, 14, 6), f, 5)[:, ::2, :]  # (5, 7, 6) sliced
    y = TA.add_scaled(base, delta, -1.25, cfg=TA.AddCfg(block=64, num_warps=4))
    assert y.dtype == h and y.shape == base.shape and y.is_contiguous()
    close(y, o_add(base, delta, -1.25), REL_TOL[h], "permuted + sliced")
    # four strided runs: copied contiguous (fallback), delta of another shape
    b4 = _mk((3, 4, 5, 6), f, 6)[:, ::2, :, ::2].permute(0, 2, 1, 3)
    d4 = _mk((b4.numel(),), f, 7)
    close(TA.add_scaled(b4, d4, 0.5), o_add(b4, d4, 0.5), REL_TOL[f], "4 runs")


@pytest.mark.parametrize("shape,ax", [((0, 5), -1), ((4, 5, 0), 1), ((3, 0), 0), ((0, 5, 2), 1)])
def test_zero_sizes(shape, ax):
    """Empty leading or trailing dims: nothing launches (empty trailing dims once launched an
    (A, C) grid over the empty tensors: out-of-bounds reads and writes)."""
    f = torch.float32
    x, w = _mk(shape, f, 8), torch.full((shape[ax],), 0.5, dtype=f)
    assert ops.ia3_fwd(x, w, ax, 1.0, 1.0).shape == shape
    gx, gw = ops.ia3_bwd(x, x, w, ax, 1.0, 1.0)
    assert gx.shape == shape and gw.shape == w.shape and gw.abs().sum() == 0
    assert ops.add_scaled(x, x, 2.0).shape == shape


def test_idx64_paths(monkeypatch):
    """The 64-bit index variants (tensors past 2**31 elements) compute the same."""
    plans = (TI._fwd_plan, TI._bwd_plan, TA._plan)
    for plan in plans:
        plan.cache_clear()
    monkeypatch.setattr(TI, "needs_idx64", lambda *views: True)
    monkeypatch.setattr(TA, "needs_idx64", lambda *views: True)
    try:
        f = torch.float16
        for shape, ax, cfg in (((3, 6, 5, 7), 1, TI.Ia3Cfg(4, 8, 2)), ((37, 19), -1, TI.Ia3Cfg(4, 8, 3))):
            x, g, w = _mk(shape, f, 10, nc=True), _mk(shape, f, 11), _mk((shape[ax],), f, 12)
            close(TI.ia3_fwd(x, w, ax, 1.0, 0.5, cfg=cfg), o_ia3(x, w, ax, 1.0, 0.5), REL_TOL[f], "fwd")
            for got, want in zip(TI.ia3_bwd(g, x, w, ax, 1.0, 0.5, cfg=cfg), o_ia3_grads(g, x, w, ax, 1.0, 0.5)):
                close(got, want, REL_TOL[f], "bwd")
        base, delta = _mk((5, 7, 6), f, 13), _mk((7, 5, 6), f, 14).transpose(0, 1)
        close(TA.add_scaled(base, delta, 0.3, cfg=TA.AddCfg(64, 4)), o_add(base, delta, 0.3), REL_TOL[f], "add")
    finally:
        for plan in plans:
            plan.cache_clear()


# ----------------------------------------------------------------------------- compile-only (sm_90)


def _compile_all(dtype_names):
    from lycoris_ops.backends.triton.common import compile_only

    for dn in dtype_names:
        jobs = [
            (TA._add_scaled_kernel, {"base_ptr": dn, "delta_ptr": "fp32", "out_ptr": dn},
             dict(B_ND=1, D_ND=3, IDX64=dn == "bf16", BLOCK=2048), ("bs0",), 8),
            (TI._ia3_fwd_kernel, {"x_ptr": dn, "w_ptr": "fp32", "y_ptr": "fp32"},
             dict(CH_ROWS=True, X_FLAT=True, IDX64=dn == "bf16", BLOCK_M=16, BLOCK_N=256), ("s_xb",), 4),
            (TI._ia3_fwd_kernel, {"x_ptr": dn, "w_ptr": dn, "y_ptr": dn},
             dict(CH_ROWS=False, X_FLAT=True, IDX64=dn == "bf16", BLOCK_M=16, BLOCK_N=256), ("s_xc", "s_w"), 4),
            (TI._ia3_bwd_kernel, {"g_ptr": dn, "x_ptr": dn, "w_ptr": dn, "gx_ptr": dn, "part_ptr": "fp32",
                                  "gw_ptr": dn},
             dict(CH_ROWS=True, G_FLAT=False, X_FLAT=True, DIRECT=False, IDX64=dn == "bf16", BLOCK_M=8, BLOCK_N=256),
             ("s_gb", "s_xb"), 4),
            (TI._ia3_bwd_kernel, {"g_ptr": dn, "x_ptr": dn, "w_ptr": dn, "gx_ptr": dn, "part_ptr": "fp32",
                                  "gw_ptr": dn},
             dict(CH_ROWS=False, G_FLAT=True, X_FLAT=True, DIRECT=True, IDX64=dn == "bf16", BLOCK_M=16, BLOCK_N=128),
             ("s_gc", "s_xc", "s_w"), 4),
            (TI._colsum_kernel, {"part_ptr": "fp32", "gw_ptr": dn},
             dict(IDX64=dn == "bf16", BLOCK_K=16, BLOCK_C=256), (), 4),
        ]
        for fn, pointers, cx, ones, warps in jobs:
            k = compile_only(fn, pointers, cx, ones=ones, num_warps=warps)
            assert k.asm.get("cubin"), fn.__name__
            print(f"ok {fn.__name__} {dn}", flush=True)


def test_compile_sm90():
    out = run_compile_check(__file__, ["fp16", "bf16"])
    assert out.count("ok ") == 12, out


if __name__ == "__main__" and sys.argv[1:2] == ["--compile"]:
    _compile_all(sys.argv[2:])


def test_fast_launch_reuses_the_compiled_kernel_per_specialization(monkeypatch):
    """FastJIT (triton/_common.py): the first call of a key goes through the JIT, later
    ones through the compiled kernel's own launcher with the same arguments; a new
    dtype, alignment, int value, keyword or grid is a new key; a float is not; a tensor
    keyword is never cached; launch hooks and callable grids always go through the JIT.
    (The GPU suite runs every op through the real path.)"""
    from types import SimpleNamespace

    from lycoris_ops.backends.triton import common as _common

    monkeypatch.setattr(_common, "_INTERPRETED", [False])
    monkeypatch.setattr(_common, "_current_device", lambda: 0)
    monkeypatch.setattr(_common, "_raw_stream", lambda dev: 1234)
    monkeypatch.setattr(_common, "_launch_hooks", lambda: False)
    runs, jit_calls = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            runs.append(a)

    compiled = Compiled()

    class FakeJIT:
        params = [SimpleNamespace(name=n, default=d) for n, d in
                  (("x", _common._EMPTY), ("n", _common._EMPTY), ("g", _common._EMPTY),
                   ("BLOCK", _common._EMPTY), ("FLAG", False))]

        def __getitem__(self, grid):
            def call(*args, **meta):
                jit_calls.append((grid, args, meta))
                return compiled
            return call

    f = _common.FastJIT(FakeJIT())
    x = torch.zeros(64)
    f[(3,)](x, 7, 0.5, BLOCK=16)
    assert len(jit_calls) == 1 and not runs
    f[(3,)](x, 7, 0.25, BLOCK=16)  # a new float value: same key
    assert len(jit_calls) == 1
    assert runs[-1] == (3, 1, 1, 1234, "fn", "meta", None, None, None, x, 7, 0.25, 16, False)
    y = torch.zeros(64, dtype=torch.float16)
    for args, meta, grid in (((y, 7, 0.5), {"BLOCK": 16}, (3,)),            # dtype
                             ((x[1:], 7, 0.5), {"BLOCK": 16}, (3,)),        # 4-byte offset: unaligned
                             ((x, 8, 0.5), {"BLOCK": 16}, (3,)),            # int value
                             ((x, 7, 0.5), {"BLOCK": 32}, (3,)),            # keyword
                             ((x, 7, 0.5), {"BLOCK": 16}, (3, 2))):         # grid
        n = len(jit_calls)
        f[grid](*args, **meta)
        assert len(jit_calls) == n + 1, (args, meta, grid)
        f[grid](*args, **meta)
        assert len(jit_calls) == n + 1
    n = len(jit_calls)
    f[(3,)](x, 7, 0.5, BLOCK=16, FLAG=x)  # a tensor keyword: through the JIT every time
    f[(3,)](x, 7, 0.5, BLOCK=16, FLAG=x)
    assert len(jit_calls) == n + 2
    f[lambda meta: (1,)](x, 7, 0.5, BLOCK=16)
    # triton >= 3.5 always has a HookChain: empty means no hook
    assert not _common._hook_active(SimpleNamespace(calls=[])) and not _common._hook_active(None)
    assert _common._hook_active(SimpleNamespace(calls=[print])) and _common._hook_active(print)
    monkeypatch.setattr(_common, "_launch_hooks", lambda: True)
    f[(3,)](x, 7, 0.5, BLOCK=16)
    assert len(jit_calls) == n + 4


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (same strides) whose address is off the 16-byte grid."""
    span = t.untyped_storage().nbytes() // t.element_size() if t.numel() else 0
    buf = torch.empty(span + 1, device=t.device, dtype=t.dtype)
    out = buf.as_strided(t.shape, t.stride(), 1)
    out.copy_(t)
    return out


@pytest.mark.gpu  # the direct launch path runs on CUDA only
@pytest.mark.parametrize("case", [c for c in cases() if c.tensors()], ids=lambda c: f"{c.op}-{c.id}")
def test_repeated_calls_through_direct_launches(case):
    """Every op called three times on CUDA (bf16): the JIT path, then the cached direct
    launch with fresh data, then operands at unaligned addresses (a new specialization);
    each result against the eager body."""
    torch.manual_seed(0)
    base = case.to(device="cuda", dtype=torch.bfloat16)
    fresh = lambda c: c.to()  # noqa: E731  (same geometry, new buffers)
    for run in (base, fresh(base), Case(base.op, tuple(_misaligned(a) if isinstance(a, torch.Tensor)
                                                       and a.numel() else a for a in base.args), base.id)):
        check_bf16_against_eager(run)
