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

``capturing()`` (for ``backends/tilelang/runner.py``'s precompile): while active on a thread,
``kernel`` records each kernel it would build there and returns a stand-in whose
launch does nothing, so an op function run once lists the kernels of its first call.
"""
from __future__ import annotations

import collections
import functools
import os
import re
import threading
import time
import types
from typing import Callable, Dict, Tuple

import torch

from lycoris_ops import settings

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
    caller (``runner.run``) steps down to the op's eager body."""


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
    (``cfg`` None or ``{}``: the fixed one; backends/tilelang/runner.py passes the tuner's pick)."""
    return fixed if not cfg else {**fixed, **cfg}


def tl():
    """The ``tilelang`` module (imported on first use; installs the macro memo once)."""
    import tilelang
    if not _memo["tried"]:
        _first_use()
    return tilelang


def lang():
    """``tilelang.language`` (imported on first use; builders ``import tilelang.language as T``)."""
    import tilelang.language as lang
    if not _memo["tried"]:
        _first_use()
    return lang


def _first_use() -> None:
    """Once per process, after ``import tilelang``: Ctrl-C during a build stays a
    ``KeyboardInterrupt`` (tvm_ffi turns an exception type it does not know, raised in the
    Python callback that runs nvcc, into a bare ``RuntimeError``: callers took it for a
    kernel that cannot build and went on); then the macro memo."""
    from tvm_ffi import register_error

    register_error("KeyboardInterrupt", KeyboardInterrupt)
    _install_macro_memo()


# ----------------------------------------------------------------------------- the macro memo
#
# TileLang's ``T.macro`` / ``T.prim_func`` call ``tilelang.language.eager.builder.mutate(func)``
# on every call: it reads ``func``'s source, parses it, rewrites the AST (DSLMutator) and
# compiles it into a ``make_closure(<nonlocals>)`` that it calls with the closure's values.
# Each T.gemm lowering defines its ldmatrix/mma macros anew (nested functions closing over
# that lowering's emitter, buffers and offsets), so one build parses the same five functions
# again and again (about a tenth of a build's time, bench/tilelang_build_profile.py); with
# the memo nearly all of them are hits, the CUDA source byte-identical.
#
# What ``mutate`` produces depends on the function's code (its source text, file, free
# variable names), its globals dict (the closure's code runs in it, by reference) and the
# closure values in only two ways: ``make_closure`` is called with them (so the result's
# ``gen`` is a fresh function whose cells hold them), and the rewrite evaluates a few
# expressions with them (``_try_eval``: a ``with X(...)`` head, to tell a kernel launch, and
# a parameter's ``A: T.Tensor`` / ``x: T.float32`` annotation). The memo keeps, per code
# object (the same object, held), globals dict and free-variable names, the compiled inner
# function's code, the unparsed source, the extra type hints and the outcome of each
# ``_try_eval``; a later call re-evaluates those expressions with its own closure and uses
# the entry only if each gives the identical object, then binds the current closure values
# into fresh cells - what ``make_closure(**nonlocals)`` does. It never hands out another
# closure's values. ``LYCORIS_TILELANG_MACRO_MEMO=0`` turns it off (read at the first import).

MACRO_MEMO_ENV = "LYCORIS_TILELANG_MACRO_MEMO"
#: entries at most (distinct function definitions; the oldest used goes first)
MACRO_MEMO_SIZE = 1024
_memo = {"tried": False, "installed": False, "hits": 0, "misses": 0, "uncached": 0}
_memo_lock = threading.Lock()
_memo_entries: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_memo_log = threading.local()  # .log: the _try_eval outcomes of the mutate running on this thread
_NESTED = object()  # a log entry: a mutate ran inside this one (its evaluations are not listed here)


def macro_memo_stats() -> Dict[str, int]:
    """``{"installed", "hits", "misses", "uncached", "entries"}`` of the macro memo."""
    return {"installed": int(_memo["installed"]), "hits": _memo["hits"], "misses": _memo["misses"],
            "uncached": _memo["uncached"], "entries": len(_memo_entries)}


def _code_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _install_macro_memo() -> bool:
    """Wrap ``tilelang.language.eager.builder.mutate`` with the memo (once per process; True
    when installed). Does nothing when turned off or when TileLang's layout is not the one
    the memo was checked against (no ``builder.mutate``, ``ast._try_eval``, or a rewrite
    that reads the closure's values elsewhere)."""
    if _memo["tried"]:
        return _memo["installed"]
    with _memo_lock:
        if _memo["tried"]:
            return _memo["installed"]
        try:
            if settings.get(MACRO_MEMO_ENV):
                _memo["installed"] = _wrap_mutate()
        except Exception:  # any surprise in TileLang's layout: no memo
            _memo["installed"] = False
        _memo["tried"] = True
        return _memo["installed"]


def _wrap_mutate() -> bool:
    import dataclasses
    from tilelang.language.eager import ast as eager_ast
    from tilelang.language.eager import builder as eager_builder

    mutate = getattr(eager_builder, "mutate", None)
    try_eval = getattr(eager_ast, "_try_eval", None)
    mutator = getattr(eager_ast, "DSLMutator", None)
    ir_cls = getattr(eager_ast, "IRGenerator", None)
    get_nonlocals = getattr(getattr(eager_ast, "utils", None), "get_func_nonlocals", None)
    if not all(callable(f) for f in (mutate, try_eval, mutator, ir_cls, get_nonlocals)):
        return False
    if getattr(mutate, "_lycoris_memo", False):
        return True
    if not dataclasses.is_dataclass(ir_cls) or \
            [f.name for f in dataclasses.fields(ir_cls)] != ["gen", "source", "extra_type_hints"]:
        return False
    orig_mutate = getattr(eager_ast, "mutate", mutate)
    if not {"DSLMutator", "get_func_nonlocals", "get_compiled_object", "IRGenerator"} <= _code_names(orig_mutate.__code__):
        return False
    # the rewrite may read the closure's values (and the globals) only through _try_eval;
    # visit_FunctionDef reads the names (make_closure's parameters), which the key holds
    readers = {name for name, f in vars(mutator).items() if isinstance(f, types.FunctionType)
               and _code_names(f.__code__) & {"nonlocals", "globals"}}
    if not readers <= {"__init__", "_try_eval", "visit_FunctionDef"} or \
            "_try_eval" not in _code_names(mutator._try_eval.__code__):
        return False

    def recording_try_eval(node, nonlocals, globals):
        res = try_eval(node, nonlocals, globals)
        log = getattr(_memo_log, "log", None)
        if log is not None:
            log.append((eager_ast.ast.unparse(node), res))
        return res

    def revalidate(log, nonlocals, globals) -> bool:
        parse = eager_ast.ast.parse
        return all(try_eval(parse(src, mode="eval").body, nonlocals, globals) is res for src, res in log)

    def memo_mutate(func):
        if type(func) is not types.FunctionType or "__wrapped__" in func.__dict__:
            return mutate(func)  # inspect.getsource unwraps __wrapped__: not keyed by func's code
        code, globs = func.__code__, func.__globals__
        nonlocals = get_nonlocals(func)
        where = None if os.path.isabs(code.co_filename) else os.getcwd()  # mutate makes the path absolute
        key = (id(code), id(globs), tuple(nonlocals), where)
        with _memo_lock:
            entry = _memo_entries.get(key)
            if entry is not None:
                _memo_entries.move_to_end(key)
        if entry is not None and entry[0] is code and entry[1] is globs and revalidate(entry[7], nonlocals, globs):
            _, _, gen_code, name, defaults, kwdefaults, source, log, hints = entry
            gen = types.FunctionType(gen_code, globs, name, defaults,
                                     tuple(types.CellType(nonlocals[v]) for v in gen_code.co_freevars))
            gen.__kwdefaults__ = dict(kwdefaults) if kwdefaults else kwdefaults
            with _memo_lock:
                _memo["hits"] += 1
            return ir_cls(gen=gen, source=source, extra_type_hints=dict(hints))
        outer = getattr(_memo_log, "log", None)
        _memo_log.log = log = []
        try:
            ir = mutate(func)
        finally:
            _memo_log.log = outer
            if outer is not None:
                outer.append((None, _NESTED))
        gen = getattr(ir, "gen", None)
        cacheable = (type(ir) is ir_cls and type(gen) is types.FunctionType and gen.__globals__ is globs
                     and not gen.__dict__ and all(res is not _NESTED for _, res in log)
                     and len(gen.__code__.co_freevars) == len(gen.__closure__ or ())
                     and all(v in nonlocals and c.cell_contents is nonlocals[v]
                             for v, c in zip(gen.__code__.co_freevars, gen.__closure__ or ())))
        with _memo_lock:
            if cacheable:
                _memo["misses"] += 1
                _memo_entries[key] = (code, globs, gen.__code__, gen.__name__, gen.__defaults__, gen.__kwdefaults__,
                                      ir.source, tuple(log), dict(ir.extra_type_hints))
                _memo_entries.move_to_end(key)
                while len(_memo_entries) > MACRO_MEMO_SIZE:
                    _memo_entries.popitem(last=False)
            else:
                _memo["uncached"] += 1
        return ir

    memo_mutate._lycoris_memo = True
    memo_mutate.__wrapped__ = mutate
    eager_ast._try_eval = recording_try_eval
    eager_builder.mutate = memo_mutate
    return True


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
    tilelang = tl()  # before the builder runs: its T.prim_func goes through the macro memo too
    if arch == CPU_ARCH:
        # no vectorization: the C target's fp16 vector casts (float4 -> half4) do not compile
        return tilelang.compile(builder(*args, cpu=True), target="c", execution_backend="cython",
                                pass_configs={"tirx.disable_vectorize": True})
    func = builder(*args)
    configs = dict(GPU_PASS_CONFIGS)
    if not WARP_SPECIALIZE or (func.attrs is not None and NO_WS_ATTR in func.attrs):
        configs["tl.disable_warp_specialized"] = True
    if func.attrs is not None and NO_WGMMA_ATTR in func.attrs:
        configs["tl.disable_wgmma"] = True
    return tilelang.compile(func, target=target_of(arch), execution_backend=backend, pass_configs=configs)


#: False (``LYCORIS_TILELANG_WS=off`` at import): no kernel is warp-specialized - an A/B
#: switch for benchmarks (a process compiles one way; TileLang's disk cache keys the configs)
WARP_SPECIALIZE = settings.get("LYCORIS_TILELANG_WS")
#: the function attribute of ``without_warp_specialization``
NO_WS_ATTR = "lycoris.no_warp_specialization"


def without_warp_specialization(func):
    """``func`` (a builder's prim_func) marked to compile without TileLang's producer/consumer
    warp specialization. A warp-specialized program on sm_90a takes 256 threads at up to 240
    registers: one program an SM. Kernels whose programs run a serial phase (a loop that is
    not the pipelined one) want several programs an SM to hide it instead."""
    return func.with_attr(NO_WS_ATTR, True)


#: the function attribute of ``without_wgmma``
NO_WGMMA_ATTR = "lycoris.no_wgmma"


def without_wgmma(func):
    """``func`` marked to compile its T.gemm calls as mma.sync (TileLang's ``tl.disable_wgmma``):
    sm_90a's WGMMA takes a GEMM's M rows 64 at a time (a warpgroup's), so a GEMM with, say,
    96 rows has no WGMMA warp partition; mma.sync takes them 16 at a time."""
    return func.with_attr(NO_WGMMA_ATTR, True)


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
