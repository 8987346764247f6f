"""Argument checks shared by the eager kernels and the fakes.

Every op validates its operands with these helpers before it computes or
allocates anything, so the CPU kernel, the CUDA kernel and the fake raise the
same ``ValueError`` naming the op, the argument and what was expected. They use
``torch._check_value`` so that symbolic sizes (dynamic token dims under
torch.compile / torch.export) become guards instead of data-dependent errors.

Each ``check_<op>`` (``cached``) also checks that the outputs it specifies can be
allocated at all (``outputs_fit``): an expanded (stride-0) input can describe a
result of terabytes, which would otherwise be computed for minutes before the
allocation fails.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Iterable, Optional, Sequence, Tuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def fail(op: str, message: str) -> None:
    """Raise the library's argument error: ``lycoris.<op>: <message>``."""
    raise ValueError(f"lycoris.{op}: {message}")


def _text(part) -> str:
    """A message part: a str, or a callable returning one (rendered only when needed: a part
    naming an int argument, e.g. an axis, must not be formatted while Dynamo traces it)."""
    return part() if callable(part) else part


def expect(cond, op: str, message) -> None:
    """Check ``cond`` (a bool or SymBool); symbolic conditions become guards.

    ``message`` (a str, or a callable returning one) is rendered only when the
    check runs outside Dynamo: the compile tier traces these checks too.
    """
    if cond is True:  # plain sizes (every eager call): no torch._check_value, whose first call
        return        # imports the symbolic-shape machinery (0.4 s once per process, bench/first_call.py)
    if cond is not False and torch.compiler.is_dynamo_compiling():
        # Dynamo traces an eager body only in the compile tier, after the op checked the real
        # operands. torch 2.11's Dynamo breaks the graph on torch._check_value with a message
        # closure and on str() of a size, so the guard goes in without a message.
        torch._check(cond)
        return
    text = f"lycoris.{op}: {_text(message)}"
    if cond is False:
        raise ValueError(text)
    torch._check_value(cond, lambda: text)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def tensor(op: str, name: str, t, ndim: Optional[int] = None, layout="") -> torch.Tensor:
    """A floating-point tensor of rank ``ndim`` (when given); ``layout`` (str or callable) names its dims."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        want = f"{ndim}-D {_text(layout)}" if layout else f"{ndim}-D"
        fail(op, f"{name} must be {want}, got shape {_shape(t)}")
    return t


def size(op: str, what, actual, expected) -> None:
    """``actual == expected`` for one dimension; ``what`` (str or callable) reads like 'x.shape[1] (I)'."""
    expect(actual == expected, op, lambda: f"{_text(what)} must be {expected}, got {actual}")


def shape(op: str, name: str, t: torch.Tensor, expected: Sequence, layout="") -> None:
    """The whole shape of ``t`` equals ``expected`` (after the rank check)."""
    expected = tuple(expected)

    def message():
        return f"{name} must have shape {expected}{' ' + _text(layout) if layout else ''}, got {_shape(t)}"

    if t.dim() != len(expected):
        fail(op, message())
    for a, e in zip(t.shape, expected):
        expect(a == e, op, message)


def same_device(op: str, **named) -> torch.device:
    """All given (non-None) tensors on one device; returns it."""
    device = None
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            fail(op, f"{name} is on {t.device} but {first} is on {device}: all tensors must be on one device")
    return device


def promote_dtypes(*dtypes) -> torch.dtype:
    """The compute dtype of docs/ops.md §1.3 without checks (for arguments already
    validated): a 16-bit dtype wins (16-bit operands round the others down to it),
    else float32, float64 only when every dtype is float64."""
    # tuple scans instead of building a set: this runs on every call of an op
    for d in (torch.float16, torch.bfloat16, torch.float32):
        if d in dtypes:
            return d
    for d in dtypes:
        if d is not None:
            return torch.float64
    return torch.float32


def compute_dtype(op: str, **named) -> torch.dtype:
    """``promote_dtypes`` of the named operands, after checking that float16 and
    bfloat16 do not meet in one call (they never do, docs/ops.md §1.3)."""
    seen = {}
    for name, t in named.items():
        if t is not None:
            seen.setdefault(t.dtype, name)
    if torch.float16 in seen and torch.bfloat16 in seen:
        fail(op, f"{seen[torch.float16]} is float16 but {seen[torch.bfloat16]} is bfloat16: "
                 "float16 and bfloat16 cannot be mixed in one call")
    return promote_dtypes(*seen)


def float_arg(op: str, name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        fail(op, f"{name} must be a Python float, got a Tensor (a scale with a gradient goes through eager torch)")
    return float(value)


def choice(op: str, name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        fail(op, f"{name} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")


def out_dtype(op: str, dtype, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if dtype not in FLOAT_DTYPES:
        fail(op, f"out_dtype must be a floating dtype, got {dtype}")
    return dtype


def axis(op: str, name: str, value: int, ndim: int) -> int:
    """Normalize a possibly negative axis of a rank-``ndim`` tensor."""
    if not -ndim <= value < ndim:
        fail(op, f"{name}={value} is out of range for a {ndim}-D tensor")
    return value % ndim


# --------------------------------------------------------------------------- output size

#: bytes one tensor can never exceed (torch indexes storage bytes with int64)
MAX_TENSOR_BYTES = 2**63 - 1


def _host_memory() -> Optional[int]:
    """RAM + swap in bytes (an output larger than both can never be written), or None."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return 1024 * sum(int(fields[k].split()[0]) for k in ("MemTotal", "SwapTotal") if k in fields) or None
    except (OSError, ValueError):
        pass
    try:  # not Linux
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@functools.lru_cache(maxsize=None)
def _memory(device: torch.device) -> Optional[int]:
    if device.type == "cpu":
        return _host_memory()
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_properties(device).total_memory
        except Exception:  # a fake CUDA device that this machine lacks (export)
            return None
    return None


def device_memory(device: torch.device) -> Optional[int]:
    """Bytes the outputs of one call on ``device`` can never exceed: a CUDA device's total
    memory, the host's RAM + swap for CPU; None where unknown (meta, a fake CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        return None  # a fake's check never initializes CUDA (a real CUDA operand has done so)
    return _memory(device)


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def outputs_fit(op: str, spec, named: Iterable[Tuple[str, object]]) -> None:
    """Raise unless the outputs of ``spec`` (``check_<op>``'s ``(shape, dtype)`` list) fit in
    the memory of the operands' device, before anything is computed. ``named``: the call's
    ``(argument name, value)`` pairs, to name the argument whose shape the largest output has."""
    if torch.compiler.is_dynamo_compiling():
        return  # Dynamo traces an eager body in the compile tier, after the op checked the real operands
    sizes = []
    for shape, dtype in spec:
        if any(type(d) is not int for d in shape):
            return  # symbolic sizes (dynamic shapes): checked when the real operands arrive
        sizes.append(math.prod(shape) * dtype.itemsize)
    tensors = [(n, t) for n, t in named if isinstance(t, torch.Tensor)]
    if not sizes or not tensors:
        return
    need = sum(sizes)
    device = tensors[0][1].device
    limit = device_memory(device) if need <= MAX_TENSOR_BYTES else None
    if need <= MAX_TENSOR_BYTES and (limit is None or need <= limit):
        return
    big = max(range(len(spec)), key=sizes.__getitem__)
    shape, dtype = spec[big]
    same = [(n, t) for n, t in tensors if tuple(t.shape) == tuple(shape)]
    if same:
        source = "the shape of " + " and ".join(n for n, _ in same)
        expanded = [n for n, t in same if 0 in t.stride() and t.numel() > 1]
        if expanded:
            source += f" ({' and '.join(expanded)}: an expanded view, stride 0)"
    else:
        source = "from " + ", ".join(f"{n} {_shape(t)}" for n, t in tensors)
    where = "more than int64 can index" if limit is None else f"more than the {_bytes(limit)} of memory of {device}"
    largest = f"{tuple(shape)} {str(dtype).replace('torch.', '')}"
    fail(op, f"the output{'s' if len(spec) > 1 else ''} would need {_bytes(need)}, {where}: "
             f"{'the largest is ' if len(spec) > 1 else ''}{largest}, {source}")


# --------------------------------------------------------------------------- signature cache

#: tensor types with concrete metadata; FakeTensor, FunctionalTensor and every other
#: subclass (symbolic sizes, tracing wrappers) bypass the cache and run the check
_CONCRETE = (torch.Tensor, torch.nn.Parameter)
#: a check's cache holding more signatures than this is emptied (bounded memory under shape churn)
MAX_SIGNATURES = 4096
_caches: list = []

_CACHED_TEMPLATE = """
def {name}({params}):
    if _compiling(){guards}:
        return _check({names})
    try:
        key = ({key},)
        spec = _get(key)
    except Exception:  # an unhashable or odd argument: validate it the long way
        return _check({names})
    if spec is None:
        spec = _check({names})
        if len(_cache) >= _MAX:
            _cache.clear()
        _cache[key] = spec
    return spec
"""


def _int_list(v) -> tuple:
    """The key of an ``int[]`` argument; raises (-> uncached check) unless it is a list
    or tuple of plain ints (bools and SymInts are checked every time)."""
    if type(v) not in (list, tuple) or any(type(s) is not int for s in v):
        raise TypeError("not a plain int list")
    return (type(v),) + tuple(v)


def cached(check):
    """Memoize ``check_<op>`` on its call signature, so a repeated call does not re-run it.

    A check's outcome (its output spec, or the ValueError it raises) depends only on each
    tensor's dtype, device and shape and on the non-float arguments' types and values
    (a float argument is only required to be a Python float), so that is the key: the
    steady state is one tuple and one dict lookup instead of the checks. Only
    successful checks are stored, so a bad call always reaches the check and raises
    its own error. Bypassed (the plain check runs): while ``torch.compile`` /
    ``torch.export`` trace, for tensor subclasses (FakeTensor: the fakes keep validating
    symbolic sizes), and for arguments of an unexpected type (a float argument that is
    not a float, an int list holding bools or SymInts, anything unhashable).
    The wrapper keeps the check's name and signature (``__wrapped__`` is the plain one).
    A check that validates a float argument's value must not be cached this way.
    Every run of the check also runs ``outputs_fit`` on the spec it returns.
    """
    import inspect

    op = check.__name__[len("check_"):]
    schema = getattr(torch.ops.lycoris, op).default._schema.arguments
    sig = inspect.signature(check)
    if [p.name for p in sig.parameters.values()] != [a.name for a in schema]:
        raise TypeError(f"{check.__name__} must take the schema arguments of lycoris.{op} in order")
    names_in_order = [p.name for p in sig.parameters.values()]

    def checked(*args):
        spec = check(*args)
        outputs_fit(op, spec, zip(names_in_order, args))
        return spec

    cache: dict = {}
    ns = {"_check": checked, "_get": cache.get, "_cache": cache, "_MAX": MAX_SIGNATURES,
          "_compiling": torch.compiler.is_compiling, "_P": _CONCRETE, "_int_list": _int_list}
    params, names, guards, key = [], [], [], []
    for i, (p, a) in enumerate(zip(sig.parameters.values(), schema)):
        n, kind = p.name, str(a.type)
        names.append(n)
        if p.default is inspect.Parameter.empty:
            params.append(n)
        else:
            ns[f"_d{i}"] = p.default
            params.append(f"{n}=_d{i}")
        if kind == "Tensor":
            guards.append(f"type({n}) not in _P")
            key.append(f"{n}.dtype, {n}.device, {n}.shape")
        elif kind == "Optional[Tensor]":
            guards.append(f"({n} is not None and type({n}) not in _P)")
            key.append(f"None if {n} is None else ({n}.dtype, {n}.device, {n}.shape)")
        elif kind == "float":
            guards.append(f"type({n}) is not float")  # then its value cannot fail the check
        elif kind.startswith("List[") or kind.startswith("Optional[List["):
            key.append(f"None if {n} is None else _int_list({n})")
        else:  # int, bool, str, ScalarType: type and value (True == 1 but may be checked differently)
            key.append(f"type({n}), {n}")
    src = _CACHED_TEMPLATE.format(name=check.__name__, params=", ".join(params), names=", ".join(names),
                                  guards="".join(f" or {g}" for g in guards), key=", ".join(key) or "None")
    exec(compile(src, f"<lycoris_ops.reference.checks.cached {check.__name__}>", "exec"), ns)
    fn = ns[check.__name__]
    functools.update_wrapper(fn, check)
    fn.cache = cache
    _caches.append(cache)
    return fn


def clear_cached_checks() -> None:
    """Empty every ``cached`` check's signature cache."""
    for cache in _caches:
        cache.clear()
