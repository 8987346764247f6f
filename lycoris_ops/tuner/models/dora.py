"""Work model of the DoRA kernels (``dora_fwd``, ``dora_bwd``).

M (= w + delta) is seen as R norm vectors of NC elements. Two variants, chosen by the
config: *resident* (a tile of BR whole vectors in registers; one pass: M read once) and
*streamed* (two passes: a split sum of squares / (ρ, ‖M‖²), then the scale / gradient
pass: M read twice). Memory-bound; the resident tile is an fp32 register footprint;
tiles are oriented by the launcher along the contiguous axis.
"""
from __future__ import annotations

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, p2
from lycoris_ops.tuner.device import DeviceFacts


def layout(R: int, NC: int, r_contig: bool, bwd: bool, sm: int, c: dict, max_split: int):
    """(mode, BR, BC, split) the launcher picks for config ``c`` (``max_split``: its cap)."""
    bc_res = max(16, p2(NC))
    budget = c["resident_max"] // (2 if bwd else 1)
    if r_contig:
        br_res = max(32, min(128, budget // bc_res))
    else:
        br_res = max(1, min(64, budget // bc_res, p2(R)))
    if br_res * bc_res <= budget and (cdiv(R, br_res) >= sm or R * NC <= 4 * budget):
        return "res", br_res, bc_res, 1
    br = c["br"] or (128 if r_contig else 4)
    bc = c["bc"] or (32 if r_contig else 512)
    n_chunks = max(1, cdiv(NC, bc))
    split = c["split"] or max(1, min(max_split, n_chunks, cdiv(2 * sm, cdiv(R, br))))
    split = cdiv(n_chunks, cdiv(n_chunks, split))
    return "str", br, bc, split


def model(dev: DeviceFacts, R, NC, r_contig, bwd, ew, ed, ey, eg, *, max_split: int, seen=None):
    """(work of a Triton config, eager seconds); ``seen``: drop configs whose launch an
    earlier config had (None: score every config)."""
    def work(c):
        mode, br, bc, split = layout(R, NC, r_contig, bwd, dev.sm_count, c, max_split)
        sig = (mode, br, bc, split, c["num_warps"], c["num_stages"])
        if seen is not None and seen.setdefault(sig, id(c)) != id(c):
            return None  # the same launch as an earlier config
        m = R * NC * (ew + ed)
        w, s = c["num_warps"], c["num_stages"]
        if mode == "res":
            return Work(grid=cdiv(R, br), warps=w, stages=s, acc=br * bc * (2 if bwd else 1),
                        dram=m + R * NC * (ey + eg) + R * 12, inflight=br * bc * (ew + ed + eg) // max(1, s))
        part = (2 if bwd else 1) * split * R * 4
        return [Work(grid=cdiv(R, br) * split, warps=w, stages=s, acc=br * bc, dram=m + R * NC * eg + part,
                     inflight=br * bc * (ew + ed + eg)),
                Work(grid=cdiv(R, br) * max(1, cdiv(NC, bc)), warps=w, stages=s, acc=br * bc,
                     dram=m + R * NC * (ey + eg) + part + R * 8, inflight=br * bc * (ew + ed + eg))]

    return work, eager(dev, R, NC, ew, ed, ey, eg, bwd)


def eager(dev: DeviceFacts, R, NC, ew, ed, ey, eg, bwd) -> float:
    """Predicted seconds of the eager body (norms, scale, output; the backward's gradients)."""
    steps = [(R * NC * (ew + ed + 4), 0), (R * NC * 4, 0), (R * 16, 0), (R * NC * (4 + 4), 0), (R * NC * (4 + ey), 0)]
    if bwd:
        steps += [(R * NC * (eg + 4 + 4), 0), (R * NC * 4 * 3, 0), (R * NC * (4 + 4), 0)]
    return eager_time(dev, steps)
