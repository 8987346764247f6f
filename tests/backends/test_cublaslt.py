"""``lycoris_ops.reference.cublaslt.addmm``: ``round(α·(a @ b) + base)`` into a fresh output by one cuBLASLt
call (base read where it lies), against the fp32 formula and ``torch.addmm``; the layouts it
takes, the ones it declines (None, the caller falls back), CUDA-graph capture. On CPU only the
declining is checkable: the GPU script runs the rest."""
import pytest
import torch

from lycoris_ops.reference import cublaslt as _cublaslt
from lycoris_ops.reference import gemm_epilogue


def _excess(got, base, a, b, alpha):
    """Largest |got - exact| over what one rounding of the output plus the fp32 accumulation may
    leave: eps·|exact| + 2^-16·|α|·(|a|·|b|). A 16-bit intermediate (α·a·b rounded before the
    add) overshoots it wherever the result is much smaller than the product."""
    exact = alpha * (a.double() @ b.double()) + base.double()
    eps = torch.finfo(base.dtype).eps
    allowed = eps * exact.abs() + 2.0 ** -16 * abs(alpha) * (a.double().abs() @ b.double().abs())
    return ((got.double() - exact).abs() / allowed).max().item()


def _err(got, base, a, b, alpha):
    return (got.double() - (alpha * (a.double() @ b.double()) + base.double())).norm().item()


def test_declines_cpu():
    a, b, base = torch.randn(5, 3), torch.randn(3, 4), torch.randn(5, 4)
    assert _cublaslt.addmm(base, a, b, 0.5) is None
    assert _cublaslt.addmm(base.half(), a.half(), b.half(), 0.5) is None
    # the caller's fallback: gemm_epilogue with base_in_place on CPU is the plain formula
    got = gemm_epilogue(a, b, torch.float32, 0.5, base, base_in_place=True)
    torch.testing.assert_close(got, 0.5 * (a @ b) + base)


def test_fp32_compute_type_follows_torch_matmul_precision():
    """fp32 operands run IEEE (COMPUTE_32F) unless torch's own fp32 matmuls may use TF32."""
    was = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert _cublaslt._compute_type(torch.float32) == _cublaslt._CUBLAS_COMPUTE_32F
        torch.set_float32_matmul_precision("high")
        assert _cublaslt._compute_type(torch.float32) == _cublaslt._CUBLAS_COMPUTE_32F_FAST_TF32
        assert _cublaslt._compute_type(torch.bfloat16) == _cublaslt._CUBLAS_COMPUTE_32F
    finally:
        torch.set_float32_matmul_precision(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("alpha", [1.0, -0.37])
def test_gemm_epilogue_wide_dtypes_one_call(dtype, with_base, alpha):
    """fp32 / fp64: α and base go into the GEMM call's epilogue (one op, no separate scale and add
    passes), with the formula's value and autograd through it (double backward records it)."""
    gen = torch.Generator().manual_seed(int(with_base) * 10 + int(alpha > 0))
    a = torch.randn(13, 29, generator=gen, dtype=dtype)
    b = torch.randn(29, 7, generator=gen, dtype=dtype).t().contiguous().t()  # column-major
    base = torch.randn(13, 7, generator=gen, dtype=dtype) if with_base else None
    want = alpha * (a.double() @ b.double()) + (base.double() if with_base else 0)
    with torch.profiler.profile() as prof:
        got = gemm_epilogue(a, b, dtype, alpha, base)
    assert got.dtype == dtype and got.shape == (13, 7)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert not [o for o in ops if o in ("aten::mul", "aten::add", "aten::mul_", "aten::add_")], ops
    a.requires_grad_(True)
    (ga,) = torch.autograd.grad(gemm_epilogue(a, b, dtype, alpha, base).sum(), a)
    torch.testing.assert_close(ga, alpha * torch.ones(13, 7, dtype=dtype) @ b.t())


def _col_major(t, rows, cols, ld, op):
    """The matrix cuBLAS reads from ``t``'s storage for a layout (rows, cols, ld) and op, as a
    tensor: column-major storage read with leading dimension ld, then op (T: transposed)."""
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    m = flat.as_strided((rows, cols), (1, ld), t.storage_offset())
    return m.t() if op == _cublaslt._OP_T else m


@pytest.mark.parametrize("make", [lambda: torch.randn(5, 7), lambda: torch.randn(7, 5).t(),
                                  lambda: torch.randn(5, 11)[:, 2:9], lambda: torch.randn(9, 7)[1:6],
                                  lambda: torch.randn(1, 7), lambda: torch.randn(5, 1)])
def test_operand_layout_reads_the_transpose(make):
    """``_operand(t)``: a column-major layout whose op reads tᵀ from t's own storage (CPU: the
    layout math; the GPU tests run it). Row- or column-major with any pitch; else None."""
    t = make()
    rows, cols, ld, op = _cublaslt._operand(t)
    assert ld >= rows
    assert torch.equal(_col_major(t, rows, cols, ld, op), t.t())


def test_operand_declines_other_strides_and_alignment_is_a_power_of_two():
    assert _cublaslt._operand(torch.randn(6, 8)[:, ::2]) is None
    assert _cublaslt._operand(torch.randn(4, 6, 2)[:, :, 0]) is None
    t = torch.randn(8, 64, dtype=torch.float16)
    assert _cublaslt._alignment(t, 64) == min(128, t.data_ptr() & -t.data_ptr())  # a 128-byte pitch
    assert _cublaslt._alignment(t[:, 3:], 64) == 2  # 6 bytes past a 256-aligned start
    assert _cublaslt._alignment(t, 60) <= 8  # a 120-byte pitch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc", "pitched"])
@pytest.mark.parametrize("mkn", [(37, 61, 45), (1024, 520, 768)])
def test_addmm_matches_formula(dtype, layout, mkn):
    M, K, N = mkn
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + K)
    a = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    b = torch.randn(K, N, device="cuda", generator=gen).to(dtype) * 0.1
    base = torch.randn(M, N, device="cuda", generator=gen).to(dtype)
    if layout[0] == "c":
        a = a.t().contiguous().t()
    if layout[1:] == "c":
        b = b.t().contiguous().t()
    if layout == "pitched":  # base a column slice of a wider tensor (row pitch > N)
        wide = torch.randn(M, N + 13, device="cuda", generator=gen).to(dtype)
        base = wide[:, 5:5 + N]
    base_before = base.clone()
    assert _cublaslt.available()
    got = _cublaslt.addmm(base, a, b, 0.75)
    assert got is not None, "a layout this path takes came back declined"
    assert got.shape == (M, N) and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(base, base_before), "base was written"
    assert _excess(got, base, a, b, 0.75) <= 1
    theirs = _err(torch.addmm(base, a, b, alpha=0.75), base, a, b, 0.75)
    if dtype == torch.float32:  # IEEE fp32 both (torch's default precision): accumulation order apart
        assert _err(got, base, a, b, 0.75) <= 2 * theirs + 1e-6
    else:  # at least as close to the exact result as torch.addmm, whose H200 in-place epilogue
        # rounds α·a·b to 16 bits before the add (bench/cublaslt_check.py: 2.5-5% of elements > 1 eps)
        assert _err(got, base, a, b, 0.75) <= 1.0001 * theirs


@pytest.mark.gpu
def test_addmm_declines_what_it_cannot_lay_out():
    a = torch.randn(8, 12, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(6, 20, device="cuda", dtype=torch.bfloat16)[:, ::2]  # (6, 10), neither stride 1
    base = torch.randn(8, 10, device="cuda", dtype=torch.bfloat16)
    assert _cublaslt.addmm(base, a[:, :6], b, 1.0) is None
    assert _cublaslt.addmm(base.t().contiguous().t(), a[:, :6], b.contiguous(), 1.0) is None  # column-major base
    assert _cublaslt.addmm(base.float(), a[:, :6], b.contiguous(), 1.0) is None  # mixed dtypes
    assert _cublaslt.addmm(base.double(), a[:, :6].double(), b.contiguous().double(), 1.0) is None  # fp64
    got = gemm_epilogue(a[:, :6], b, torch.bfloat16, 1.0, base, base_in_place=True)  # the fallback: torch's addmm
    assert torch.equal(got, torch.addmm(base, a[:, :6], b))


@pytest.mark.gpu
def test_addmm_cuda_graph_replay():
    M, K, N = 96, 80, 72
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    _cublaslt.addmm(base, a, b, 0.5)  # warm: plan and handle outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = _cublaslt.addmm(base, a, b, 0.5)
    assert out is not None
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        base.copy_(torch.randn_like(base))
        g.replay()
        torch.cuda.synchronize()
        assert _excess(out, base, a, b, 0.5) <= 1
