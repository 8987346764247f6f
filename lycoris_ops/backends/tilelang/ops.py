"""The TileLang op set: the fused TileLang kernels of the 23 ops, one function per op.

Each function has the op's schema signature and name and receives arguments that
the op already validated (``check_<op>``) and that are inside
``lycoris_ops.backends.scope`` for backend ``"tilelang"`` (16-bit compute dtypes: fp32
calls of the GEMM ops step down); outputs are fresh and contiguous, dtypes as the eager
bodies (``reference/<family>.py``). An op absent from this module steps down to the next
tier (``select``). Optional module attributes read by ``registry``/``select``:
``DEVICE_TYPES`` (default ``("cuda",)``), ``DTYPES``, ``MIN_CAPABILITY``.

Importing this module raises ImportError when tilelang is not installed (the backend is
then absent) and compiles nothing: kernels compile on first use. Each call goes through
``backends/tilelang/runner.py``: the op's launcher (``backends/tilelang/kernels``), or the
op's eager body at the shapes where a timing showed eager faster.
"""
import importlib.util as _ilu

# whether tilelang is installed, without importing it (its import takes seconds): else the backend is absent
if _ilu.find_spec("tilelang") is None:
    raise ImportError("lycoris_ops.backends.tilelang.ops needs the tilelang package")

from lycoris_ops.backends.tilelang import runner as _tl_pick  # noqa: E402  (each call: the kernel, or eager where eager won)
from lycoris_ops.backends.tilelang.common import device_guard as _tl_guard  # noqa: E402


def lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    with _tl_guard(a1):
        return _tl_pick.run("lora_merge_fwd", (a1, b1, a2, b2, base, gamma, mode, out_dtype))


def lora_merge_bwd(grad, up, down, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("lora_merge_bwd", (grad, up, down, gamma))


def lora_bypass_fwd(x, up, down, gamma, base=None):
    with _tl_guard(x):
        return _tl_pick.run("lora_bypass_fwd", (x, up, down, gamma, base))


def lora_bypass_bwd(grad, x, up, down, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("lora_bypass_bwd", (grad, x, up, down, gamma))


def loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("loha_merge_bwd", (grad, a1, b1, a2, b2, gamma))


def loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    with _tl_guard(x):
        return _tl_pick.run("loha_bypass_fwd", (x, a1, b1, a2, b2, gamma, base))


def loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("loha_bypass_bwd", (grad, x, a1, b1, a2, b2, gamma))


def add_scaled(base, delta, gamma):
    with _tl_guard(base):
        return _tl_pick.run("add_scaled", (base, delta, gamma))


def ia3_fwd(x, w, channel_axis, alpha, gamma):
    with _tl_guard(x):
        return _tl_pick.run("ia3_fwd", (x, w, channel_axis, alpha, gamma))


def ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    with _tl_guard(x):
        return _tl_pick.run("ia3_bwd", (grad, x, w, channel_axis, alpha, gamma))


def dora_fwd(w, dscale, mult, row_axis, delta=None):
    with _tl_guard(w):
        return _tl_pick.run("dora_fwd", (w, dscale, mult, row_axis, delta))


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    with _tl_guard(w):
        return _tl_pick.run("dora_bwd", (grad, w, dscale, norms, mult, row_axis, delta))


def oft_fwd(blocks, x, rescale, cscale, shift, weight):
    with _tl_guard(x):
        return _tl_pick.run("oft_fwd", (blocks, x, rescale, cscale, shift, weight))


def oft_bwd(grad, blocks, x, rescale, cscale, shift, weight):
    with _tl_guard(x):
        return _tl_pick.run("oft_bwd", (grad, blocks, x, rescale, cscale, shift, weight))


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    with _tl_guard(x):
        return _tl_pick.run("boft_fwd", (blocks, x, axis, cscale, scale, rescale, diff))


def boft_bwd(grad, blocks, x, axis, cscale, scale):
    with _tl_guard(x):
        return _tl_pick.run("boft_bwd", (grad, blocks, x, axis, cscale, scale))


def lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    with _tl_guard(a1):
        return _tl_pick.run("lora_tucker_fwd", (a1, t1, b1, a2, t2, b2, gamma))


def lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    with _tl_guard(w1):
        return _tl_pick.run("lokr_full_merge_fwd", (w1, w2, base, gamma, out_dtype))


def lokr_full_merge_bwd(grad, w1, w2, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("lokr_full_merge_bwd", (grad, w1, w2, gamma))


def lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    with _tl_guard(w1a):
        return _tl_pick.run("lokr_merge_fwd", (w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype))


def lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("lokr_merge_bwd", (grad, w1a, w1b, w2a, w2b, shape, gamma))


def lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    with _tl_guard(x):
        return _tl_pick.run("lokr_bypass_fwd", (x, w1, w2, gamma, base))


def lokr_bypass_bwd(grad, x, w1, w2, gamma):
    with _tl_guard(grad):
        return _tl_pick.run("lokr_bypass_bwd", (grad, x, w1, w2, gamma))
