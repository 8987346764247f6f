"""``lycoris.kernels.select`` (lycoris-lora 4.1's per-call backend choice), on lycoris_ops.

lycoris-lora's functional and module layers ask ``choose(tensors, supported,
backend)`` before every call and branch on the answer: a name in ``FUSED`` calls
the matching ``lycoris.kernels.autograd`` function (here: lycoris_ops' ops),
``"compile"`` runs their eager body through ``call_compiled``, ``"torch"`` runs it
as is. Unlike lycoris-lora's own choice, ours also answers ``lycoris_ops`` inside
``torch.compile``: the ops are opaque custom ops with fakes, so a compiled graph
holds them (the kernel is chosen at run time inside the op).
"""
from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["FUSED", "choose", "static_scale", "compiled", "call_compiled"]

#: the one fused tier: lycoris_ops' ``torch.ops.lycoris.*``
FUSED = ("lycoris_ops",)
#: ``backend=`` values taken from lycoris-lora's vocabulary: its fused backends
#: are served by our ops (our per-call choice of kernel inside the op)
_OURS = frozenset(("lycoris_ops", "triton", "tilelang"))
_EAGER = frozenset(("compile", "torch"))
#: devices our ops have kernels for (the CPU kernel is the eager formula)
_DEVICES = frozenset(("cpu", "cuda"))


def backend_name(backend) -> str | None:
    """``backend`` validated: None (auto), ``lycoris_ops``, ``compile`` or ``torch``."""
    if backend is None or backend == "auto":
        return None
    if backend in _OURS:
        return "lycoris_ops"
    if backend in _EAGER:
        return backend
    raise ValueError(
        f"lycoris.kernels (served by lycoris_ops): backend={backend!r} is not a backend; valid values: "
        "None, 'auto', 'lycoris_ops' (also accepted as 'triton' or 'tilelang': lycoris_ops picks the kernel "
        "per call, see LYCORIS_KERNEL_BACKEND), 'compile', 'torch'"
    )


def choose(tensors, supported: bool = True, backend: str | None = None) -> str:
    """Backend for this call: ``lycoris_ops`` when lycoris-lora's own layout test
    ``supported`` passes and the operands suit our ops (floating tensors on one
    CPU or CUDA device, float16 and bfloat16 not mixed), else ``torch`` (its eager
    body). ``backend="compile"`` / ``"torch"`` are honoured as named."""
    name = backend_name(backend)
    if name in _EAGER:
        return name
    if not supported:
        return "torch"
    device = None
    half = None
    for t in tensors:
        if t is None:
            continue
        if not t.is_floating_point():
            return "torch"
        if device is None:
            device = t.device
            if device.type not in _DEVICES:
                return "torch"
        elif t.device != device:
            return "torch"
        if t.dtype in (torch.float16, torch.bfloat16):
            if half is not None and t.dtype != half:
                return "torch"
            half = t.dtype
    return "torch" if device is None else "lycoris_ops"


def static_scale(gamma) -> bool:
    """A scale the fused path can take: anything but a tensor that carries a gradient
    (a float is the op's argument; a tensor without a gradient is folded into a
    factor, so no host sync)."""
    return not (isinstance(gamma, torch.Tensor) and gamma.requires_grad)


@functools.cache
def compiled(fn):
    """``torch.compile`` of lycoris-lora's eager body ``fn``, once per function."""
    return torch.compile(fn, dynamic=None)


_compile_failed: set = set()


def call_compiled(fn, *args, **kwargs):
    """``fn`` compiled (``backend="compile"``), its eager body when compiling fails
    (one warning per function) or when already inside a compiled region."""
    if fn in _compile_failed or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    try:
        return compiled(fn)(*args, **kwargs)
    except Exception as exc:  # a Dynamo/Inductor failure: the eager body gives the same answer
        _compile_failed.add(fn)
        warnings.warn(f"lycoris.kernels: compiling {getattr(fn, '__name__', fn)} failed ({type(exc).__name__}: "
                      f"{exc}); running it eagerly from now on", RuntimeWarning, stacklevel=2)
        return fn(*args, **kwargs)
