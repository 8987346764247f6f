"""``D = α·(A @ B) + C`` into a fresh D, C read where it lies: one cuBLASLt call.

``torch.addmm(base, a, b, alpha=α)`` must write its result into a new tensor, and cuBLAS
(the API torch calls) only computes ``C ← α·A·B + β·C`` in place, so torch first copies
``base`` into the output (a device-to-device copy of the output's size before the GEMM). cuBLASLt
takes separate C and D: the GEMM reads base in its epilogue and writes D once, as the math
reads. The math of the addmm with one rounding: fp32 accumulation, α and the add in fp32,
then D's dtype; split-K reductions only in fp32 (the reduced-precision reduction of the
16-bit output is masked out). This out-of-place epilogue is also the more exact of the
two: torch.addmm's in-place one leaves some elements more than one rounding from the exact
result (``bench/cublaslt_check.py`` counts them). ``LYCORIS_CUBLASLT=0``
turns the path off (torch.addmm everywhere).

The library is the one torch's CUDA build already loaded (found in ``/proc/self/maps``),
called through ctypes: no CUDA headers at build time, nothing on CPU builds. ``addmm``
returns None wherever this path does not apply (CPU, dtypes, layouts, a library or a
status that says no) and the caller falls back to ``torch.addmm``; it never raises for
those. The descriptors and the heuristic's algorithm are cached per shape, strides,
dtype and alignment; the workspace comes from torch's caching allocator on the current
stream, so the call is CUDA-graph capturable.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from typing import Optional

import torch

from lycoris_ops import settings
from lycoris_ops._library.launch_record import foreign_work

__all__ = ["addmm", "available"]

# cuBLASLt / CUDA enums (cublasLt.h, library_types.h, cublas_api.h)
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_REDUCTION_COMPUTE_TYPE = 2  # split-K partials in fp32 only (no in-place or 16-bit reduction)
_SZ4, _SZ8 = ctypes.c_size_t(4), ctypes.c_size_t(8)  # size_t arguments, passed as such
_DTYPES = {torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF, torch.float32: _CUDA_R_32F}
#: the most workspace the heuristic may ask for (torch's own cuBLASLt default on Hopper)
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lock = threading.Lock()
_state: dict = {}


def _library() -> Optional[ctypes.CDLL]:
    """cuBLASLt as torch loaded it (libtorch_cuda needs it), or None."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    if settings.get("LYCORIS_CUBLASLT") and torch.cuda.is_available():
        try:
            with open("/proc/self/maps") as maps:
                paths = [ln.split()[-1] for ln in maps if "libcublasLt.so" in ln]
            if paths:
                lib = ctypes.CDLL(paths[0])
                for name in ("cublasLtCreate", "cublasLtMatmul", "cublasLtMatmulAlgoGetHeuristic"):
                    getattr(lib, name)
        except (OSError, AttributeError):
            lib = None
    _state["lib"] = lib
    return lib


def available() -> bool:
    """Whether ``addmm`` can run here (a CUDA build of torch with cuBLASLt loaded)."""
    return _library() is not None


def _handle(lib, device: int):
    """One handle per device (cuBLASLt reads the current device's properties at creation)."""
    handles = _state.setdefault("handles", {})
    if device not in handles:
        h = ctypes.c_void_p()
        with torch.cuda.device(device):
            handles[device] = h if lib.cublasLtCreate(ctypes.byref(h)) == 0 else None
    return handles[device]


def _pow2_dividing(*values: int) -> int:
    """The largest power of two (<= 256) dividing every value."""
    a = 256
    for v in values:
        while a > 1 and v % a:
            a //= 2
    return a


def _alignment(t: torch.Tensor, ld: int) -> int:
    """The largest power of two (<= 256) dividing the data pointer and the row pitch in bytes."""
    return _pow2_dividing(t.data_ptr(), ld * t.element_size())


def _operand(t: torch.Tensor):
    """Column-major layout (rows, cols, ld) and op of a 2-D ``t`` such that op(layout) is ``t``ᵀ,
    for row-major or column-major ``t``; None for other strides."""
    r, c = t.shape
    s0, s1 = t.stride()
    if s1 == 1 and s0 >= max(c, 1):
        return (c, r, s0, _OP_N)
    if s0 == 1 and s1 >= max(r, 1):
        return (r, c, s1, _OP_T)
    return None


@functools.lru_cache(maxsize=256)
def _plan(key):
    """Descriptors and the heuristic's first algorithm for one call signature, or None."""
    (device, lay_a, lay_b, lay_c, lay_d, dtype, align, compute) = key
    lib = _library()
    h = _handle(lib, device) if lib is not None else None
    if h is None:
        return None
    desc = ctypes.c_void_p()
    if lib.cublasLtMatmulDescCreate(ctypes.byref(desc), compute, _CUDA_R_32F) != 0:
        return None
    for attr, op in ((_DESC_TRANSA, lay_a[3]), (_DESC_TRANSB, lay_b[3])):
        v = ctypes.c_int32(op)
        if lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), _SZ4) != 0:
            return None
    layouts = []
    for rows, cols, ld in (lay_a[:3], lay_b[:3], lay_c, lay_d):
        lay = ctypes.c_void_p()
        if lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                          ctypes.c_int64(ld)) != 0:
            return None
        layouts.append(lay)
    pref = ctypes.c_void_p()
    if lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)) != 0:
        return None
    ws = ctypes.c_uint64(WORKSPACE_BYTES)
    mask = ctypes.c_uint32(_REDUCTION_COMPUTE_TYPE)
    ok = lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), _SZ8) == 0
    ok = ok and lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.byref(mask),
                                                         _SZ4) == 0
    for name, a in zip("abcd", align):
        v = ctypes.c_uint32(a)
        ok = ok and lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MIN_ALIGNMENT[name], ctypes.byref(v), _SZ4) == 0
    result, count = _Heuristic(), ctypes.c_int(0)
    ok = ok and lib.cublasLtMatmulAlgoGetHeuristic(h, desc, layouts[0], layouts[1], layouts[2], layouts[3], pref, 1,
                                                   ctypes.byref(result), ctypes.byref(count)) == 0
    lib.cublasLtMatmulPreferenceDestroy(pref)
    if not ok or count.value < 1 or result.state != 0:
        return None
    return h, desc, layouts, result.algo, int(result.workspace_size)


def addmm(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> Optional[torch.Tensor]:
    """``round(α·(a @ b) + base)`` as a new contiguous (M, N) tensor, or None where this path does
    not apply (the caller then uses ``torch.addmm(base, a, b, alpha=alpha)``, the same math).

    a (M, K), b (K, N), base (M, N) with unit column stride; all three CUDA, on one device, of
    one dtype (fp16, bf16 or fp32); any row-major or column-major a and b."""
    if not (a.is_cuda and a.dtype == b.dtype == base.dtype and a.dtype in _DTYPES and a.dim() == b.dim() == 2
            and base.dim() == 2 and a.device == b.device == base.device):
        return None
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or base.shape != (M, N) or M == 0 or N == 0 or K == 0 or base.stride(1) != 1 \
            or base.stride(0) < max(N, 1):
        return None
    plan = _prepare(base, a, b)
    if plan is None:
        return None
    out = torch.empty((M, N), device=a.device, dtype=a.dtype)
    if out.data_ptr() % 256:  # the plan assumed the allocator's alignment (another allocator: decline)
        return None
    foreign_work("cublasLtMatmul")  # invisible to the launch recorder: this call's signature stays in Python
    return out if _matmul(plan, a, b, base, out, alpha) == 0 else None


def _compute_type(dtype: torch.dtype) -> int:
    """fp32 accumulation; fp32 operands on TF32 tensor cores only where torch's own fp32 matmuls
    are (``torch.get_float32_matmul_precision()`` other than "highest"), as torch.addmm would."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return _CUBLAS_COMPUTE_32F_FAST_TF32
    return _CUBLAS_COMPUTE_32F


def _prepare(base, a, b):
    """The cached plan for ``addmm``'s checked arguments (D a fresh contiguous (M, N) tensor), or None."""
    M = a.shape[0]
    N = b.shape[1]
    # row-major D = α·A·B + C is column-major Dᵀ = α·Bᵀ·Aᵀ + Cᵀ: cuBLAS's A is b, its B is a
    lay_a, lay_b = _operand(b), _operand(a)
    if lay_a is None or lay_b is None or _library() is None:
        return None
    # a fresh output starts on the caching allocator's 512-byte granule: its pitch decides
    align = (_alignment(b, lay_a[2]), _alignment(a, lay_b[2]), _alignment(base, base.stride(0)),
             _pow2_dividing(N * a.element_size()))
    key = (a.device.index if a.device.index is not None else torch.cuda.current_device(), lay_a, lay_b,
           (N, M, base.stride(0)), (N, M, N), _DTYPES[a.dtype], align, _compute_type(a.dtype))
    with _lock:
        return _plan(key)


def _matmul(plan, a, b, c, d, alpha: float) -> int:
    """One cublasLtMatmul of a plan: d = α·(a @ b) + c (row-major views); its status."""
    h, desc, layouts, algo, ws_size = plan
    ws = torch.empty((max(ws_size, 1),), device=a.device, dtype=torch.uint8)
    alpha_v, beta_v = ctypes.c_float(alpha), ctypes.c_float(1.0)
    stream = ctypes.c_void_p(torch.cuda.current_stream(a.device).cuda_stream)
    with torch.cuda.device(a.device):
        return _library().cublasLtMatmul(
            h, desc, ctypes.byref(alpha_v), ctypes.c_void_p(b.data_ptr()), layouts[0], ctypes.c_void_p(a.data_ptr()),
            layouts[1], ctypes.byref(beta_v), ctypes.c_void_p(c.data_ptr()), layouts[2],
            ctypes.c_void_p(d.data_ptr()), layouts[3], ctypes.byref(algo), ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_size_t(ws_size), stream)


def describe(base, a, b) -> dict:
    """The plan ``addmm`` would run for these arguments: the algorithm's config and capabilities
    (bench/cublaslt_check.py; empty where the path does not apply)."""
    plan = _prepare(base, a, b)
    if plan is None:
        return {}
    h, desc, layouts, algo, ws_size = plan
    lib, out = _library(), {"workspace": ws_size}
    for name, attr in (("tile", 1), ("split_k", 2), ("reduction", 3), ("stages", 6)):
        v, n = ctypes.c_uint32(0), ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), _SZ4, ctypes.byref(n)) == 0:
            out[name] = v.value
    v, n = ctypes.c_int32(0), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), 4, ctypes.byref(v), _SZ4, ctypes.byref(n)) == 0:
        out["out_of_place"] = v.value
    return out
