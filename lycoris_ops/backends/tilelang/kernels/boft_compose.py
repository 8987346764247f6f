"""The composed launch units of the BOFT run kernels (``boft.py``), host side: which
consecutive stages run as ONE matrix (``compose_units``), those matrices
J = E_{L-1}···E_0 (fp64 products of the stages' run-basis matrices, split into the (hi, lo)
pairs the run kernels take: ``unit_matrices``), and each stage's partials from a unit's
Σ gᵀ·u (``batch_partials``). A 2^L-run box of the view (NP, C/2^L·κ, 2^L, κ) holds a
unit's channels; the units of one geometry are stacked into one batch of small host ops.
"""
import torch

__all__ = ["COMPOSE_MOST", "COMPOSE_BWD_SPLIT", "compose_units", "one_box", "unit_matrices", "composed_matrices",
           "batch_partials", "Batch"]

#: the most consecutive stages a launch applies as ONE matrix J = E_{L-1}···E_0 of width
#: 2^(L-1)·GC on a 2^L-run box (``compose_units``, ``composed_matrices``; the product formed
#: on the host in fp64, then split in a (hi, lo) pair), one three-term GEMM a tile, forward and
#: backward (``boft._stream_composed``: gx = g·J and A = Σ gᵀ·u on the unit's box, the stages'
#: partials from A on the host): measured faster than one launch a stage, and than 2
COMPOSE_MOST = 3
#: the composed backward's stream as two launches (``boft._stream_composed``) for units at least
#: this wide: gx by the forward's composed kernel with Jᵀ, then the partials alone (64-position
#: tiles, where the one-launch stream holds gx's tile beside its W x W accumulator and runs 32
#: at W = 128); narrower units (96) measured faster in one launch
COMPOSE_BWD_SPLIT = 128
#: the widest composed matrix (a 128 x 128 (hi, lo) pair is 64 KiB of shared memory)
_COMPOSE_WIDTH = 128


def _compose_at(i, L, m, s, runs) -> bool:
    """Whether stages i … i + L − 1 can run as one composed unit: they exist, the unit's width
    W = 2^(L-1)·GC is a multiple of 32 (a warp partition of T.gemm; 96 at the small bench
    shape's GC = 48, which a single stage pads to 64; the backward's Σ gᵀ·u GEMM then runs on
    mma.sync: sm_90's WGMMA takes its W rows 64 at a time) and at most ``_COMPOSE_WIDTH``, and
    stage i's runs are whole (κ_i >= GC/2: the 2^L runs of the box do not overlap)."""
    W = runs[0] << (L - 1)
    return i + L <= m and W % 32 == 0 and W <= _COMPOSE_WIDTH and ((s // 2) << i) >= runs[0] // 2


def _leading(i, s, GC) -> bool:
    """Whether stage i's κ is at most half a group (GC/2): its group is the GC channels in order."""
    return ((s // 2) << i) <= GC // 2


def one_box(i, L, s, GC) -> bool:
    """Whether the unit (i, L), L > 1, is the leading stages' single box: ``_leading`` up to
    its last stage, so every stage's group is the same GC channels in order."""
    return L > 1 and _leading(i + L - 1, s, GC)


def compose_units(m, s, runs, most):
    """The launch units [(first stage, L)] with up to ``most`` stages composed: first the
    leading stages that share one box (``one_box``: one GC x GC matrix through the single
    stage kernels, measured faster than stage 0 alone), then from there the largest L that
    ``_compose_at`` allows (1 always can)."""
    out, i = [], 0
    while i < min(most, m) and _leading(i, s, runs[0]):
        i += 1
    if i > 1:
        out.append((0, i))
    else:
        i = 0
    while i < m:
        L = max([n for n in range(2, most + 1) if _compose_at(i, n, m, s, runs)], default=1)
        out.append((i, L))
        i += L
    return out


_COMPOSE_GROUPS = {}


def _compose_groups(i, L, s, GC, gps, device):
    """Per stage k < L of the unit (i, L), the stage group each 2 x 2 block of E_k comes from:
    (npg, 2^(L−k−1), 2^k) indices into the stage matrices (m·gps of them), by (unit group q,
    the bits of tb above k, the bits below k). The box of unit group q is (tb, j), tb < 2^L,
    j < H = GC/2, over channels seg·2^Lκ + tb·κ + j0 + j (κ = κ_i, seg = ⌊qH/κ⌋, j0 = qH mod κ);
    stage i + k mixes (bit k of tb, j) at fixed other bits, with the group
    g = ((seg·2^(L−k−1) + hi)·2^kκ + lo·κ + j0)/H. Cached per unit geometry and device."""
    key = (i, L, s, GC, gps, str(device))
    if key not in _COMPOSE_GROUPS:
        H, kappa, R = GC // 2, (s // 2) << i, 1 << L
        npg = gps >> (L - 1)
        q = torch.arange(npg).view(npg, 1, 1)
        seg, j0 = (q * H) // kappa, (q * H) % kappa
        out = []
        for k in range(L):
            hi = torch.arange(R >> (k + 1)).view(1, -1, 1)
            lo = torch.arange(1 << k).view(1, 1, -1)
            out.append(((i + k) * gps + ((seg * (R >> (k + 1)) + hi) * (kappa << k) + lo * kappa + j0) // H).to(device))
        _COMPOSE_GROUPS[key] = out
    return _COMPOSE_GROUPS[key]


def _composed_stages(f, firsts, L, s, GC, gps):
    """The stage matrices E_0 … E_{L-1} of the units (i, L), i in ``firsts``, stacked along the
    unit groups ((len(firsts)·npg, W, W) each) in the box basis (tb, j), fp64:
    E_k[(hi, t, lo, j), (hi', t', lo', j')] = δ(hi, hi')·δ(lo, lo')·M[(t, j), (t', j')], M the
    run-basis matrix (``f`` = fh + fl in fp64, its first GC rows / columns) of the group
    ``_compose_groups`` names: one gather, one zero fill and one copy a stage for all the units."""
    H = GC // 2
    out = []
    for grp in _batch_groups(firsts, L, s, GC, gps, f.device):
        npg, nhi, nlo = grp.shape
        m = f[grp].view(npg, nhi, nlo, 2, H, 2, H)
        # E's nonzero entries are its (hi = hi', lo = lo') diagonals: zeros, then M into that view
        e = f.new_zeros((npg, nhi, 2, nlo, H, nhi, 2, nlo, H))
        e.diagonal(dim1=1, dim2=5).diagonal(dim1=2, dim2=5).copy_(m.permute(0, 3, 4, 5, 6, 1, 2))
        out.append(e.view(npg, nhi * 2 * nlo * H, nhi * 2 * nlo * H))
    return out


_BATCH_GROUPS = {}


def _batch_groups(firsts, L, s, GC, gps, device):
    """Per stage k < L, ``_compose_groups``' indices of the units (i, L), i in ``firsts``,
    concatenated along the unit groups (a batch's: ``_composed_stages``, ``batch_partials``);
    cached like them."""
    key = (tuple(firsts), L, s, GC, gps, str(device))
    if key not in _BATCH_GROUPS:
        per = [_compose_groups(i, L, s, GC, gps, device) for i in firsts]
        _BATCH_GROUPS[key] = [torch.cat([g[k] for g in per]) for k in range(L)]
    return _BATCH_GROUPS[key]


class Batch:
    """The composed units of one geometry stacked (``unit_matrices``): the leading box alone, or
    every unit of one L. ``es``: the stage matrices E_0 … E_{L-1} and ``j`` = E_{L-1}···E_0 (fp64,
    (n·npg, W, W) in the units' basis, unit n at rows n·npg …); ``pair``: J as the forward's
    (hi, lo) (the box's padded to GP); ``tpair`` (backward): Jᵀ as its stream's (the box's padded
    to GP; ``split``: the stream splits, ``COMPOSE_BWD_SPLIT`` from the units' width); ``pg``: the
    streams' fp32 partials per split of every unit, (NS, n·npg, GEMM width²), for
    ``batch_partials`` after the last stream. One batch is one set of small host ops, not one a
    unit (per-unit host algebra was a large share of the small bench shape's time)."""

    def __init__(self, es, firsts, L, box, GP, dtype, bwd, split):
        self.es, self.firsts, self.L, self.box, self.split = es, firsts, L, box, split
        self.npg = es[0].shape[0] // len(firsts)
        self.j = _product(es)
        W = self.j.shape[-1]
        self.pair = _padded_pair(self.j, GP, dtype) if box else _split16(self.j, dtype)
        self.tpair, self.pg = None, None
        if bwd:
            gp = GP if box else W
            if gp == self.pair[0].shape[-1]:  # Jᵀ's pair is J's transposed (rounding is per entry)
                self.tpair = tuple(t.transpose(1, 2).contiguous() for t in self.pair)
            else:
                self.tpair = _padded_pair(self.j.transpose(1, 2), gp, dtype)

    def rows(self, pair, n):
        """Unit n's slice of a (hi, lo) pair of the batch."""
        return tuple(t[n * self.npg:(n + 1) * self.npg] for t in pair)

    def partials(self, nsplit, gp, device):
        """``pg`` ((nsplit, n·npg, gp, gp) fp32), allocated by the first stream that writes it."""
        if self.pg is None:
            self.pg = torch.empty((nsplit, self.j.shape[0], gp, gp), device=device, dtype=torch.float32)
        return self.pg


def unit_matrices(fh, fl, units, s, GC, gps, GP, dtype, bwd=False, split=False):
    """{(i, L): (its ``Batch``, its index n in it)} for every composed unit (L > 1) of ``units``:
    the leading box (``one_box``: the stages' own run-basis matrices) in a batch of its own, the
    other units of one L stacked, formed with a few batched ops a batch. ``bwd``: with the
    streams' Jᵀ pairs (``split``: ``COMPOSE_BWD_SPLIT`` from a width)."""
    f = fh[:, :GC, :GC].double() + fl[:, :GC, :GC].double()
    out = {}
    for i, L in units:
        if one_box(i, L, s, GC):
            es = [f[(i + k) * gps:(i + k + 1) * gps] for k in range(L)]
            out[(i, L)] = (Batch(es, [i], L, True, GP, dtype, bwd, False), 0)
    for L in sorted({k for _, k in units if k > 1}):
        firsts = [i for i, k in units if k == L and not one_box(i, k, s, GC)]
        if not firsts:
            continue
        W = GC << (L - 1)
        b = Batch(_composed_stages(f, firsts, L, s, GC, gps), firsts, L, False, GP, dtype, bwd,
                   bool(split) and W >= split)
        for n, i in enumerate(firsts):
            out[(i, L)] = (b, n)
    return out


def _product(es):
    """E_{L-1}···E_0 of fp64 batches (bmm in fp64: no TF32 whatever the caller's matmul settings)."""
    j = es[0]
    for e in es[1:]:
        j = torch.bmm(e, j)
    return j


def _split16(j, dtype):
    """An fp64 matrix batch as the (hi, lo) pair of ``dtype`` the run kernels take."""
    hi = j.to(dtype)
    return hi, (j - hi.double()).to(dtype)


def composed_matrices(fh, fl, i, L, s, GC, gps, dtype):
    """The unit (i, L)'s matrices J = E_{L-1}···E_0 per unit group (npg, W, W) in the box
    basis, as a (hi, lo) pair of ``dtype`` (the ``pair`` of ``unit_matrices``' batch)."""
    return unit_matrices(fh, fl, [(i, L)], s, GC, gps, GC, dtype)[(i, L)][0].pair


def batch_partials(b, part, s, GC, gps):
    """Every stage's partials of the batch's units into split 0 of ``part`` (NS, m·gps, GP, GP;
    the caller zeroes the other splits' rows where NS > 1), from A = Σ gᵀ·u over each unit (its
    streams' ``pg`` summed over the splits): stage k's ``P_k = (E_{L-1}···E_{k+1})ᵀ·A·
    (E_{k-1}···E_0)ᵀ`` (``_stage_partials``). The box's are the stages' own run-basis rows; a
    composed unit's each 2 x 2 block of P_k (the other bits equal) is the partial of the group
    ``_compose_groups`` names (the inverse of ``_composed_stages``' placement), all units' in one
    scatter a stage."""
    W = b.j.shape[-1]
    a = b.pg.sum(0)[:, :W, :W].double()
    if b.box:
        i = b.firsts[0]
        for k, pk in _stage_partials(b.es, a):
            part[0, (i + k) * gps:(i + k + 1) * gps, :GC, :GC] = pk.to(part.dtype)
        return
    H = GC // 2
    groups = _batch_groups(b.firsts, b.L, s, GC, gps, part.device)
    for k, pk in _stage_partials(b.es, a):
        grp = groups[k]
        npg, nhi, nlo = grp.shape
        blocks = pk.view(npg, nhi, 2, nlo, H, nhi, 2, nlo, H)
        blocks = blocks.diagonal(dim1=1, dim2=5).diagonal(dim1=2, dim2=5)  # (npg, 2, H, 2, H, nhi, nlo)
        part[0, grp.reshape(-1), :GC, :GC] = blocks.permute(0, 5, 6, 1, 2, 3, 4).reshape(-1, GC, GC).to(part.dtype)


def _stage_partials(es, a):
    """(k, P_k) for the stages of a unit, from the last:
    ``P_k = (E_{L-1}···E_{k+1})ᵀ·A·(E_{k-1}···E_0)ᵀ`` (Σ g^{k+1}·(u^k)ᵀ) from A = Σ gᵀ·u over the
    unit, all in the unit's basis (fp64 batches)."""
    L = len(es)
    pre = [None] * L  # E_{k-1}···E_0
    for k in range(1, L):
        pre[k] = es[0] if k == 1 else torch.bmm(es[k - 1], pre[k - 1])
    suf = None  # E_{L-1}···E_{k+1}
    for k in reversed(range(L)):
        pk = a if suf is None else torch.bmm(suf.transpose(1, 2), a)
        if pre[k] is not None:
            pk = torch.bmm(pk, pre[k].transpose(1, 2))
        yield k, pk
        suf = es[k] if suf is None else torch.bmm(suf, es[k])


def _padded_pair(j, GP, dtype):
    """A (n, GC, GC) fp64 batch zero-padded to (n, GP, GP), as the (hi, lo) pair of ``dtype``."""
    GC = j.shape[-1]
    return _split16(torch.nn.functional.pad(j, (0, GP - GC, 0, GP - GC)).contiguous(), dtype)
