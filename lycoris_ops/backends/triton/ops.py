"""The Triton op set: one function per op, named and called like the schema
(docs/ops.md §0). The CUDA dispatcher (``lycoris_ops.backends.select``) calls these with
arguments already validated by the op's ``check_<op>`` and inside the scope limits of
``lycoris_ops.backends.scope``; outputs are fresh and contiguous, with the dtypes of
``reference/<family>.py``.

Each function asks its family's tuning (``tuning/<family>.py: <op>_kwargs``: the tuned
launch config, ``{}`` off CUDA) and runs the launcher of ``kernels/<family>.py`` with it,
or the eager body (``reference/<family>.py``) where eager won the timing at this shape.

Importing this module needs triton (ImportError otherwise: the backend is then
absent) but no GPU.
"""
from __future__ import annotations

import triton  # noqa: F401  (the probe: no triton, no op set)

from lycoris_ops.backends.triton.common import device_guard
from lycoris_ops.backends.triton.kernels import lora as lora_kernels
from lycoris_ops.backends.triton.kernels import tucker as tucker_kernels
from lycoris_ops.backends.triton.kernels import loha as loha_kernels
from lycoris_ops.backends.triton.kernels import lokr as lokr_kernels
from lycoris_ops.backends.triton.kernels import dora as dora_kernels
from lycoris_ops.backends.triton.kernels import oft as oft_kernels
from lycoris_ops.backends.triton.kernels import boft as boft_kernels
from lycoris_ops.backends.triton.kernels import ia3 as ia3_kernels
from lycoris_ops.backends.triton.kernels import add as add_kernels
from lycoris_ops.backends.triton.tuning import lora as lora_tuning
from lycoris_ops.backends.triton.tuning import tucker as tucker_tuning
from lycoris_ops.backends.triton.tuning import loha as loha_tuning
from lycoris_ops.backends.triton.tuning import lokr as lokr_tuning
from lycoris_ops.backends.triton.tuning import dora as dora_tuning
from lycoris_ops.backends.triton.tuning import oft as oft_tuning
from lycoris_ops.backends.triton.tuning import boft as boft_tuning
from lycoris_ops.backends.triton.tuning import ia3 as ia3_tuning
from lycoris_ops.backends.triton.tuning import add as add_tuning
from lycoris_ops.reference import lora as lora_reference
from lycoris_ops.reference import loha as loha_reference
from lycoris_ops.reference import lokr as lokr_reference
from lycoris_ops.reference import dora as dora_reference
from lycoris_ops.reference import oft as oft_reference
from lycoris_ops.reference import boft as boft_reference
from lycoris_ops.reference import ia3 as ia3_reference
from lycoris_ops.reference import add as add_reference
from lycoris_ops.tuner.keys import is_eager

#: the 23 ops, all with Triton kernels (limits: lycoris_ops/backends/scope.py)
__all__ = [
    "lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd", "lora_tucker_fwd",
    "loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd",
    "lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
    "lokr_bypass_fwd", "lokr_bypass_bwd",
    "dora_fwd", "dora_bwd", "oft_fwd", "oft_bwd", "boft_fwd", "boft_bwd",
    "ia3_fwd", "ia3_bwd", "add_scaled",
]


def lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    with device_guard(a1):
        kw = lora_tuning.merge_fwd_kwargs(a1, b1, a2, b2, base, gamma, mode, out_dtype)
        if is_eager(kw):
            return lora_reference.lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype)
        return lora_kernels.merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype, **kw)


def lora_merge_bwd(grad, up, down, gamma):
    with device_guard(grad):
        kw = lora_tuning.merge_bwd_kwargs(grad, up, down, gamma)
        if is_eager(kw):
            return lora_reference.lora_merge_bwd(grad, up, down, gamma)
        return lora_kernels.merge_bwd(grad, up, down, gamma, **kw)


def lora_bypass_fwd(x, up, down, gamma, base=None):
    with device_guard(x):
        kw = lora_tuning.bypass_fwd_kwargs(x, up, down, gamma, base)
        if is_eager(kw):
            return lora_reference.lora_bypass_fwd(x, up, down, gamma, base)
        return lora_kernels.bypass_fwd(x, up, down, gamma, base, **kw)


def lora_bypass_bwd(grad, x, up, down, gamma):
    with device_guard(x):
        kw = lora_tuning.bypass_bwd_kwargs(grad, x, up, down, gamma)
        if is_eager(kw):
            return lora_reference.lora_bypass_bwd(grad, x, up, down, gamma)
        return lora_kernels.bypass_bwd(grad, x, up, down, gamma, **kw)


def lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    with device_guard(a1):
        kw = tucker_tuning.tucker_fwd_kwargs(a1, t1, b1, a2, t2, b2, gamma)
        if is_eager(kw):
            return lora_reference.lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma)
        return tucker_kernels.tucker_fwd(a1, t1, b1, a2, t2, b2, gamma, **kw)


def loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    with device_guard(grad):
        kw = loha_tuning.merge_bwd_kwargs(grad, a1, b1, a2, b2, gamma)
        if is_eager(kw):
            return loha_reference.loha_merge_bwd(grad, a1, b1, a2, b2, gamma)
        return loha_kernels.merge_bwd(grad, a1, b1, a2, b2, gamma, **kw)


def loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    with device_guard(x):
        kw = loha_tuning.bypass_fwd_kwargs(x, a1, b1, a2, b2, gamma, base)
        if is_eager(kw):
            return loha_reference.loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base)
        return loha_kernels.bypass_fwd(x, a1, b1, a2, b2, gamma, base, **kw)


def loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    with device_guard(x):
        kw = loha_tuning.bypass_bwd_kwargs(grad, x, a1, b1, a2, b2, gamma)
        if is_eager(kw):
            return loha_reference.loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma)
        return loha_kernels.bypass_bwd(grad, x, a1, b1, a2, b2, gamma, **kw)


def lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    with device_guard(w1):
        kw = lokr_tuning.full_merge_fwd_kwargs(w1, w2, base, gamma, out_dtype)
        if is_eager(kw):
            return lokr_reference.lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype)
        return lokr_kernels.lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype, **kw)


def lokr_full_merge_bwd(grad, w1, w2, gamma):
    with device_guard(grad):
        kw = lokr_tuning.full_merge_bwd_kwargs(grad, w1, w2, gamma)
        if is_eager(kw):
            return lokr_reference.lokr_full_merge_bwd(grad, w1, w2, gamma)
        return lokr_kernels.lokr_full_merge_bwd(grad, w1, w2, gamma, **kw)


def lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    with device_guard(w1a):
        kw = lokr_tuning.merge_fwd_kwargs(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)
        if is_eager(kw):
            return lokr_reference.lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)
        return lokr_kernels.lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype, **kw)


def lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    with device_guard(grad):
        kw = lokr_tuning.merge_bwd_kwargs(grad, w1a, w1b, w2a, w2b, shape, gamma)
        if is_eager(kw):
            return lokr_reference.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma)
        return lokr_kernels.lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma, **kw)


def lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    with device_guard(x):
        kw = lokr_tuning.bypass_fwd_kwargs(x, w1, w2, gamma, base)
        if is_eager(kw):
            return lokr_reference.lokr_bypass_fwd(x, w1, w2, gamma, base)
        return lokr_kernels.bypass_fwd(x, w1, w2, gamma, base, **kw)


def lokr_bypass_bwd(grad, x, w1, w2, gamma):
    with device_guard(x):
        kw = lokr_tuning.bypass_bwd_kwargs(grad, x, w1, w2, gamma)
        if is_eager(kw):
            return lokr_reference.lokr_bypass_bwd(grad, x, w1, w2, gamma)
        return lokr_kernels.bypass_bwd(grad, x, w1, w2, gamma, **kw)


def dora_fwd(w, dscale, mult, row_axis, delta=None):
    with device_guard(w):
        kw = dora_tuning.dora_fwd_kwargs(w, dscale, mult, row_axis, delta)
        if is_eager(kw):
            return dora_reference.dora_fwd(w, dscale, mult, row_axis, delta)
        return dora_kernels.dora_fwd(w, dscale, mult, row_axis, delta, **kw)


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    with device_guard(grad):
        kw = dora_tuning.dora_bwd_kwargs(grad, w, dscale, norms, mult, row_axis, delta)
        if is_eager(kw):
            return dora_reference.dora_bwd(grad, w, dscale, norms, mult, row_axis, delta)
        return dora_kernels.dora_bwd(grad, w, dscale, norms, mult, row_axis, delta, **kw)


def oft_fwd(blocks, x, rescale, cscale, shift, weight):
    with device_guard(x):
        kw = oft_tuning.oft_fwd_kwargs(blocks, x, rescale, cscale, shift, weight)
        if is_eager(kw):
            return oft_reference.oft_fwd(blocks, x, rescale, cscale, shift, weight)
        return oft_kernels.oft_fwd(blocks, x, rescale, cscale, shift, weight, **kw)


def oft_bwd(grad, blocks, x, rescale, cscale, shift, weight):
    with device_guard(x):
        kw = oft_tuning.oft_bwd_kwargs(grad, blocks, x, rescale, cscale, shift, weight)
        if is_eager(kw):
            return oft_reference.oft_bwd(grad, blocks, x, rescale, cscale, shift, weight)
        return oft_kernels.oft_bwd(grad, blocks, x, rescale, cscale, shift, weight, **kw)


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    with device_guard(x):
        kw = boft_tuning.boft_fwd_kwargs(blocks, x, axis, cscale, scale, rescale, diff)
        if is_eager(kw):
            return boft_reference.boft_fwd(blocks, x, axis, cscale, scale, rescale, diff)
        return boft_kernels.boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, **kw)


def boft_bwd(grad, blocks, x, axis, cscale, scale):
    with device_guard(x):
        kw = boft_tuning.boft_bwd_kwargs(grad, blocks, x, axis, cscale, scale)
        if is_eager(kw):
            return boft_reference.boft_bwd(grad, blocks, x, axis, cscale, scale)
        return boft_kernels.boft_bwd(grad, blocks, x, axis, cscale, scale, **kw)


def ia3_fwd(x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        kw = ia3_tuning.ia3_fwd_kwargs(x, w, channel_axis, alpha, gamma)
        if is_eager(kw):
            return ia3_reference.ia3_fwd(x, w, channel_axis, alpha, gamma)
        return ia3_kernels.ia3_fwd(x, w, channel_axis, alpha, gamma, **kw)


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        kw = ia3_tuning.ia3_bwd_kwargs(grad, x, w, channel_axis, alpha, gamma)
        if is_eager(kw):
            return ia3_reference.ia3_bwd(grad, x, w, channel_axis, alpha, gamma)
        return ia3_kernels.ia3_bwd(grad, x, w, channel_axis, alpha, gamma, **kw)


def add_scaled(base, delta, gamma):
    with device_guard(base):
        kw = add_tuning.add_scaled_kwargs(base, delta, gamma)
        if is_eager(kw):
            return add_reference.add_scaled(base, delta, gamma)
        return add_kernels.add_scaled(base, delta, gamma, **kw)
