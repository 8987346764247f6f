"""The per-call choice of backend: the one place it is made.

``choose(tensors, supported)`` walks the tiers of ``dispatch.candidates`` for the
operands' device (``triton`` -> ``tilelang`` -> ``compile`` -> ``torch`` under
``auto``) and returns the first whose scope the call is in. A call steps one tier
down when its operands or layout are outside a fused kernel's scope: CPU tensors
(no op set serves them), float16 mixed with bfloat16, float64, bfloat16 before
sm_80, a zero-size operand, an op the op set does not have (yet), a limit or
layout of ``scope.SCOPE``, or the caller's own ``supported`` test. A scale
tensor that carries a gradient goes straight to eager ``torch``. The compile tier
is taken on CUDA only, unless ``compile`` is the named backend.

``kernel(op, eager)`` builds the CUDA kernel of an op (registry.py registers it):
a function with the op's schema signature whose steady state is one dict lookup,
key = (per tensor: dtype, device index, shape, contiguity; the non-float scalars) ->
a ready callable (the op-set function, the compile tier's runner or the eager
body). A miss validates once with ``check_<op>``, walks the tiers and caches
the result; floats (gamma, scales) are not part of the key, since no choice or
validation depends on their values. The choice happens at run time, inside the
op, so a compiled or exported graph keeps the op opaque and never hard-codes a
backend.

Failures: a fused backend or the compile tier that raises at run time (launch
error, missing arch support, a Dynamo/Inductor error) is demoted for that device
with one RuntimeWarning naming the error, and the call returns the next tier's
answer. The compile tier never starts a compile while
``torch.compiler.is_compiling()`` or while a CUDA graph is being captured: it
runs the eager body then.

Test hook: an op set may declare ``DEVICE_TYPES = ("cpu",)``; then calls of
``kernel(op, eager)`` (and, once registry wires ``cpu_kernel`` and
``route_cpu(True)`` is set, real CPU calls) on CPU tensors take it.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from lycoris_ops import reference
from lycoris_ops._library import optable
from lycoris_ops.backends import registry as dispatch, scope

__all__ = ["choose", "kernel", "cuda_kernel", "cpu_kernel", "explain", "trace", "clear", "reset", "route_cpu"]

_HALF = (torch.float16, torch.bfloat16)
#: a per-op cache holding more keys than this is emptied (bounded memory under shape churn)
MAX_KEYS = 4096

_AUTO = object()
_states: "weakref.WeakSet[_Kernel]" = weakref.WeakSet()
_compiled_fallback: Dict[Callable, Callable] = {}
_cpu_hook = False
_cpu_wired = False
#: [True/False/None]: do registered CPU kernels take the selecting path? None = recompute
_route = [None]


def _torch_compile(fn: Callable) -> Callable:
    """The compile tier's compiler (tests replace it)."""
    return torch.compile(fn, dynamic=None)


# --------------------------------------------------------------------------- choose

def _walk(tensors: Sequence[torch.Tensor], op: Optional[str], args: Optional[Sequence],
          supported, scales: Sequence, trail: Optional[List]) -> str:
    """The tier a call takes; appends (tier, reason it was skipped) to ``trail``."""
    def skip(name, why):
        if trail is not None:
            trail.append((name, why))

    if not scope.static_scale(*scales):
        skip("*", "a scale tensor carries a gradient")
        return "torch"
    if not tensors:
        skip("*", "no tensor operand")
        return "torch"
    device = tensors[0].device
    dtypes = set()
    for t in tensors:
        if t.device != device:
            skip("*", f"operands on {device} and {t.device}")
            return "torch"
        dtypes.add(t.dtype)
    if any(not d.is_floating_point for d in dtypes):
        skip("*", "a non-floating operand")
        return "torch"
    mixed = _HALF[0] in dtypes and _HALF[1] in dtypes
    empty = any(t.numel() == 0 for t in tensors)
    for name in dispatch.iter_candidates(device):
        if name in dispatch.FUSED:
            module = dispatch.opset(name)
            why = None
            if op is not None and getattr(module, op, None) is None:
                why = f"the op set has no {op}"
            elif mixed:
                why = "float16 mixed with bfloat16"
            elif empty:
                why = "a zero-size operand"
            elif not dtypes.issubset(scope.fused_dtypes(name, module)):
                why = f"dtype {', '.join(sorted(str(d) for d in dtypes))} not taken by the kernel"
            elif torch.bfloat16 in dtypes and device.type == "cuda" \
                    and dispatch.capability(device) < scope.BF16_CAPABILITY:
                why = "bfloat16 before sm_80"
            elif op is not None and args is not None:
                why = scope.why_not(op, name, args)
            if why is None and supported is not True and supported is not None:
                ok = supported(name) if callable(supported) else bool(supported)
                if not ok:
                    why = "outside the caller's layout test"
            if why is None:
                return name
            skip(name, why)
        else:
            return name
    return "torch"  # unreachable: candidates() ends with torch


def choose(tensors: Iterable, supported=True, *, op: Optional[str] = None, args: Optional[Sequence] = None,
           scales: Sequence = ()) -> str:
    """The backend a call takes: ``"triton"``, ``"tilelang"``, ``"compile"`` or ``"torch"``
    (or any registered backend).

    ``tensors``: the call's operands (None and non-tensors are skipped).
    ``supported``: the caller's own layout test, a bool or ``f(backend) -> bool``;
    False steps every fused tier down. ``op`` (+ ``args`` in schema order): also
    require the op in the op set and apply ``scope.SCOPE[op]``. ``scales``: the
    call's scale factors; one that is a tensor requiring grad gives ``"torch"``.
    """
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    return _walk(ts, op, args, supported, scales, None)


def trace(op: str, *args) -> List[Tuple[str, Optional[str]]]:
    """What a call of ``op`` with ``args`` would do on its device, without running it:
    the skipped tiers with the reason, then ``(chosen tier, None)``. Validates first."""
    args = _full_args(op, args)
    check = _check_of(op)
    if check is not None:
        check(*args)
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    trail: List = []
    if ts and ts[0].device.type == "cpu" and not _routes_cpu():
        return [("torch", None)]  # registered CPU kernels are the eager bodies
    tier = _walk(ts, op, args, True, (), trail)
    return trail + [(tier, None)]


def explain(op: str, *args) -> str:
    """The tier a call of ``op`` with ``args`` would take (see ``trace``)."""
    return trace(op, *args)[-1][0]


# --------------------------------------------------------------------------- kernels

def _schema(op: str):
    return getattr(torch.ops.lycoris, op).default._schema.arguments


def _full_args(op: str, args: Sequence) -> tuple:
    params = _schema(op)
    args = tuple(args)
    if len(args) < len(params):
        args += tuple(p.default_value for p in params[len(args):])
    return args


def _check_of(op: str):
    return reference.check(op) if op in optable.BY_NAME else None


def _capturing(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # a build without CUDA (fake CUDA tensors in tests)
        return False


def _compiled(eager: Callable) -> Callable:
    """``torch.compile`` of an eager body, cached on the function object (one per op)."""
    fn = getattr(eager, "_lycoris_compiled", None) or _compiled_fallback.get(eager)
    if fn is None:
        fn = _torch_compile(eager)
        try:
            eager._lycoris_compiled = fn
        except (AttributeError, TypeError):
            _compiled_fallback[eager] = fn
    return fn


def _contiguous(out):
    """The op's outputs as its fake promises them: fresh and contiguous. Inductor on CUDA
    may pad an output's rows (19 fp32 columns stored with stride 20), which a compiled
    graph calling the op then rejects against the fake's strides."""
    if isinstance(out, torch.Tensor):
        return out if out.is_contiguous() else out.contiguous()
    if isinstance(out, tuple):
        return tuple(_contiguous(o) for o in out)
    return out


def _compile_runner(eager: Callable, device: torch.device) -> Callable:
    """The compile tier for one cache key: eager until the first compile may start
    (not while compiling/capturing), the compiled body after."""
    compiled = _compiled(eager)
    warm = [False]

    def run(*args):
        if not warm[0] and (torch.compiler.is_compiling() or _capturing(device)):
            return eager(*args)
        with torch.no_grad():  # below autograd already; keep AOTAutograd from building a joint graph
            out = compiled(*args)
        warm[0] = True
        return _contiguous(out)

    return run


class _Kernel:
    """State of one generated kernel: its cache and how each entry was chosen."""

    def __init__(self, op: str, eager: Callable, check):
        self.op = op
        self.eager = eager
        self._check = check
        self.cache: Dict[tuple, Callable] = {}
        self.meta: Dict[tuple, Tuple[str, torch.device]] = {}
        self.fn: Optional[Callable] = None  # the generated function
        _states.add(self)

    @property
    def check(self):
        if self._check is _AUTO:
            self._check = _check_of(self.op)
        return self._check

    def miss(self, key: tuple, args: tuple) -> Callable:
        check = self.check
        if check is not None:
            check(*args)
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        tier = _walk(ts, self.op, args, True, (), None)
        device = ts[0].device if ts else torch.device("cpu")
        if tier in dispatch.FUSED:
            fn = getattr(dispatch.opset(tier), self.op)
        elif tier == "compile":
            fn = _compile_runner(self.eager, device)
        else:
            fn = self.eager
        if len(self.cache) >= MAX_KEYS:
            self.cache.clear()
            self.meta.clear()
        self.cache[key] = fn
        self.meta[key] = (tier, device)
        return fn

    def tier_of(self, *args) -> Optional[str]:
        """The tier that serves these arguments now (None before their first call)."""
        return self.meta.get(self.key_of(*args), (None,))[0]

    def failed(self, key: tuple, args: tuple):
        """Called from the kernel's ``except``: demote the failing tier and rerun, or re-raise."""
        exc = sys.exc_info()[1]
        tier, device = self.meta.get(key, ("torch", None))
        if tier == "torch" or device is None or isinstance(exc, torch.OutOfMemoryError):
            raise
        text = f"{type(exc).__name__}: {exc}"
        if len(text) > 400:
            text = text[:400] + " ..."
        warnings.warn(
            f"lycoris_ops: backend {tier!r} failed in lycoris.{self.op} on {device} ({text}); "
            f"it is demoted on {device} for the rest of the process and calls step down to the next tier",
            RuntimeWarning, stacklevel=3,
        )
        dispatch.demote(tier, device, text)  # clears every cache
        return self.fn(*args)


_TEMPLATE = """
def {op}({params}):
    _k = ({key},)
    _f = _get(_k)
    if _f is None:
        _f = _miss(_k, ({names},))
    try:
        return _f({names})
    except Exception:
        return _failed(_k, ({names},))
"""

_KEY_TEMPLATE = """
def {op}_key({params}):
    return ({key},)
"""

_CPU_TEMPLATE = """
def {op}({params}):
    if _route[0] is False:
        return _eager({names})
    if _routes_cpu():
        return _full({names})
    return _eager({names})
"""


def _signature(op: str, ns: dict) -> Tuple[str, str, str]:
    """(parameter list, argument names, key expression) of an op's schema."""
    params, names, key = [], [], []
    for i, a in enumerate(_schema(op)):
        n = a.name
        names.append(n)
        if a.has_default_value():
            ns[f"_d{i}"] = a.default_value
            params.append(f"{n}=_d{i}")
        else:
            params.append(n)
        kind = str(a.type)
        if kind == "Tensor":
            key.append(f"{n}.dtype, {n}.get_device(), {n}.shape, {n}.is_contiguous()")
        elif kind == "Optional[Tensor]":
            key.append(f"None if {n} is None else ({n}.dtype, {n}.get_device(), {n}.shape, {n}.is_contiguous())")
        elif kind in ("float", "Optional[float]"):
            continue  # no choice depends on a float's value
        elif kind.startswith("List[") or kind.startswith("Optional[List["):
            key.append(f"None if {n} is None else tuple({n})")
        else:
            key.append(n)
    return ", ".join(params), ", ".join(names), ", ".join(key) or "None"


def kernel(op: str, eager: Callable, check=_AUTO) -> Callable:
    """The selecting kernel of ``op`` (schema signature; any device).

    ``eager``: the op's eager body (the ``torch`` tier and what ``compile``
    compiles). ``check``: the validation run once per cache key (default
    ``reference.check(op)``; None: none)."""
    state = _Kernel(op, eager, check)
    ns = {"_get": state.cache.get, "_miss": state.miss, "_failed": state.failed}
    params, names, key = _signature(op, ns)
    exec(_TEMPLATE.format(op=op, params=params, names=names, key=key), ns)
    fn = ns[op]
    fn.__qualname__ = f"cuda_kernel.{op}"
    fn.__module__ = __name__
    fn.__doc__ = f"lycoris.{op} on any device: the per-call backend choice (lycoris_ops.backends.select)."
    fn._lycoris_state = state
    state.fn = fn
    exec(_KEY_TEMPLATE.format(op=op, params=params, key=key), ns)
    state.key_of = ns[f"{op}_key"]
    return fn


def cuda_kernel(op: str, eager: Callable) -> Callable:
    """The CUDA kernel of ``op`` (registry.py registers it for the CUDA key)."""
    return kernel(op, eager)


def cpu_kernel(op: str, eager: Callable) -> Callable:
    """An optional CPU kernel: the eager body, unless CPU calls are routed through the
    choice (``compile`` named, or ``route_cpu(True)``). One global read on the
    default path. Registering it instead of the bare body is what makes
    ``LYCORIS_KERNEL_BACKEND=compile`` apply to CPU calls of ``torch.ops.lycoris.*``."""
    global _cpu_wired
    _cpu_wired = True
    _route[0] = None
    full = kernel(op, eager)
    ns = {"_route": _route, "_eager": eager, "_full": full, "_routes_cpu": _routes_cpu}
    params, names, _ = _signature(op, ns)
    exec(_CPU_TEMPLATE.format(op=op, params=params, names=names), ns)
    fn = ns[op]
    fn.__qualname__ = f"cpu_kernel.{op}"
    fn.__module__ = __name__
    fn.__doc__ = f"lycoris.{op} on CPU: the eager body unless CPU calls are routed (lycoris_ops.backends.select)."
    return fn


def _routes_cpu() -> bool:
    """Whether registered CPU kernels take the selecting path (recomputed after clear())."""
    r = _route[0]
    if r is None:
        try:
            r = _cpu_hook or (_cpu_wired and dispatch.backend_setting() == "compile")
        except ValueError:
            r = _cpu_wired  # an invalid LYCORIS_KERNEL_BACKEND: let the selecting path raise it
        _route[0] = r
    return r


def route_cpu(enabled: bool = True) -> None:
    """Test hook: send CPU calls of the ops through the choice (needs ``cpu_kernel``
    registered for CPU), e.g. to an op set declaring ``DEVICE_TYPES = ("cpu",)``."""
    global _cpu_hook
    _cpu_hook = bool(enabled)
    clear()


def clear() -> None:
    """Drop every cached choice (after set_backend, a demotion, a new backend)."""
    for state in list(_states):
        state.cache.clear()
        state.meta.clear()
    _route[0] = None
    from lycoris_ops import _C

    if hasattr(_C, "_clear_launch_plans"):  # the C++ CUDA kernel's replay plans (csrc/launch.cpp)
        _C._clear_launch_plans()


def reset() -> None:
    """Back to a fresh process: caches, probes, setting, demotions (not compiled bodies)."""
    dispatch.reset()
    clear()


dispatch.on_change(clear)
