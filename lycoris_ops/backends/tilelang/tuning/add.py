"""TileLang tuning space of ``add_scaled`` (``backends/tilelang/kernels/add.py``)."""
from __future__ import annotations

from lycoris_ops.backends.tilelang.kernels import add as kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.tuner.cost import tl_shortlist
from lycoris_ops.tuner.models import add as models

#: the kernel's 16-byte vectors per tile and threads (every combination compiles for sm_90a:
#: tests/tilelang/test_tilelang_elementwise.py)
TL_SPACE = dict(BV=(128, 256, 512, 1024), threads=(128, 256))


def _add_tl(dev, base, delta, gamma, n: int = TL_N):
    """The TileLang shortlist of one call: the fixed config first, then the model's best, eager."""
    numel = base.numel()
    vec = kernels.vec_width(numel, base.dtype, delta.dtype)
    work, eager = models.model(dev, numel, base.dtype, delta.dtype)

    def tl_work(c):
        return work(dict(block=c["BV"] * vec, num_warps=c["threads"] // 32))

    default = dict(kernels.ADD)
    cfgs = [dict(BV=b, threads=t) for b in TL_SPACE["BV"] for t in TL_SPACE["threads"]]
    return tl_shortlist("add_scaled", cfgs, tl_work, dev, default, eager, ("BV",), n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {"add_scaled": (_add_tl, lambda base, delta, *a: (base.numel(),))}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"add_scaled": kernels.add_scaled}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels,)
