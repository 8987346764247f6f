"""Shared helpers of the Triton op set: interpreter flag, dtype maps, device
facts and the small host-side utilities the launchers share.

Nothing here touches a GPU at import time: the module imports on a machine
without CUDA (``import triton`` must succeed; the op set is absent otherwise).
Works with triton 3.6 and 3.7.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
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


# =============================================================================== direct launches

#: a FastJIT holding more entries than this is emptied (varying sizes: one entry per value)
_FAST_MAX = 1024
_FAST: dict = {}
_EMPTY = inspect.Parameter.empty
#: [INTERPRET] (a list: tests of the direct path flip it on a machine without CUDA)
_INTERPRETED = [INTERPRET]


class FastJIT:
    """``fast(kernel)[grid](*args, **meta)``: a launch with Triton's per-call binding
    skipped once the same specialization has run.

    ``kernel[grid](...)`` re-derives the specialization of every argument (dtype and
    16-byte alignment of each tensor, the value class of each int), hashes it and
    builds the launch metadata on every call: more host time per launch than the
    launch itself.
    Here the first call of a key goes through Triton (compiling if needed) and keeps
    the compiled kernel; later calls with the same key launch it through its own
    launcher. The key is finer than Triton's specialization: per tensor its dtype and
    whether its address is 16-byte aligned, every int/bool/None/str by value, a float
    by type (floats are never specialized), the keyword arguments by value, the grid
    and the current device. Under the interpreter, with Triton launch hooks set (a
    profiler) or for a callable grid, every call goes through Triton.
    """

    __slots__ = ("jit", "cache", "params")

    def __init__(self, jit):
        self.jit = jit
        self.cache = {}
        self.params = getattr(jit, "params", None)

    def __getitem__(self, grid):
        if grid.__class__ is list:
            grid = tuple(grid)
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args, meta):
        if _INTERPRETED[0] or _launch_hooks() or callable(grid):
            return self.jit[grid](*args, **meta)
        dev = _current_device()
        key = [grid, dev]
        for a in args:
            c = a.__class__
            if c is float:
                key.append(float)
            elif c is int or c is bool or a is None:
                key.append(a)
            elif isinstance(a, torch.Tensor):
                key.append(a.dtype)
                key.append(a.data_ptr() & 15 == 0)
            else:
                key.append(a)
        if meta:
            key.append(tuple(meta.items()))
        key = tuple(key)
        entry = self.cache.get(key)
        if entry is None:
            return self._first(key, grid, args, meta)
        kernel, g0, g1, g2, tail = entry
        kernel.run(g0, g1, g2, _raw_stream(dev), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *tail)
        return kernel

    def _first(self, key, grid, args, meta):
        kernel = self.jit[grid](*args, **meta)
        if self.params is None or not hasattr(kernel, "packed_metadata") \
                or any(isinstance(v, torch.Tensor) for v in meta.values()):
            return kernel  # (a tensor keyword would be kept alive by the key: not cached)
        tail = []
        for p in self.params[len(args):]:
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.default is not _EMPTY:
                tail.append(p.default)
            else:  # an unbound parameter: leave it to Triton (it raised above otherwise)
                return kernel
        g = tuple(grid) + (1, 1)
        if len(self.cache) >= _FAST_MAX:
            self.cache.clear()
        self.cache[key] = (kernel, g[0], g[1], g[2], tuple(tail))
        return kernel


# module attributes (tests stand in for them on a machine without CUDA)
_current_device = torch.cuda.current_device
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def fast(jit) -> FastJIT:
    """The FastJIT of a ``@triton.jit`` kernel (one per kernel, kept for the process)."""
    f = _FAST.get(jit)
    if f is None:
        f = _FAST[jit] = FastJIT(jit)
    return f


def _hook_active(hook) -> bool:
    """A launch hook that does something: set, and for triton >= 3.5's HookChain
    (always present) holding at least one function."""
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _launch_hooks() -> bool:
    runtime = _knobs_runtime
    return runtime is not None and (_hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook))


try:  # triton >= 3.4: launch hooks live in triton.knobs
    from triton import knobs as _knobs

    _knobs_runtime = _knobs.runtime
except (ImportError, AttributeError):  # older: no knobs; CompiledKernel.launch_enter_hook (not used here)
    _knobs_runtime = None
