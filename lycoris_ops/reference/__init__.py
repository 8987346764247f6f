"""Eager bodies of the 23 ops: the CPU kernels, the ``torch`` tier on CUDA and
the body the ``compile`` tier compiles. One file per family; each op's function
has the op's name and schema signature, validates with ``check_<op>`` first and
returns fresh, contiguous outputs (never an input or a view of one).

``check_<op>(same arguments)`` validates and returns the output spec, a tuple of
``(shape, dtype)`` per output: the fakes allocate from it, so shapes and errors
are the same on every device.
"""
from __future__ import annotations

import torch


#: ``torch.mm(a, b, out_dtype=torch.float32)`` (CUDA, 16-bit operands): fp32 accumulation
#: and an fp32 result straight from the tensor cores, without upcast copies of the operands
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.bmm, "dtype")
_HALF = (torch.float16, torch.bfloat16)
_WIDE = (torch.float32, torch.float64)


_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality
_F32_MAX = torch.finfo(torch.float32).max


def scalar_in(value: float, dtype: torch.dtype) -> float:
    """A float argument as arithmetic of ``dtype``'s accumulation holds it: fp32 for fp32 and
    16-bit operands (docs/ops.md §1.3 rule 4), where a finite value beyond fp32's range is ±inf,
    as its fp32 rounding is (torch's ``alpha=`` would raise on it instead); fp64 keeps it."""
    if dtype != torch.float64 and abs(value) > _F32_MAX and abs(value) != float("inf"):
        return float("inf") if value > 0 else float("-inf")
    return value


def recording(*tensors) -> bool:
    """True where autograd records an op on these tensors: grad mode on, one of them
    requires grad, and the call is not below the autograd keys. Inside an op's kernel
    (our autograd and torch.library's redispatch below them) the inputs still say
    ``requires_grad`` but nothing is recorded: there the 16-bit tensor-core paths below
    are taken, not the fp32 upcast a recorded (double-backward) product needs."""
    return (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
            and not torch._C._dispatch_tls_is_dispatch_key_excluded(_AUTOGRAD))


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in float32 (float64 stays float64).

    Operands keep their (compute) dtype: a 16-bit product is the exact product of
    the 16-bit values with fp32 accumulation, rounded once by the caller. On CUDA,
    two 16-bit operands of the same dtype go to the tensor cores with an fp32
    output (``out_dtype``): the same math as upcasting both to fp32 (every 16-bit
    product is exact in fp32) at the 16-bit GEMM rate; elsewhere, and where autograd
    records the product (double backward), they are upcast.
    """
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return a.double() @ b.double()
    if (_MM_OUT_DTYPE and a.dtype == b.dtype and a.dtype in _HALF and a.is_cuda
            and a.dim() == b.dim() and a.dim() in (2, 3)
            and not recording(a, b)):
        if a.dim() == 2:
            return torch.mm(a, b, out_dtype=torch.float32)
        if a.shape[0] == b.shape[0]:
            return torch.bmm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


_REDUCED = {torch.float16: "allow_fp16_reduced_precision_reduction",
            torch.bfloat16: "allow_bf16_reduced_precision_reduction"}


def mm_rounded(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(a @ b)`` accumulated in fp32 and rounded once to ``dtype``: ``mm32(a, b).to(dtype)``.

    On CUDA, with a and b 16-bit of ``dtype``: one cuBLAS GEMM with the 16-bit output,
    torch's reduced-precision reduction disallowed for the call, so a split reduction adds
    its partials in fp32 and the result is rounded once, as above, without the fp32 output
    and the cast pass (the same bits, measured faster: ``bench/loha_gw_gemm.py``). The flag
    is process-wide: a GEMM another thread runs meanwhile also reduces in fp32 (more precise,
    never less)."""
    if (a.is_cuda and a.dtype == b.dtype == dtype and dtype in _REDUCED and a.dim() == b.dim() == 2
            and not recording(a, b)):
        flags, name = torch.backends.cuda.matmul, _REDUCED[dtype]
        was = getattr(flags, name)
        setattr(flags, name, False)
        try:
            return torch.mm(a, b)
        finally:
            setattr(flags, name, was)
    return mm32(a, b).to(dtype)


#: the fused 16-bit-output GEMM path is taken where cuBLAS has no reason to split the reduction:
#: a short one (K <= this), or an output with enough tiles to fill the GPU (M·N >= the
#: next) and K <= the last. A split reduction may add its partial sums in 16 bits
#: (torch's default reduced-precision reduction); elsewhere the product is fp32.
GEMM_EPILOGUE_SHORT_K = 256
GEMM_EPILOGUE_MIN_OUT = 1 << 24
GEMM_EPILOGUE_MAX_K = 8192


def gemm_epilogue(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, alpha: float = 1.0,
                  base: "torch.Tensor | None" = None, base_in_place: bool = False) -> torch.Tensor:
    """``round_out(alpha·(a @ b) [+ base])``: fp32 accumulation, the scale and the add in
    fp32, one rounding to ``out_dtype``.

    On CUDA, when a and b are 16-bit of ``out_dtype`` (and base absent or of that dtype),
    one cuBLAS call does all of it (its 16-bit GEMM accumulates in fp32 and applies
    alpha and the add in fp32 before its single rounding), instead of an fp32 product
    and three fp32 passes over the output. Elsewhere: ``mm32`` and the fp32 epilogue.
    ``base_in_place`` (the fused backends' vendor paths; the eager bodies keep torch's
    addmm): base is read by the GEMM where it lies (``cublaslt.addmm``), not first
    copied into the output as ``torch.addmm`` does; that out-of-place epilogue also rounds
    once, where torch.addmm's in-place one (C = D) rounds α·a·b to 16 bits before the add
    (``bench/cublaslt_check.py`` counts the elements off by more than one rounding).
    fp32 / fp64 a, b, base and output, on any device: the same single call, α and the add
    in the GEMM's epilogue at the product's precision.
    """
    alpha = scalar_in(alpha, a.dtype)
    one_dtype = (a.dtype == b.dtype == out_dtype and a.dim() == 2 and b.dim() == 2
                 and (base is None or (base.dtype == out_dtype and base.shape == (a.shape[0], b.shape[1]))))
    # fp32 / fp64: always (a separate scale and add pass cost more than the GEMM at LoRA's
    # shapes); 16 bits: where the reduction is not split
    if one_dtype and (a.dtype in _WIDE or (
            _MM_OUT_DTYPE and a.is_cuda and a.dtype in _HALF and not recording(a, b, base)
            and (a.shape[1] <= GEMM_EPILOGUE_SHORT_K
                 or (a.shape[1] <= GEMM_EPILOGUE_MAX_K and a.shape[0] * b.shape[1] >= GEMM_EPILOGUE_MIN_OUT)))):
        if base is not None:
            if base_in_place and a.is_cuda and not recording(a, b, base):
                from lycoris_ops.reference.cublaslt import addmm

                y = addmm(base, a, b, alpha)
                if y is not None:
                    return y
            return torch.addmm(base, a, b, alpha=alpha)
        if alpha == 1.0:
            return torch.mm(a, b)
        return torch.addmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)
    y = mm32(a, b)
    if alpha != 1.0:
        y = y * alpha
    if base is not None:
        y = y + base.to(y.dtype)
    return cast(y, out_dtype)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` already has that dtype (same result:
    ``t`` itself). A no-op ``.to`` still costs host time, several times per op."""
    return t if t.dtype == dtype else t.to(dtype)


# The family modules, after the helpers they import from this package.
from lycoris_ops.reference import add, boft, dora, ia3, lokr, lora, loha, oft  # noqa: E402,F401
from lycoris_ops._library.optable import BY_NAME as _OPS  # noqa: E402


def eager(op: str):
    """The exact eager body of ``op``: the CPU kernel, and every test's oracle."""
    return getattr(globals()[_OPS[op].family], op)


def check(op: str):
    """``check_<op>``: validates a call and returns its output spec (CPU, CUDA and fake alike)."""
    return getattr(globals()[_OPS[op].family], f"check_{op}")


def step_down(op: str):
    """The body the step-down tiers (``torch``, ``compile``) run on CUDA: ``<op>_native``
    where the family has one (the token-sized math in the operands' 16-bit dtype with fp32
    accumulation, as the user's own formula runs; docs/ops.md §1.5), else the exact body."""
    family = globals()[_OPS[op].family]
    return getattr(family, f"{op}_native", None) or getattr(family, op)
