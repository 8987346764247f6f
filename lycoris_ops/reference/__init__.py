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
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))):
        if a.dim() == 2:
            return torch.mm(a, b, out_dtype=torch.float32)
        if a.shape[0] == b.shape[0]:
            return torch.bmm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` already has that dtype (same result:
    ``t`` itself). A no-op ``.to`` still costs 1-2 µs of host time, several per op."""
    return t if t.dtype == dtype else t.to(dtype)


def new_empty_like_spec(ref: torch.Tensor, spec):
    """Allocate outputs from a ``check_<op>`` spec (used by the fakes)."""
    return tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in spec)
