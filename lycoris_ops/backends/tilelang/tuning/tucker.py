"""TileLang tuning space of the tucker rebuild (``backends/tilelang/kernels/tucker.py``):
``lora_tucker_fwd``."""
from __future__ import annotations

from lycoris_ops.backends.tilelang.kernels import tucker as kernels, lora as lora_kernels
from lycoris_ops.backends.tilelang.tuning import TL_N
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner.cost import Work, cdiv, esize, p2, tl_shortlist, tl_threads
from lycoris_ops.tuner.device import DeviceFacts
from lycoris_ops.tuner.models import tucker as models

#: the kernels' output tile (BO rows x BI columns per kernel position) and threads (256 only
#: with 128-row tiles); the corners compile for sm_90a (tests/tilelang/test_tilelang_lora.py)
TL_SPACE = dict(BO=(64, 128), BI=(32, 64, 128, 256), threads=(128, 256))


def _tl_plan(dev: DeviceFacts, a1, t1, b1, a2, t2, b2, gamma, n: int = TL_N):
    """The TileLang shortlist: fixed config first, the model's best, eager. Model: per chain a
    (BO x Rap)·(Rap x Rbp) dot, rounded, then (BO x Rbp)·(Rbp x BI); the output written once,
    the factors read per program from L2. Where the staged tile fits (``all_k_fits``),
    program = (I tile, O tile) over every κ, the (BO, BI·Kk) output tile in shared memory;
    else program = (κ, I tile, O tile) with κ-strided stores (a sector a store)."""
    two = a2 is not None
    chains = 2 if two else 1
    O, I, Kk = int(a1.shape[0]), int(b1.shape[1]), int(t1.shape[2])
    ranks = [int(t1.shape[0]), int(t1.shape[1])] + ([int(t2.shape[0]), int(t2.shape[1])] if two else [])
    compute = compute_dtype(*(t.dtype for t in (a1, t1, b1, a2, t2, b2) if t is not None))
    e, eo = esize(compute), esize(a1.dtype)
    rpa, rpb = max(p2(r, 16) for r in ranks[0::2]), max(p2(r, 16) for r in ranks[1::2])

    def work(c):
        bo, bi = c["BO"], c["BI"]
        n_o, n_i = cdiv(O, bo), cdiv(I, bi)
        all_k = kernels.all_k_fits(bo, bi, Kk, rpa, rpb, chains, e, eo)
        per_chain = chains * (bo * rpa + rpa * rpb + bo * rpb + rpb * bi) * e
        out = O * I * Kk * eo
        return Work(grid=(1 if all_k else Kk) * n_o * n_i, warps=c["threads"] // 32,
                    acc=chains * (bo * bi + bo * rpb),
                    smem=per_chain + (bo * bi * Kk * eo if all_k else 0),
                    # per-κ stores are 2 bytes Kk·2 apart: a 32-byte sector written per element
                    dram=(out if all_k else out // eo * 32)
                    + chains * (O * rpa + rpb * I) * e * (1 if all_k else min(Kk, 8)),
                    mma=chains * 2.0 * Kk * n_o * n_i * (bo * rpa * rpb + bo * rpb * bi), tc=True,
                    mma_tile=bo * bi * rpb, inflight=bo * bi * (Kk if all_k else 1) * eo)

    default = dict(kernels.TUCKER)
    cfgs = [dict(BO=bo, BI=bi, threads=t) for bo in TL_SPACE["BO"] for bi in TL_SPACE["BI"]
            for t in tl_threads(TL_SPACE["threads"], bo)]
    eager = models.fwd_eager(dev, O, I, Kk, max(ranks), chains, e, eo, True)
    return tl_shortlist("lora_tucker_fwd", cfgs, work, dev, default, eager, ("BO", "BI"), n)


#: op -> (TileLang shortlist f(DeviceFacts, *schema args) -> Plan, exact sizes of its key)
TILELANG = {"lora_tucker_fwd": (_tl_plan, lambda a1, t1, b1, a2, t2, b2, *a: (
    tuple(a1.shape), tuple(t1.shape), tuple(b1.shape), None if t2 is None else tuple(t2.shape)))}
#: op -> its launcher (what the op function runs: schema arguments, then ``cfg``)
LAUNCHERS = {"lora_tucker_fwd": kernels.tucker_fwd}
#: the kernel modules whose source hash versions this family's tuning rows (an edited kernel is timed again)
SOURCES = (kernels, lora_kernels)
