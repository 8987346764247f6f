"""Work model of the BOFT kernels (``boft_fwd``, ``boft_bwd``).

The m butterfly stages are cut into segments of at most L stages, the largest L with
2^L·pow2(s/2) <= ``max_group`` channels; one launch per segment (a program: one channel
group of GP = max(16, 2^L·pow2(s/2)) rows and a share of the positions), after two small
launches shared by all segments (the Cayley factors of every block; the GP x GP group
matrix of every group). More stages per segment = fewer passes over x (each extra
segment streams an fp32 scratch of x's size in and out) but a bigger GP x GP dot per
tile. ``block_p`` positions per tile; the backward keeps the segment inputs (forward
passes at ``block_p``), streams each segment back (two dots per tile at ``bwd_block_p``,
fp32 partials) and runs one tiny chain launch per segment.
"""
from __future__ import annotations

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, p2


def geometry(blocks, x, axis):
    """(m, nb, s, npos, c_contig) of a call: the stages, blocks a stage, block size, the
    positions each block rotates and whether the channels are contiguous."""
    ax = axis % x.dim()
    npos = 1
    for i, sz in enumerate(x.shape):
        if i != ax:
            npos *= int(sz)
    m, nb, s = (int(v) for v in blocks.shape[:3])
    return m, nb, s, npos, x.stride(ax) == 1


def segments(m: int, nb: int, s: int, npos: int, sm: int, max_group: int, bp: int, *, auto_split):
    """([(L, GP, n_groups, split)], n_tiles) of the launcher's segment plan;
    ``auto_split(n_groups, sm)``: its split rule."""
    half = s // 2
    HP = p2(half)
    lmax = 1
    while (1 << (lmax + 1)) * HP <= max_group:
        lmax += 1
    n_tiles = cdiv(npos, bp)
    C = nb * s
    out, a = [], 0
    while a < m:
        L = min(lmax, m - a)
        GP = max(16, (1 << L) * HP)
        n_groups = C // (half << L)
        split = max(1, min(auto_split(n_groups, sm), n_tiles))
        out.append((L, GP, n_groups, split))
        a += L
    return out, n_tiles


def model(dev, m, nb, s, npos, c_contig, bwd, ex, eb, *, auto_split, chain_warps, cayley_warps: int, seen=None):
    """(work of a Triton config, eager seconds); ``seen``: drop configs whose launch signature
    an earlier config had (None: score every config). The launcher's rules: ``auto_split``
    (``segments``), ``chain_warps(requested, GP)``, ``cayley_warps``."""
    C = nb * s
    SP = 2 * p2(s // 2)
    # the Cayley factors of every block (one launch, the same for every config)
    nbb = max(1, 2048 // (SP * SP))
    cayley = Work(grid=cdiv(m * nb, nbb), warps=cayley_warps, acc=3 * nbb * SP * SP,
                  dram=m * nb * (s * s * eb + SP * SP * 4), fma=m * nb * 4.0 * SP ** 3, tc=False)

    def work(c):
        bp = c["bwd_block_p"] if bwd else c["block_p"]
        fbp = c["block_p"]  # the backward's forward passes (segment inputs) use block_p
        segs, n_tiles = segments(m, nb, s, npos, dev.sm_count, c["max_group"], bp, auto_split=auto_split)
        f_tiles = cdiv(npos, fbp)
        cw = chain_warps(c.get("chain_warps", 0), segs[0][1])
        sig = (tuple(segs), bp, fbp if bwd else 0, c["num_warps"], c["num_stages"], cw)
        if seen is not None and seen.setdefault(sig, id(c)) != id(c):
            return None
        # the group matrices J of every segment (one launch; stages gathered, an IEEE dot per stage after the first)
        GP0 = segs[0][1]
        n_j = sum(g for _, _, g, _ in segs)
        works = [cayley, Work(grid=n_j, warps=cw, acc=3 * GP0 * GP0, dram=n_j * GP0 * GP0 * 4 + m * nb * SP * SP * 4,
                              fma=sum(g * (L - 1) * 2.0 * GP ** 3 for L, GP, g, _ in segs), tc=False)]
        for idx, (L, GP, n_groups, split) in enumerate(segs):
            first, last = idx == 0, idx == len(segs) - 1
            e_in = ex if first else 4
            e_out = ex if last else 4
            sector = max(1.0, 32.0 / max((GP if c_contig else bp) * min(e_in, e_out), 1))
            grid = n_groups * split
            dots = 3 * 2.0 * GP * GP * bp * n_tiles * n_groups
            if not bwd:
                works.append(Work(grid=grid, warps=c["num_warps"], stages=c["num_stages"], acc=GP * bp + GP * GP,
                                  smem=GP * bp * e_in, dram=npos * C * (e_in + e_out) * sector, mma=dots))
            else:
                if not last:  # segment input kept for the backward
                    fsplit = max(1, min(auto_split(n_groups, dev.sm_count), f_tiles))
                    fsector = max(1.0, 32.0 / max((GP if c_contig else fbp) * min(e_in, 4), 1))
                    works.append(Work(grid=n_groups * fsplit, warps=c["num_warps"], stages=c["num_stages"],
                                      acc=GP * fbp + GP * GP, smem=GP * fbp * e_in,
                                      dram=npos * C * (e_in + 4) * fsector,
                                      mma=3 * 2.0 * GP * GP * fbp * f_tiles * n_groups))
                part = split * n_groups * GP * GP * 4
                works.append(Work(grid=grid, warps=c["num_warps"], stages=c["num_stages"],
                                  acc=GP * bp * 2 + 2 * GP * GP, smem=2 * GP * bp * 4,
                                  dram=npos * C * (3 * 4) * sector + part, mma=2 * dots))
                works.append(Work(grid=n_groups * L, warps=chain_warps(c.get("chain_warps", 0), GP), acc=3 * GP * GP,
                                  dram=part + n_groups * L * L * GP * GP * 4,
                                  fma=n_groups * L * (L + 1) * 2.0 * GP ** 3, inflight=GP * GP * 4, tc=False))
        return works

    per_stage = [(nb * s * s * (eb + 4) * 3, nb * 4.0 * s ** 3), (npos * C * 4 * 2, 2.0 * npos * C * s),
                 (npos * C * 4 * 2, 0)]
    steps = [(npos * C * (ex + 4), 0)] + per_stage * m + [(npos * C * (4 + ex), 0)]
    return work, eager_time(dev, steps * 3 if bwd else steps, tc=False)
