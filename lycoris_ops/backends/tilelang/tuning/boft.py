"""TileLang tuning spaces of BOFT (``backends/tilelang/kernels/boft.py``): ``boft_fwd``, ``boft_bwd``.

The kernels run one launch per stage (or composed unit): the run kernels (channels last, 16-bit
x) or diag-OFT's gather kernels (fp32 GEMMs) otherwise. The spaces and legality are
``tuning/oft.py``'s for the gather kernels (TL_APPLY for boft_fwd, TL_STREAM for boft_bwd's
stream launches; the backward's forward replay keeps the fixed apply config), the larger of
the two footprints; where the run kernels take the call, only tiles they fit
(``_tl_run_fits``). Scored by the Triton kernels' work model (``tuner/models/boft.py``).
"""
from __future__ import annotations

from lycoris_ops.backends.tilelang.common import arch_of_capability
from lycoris_ops.backends.tilelang.kernels import boft as kernels, oft as oft_kernels, oft_cayley
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.backends.tilelang.tuning.oft import tl_channels_first, tl_plan
# the Triton kernels' launch rules their work model takes (the TileLang model borrows that model)
from lycoris_ops.backends.triton.kernels import boft as triton_boft
from lycoris_ops.tuner.cost import esize, p2
from lycoris_ops.tuner.models import boft as models


def _tl_model(dev, blocks, x, axis, bwd):
    """The Triton model's work of a TileLang config (names mapped: one stage per segment,
    ``max_group`` = one butterfly pair of blocks; BT -> the streamed tile, threads -> warps;
    the backward's forward passes at the fixed apply tile) and eager; the group width GP."""
    m, nb, s, npos, _ = models.geometry(blocks, x, axis)
    work, eager = models.model(dev, m, nb, s, npos, not _tl_sizes(blocks, x, axis)[3], bwd, esize(x.dtype),
                               esize(blocks.dtype), auto_split=triton_boft.auto_split,
                               chain_warps=triton_boft.chain_warps, cayley_warps=triton_boft.CAYLEY_WARPS)
    fixed_bt = oft_kernels.APPLY["BT"]

    def tl_work(c):
        return work(dict(max_group=2 * p2(s // 2), block_p=fixed_bt if bwd else c["BT"], bwd_block_p=c["BT"],
                         split=0, num_warps=c["threads"] // 32, num_stages=1, dot_prec="tf32x3", chain_warps=0))
    return tl_work, eager, kernels.boft_groups(s, nb)[0]


def _tl_run_fits(dev, blocks, x, axis, bwd: bool):
    """Where the run kernels take the call (``kernels.runs_for``: channels last, 16-bit x, a
    ``run_groups`` size), a config filter: only tiles whose run kernels fit in shared memory. A
    larger tile would build and run the gather kernels instead (several times slower, and
    slower to build: a cold key's time)."""
    m, nb, s, cf = _tl_sizes(blocks, x, axis)
    arch = arch_of_capability(dev.capability)
    runs = kernels.runs_for(x, cf, s, nb, arch)
    if runs is None:
        return None
    limit = min(dev.smem_per_block, kernels.smem_limit(x.device))
    return lambda c: kernels.runs_fit(runs, c["BT"], esize(x.dtype), arch, bwd, limit)


def _fwd_tl(dev, blocks, x, axis, cscale, scale, rescale, diff, n: int = TL_N):
    work, eager, GP = _tl_model(dev, blocks, x, axis, False)
    return tl_plan("boft_fwd", dev, work, eager, GP, 4, False, n,  # gather kernels' fp32 GEMMs: 4-byte operands
                   _tl_run_fits(dev, blocks, x, axis, False))


def _bwd_tl(dev, grad, blocks, x, axis, cscale, scale, n: int = TL_N):
    work, eager, GP = _tl_model(dev, blocks, x, axis, True)
    return tl_plan("boft_bwd", dev, work, eager, GP, 4, True, n, _tl_run_fits(dev, blocks, x, axis, True))


def _tl_sizes(blocks, x, axis, *a):
    """(m, nb, s, channels-first layout); the positions stay bucketed (key_parts)."""
    m, nb, s, _, _ = models.geometry(blocks, x, axis)
    return m, nb, s, tl_channels_first(x, axis % x.dim())


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {"boft_fwd": (_fwd_tl, _tl_sizes), "boft_bwd": (_bwd_tl, lambda g, *a: _tl_sizes(*a))}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"boft_fwd": kernels.boft_fwd, "boft_bwd": kernels.boft_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels, oft_kernels, oft_cayley)
