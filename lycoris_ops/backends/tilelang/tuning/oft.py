"""TileLang tuning spaces of diag-OFT (``backends/tilelang/kernels/oft.py``): ``oft_fwd``,
``oft_bwd``; BOFT's (``boft.py``) share them. Scored by the Triton kernels' work models
(``tuner/models/oft.py``) with the names mapped."""
from __future__ import annotations

import math

from lycoris_ops.backends.tilelang.kernels import oft as kernels, oft_cayley
from lycoris_ops.backends.tilelang.tuning import TL_N
# the Triton kernels' split rule its work model takes (the TileLang model borrows that model)
from lycoris_ops.backends.triton.kernels import oft as triton_oft
from lycoris_ops.tuner.cost import esize, smem_fits, tl_shortlist, tl_threads
from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.models import oft as models

#: the streaming kernels' positions per tile (BT) and threads: the forward's apply kernel
#: (TL_APPLY) and the backward's stream kernel (TL_STREAM); 256 threads only with 128-row tiles
#: (the gx / y GEMM's warpgroups); a config must fit the block's shared memory (``tl_legal``).
#: The corners compile for sm_90a (tests/tilelang/test_tilelang_oft.py)
TL_APPLY = dict(BT=(64, 128, 256), threads=(128, 256))
TL_STREAM = dict(BT=(32, 64, 128), threads=(128, 256))
#: fp32 accumulator registers per thread a TileLang config may hold (the (BT x GP) tile,
#: plus the backward's GP x GP partial): beyond it the fragment spills
TL_ACC_PER_THREAD = 128


def tl_legal(dev: DeviceFacts, c: dict, GP: int, csize: int, bwd: bool) -> bool:
    """Whether the TileLang config ``c`` fits one block: the kernel's shared memory (with the
    planners' margin for the compiler's scratch) and its accumulator registers."""
    smem = (kernels.stream_smem if bwd else kernels.apply_smem)(GP, c["BT"], csize)
    acc = c["BT"] * GP + (GP * GP if bwd else 0)
    return smem_fits(dev, smem) and acc <= TL_ACC_PER_THREAD * c["threads"]


def tl_configs(dev: DeviceFacts, GP: int, csize: int, bwd: bool) -> list:
    """The legal configs of TL_STREAM (bwd) or TL_APPLY for groups of GP channels."""
    sp = TL_STREAM if bwd else TL_APPLY
    cfgs = [dict(BT=bt, threads=t) for bt in sp["BT"] for t in tl_threads(sp["threads"], bt)]
    return [c for c in cfgs if tl_legal(dev, c, GP, csize, bwd)]


def tl_plan(op: str, dev: DeviceFacts, work, eager: float, GP: int, csize: int, bwd: bool, n: int, keep=None):
    """The shortlist of a streaming kernel: the fixed config first, the model's best legal
    configs (``keep``: only those it accepts), eager (oft_* and boft_*)."""
    default = dict(kernels.STREAM if bwd else kernels.APPLY)
    cfgs = [c for c in tl_configs(dev, GP, csize, bwd) if keep is None or keep(c)]
    return tl_shortlist(op, cfgs, work, dev, default, eager, ("BT",), n)


def tl_channels_first(x, ax: int) -> bool:
    """Whether the kernels (diag-OFT's and BOFT's) read x as channels first: x is seen as
    (pre, C, post) around the rotated axis ``ax``, channels first when post != 1."""
    return math.prod(int(s) for s in x.shape[ax + 1:]) != 1


def _tl_shape(blocks, x, weight):
    """(K, S, npos, channels-first layout) as the kernels see x (contiguous)."""
    cf = tl_channels_first(x, models.rotated_axis(x, weight))
    return int(blocks.shape[0]), int(blocks.shape[1]), models.geometry(x, weight)[0], cf


def _tl_model(dev, K, S, npos, cf, bwd, ex, eb):
    """The Triton model's work of a TileLang config (names mapped: BT -> the streamed tile,
    threads -> warps, the group -> ``group``; no pipelined loop: one stage) and eager."""
    GP = kernels.group_plan(S)[0]
    work, eager = models.model(dev, K, S, npos, not cf, bwd, ex, eb, auto_split=triton_oft.auto_split)

    def tl_work(c):
        return work(dict(block_p=c["BT"], bwd_block_p=c["BT"], group=GP, split=0, num_warps=c["threads"] // 32,
                         num_stages=1, dot_prec="tf32x3", chain_warps=4))
    return tl_work, eager, GP


def _fwd_tl(dev, blocks, x, rescale, cscale, shift, weight, n: int = TL_N):
    K, S, npos, cf = _tl_shape(blocks, x, weight)
    work, eager, GP = _tl_model(dev, K, S, npos, cf, False, esize(x.dtype), esize(blocks.dtype))
    csize = esize(kernels.gemm_dtype(x.dtype))
    return tl_plan("oft_fwd", dev, work, eager, GP, csize, False, n)


def _bwd_tl(dev, grad, blocks, x, rescale, cscale, shift, weight, n: int = TL_N):
    K, S, npos, cf = _tl_shape(blocks, x, weight)
    work, eager, GP = _tl_model(dev, K, S, npos, cf, True, esize(x.dtype), esize(blocks.dtype))
    csize = esize(kernels.gemm_dtype(x.dtype, grad.dtype))
    return tl_plan("oft_bwd", dev, work, eager, GP, csize, True, n)


def _tl_sizes(blocks, x, rescale, cscale, shift, weight):
    """(K, S, channels-first layout); the positions stay bucketed (key_parts)."""
    K, S, _, cf = _tl_shape(blocks, x, weight)
    return K, S, cf


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {"oft_fwd": (_fwd_tl, _tl_sizes), "oft_bwd": (_bwd_tl, lambda g, *a: _tl_sizes(*a))}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"oft_fwd": kernels.oft_fwd, "oft_bwd": kernels.oft_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels, oft_cayley)
