"""TileLang tuning space of IA3 (``backends/tilelang/kernels/ia3.py``): ``ia3_fwd``, ``ia3_bwd``."""
from __future__ import annotations

from lycoris_ops.backends.tilelang.kernels import ia3 as kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.tuner.cost import tl_shortlist
from lycoris_ops.tuner.models import ia3 as models

#: the streaming kernels' vectors per tile (rows x a minor extent of up to 32 16-byte vectors)
#: and threads; every combination compiles for sm_90a (tests/tilelang/test_tilelang_elementwise.py)
TL_SPACE = dict(vecs=(256, 512, 1024, 2048), threads=(128, 256))


def _tl_mapped(work, N: int, x_dtype):
    """The Triton model's work of a TileLang config: its tile (rows x vectors) in elements."""
    vec = kernels._vec(N, x_dtype)

    def tl_work(c):
        bm, bn = kernels._tile(N // vec, c["vecs"])
        return work(dict(block_m=bm, block_n=bn * vec, split=0, num_warps=c["threads"] // 32))
    return tl_work


def _tl_plan(op, work, eager, dev, n):
    default = dict(kernels.IA3)
    cfgs = [dict(vecs=v, threads=t) for v in TL_SPACE["vecs"] for t in TL_SPACE["threads"]]
    return tl_shortlist(op, cfgs, work, dev, default, eager, ("vecs",), n)


def _fwd_tl(dev, x, w, channel_axis, alpha, gamma, n: int = TL_N):
    M, N, C, ch_rows = models.geometry(x.shape, channel_axis)
    work, eager = models.fwd_model(dev, M, N, C, x.dtype, w.dtype)
    return _tl_plan("ia3_fwd", _tl_mapped(work, N, x.dtype), eager, dev, n)


def _bwd_tl(dev, grad, x, w, channel_axis, alpha, gamma, n: int = TL_N):
    M, N, C, ch_rows = models.geometry(x.shape, channel_axis)
    work, eager = models.bwd_model(dev, M, N, C, ch_rows, x.dtype, w.dtype, grad.dtype)
    return _tl_plan("ia3_bwd", _tl_mapped(work, N, x.dtype), eager, dev, n)


def _sizes(x, w, channel_axis, *a):
    """The channel geometry (N, C, layout); the token rows M stay bucketed (key_parts)."""
    return tuple(models.geometry(x.shape, channel_axis)[1:])


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {"ia3_fwd": (_fwd_tl, _sizes), "ia3_bwd": (_bwd_tl, lambda g, x, w, ax, *a: _sizes(x, w, ax))}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"ia3_fwd": kernels.ia3_fwd, "ia3_bwd": kernels.ia3_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels,)
