"""Work model of ``add_scaled`` (``out = base + γ·delta``, one program per ``block``
elements): memory-bound; DRAM bytes = numel·(base + delta + out element sizes), a program
keeps ``block·(eb + ed)`` bytes in flight, blocks of at most 64 elements a thread."""
from __future__ import annotations

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, esize
from lycoris_ops.tuner.device import DeviceFacts


def model(dev: DeviceFacts, numel: int, base_dtype, delta_dtype):
    """(work(cfg), eager seconds) of ``add_scaled``; cfg in the Triton launcher's names."""
    eb, ed = esize(base_dtype), esize(delta_dtype)

    def work(c):
        block, w = c["block"], c["num_warps"]
        threads = 32 * w
        if block < threads or block > 64 * threads:
            return None
        return Work(grid=cdiv(numel, block), warps=w, regs=3 * block, dram=numel * (2 * eb + ed),
                    inflight=block * (eb + ed))

    return work, eager_time(dev, [(numel * (ed + 4), 0), (numel * (eb + 4 + 4), 0), (numel * (4 + eb), 0)])
