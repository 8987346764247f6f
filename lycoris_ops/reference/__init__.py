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


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in float32 (float64 stays float64).

    Operands keep their (compute) dtype: a 16-bit product is the exact product of
    the 16-bit values with fp32 accumulation, rounded once by the caller.
    """
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        return a.double() @ b.double()
    return a.float() @ b.float()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` already has that dtype (same result:
    ``t`` itself). A no-op ``.to`` still costs 1-2 µs of host time, several per op."""
    return t if t.dtype == dtype else t.to(dtype)


def new_empty_like_spec(ref: torch.Tensor, spec):
    """Allocate outputs from a ``check_<op>`` spec (used by the fakes)."""
    return tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in spec)
