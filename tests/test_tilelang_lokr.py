"""TileLang LoKr kernels (lycoris_ops/tilelang/lokr.py).

1. Compile check without a GPU: every kernel family compiles for sm_90a (bf16)
   and sm_80 (fp16) with nvcc (``execution_backend="tvm_ffi"``); skipped when
   nvcc is not on PATH (LYCORIS_TILELANG_FULL_COMPILE=1: all four pairs).
2. CPU twins (the same builders, ``cpu=True``, C target, same host code): the
   six LoKr op functions against the eager bodies (reference/lokr.py) over the
   case table in fp32; the core contraction w1·X_t·w2ᵀ (token blocks laid side
   by side, the fp32 intermediate carried as a hi + lo pair) and its backward
   in fp16.
3. On a GPU (skipped here): the op set against the eager bodies in fp16/bf16.
"""
import inspect

import pytest
import torch

pytest.importorskip("tilelang")

from lycoris_ops.reference import lokr as REF  # noqa: E402
from lycoris_ops.testing import lokr as CASES  # noqa: E402
from lycoris_ops.tilelang import _common, lokr, ops  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import GPU, IDS, MATRIX, NVCC  # noqa: E402

OPS = ["lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
       "lokr_bypass_fwd", "lokr_bypass_bwd"]


def compare(op, args, dtype, tol=None):
    harness.compare(ops, REF, op, args, dtype, tol)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: the CUDA compile check needs it (no GPU needed)")
@pytest.mark.parametrize("arch,dtype", MATRIX, ids=[f"{a}-{IDS[d]}" for a, d in MATRIX])
def test_kernels_compile(arch, dtype):
    for builder, args in lokr.compile_specs(dtype):
        k = _common.compile_only(builder, arch, *args)
        assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


def test_opset_signatures():
    for op in OPS:
        params = list(inspect.signature(getattr(ops, op)).parameters)
        schema = [a.name for a in getattr(torch.ops.lycoris, op).default._schema.arguments]
        assert params == schema, op


@pytest.mark.skipif(GPU, reason="CPU twins: the GPU run checks the real kernels")
def test_twin_case_table_fp32():
    for case in CASES.cases(torch.float32, "cpu", False, torch.Generator().manual_seed(0)):
        compare(case.op, case.args, torch.float32)


@pytest.mark.skipif(GPU, reason="CPU twins: the GPU run checks the real kernels")
def test_twin_bypass_fp16():
    """w1·X_t·w2ᵀ with the hi/lo intermediate, and its three gradients, in fp16."""
    n = 0
    for case in CASES.cases(torch.float16, "cpu", False, torch.Generator().manual_seed(1)):
        if case.op in ("lokr_bypass_fwd", "lokr_bypass_bwd") and case.id in ("bypass_fwd-plain", "bypass_bwd-plain"):
            compare(case.op, case.args, torch.float16, tol=1e-3)  # ~1 fp16 ulp: the lo term matters
            n += 1
    assert n == 2


@pytest.mark.skipif(GPU, reason="CPU twins: the GPU run checks the real kernels")
def test_twin_token_split():
    """Enough tokens for the split token reduction of g_w1 / g_w2 (fp32 partials)."""
    g = torch.Generator().manual_seed(2)
    T, (a, b), (c, d) = 150, (3, 5), (7, 4)
    x, G = torch.randn(T, b * d, generator=g), torch.randn(T, a * c, generator=g)
    compare("lokr_bypass_bwd", (G, x, torch.randn(a, b, generator=g), torch.randn(c, d, generator=g), 0.8),
            torch.float32)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
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
