"""The Triton op set: one function per op, named and called like the schema
(OPS.md §0), for the ops that have Triton kernels. The CUDA dispatcher calls
these with arguments already validated by the op's ``check_<op>`` and already
inside the scope limits (``lycoris_ops.scope``); outputs are fresh and
contiguous, with the dtypes of ``reference/<family>.py``.

Host work per call is what eager does too (allocating the outputs) plus a
cached plan lookup and the launches; no casts, copies or syncs (the only
exceptions: an IA3 / add_scaled operand whose layout does not collapse to a few
strided runs is copied contiguous, and the bypass backward allocates a small
(2, T, r) workspace and, when its token reduction is split, fp32 partials).

Importing this module needs triton (ImportError otherwise: the backend is then
absent) but no GPU.
"""
from __future__ import annotations

from . import add as _add
from . import ia3 as _ia3
from . import lora as _lora
from ._common import device_guard

#: the 23 ops, all with Triton kernels (limits: lycoris_ops/scope.py)
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
        return _lora.merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype)


def lora_merge_bwd(grad, up, down, gamma):
    with device_guard(up):
        return _lora.merge_bwd(grad, up, down, gamma)


def lora_bypass_fwd(x, up, down, gamma, base=None):
    with device_guard(x):
        return _lora.bypass_fwd(x, up, down, gamma, base)


def lora_bypass_bwd(grad, x, up, down, gamma):
    with device_guard(x):
        return _lora.bypass_bwd(grad, x, up, down, gamma)


def ia3_fwd(x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        return _ia3.ia3_fwd(x, w, channel_axis, alpha, gamma)


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    with device_guard(x):
        return _ia3.ia3_bwd(grad, x, w, channel_axis, alpha, gamma)


def add_scaled(base, delta, gamma):
    with device_guard(base):
        return _add.add_scaled(base, delta, gamma)


# DoRA, diag-OFT, BOFT (triton/dora.py, oft.py, boft.py: validated, in-scope calls)
from .dora import dora_fwd, dora_bwd  # noqa: F401,E402
from .oft import oft_fwd, oft_bwd  # noqa: F401,E402
from .boft import boft_fwd, boft_bwd  # noqa: F401,E402
# LoHa, LoKr, tucker (triton/loha.py, lokr.py, tucker.py: validated, in-scope calls)
from .loha import loha_merge_bwd, loha_bypass_fwd, loha_bypass_bwd  # noqa: F401,E402
from .lokr import (lokr_full_merge_fwd, lokr_full_merge_bwd, lokr_merge_fwd, lokr_merge_bwd,  # noqa: F401,E402
                   lokr_bypass_fwd, lokr_bypass_bwd)
from .tucker import lora_tucker_fwd  # noqa: F401,E402
