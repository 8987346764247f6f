"""``register_autograd`` for the lycoris ops: torch.library's registration, minus its
per-call overhead.

``torch.library.register_autograd`` registers, for the ``Autograd`` key, a generic
Python kernel that on every call builds a metadata dataclass, re-reads the op's
tags, and (when a gradient is needed) rebuilds the full argument list from the
schema (``fill_defaults``: ~10 µs, the schema's argument list is re-created per
argument). This module registers the same thing specialized once per op:

* no gradient needed (grad mode off, or no input requires grad): redispatch below
  autograd (``_AutoDispatchBelowAutograd`` + ``redispatch_boxed`` on the keyset
  after autograd), exactly what the generic kernel does;
* else an ``autograd.Function`` whose forward redispatches the same way and calls
  ``setup_context(ctx, inputs, output)`` with the trailing defaults filled in from
  a tuple computed at registration, and whose backward calls ``backward`` with
  ``ctx.needs_input_grad`` restricted to the op's inputs.

Registration, dispatch, tracing (torch.compile / AOTAutograd / export go through
the same Autograd-key kernel and autograd.Function) and the ``backward`` /
``setup_context`` contract are those of ``torch.library.register_autograd``.
Ops with kwarg-only or tensor-list arguments (none here) use torch's registration.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import _C
from torch._library.utils import is_tensorlist_like_type

__all__ = ["register_autograd"]

#: the FRAGMENT libraries holding the registrations (kept alive with the process)
_libs = {}


def register_autograd(qualname: str, backward: Callable, *, setup_context: Optional[Callable] = None) -> None:
    """Register ``backward`` / ``setup_context`` as the autograd formula of ``qualname``
    ("lycoris::<op>"), like ``torch.library.register_autograd``."""
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
