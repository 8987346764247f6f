"""Triton DoRA kernels (lycoris_ops/backends/triton/kernels/dora.py) against an fp64 oracle.

Without a GPU the kernels run under the Triton interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1); with one, on the GPU. The oracle
is the plain DoRA formula in fp64 and its gradients come from torch.autograd
(the exact derivative of ‖M‖ + ε). The compile-only check builds every kernel
for sm_90 in a subprocess without the interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from lycoris_ops.testing import REL_TOL, rel_err  # noqa: E402
from lycoris_ops.backends.triton.kernels import dora as T  # noqa: E402
from lycoris_ops.backends.triton.kernels.dora import DoraCfg  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

#: one-pass (resident) and two-pass (streamed) variants; small tiles so the
#: streamed one really loops and splits its reduction
CFGS = {
    "resident": DoraCfg(),
    "streamed": DoraCfg(resident_max=0, br=16, bc=16, split=2, num_warps=4),
}


def _oracle(w, dscale, mult, row_axis, delta, grad):
    """y, norms and the autograd gradients (g_M, g_dscale) of the DoRA formula in fp64."""
    m = w.detach().double()
    if delta is not None:
        m = m + delta.detach().double()
    m.requires_grad_(True)
    d = dscale.detach().double().reshape(-1).requires_grad_(True)
    red = 1 - row_axis
    n = torch.linalg.vector_norm(m, dim=red, keepdim=True) + torch.finfo(dscale.dtype).eps
    s = mult * (d.unsqueeze(red) / n - 1.0) + 1.0
    y = m * s
    g_m, g_d = torch.autograd.grad(y, (m, d), grad.double())
    return y.detach(), n.detach().reshape(-1), g_m, g_d


def _tol(dtype):
    return REL_TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)  # interpreter bf16 stores truncate


def _make(shape, dtype, gen, nc=False, scale=1.0):
    if nc:
        big = torch.randn(shape[0], 2 * shape[1], generator=gen, dtype=torch.float64) * scale
        return big.to(DEV, dtype)[:, ::2]
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(DEV, dtype)


@pytest.mark.parametrize("variant", list(CFGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("row_axis", [0, 1])
@pytest.mark.parametrize("with_delta", [False, True])
def test_dora_fwd_bwd(variant, dtype, row_axis, with_delta):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{variant}{dtype}{row_axis}{with_delta}".encode()))
    shape = (37, 19) if row_axis == 0 else (19, 37)
    nc = with_delta  # a strided w on half of the cases
    w = _make(shape, dtype, gen, nc=nc)
    delta = _make(shape, dtype, gen, scale=0.1) if with_delta else None
    # the usual training setup on 16-bit weights: an fp32 magnitude (ε from it)
    ddt = torch.float32 if (dtype != torch.float32 and row_axis == 0) else dtype
    ds = (torch.rand(shape[row_axis], generator=gen, dtype=torch.float64) * 3 + 1.0).to(DEV, ddt)
    if row_axis == 0:
        ds = ds.reshape(-1, 1)
    mult = 0.7 if with_delta else 1.0
    grad = _make(shape, dtype, gen, nc=not nc)
    cfg = CFGS[variant]

    y, norms = T.dora_fwd(w, ds, mult, row_axis, delta, cfg=cfg)
    y0, n0, gm0, gd0 = _oracle(w, ds, mult, row_axis, delta, grad)
    assert y.dtype == w.dtype and y.shape == w.shape and y.is_contiguous()
    assert norms.dtype == torch.float32 and norms.shape == (shape[row_axis],)
    tol = _tol(dtype)
    assert rel_err(y, y0) < tol
    assert rel_err(norms, n0) < REL_TOL[torch.float32]

    gm, gd = T.dora_bwd(grad, w, ds, norms, mult, row_axis, delta, cfg=cfg)
    assert gm.dtype == w.dtype and gm.shape == w.shape
    assert gd.dtype == ds.dtype and gd.shape == (shape[row_axis],)
    assert rel_err(gm, gm0) < tol
    assert rel_err(gd, gd0) < max(_tol(ds.dtype), 1e-4)


def test_dora_mult_zero_and_zero_row():
    """mult = 0 is the identity; a zero norm vector gives a finite gradient."""
    gen = torch.Generator().manual_seed(3)
    w = _make((6, 27), torch.float32, gen)
    w[2] = 0.0
    ds = torch.rand(6, generator=gen).to(DEV) + 1
    grad = _make((6, 27), torch.float32, gen)
    for cfg in CFGS.values():
        y, n = T.dora_fwd(w, ds, 0.0, 0, None, cfg=cfg)
        assert rel_err(y, w) < 1e-6
        y, n = T.dora_fwd(w, ds, 1.0, 0, None, cfg=cfg)
        gm, gd = T.dora_bwd(grad, w, ds, n, 1.0, 0, None, cfg=cfg)
        assert torch.isfinite(gm).all() and torch.isfinite(gd).all()
        _, _, gm0, gd0 = _oracle(w, ds, 1.0, 0, None, grad)
        gm0[2] = (ds[2].double() / n[2].double()) * grad[2].double()  # autograd of ‖0‖ is nan-free by convention
        assert rel_err(gm, gm0) < REL_TOL[torch.float32]


_COMPILE = textwrap.dedent("""
    import os, sys
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    import triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from lycoris_ops.backends.triton.kernels import dora as D

    FLOATS = {"mult", "eps"}
    def build(kernel, consts, ptrs):
        sig = {}
        for n in kernel.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = ptrs.get(n, "*fp32")
            else:
                sig[n] = "fp32" if n in FLOATS else "i32"
        c = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=8))
        assert c.asm.get("cubin"), kernel.__name__
        print("ok", kernel.__name__, flush=True)

    bf = {n: "*bf16" for n in ("w_ptr", "d_ptr", "y_ptr", "g_ptr", "gm_ptr")}
    build(D._dora_fwd_resident, dict(HAS_DELTA=True, IDX64=False, BR=4, BC=4096), bf)
    build(D._dora_sumsq, dict(HAS_DELTA=True, FINAL=False, IDX64=False, BR=128, BC=32), bf)
    build(D._dora_scale, dict(HAS_DELTA=True, SPLIT=5, SPLIT_P=8, IDX64=True, BR=128, BC=32), bf)
    build(D._dora_bwd_resident, dict(HAS_DELTA=True, IDX64=False, BR=2, BC=4096), bf)
    build(D._dora_bwd_reduce, dict(HAS_DELTA=False, IDX64=False, BR=4, BC=512), bf)
    build(D._dora_bwd_apply, dict(HAS_DELTA=True, SPLIT=3, SPLIT_P=4, IDX64=False, BR=4, BC=512), bf)
""")


def test_dora_kernels_compile_sm90():
    """Every DoRA kernel compiles to a cubin for sm_90 (no GPU needed; own process,
    since a process is either interpreted or compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == 6
