"""Shared helpers of the TileLang op set: the lazy ``tilelang`` import, the
target arch of a device, and the per-process kernel cache.

Nothing here imports tilelang or compiles at import time. A kernel family is a
*builder*: a plain function of static, hashable arguments (dtypes as strings,
sizes, tile parameters, flags) that returns a ``T.prim_func``. ``kernel(builder,
arch, *args)`` compiles it once per process for that key (TileLang keeps its own
disk cache under ``~/.tilelang/cache`` / ``TILELANG_CACHE_DIR`` too, keyed by the
generated program and the target), so a repeated call never recompiles. Sizes
that vary from call to call (the token count, ...) are ``T.dynamic`` variables
inside the builders, not key entries.

``compile_only(builder, arch, *args)`` compiles without caching or running
(the CI check: nvcc on PATH, no GPU needed).

``capturing()`` (for ``plans/tilelang.py``'s precompile): while active on a thread,
``kernel`` records each kernel it would build there and returns a stand-in whose
launch does nothing, so an op function run once lists the kernels of its first call.
"""
from __future__ import annotations

import functools
import os
import re
import threading
import time
from typing import Callable, Dict, Tuple

import torch

__all__ = [
    "tl", "lang", "TL_DTYPE", "tl_dtype", "arch_of", "arch_of_capability", "target_of", "kernel", "compile_only",
    "clear", "stats", "cdiv", "next_pow2", "num_sms", "aligned", "device_guard", "EXECUTION_BACKEND",
    "capturing", "Pending", "launch_config", "BuildError",
]

EXECUTION_BACKEND = "tvm_ffi"
#: pass configs of a GPU build. TileLang always passes nvcc ``-lineinfo``, which embeds the
#: kernel's PTX text and line tables in the cubin (about 4x its size); the cubin is then
#: written into a C array and compiled by the host compiler for the disk cache, seconds
#: per kernel. ptxas drops those sections (the kernel code is byte-identical).
GPU_PASS_CONFIGS = {"tl.device_compile_flags": ["-Xptxas", "--suppress-debug-info"]}
#: pseudo-arch of the CPU twins (see ``arch_of``)
CPU_ARCH = "c"

TL_DTYPE = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}

_lock = threading.Lock()
_kernels: Dict[Tuple, object] = {}
#: kernels built in this process and the seconds spent building them (a compile, or a
#: load from TileLang's disk cache: the cost a warm cache leaves)
_stats = {"kernels": 0, "build_s": 0.0}
_capture = threading.local()
#: (builder, arch, args) -> the BuildError of a kernel TileLang could not build: raised again
#: without a second attempt (a failed build costs seconds)
_failed: Dict[Tuple, "BuildError"] = {}


class BuildError(RuntimeError):
    """TileLang could not build a kernel (its lowering or nvcc refused it): the op set's
    caller (``plans/tilelang.run``) steps down to the op's eager body."""


class Pending:
    """A kernel ``kernel`` would build: ``build()`` builds it (into TileLang's disk cache)."""

    def __init__(self, builder: Callable, arch: str, args: tuple):
        self.builder, self.arch, self.args = builder, arch, args
        self.key = kernel_key(builder, arch, args)

    def build(self):
        compile_only(self.builder, self.arch, *self.args)


def _no_launch(*args, **kwargs):
    return None


class capturing:
    """``with capturing() as pending:`` kernels this thread's ``kernel`` calls would build
    are listed in ``pending`` (once each) instead of built; their launches do nothing."""

    def __enter__(self):
        self.pending, self._seen = [], set()
        _capture.active = self
        return self.pending

    def __exit__(self, *exc):
        _capture.active = None
        return False


def launch_config(fixed: dict, cfg) -> dict:
    """A launcher's parameters: its ``fixed`` config with a tuned ``cfg``'s keys over it
    (``cfg`` None or ``{}``: the fixed one; plans/tilelang.py passes the tuner's pick)."""
    return fixed if not cfg else {**fixed, **cfg}


def tl():
    """The ``tilelang`` module (imported on first use)."""
    import tilelang
    return tilelang


def lang():
    """``tilelang.language`` (imported on first use; builders ``import tilelang.language as T``)."""
    import tilelang.language as lang
    return lang


def tl_dtype(dtype: torch.dtype) -> str:
    return TL_DTYPE[dtype]


def arch_of(device: torch.device) -> str:
    """The nvcc arch TileLang compiles for on ``device``: ``sm_90a`` on a 9.0 device
    (plain sm_90 lacks the wgmma/TMA features TileLang's Hopper path needs),
    ``sm_XY`` otherwise; ``"c"`` for a CPU tensor (the CPU twins: each builder's
    ``cpu=True`` form, fp32, compiled for TileLang's C target — tests only)."""
    if device.type == "cpu":
        return CPU_ARCH
    return arch_of_capability(torch.cuda.get_device_capability(device))


def arch_of_capability(capability) -> str:
    """``arch_of`` for a compute capability (major, minor)."""
    major, minor = capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def target_of(arch: str) -> dict:
    return {"kind": "cuda", "arch": arch}


def compile_only(builder: Callable, arch: str, *args, backend: str = EXECUTION_BACKEND):
    """Compile ``builder(*args)`` for ``arch`` (no cache lookup in this process;
    TileLang's disk cache still applies). Returns the compiled kernel. ``arch="c"``
    compiles the builder's CPU twin (``builder(*args, cpu=True)``, C target)."""
    if arch == CPU_ARCH:
        # no vectorization: the C target's fp16 vector casts (float4 -> half4) do not compile
        return tl().compile(builder(*args, cpu=True), target="c", execution_backend="cython",
                            pass_configs={"tirx.disable_vectorize": True})
    func = builder(*args)
    configs = dict(GPU_PASS_CONFIGS)
    if not WARP_SPECIALIZE or (func.attrs is not None and NO_WS_ATTR in func.attrs):
        configs["tl.disable_warp_specialized"] = True
    return tl().compile(func, target=target_of(arch), execution_backend=backend, pass_configs=configs)


#: False (``LYCORIS_TILELANG_WS=off`` at import): no kernel is warp-specialized - an A/B
#: switch for benchmarks (a process compiles one way; TileLang's disk cache keys the configs)
WARP_SPECIALIZE = os.environ.get("LYCORIS_TILELANG_WS", "auto").lower() not in ("off", "0", "false")
#: the function attribute of ``without_warp_specialization``
NO_WS_ATTR = "lycoris.no_warp_specialization"


def without_warp_specialization(func):
    """``func`` (a builder's prim_func) marked to compile without TileLang's producer/consumer
    warp specialization. A warp-specialized program on sm_90a takes 256 threads at up to 240
    registers: one program an SM. Kernels whose programs run a serial phase (a loop that is
    not the pipelined one) want several programs an SM to hide it instead."""
    return func.with_attr(NO_WS_ATTR, True)


def kernel_key(builder: Callable, arch: str, args: tuple) -> tuple:
    """The per-process cache key of ``kernel(builder, arch, *args)``."""
    return builder.__module__, builder.__qualname__, arch, args


def kernel(builder: Callable, arch: str, *args):
    """The compiled kernel of ``builder(*args)`` for ``arch``, cached per process
    by (builder, arch, args)."""
    key = kernel_key(builder, arch, args)
    k = _kernels.get(key)
    cap = getattr(_capture, "active", None)
    if cap is not None:  # listing, not launching (a kernel built already needs no build)
        if k is None and key not in cap._seen:
            cap._seen.add(key)
            cap.pending.append(Pending(builder, arch, args))
        return _no_launch
    if k is None:
        with _lock:
            k = _kernels.get(key)
            if k is None:
                if key in _failed:
                    raise _failed[key]
                t0 = time.perf_counter()
                try:
                    k = compile_only(builder, arch, *args)
                except Exception as exc:
                    _failed[key] = BuildError(f"TileLang could not build {builder.__qualname__}{args} for {arch}: "
                                              f"{type(exc).__name__}: {_first_error(str(exc))}")
                    raise _failed[key] from exc
                _stats["kernels"] += 1
                _stats["build_s"] += time.perf_counter() - t0
                _kernels[key] = k
    return k


def _first_error(text: str) -> str:
    """The line of a compiler's output that says what failed (nvcc's ``file(line): error: …``),
    else its first non-empty line; at most 300 characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if re.search(r"error:\s*\S", ln, re.IGNORECASE)]
    return (said or lines or [""])[0][:300]


def stats() -> Dict[str, float]:
    """``{"kernels": built in this process, "build_s": seconds spent building them}``."""
    return dict(_stats)


def clear() -> None:
    """Forget the compiled kernels of this process."""
    with _lock:
        _kernels.clear()
        _failed.clear()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


#: sm_90's opt-in shared memory per block: the budget the staged forms plan against
SMEM_SM90A = 227 * 1024


@functools.lru_cache(maxsize=None)
def _optin_smem(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_SM90A)


def smem_limit(device: torch.device, most: int = SMEM_SM90A) -> int:
    """Shared-memory bytes a block may ask for on ``device``: ``most``, or the device's opt-in
    per-block maximum where that is lower (163 KiB on sm_80); CPU twins: ``most``."""
    if device.type != "cuda":
        return most
    return min(most, _optin_smem(device.index if device.index is not None else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # CPU twins: small grids
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def aligned(t: torch.Tensor, align: int = 16) -> torch.Tensor:
    """``t`` itself when its data pointer is ``align``-byte aligned (the kernels use
    16-byte vector accesses from each buffer's base), else an aligned copy."""
    if t.data_ptr() % align == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def device_guard(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` when t is not on the current device, else a no-op
    context (TileLang launches on the current device and torch's current stream)."""
    import contextlib
    if t.device.type != "cuda" or t.device.index is None or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)
