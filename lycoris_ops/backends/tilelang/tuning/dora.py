"""TileLang tuning space of DoRA (``backends/tilelang/kernels/dora.py``): ``dora_fwd``,
``dora_bwd``."""
from __future__ import annotations

from lycoris_ops.backends.tilelang.kernels import dora as kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize, tl_shortlist

#: the one-kernel passes' vectors per tile and threads (the extremes compile for sm_90a:
#: tests/tilelang/test_tilelang_elementwise.py)
TL_SPACE = dict(vecs=(256, 512, 1024, 2048), threads=(128, 256))


def _tl_plan(op, dev, w, row_axis, delta, g_dtype, n: int = TL_N):
    """The TileLang shortlist of one call: the fixed config first, the model's best, eager.
    Model: one program owns BR x BC vectors of norm vectors and reads them twice (the sum,
    then the scale / gradient pass, the second mostly from L2): memory-bound, DRAM = M once
    (+ G) + the output once, in flight a tile of every operand."""
    R0, R1 = w.shape
    ew = esize(w.dtype)
    ed = 0 if delta is None else esize(delta.dtype)
    eg = 0 if g_dtype is None else esize(g_dtype)
    dts = [w.dtype] + ([] if delta is None else [delta.dtype]) + ([] if g_dtype is None else [g_dtype])
    vec = kernels._vec(R1, *dts)

    def work(c):
        br, bc = kernels.tiling(R0, R1, row_axis, vec, dev.sm_count, c["vecs"])
        grid = cdiv(R0, br) if row_axis == 0 else cdiv(R1 // vec, bc)
        tile = br * bc * vec
        return Work(grid=grid, warps=c["threads"] // 32, regs=tile * (3 if eg else 2),
                    dram=R0 * R1 * (ew + ed + eg + ew), inflight=tile * (ew + ed + eg))

    default = dict(kernels.DORA)
    cfgs = [dict(vecs=v, threads=t) for v in TL_SPACE["vecs"] for t in TL_SPACE["threads"]]
    R, NC = (R0, R1) if row_axis == 0 else (R1, R0)
    steps = [(R * NC * (ew + ed + 4), 0), (R * NC * 4, 0), (R * 16, 0), (R * NC * (4 + 4), 0), (R * NC * (4 + ew), 0)]
    if g_dtype is not None:
        steps += [(R * NC * (eg + 4 + 4), 0), (R * NC * 4 * 3, 0), (R * NC * (4 + 4), 0)]
    return tl_shortlist(op, cfgs, work, dev, default, eager_time(dev, steps), ("vecs",), n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {
    "dora_fwd": (lambda dev, w, dscale, mult, row_axis, delta=None: _tl_plan("dora_fwd", dev, w, row_axis, delta, None),
                 lambda w, dscale, mult, row_axis, *a: (tuple(w.shape), row_axis)),
    "dora_bwd": (lambda dev, grad, w, dscale, norms, mult, row_axis, delta=None:
                 _tl_plan("dora_bwd", dev, w, row_axis, delta, grad.dtype),
                 lambda grad, w, dscale, norms, mult, row_axis, *a: (tuple(w.shape), row_axis)),
}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"dora_fwd": kernels.dora_fwd, "dora_bwd": kernels.dora_bwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels,)
