"""``register_autograd`` for the lycoris ops: torch.library's contract, without its
per-call overhead.

``torch.library.register_autograd`` registers, for the ``Autograd`` key, a generic
Python kernel: every call goes from the dispatcher into Python, and a call that needs
a gradient also builds an ``autograd.Function`` with its ctx and runs
``setup_context`` in Python. Here the forward side is C++ (``csrc/autograd.cpp``):
grad mode and ``requires_grad`` are checked, the op is redispatched below autograd,
and when a gradient is needed one graph node keeps the tensors named in ``save`` (the
others only as their dtype and shape) and the scalar arguments. Python runs once, in
the backward: ``setup_context(ctx, inputs, output)`` on the saved arguments, then
``backward(ctx, *grads)``, with ``ctx.needs_input_grad`` what this backward pass needs.
An op whose backward is one call of its ``*_bwd`` op also names that call
(``direct=BwdCall(...)``): then the node makes the call itself and Python does not run
in the backward either (the Python ``backward`` stays the formula of record: the
``LYCORIS_AUTOGRAD_KERNEL=python`` kernel runs it).

An op registered without ``save`` (or where the C++ registration is missing) gets the
Python kernel below: the same contract specialized once per op (no gradient needed:
redispatch below autograd; else an ``autograd.Function`` whose forward redispatches
and calls ``setup_context`` with the trailing defaults filled in). Ops with
kwarg-only or tensor-list arguments (none here) use torch's own registration.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch import _C
from torch._library.utils import is_tensorlist_like_type

from lycoris_ops import settings
from lycoris_ops._library.optable import BwdCall

__all__ = ["register_autograd", "first_order_only", "BwdCall", "direct_backward", "DIRECT"]


@contextlib.contextmanager
def direct_backward(enabled: bool):
    """Within the block, nodes with a direct backward make the ``*_bwd`` call in C++
    (``enabled``) or run the Python backward (the A/B of bench/host_overhead.py, tests)."""
    from lycoris_ops import _C as lycoris_C

    previous = lycoris_C._set_direct_backward(enabled)
    try:
        yield
    finally:
        lycoris_C._set_direct_backward(previous)


#: the FRAGMENT libraries holding the registrations (kept alive with the process)
_libs = {}
#: "lycoris::<op>" -> its ``direct`` backward (``BwdCall``), as registered: the one ``*_bwd`` call
#: its backward makes (``autograd.backward_calls``)
DIRECT = {}


#: ``LYCORIS_AUTOGRAD_KERNEL=python`` (read at import): every op gets the Python kernel, for
#: compiled autograd (``torch._dynamo.compiled_autograd``), which the C++ node does not support.
_PYTHON_KERNEL_ONLY = settings.get("LYCORIS_AUTOGRAD_KERNEL") == "python"


class _BackwardCtx:
    """The ``ctx`` that ``setup_context`` and ``backward`` see on the C++ path."""

    saved_tensors = ()

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *outputs):  # declared at registration (nondiff_outputs)
        pass

    def set_materialize_grads(self, value):  # the node always materializes (as Function's default)
        pass


class _Absent:
    """A tensor argument the node did not keep: its dtype and shape only."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype, shape):
        self.dtype, self.shape = dtype, torch.Size(shape)


def first_order_only(qualname: str) -> None:
    """Register ``qualname`` as first order: differentiating through it raises."""
    if _PYTHON_KERNEL_ONLY or not _cpp_registration(qualname, None, None, (), (), ()):
        def backward(ctx, *grads):
            raise RuntimeError(
                f"{qualname.replace('::', '.')} is a first-order backward op: double backward (create_graph=True through a "
                "lycoris op, then differentiating again) is not supported")

        register_autograd(qualname, backward, setup_context=lambda ctx, inputs, output: None)


def _cpp_registration(qualname, backward, setup_context, save, save_outputs, nondiff_outputs,
                      direct: Optional[BwdCall] = None) -> bool:
    """Register the C++ Autograd kernel (csrc/autograd.cpp); False where the build lacks it."""
    from lycoris_ops import _C as lycoris_C  # (the module's _C is torch._C)

    if not hasattr(lycoris_C, "_register_autograd"):
        return False
    namespace, name = qualname.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    names = [a.name for a in schema.arguments]
    save_idx = [names.index(s) for s in save]
    tensor_idx = [i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type)]
    absent_idx = tuple(i for i in tensor_idx if i not in save_idx)
    single = len(schema.returns) == 1
    run = None
    if backward is not None:
        def run_backward(args, outputs, grads, need):
            ctx = _BackwardCtx(need)
            if absent_idx:
                args = list(args)
                for i in absent_idx:
                    if args[i] is not None:
                        args[i] = _Absent(*args[i])
            if setup_context is not None:
                setup_context(ctx, tuple(args), outputs[0] if single else outputs)
            result = backward(ctx, *grads)
            return result if isinstance(result, tuple) else (result,)

        run_backward.__name__ = run_backward.__qualname__ = f"{name}_backward"
        run = run_backward
    extra = {}
    if direct is not None:
        index = {**{a: i for i, a in enumerate(names)}, "grad": -1, None: -1}
        unknown = [a for a in (*direct.args, *direct.grads, direct.passthrough) if a not in index]
        if unknown:
            raise ValueError(f"{qualname}: direct backward names {unknown} are not arguments of the op ({names})")
        extra = dict(direct_op=direct.op, direct_args=[index[a] for a in direct.args],
                     direct_targets=[index[g] for g in direct.grads], direct_passthrough=index[direct.passthrough])
    lycoris_C._register_autograd(qualname, run, save_idx, list(save_outputs), list(nondiff_outputs), **extra)
    return True


def register_autograd(qualname: str, backward: Callable, *, setup_context: Optional[Callable] = None,
                      save: Optional[Sequence[str]] = None, save_outputs: Sequence[int] = (),
                      nondiff_outputs: Sequence[int] = (), direct: Optional[BwdCall] = None) -> None:
    """Register ``backward`` / ``setup_context`` as the autograd formula of ``qualname``
    ("lycoris::<op>"), like ``torch.library.register_autograd``.

    ``save``: the names of the tensor arguments ``setup_context`` saves (the C++ node keeps
    those; ``setup_context`` sees the other tensor arguments as objects with ``dtype`` and
    ``shape`` only). ``save_outputs`` / ``nondiff_outputs``: indices of outputs to keep /
    without a gradient (a kept output must be non-differentiable). ``direct``: the same
    backward as one call of a ``*_bwd`` op (``BwdCall``), made by the C++ node without
    Python. ``save=None``: the Python kernel."""
    if direct is not None:
        DIRECT[qualname] = direct
    if save is not None and not _PYTHON_KERNEL_ONLY and _cpp_registration(
            qualname, backward, setup_context, save, save_outputs, nondiff_outputs, direct):
        return
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    params = op._schema.arguments
    try:  # private torch APIs (the ones torch.library's own kernel uses)
        redispatch = op._handle.redispatch_boxed
        after_autograd = _C._after_autograd_keyset
        below_autograd = _C._AutoDispatchBelowAutograd
        grad_enabled = _C.is_grad_enabled
        any_requires_grad = _C._any_requires_grad
        private_apis = True
    except AttributeError:
        private_apis = False
    tensor_lists = any(is_tensorlist_like_type(a.type) for a in (*params, *op._schema.returns))
    if not private_apis or tensor_lists or any(a.kwarg_only for a in params):  # not specialized: torch's own
        torch.library.register_autograd(qualname, backward, setup_context=setup_context)
        return
    n = len(params)
    # the dispatcher drops trailing arguments equal to their defaults; setup_context sees them all
    defaults = tuple(a.default_value if a.has_default_value() else None for a in params)

    def forward(ctx, keyset, *args):
        with below_autograd():
            out = redispatch(keyset & after_autograd, *args)
            if setup_context is not None:
                if len(args) < n:
                    args = args + defaults[len(args):]
                setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads):
        need = ctx.needs_input_grad
        ctx.needs_input_grad = need[1:]  # drop the keyset's entry: backward sees the op's inputs
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = need
        return (None, *result) if isinstance(result, tuple) else (None, result)

    fn = type(f"LycorisBackwardFor_{namespace}_{name}", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward_)})
    apply = fn.apply

    def kernel(keyset, *args):
        if grad_enabled() and any_requires_grad(*args):
            return apply(keyset, *args)
        with below_autograd():
            return redispatch(keyset & after_autograd, *args)

    kernel.__name__ = kernel.__qualname__ = f"autograd_{name}"
    lib = _libs.get(namespace)
    if lib is None:
        lib = _libs[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.impl(name, kernel, "Autograd", with_keyset=True)
