"""TileLang LoRA/LoCon and tucker kernels (lycoris_ops/tilelang/lora.py, tucker.py).

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

from lycoris_ops.reference import lora as REF  # noqa: E402
from lycoris_ops.testing import lora as CASES  # noqa: E402
from lycoris_ops.tilelang import _common, lora, ops, tucker  # noqa: E402
import tilelang_harness as harness  # noqa: E402
from tilelang_harness import GPU, IDS, MATRIX, NVCC  # noqa: E402

OPS = ["lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd", "lora_tucker_fwd"]


def compare(op, args, dtype, tol=None):
    harness.compare(ops, REF, op, args, dtype, tol)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: the CUDA compile check needs it (no GPU needed)")
@pytest.mark.parametrize("arch,dtype", MATRIX, ids=[f"{a}-{IDS[d]}" for a, d in MATRIX])
def test_kernels_compile(arch, dtype):
    for family in (lora, tucker):
        for builder, args in family.compile_specs(dtype):
            k = _common.compile_only(builder, arch, *args)
            assert "__global__" in k.get_kernel_source(), (builder.__name__, args)


# ----------------------------------------------------------------------------- 2. CPU twins

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
def test_twin_core_fp16():
    """The bypass chain (h rounded to fp16 before ·upᵀ), its backward and the hada merge in fp16."""
    keep = {"bypass", "bypass-base-nc", "bypass-mixed_fp32", "bypass_bwd", "merge-hada", "tucker-1chain"}
    n = 0
    for case in CASES.cases(torch.float16, "cpu", False, torch.Generator().manual_seed(1)):
        if case.id in keep:
            compare(case.op, case.args, torch.float16)
            n += 1
    assert n == len(keep)


@pytest.mark.skipif(GPU, reason="CPU twins: the GPU run checks the real kernels")
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


# ----------------------------------------------------------------------------- 3. GPU

@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
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
