"""The Triton op set: one function per op, named and called like the schema
(OPS.md §0). The CUDA dispatcher (``lycoris_ops.backends.select``) calls these with
arguments already validated by the op's ``check_<op>`` and inside the scope
limits of ``lycoris_ops.backends.scope``; outputs are fresh and contiguous, with the
dtypes of ``reference/<family>.py``.

Each function takes its launch config from the tuner (``lycoris_ops.backends.triton.tuning``:
cost model shortlist, timed once, cached in ``tuning.json``; the launcher's
defaults off CUDA) and runs the family launcher (``triton/<family>.py``), or the
eager body where eager won the timing at this shape.

Importing this module needs triton (ImportError otherwise: the backend is then
absent) but no GPU.
"""
from __future__ import annotations

import triton  # noqa: F401  (the probe: no triton, no op set)

from lycoris_ops.backends.triton.tuning import tuned as _tuned
from lycoris_ops.backends.triton.common import device_guard

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
        return _tuned("lora_merge_fwd", a1, b1, a2, b2, base, gamma, mode, out_dtype)


def lora_merge_bwd(grad, up, down, gamma):
    with device_guard(grad):
        return _tuned("lora_merge_bwd", grad, up, down, gamma)


def lora_bypass_fwd(x, up, down, gamma, base=None):
    with device_guard(x):
        return _tuned("lora_bypass_fwd", x, up, down, gamma, base)


def lora_bypass_bwd(grad, x, up, down, gamma):
    with device_guard(x):
        return _tuned("lora_bypass_bwd", grad, x, up, down, gamma)


def lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    with device_guard(a1):
        return _tuned("lora_tucker_fwd", a1, t1, b1, a2, t2, b2, gamma)


def loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    with device_guard(grad):
        return _tuned("loha_merge_bwd", grad, a1, b1, a2, b2, gamma)


def loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    with device_guard(x):
        return _tuned("loha_bypass_fwd", x, a1, b1, a2, b2, gamma, base)


def loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    with device_guard(x):
        return _tuned("loha_bypass_bwd", grad, x, a1, b1, a2, b2, gamma)


def lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    with device_guard(w1):
        return _tuned("lokr_full_merge_fwd", w1, w2, base, gamma, out_dtype)


def lokr_full_merge_bwd(grad, w1, w2, gamma):
    with device_guard(grad):
        return _tuned("lokr_full_merge_bwd", grad, w1, w2, gamma)


def lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    with device_guard(w1a):
        return _tuned("lokr_merge_fwd", w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype)


def lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    with device_guard(grad):
        return _tuned("lokr_merge_bwd", grad, w1a, w1b, w2a, w2b, shape, gamma)


def lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    with device_guard(x):
        return _tuned("lokr_bypass_fwd", x, w1, w2, gamma, base)


def lokr_bypass_bwd(grad, x, w1, w2, gamma):
    with device_guard(x):
        return _tuned("lokr_bypass_bwd", grad, x, w1, w2, gamma)


def dora_fwd(w, dscale, mult, row_axis, delta=None):
    with device_guard(w):
        return _tuned("dora_fwd", w, dscale, mult, row_axis, delta)


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    with device_guard(grad):
        return _tuned("dora_bwd", grad, w, dscale, norms, mult, row_axis, delta)


def oft_fwd(blocks, x, rescale, cscale, shift, weight):
    with device_guard(x):
        return _tuned("oft_fwd", blocks, x, rescale, cscale, shift, weight)


def oft_bwd(grad, blocks, x, rescale, cscale, shift, weight):
    with device_guard(x):
        return _tuned("oft_bwd", grad, blocks, x, rescale, cscale, shift, weight)


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    with device_guard(x):
        return _tuned("boft_fwd", blocks, x, axis, cscale, scale, rescale, diff)


def boft_bwd(grad, blocks, x, axis, cscale, scale):
    with device_guard(x):
        return _tuned("boft_bwd", grad, blocks, x, axis, cscale, scale)


def ia3_fwd(x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        return _tuned("ia3_fwd", x, w, channel_axis, alpha, gamma)


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        return _tuned("ia3_bwd", grad, x, w, channel_axis, alpha, gamma)


def add_scaled(base, delta, gamma):
    with device_guard(base):
        return _tuned("add_scaled", base, delta, gamma)
