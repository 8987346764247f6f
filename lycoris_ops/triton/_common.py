"""Shared helpers of the Triton op set: interpreter flag, dtype maps, device
facts and the small host-side utilities the launchers share.

Nothing here touches a GPU at import time: the module imports on a machine
without CUDA (``import triton`` must succeed; the op set is absent otherwise).
Works with triton 3.6 (the H200 machine) and 3.7 (CI).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

#: Triton reads TRITON_INTERPRET when it is first imported; one process is
#: either interpreted (CPU tensors, CI) or compiled (CUDA), never both.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}

#: largest offset (in elements) that 32-bit index arithmetic can address
_I32_MAX = 2**31 - 1


def tl_dtype(dtype: torch.dtype):
    return TL_DTYPE[dtype]


def dot_dtype(compute: torch.dtype):
    """Operand dtype of ``tl.dot`` for a compute dtype.

    The compute dtype itself on a GPU. Under the interpreter bf16 dots return
    garbage (triton 3.7-3.9), so bf16 operands are upcast to fp32 there: exact,
    since the product of two bf16 values is representable in fp32 and the dot
    accumulates in fp32 anyway.
    """
    if INTERPRET and compute == torch.bfloat16:
        return tl.float32
    return TL_DTYPE[compute]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def pad_rank(r: int, lo: int = 16) -> int:
    """Rank padded to a power of two, at least ``lo`` (``tl.dot`` needs dims >= 16)."""
    return max(lo, next_pow2(r))


def extent(shape, stride) -> int:
    """Largest element offset a tensor view addresses (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    return sum((n - 1) * abs(s) for n, s in zip(shape, stride))


def needs_idx64(*views) -> bool:
    """Whether any (shape, stride) pair addresses past 32-bit offsets."""
    return any(extent(shape, stride) > _I32_MAX for shape, stride in views)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached). On CPU (the interpreter)
    a small number, which keeps the interpreted grids tiny."""
    if device.type != "cuda":
        return 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


#: a nullcontext holds no state: one instance serves every call (host time per launch)
_NO_GUARD = contextlib.nullcontext()


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU current while launching (Triton launches on the current
    device and stream); a no-op context when it already is, or on CPU."""
    device = t.device
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device.index)


def collapse(shape, stride, max_dims: int = 3):
    """Merge the dims of a strided view that are laid out like one dim.

    Returns a list of (size, stride) pairs, outermost first, whose row-major
    enumeration equals the view's (size-1 dims dropped), at least one pair
    (``[(1, 1)]`` for a single element), or ``None`` if more than ``max_dims``
    pairs remain.
    """
    dims = [(int(n), int(s)) for n, s in zip(shape, stride) if n != 1]
    if not dims:
        return [(1, 1)]
    out = [dims[-1]]
    for n, s in reversed(dims[:-1]):
        n_in, s_in = out[0]
        if s == n_in * s_in:
            out[0] = (n * n_in, s_in)
        else:
            out.insert(0, (n, s))
    return out if len(out) <= max_dims else None


def collapse_one(shape, stride):
    """(size, stride) when the view is one strided run (an empty or one-element
    view counts), else None."""
    c = collapse(shape, stride, 1)
    return None if c is None else c[0]


def compile_only(fn, pointers: dict, constexprs: dict, floats=("gamma", "alpha"), *, ones=(), div16=(),
                 num_warps: int = 4, num_stages: int = 3, arch: int = 90):
    """Compile a ``@triton.jit`` kernel for an NVIDIA target without a GPU
    (``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``).

    ``pointers`` maps pointer argument names to Triton type strings ("fp16",
    "bf16", "fp32"; all taken as 16-byte aligned, as a launch on fresh
    allocations specializes them); arguments named in ``floats`` are fp32
    scalars, every other runtime argument an i32 - except the names in ``ones``
    (specialized to the constant 1, as a launch does for a unit stride) and in
    ``div16`` (marked divisible by 16). ``constexprs`` gives every constexpr.
    Must run in a process without TRITON_INTERPRET. Returns the compiled kernel
    (``.asm`` holds "ptx" and "cubin", ``.metadata.shared`` the shared memory).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = {}, dict(constexprs), {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ones:
            sig[p.name] = "constexpr"
            consts[p.name] = 1
        elif p.name in pointers:
            sig[p.name] = "*" + pointers[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in floats:
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if p.name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs missing: {missing}")
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_path(arch: int = 90):
    """Path of the ptxas that triton uses for ``arch``, or None if unavailable."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception:
        return None
    return path if path and os.path.exists(path) else None
