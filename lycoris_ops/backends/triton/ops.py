"""The Triton op set: one function per op of the op table, named and called like the schema
(docs/ops.md §0). The selector (``lycoris_ops.backends.select``) calls them with arguments
already validated by the op's ``check_<op>`` and inside ``backends/scope.py``'s limits.

Each function asks its family's tuning (``tuning/<family>.py``: ``KWARGS[op]``, the tuned
launch config for these arguments, ``{}`` off CUDA) and runs the launcher the same module
names for the op (``LAUNCHERS[op]``, in ``kernels/<family>.py``) with it, or the op's
step-down body (``reference.step_down(op)``) where that won the timing at this shape.
Outputs are fresh and contiguous, with the dtypes of ``reference/<family>.py``.

Importing this module needs triton (ImportError otherwise: the backend is then absent) but
no GPU.
"""
from __future__ import annotations

import inspect

import triton  # noqa: F401  (the probe: no triton, no op set)

from lycoris_ops import reference
from lycoris_ops._library.optable import OPS
from lycoris_ops.backends.triton.common import device_guard
from lycoris_ops.backends.triton.tuning import MODULE_OF
from lycoris_ops.tuner.keys import is_eager


def _op_set_function(op: str):
    tuning = MODULE_OF[op]
    kwargs_of, launch, eager = tuning.KWARGS[op], tuning.LAUNCHERS[op], reference.step_down(op)

    def run(*args):
        with device_guard(args[0]):  # every op's first argument is a tensor on the call's device
            kw = kwargs_of(*args)
            return eager(*args) if is_eager(kw) else launch(*args, **kw)

    run.__name__ = run.__qualname__ = op
    run.__signature__ = inspect.signature(eager)  # the schema's argument names
    run.__doc__ = (f"lycoris.{op} on Triton: {tuning.__name__}.KWARGS[{op!r}] picks the config of "
                   f"{launch.__module__}.{launch.__name__}.")
    return run


#: the ops with Triton kernels: all of them
__all__ = [row.name for row in OPS]
for _row in OPS:
    globals()[_row.name] = _op_set_function(_row.name)
