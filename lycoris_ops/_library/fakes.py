"""Fake (meta) kernels of every op, from the op table.

A fake runs the op's own argument checks (``check_<op>`` in ``reference/<family>.py``,
the same the CPU and CUDA kernels run) and allocates outputs of the shapes and dtypes they
return, on the device of the op's first argument (a tensor for every op), so a traced graph
gets exactly the errors and metadata the real kernels produce, with symbolic token dims
kept symbolic.
"""
from __future__ import annotations

from torch.library import register_fake

from lycoris_ops._library.optable import OPS
from lycoris_ops import reference


def _fake(check):
    def fake(*args, **kwargs):
        first = args[0]  # every op's first argument is a (required) tensor
        outs = tuple(first.new_empty(shape, dtype=dtype) for shape, dtype in check(*args, **kwargs))
        return outs[0] if len(outs) == 1 else outs

    return fake


for _op in OPS:
    register_fake(_op.qualname)(_fake(getattr(getattr(reference, _op.family), f"check_{_op.name}")))
