"""Work model of the diag-OFT kernels (``oft_fwd``, ``oft_bwd``).

A program owns a group of NB blocks (GP = NB·pow2(S) channel rows, at least 16,
``group`` rows when set) and a share of the positions (``split`` programs per group):
it rebuilds its Cayley factors in fp32 registers (batched Gauss–Jordan, ~4·S³ flops per
block, repeated per program), then streams ``block_p`` positions per tile with one
GP x GP x block_p dot (tf32x3 on fp32 tiles: counted as 3 tensor-core passes). The
backward also accumulates P = Σ G·Xᵀ (a second dot per tile) into fp32 partials, then a
tiny chain launch. x (and G) read once, y (gx) written once; registers = the GP x block_p
tile + the GP x GP factor.
"""
from __future__ import annotations

from lycoris_ops.tuner.cost import Work, cdiv, eager_time, p2


def rotated_axis(x, weight: bool) -> int:
    """The axis of x that diag-OFT rotates: 0 for a weight, else the channels (dim 1 of an
    (N, C, *spatial) activation, the last of a (..., C) one)."""
    return 0 if weight else (1 if x.dim() >= 3 else x.dim() - 1)


def geometry(x, weight: bool):
    """(npos, c_contig) of x around its rotated axis: the positions each block rotates and
    whether the channels are contiguous."""
    ax = rotated_axis(x, weight)
    npos = 1
    for i, s in enumerate(x.shape):
        if i != ax:
            npos *= int(s)
    return npos, x.stride(ax) == 1


def group(K, S, c_contig, grp, sm, bp, npos, bwd, neumann=False, *, auto_split):
    """(SP, NB, GP, n_groups, n_tiles, split) of a launch; ``auto_split(n_groups, sm, bwd,
    neumann)``: the launcher's split rule."""
    SP = p2(S)
    want = grp or (32 if c_contig else 16)
    NB = max(1, max(16, want) // SP)
    n_groups = cdiv(K, NB)
    n_tiles = cdiv(npos, bp)
    split = max(1, min(auto_split(n_groups, sm, bwd, neumann), n_tiles))
    return SP, NB, NB * SP, n_groups, n_tiles, split


def _sector(run_bytes):
    return max(1.0, 32.0 / max(run_bytes, 1))


def model(dev, K, S, npos, c_contig, bwd, ex, eb, *, auto_split, seen=None):
    """(work of a Triton config, eager seconds); ``seen``: drop configs whose launch signature
    an earlier config had (None: score every config); ``auto_split``: as ``group``'s."""
    C = K * S

    def work(c):
        bp = c["bwd_block_p"] if bwd else c["block_p"]
        neumann = c.get("neumann", False)
        SP, NB, GP, n_groups, n_tiles, split = group(K, S, c_contig, c["group"], dev.sm_count, bp, npos, bwd,
                                                     neumann, auto_split=auto_split)
        sig = (NB, bp, c["num_warps"], c["num_stages"], neumann)
        if seen is not None and seen.setdefault(sig, id(c)) != id(c):
            return None
        grid = n_groups * split
        sector = _sector((GP if c_contig else bp) * ex)
        streams = 3 if bwd else 2  # x, y (+ G)
        cay = grid * NB * 4.0 * SP ** 3
        dots = (2 if bwd else 1) * 3 * 2.0 * GP * GP * n_tiles * bp * n_groups
        works = [Work(grid=grid, warps=c["num_warps"], stages=c["num_stages"],
                      acc=GP * bp * (2 if bwd else 1) + GP * GP * (2 if bwd else 1),
                      smem=GP * bp * ex * (2 if bwd else 1), dram=npos * C * ex * streams * sector
                      + grid * NB * S * S * eb + (split * n_groups * GP * GP * 4 if bwd else 0),
                      mma=dots, fma=cay)]
        if bwd:
            works.append(Work(grid=n_groups, warps=c.get("chain_warps", 4), acc=3 * GP * GP,
                              dram=split * n_groups * GP * GP * 4 + 2 * C * S * eb, fma=n_groups * NB * 8.0 * SP ** 3,
                              inflight=GP * GP * 4))
        return works

    steps = [(K * S * S * (eb + 4), 0), (K * S * S * 4 * 4, K * 4.0 * S ** 3), (npos * C * (ex + 4), 0),
             (npos * C * 4 * 2, 2.0 * npos * C * S), (npos * C * (4 + ex), 0)]
    return work, eager_time(dev, steps * 2 if bwd else steps, tc=False)
