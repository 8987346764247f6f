"""TileLang kernels of BOFT (docs/ops.md §2.6): ``boft_fwd`` and ``boft_bwd``.

Written from the math (``reference/boft.py`` is the oracle): everything fp32,
one rounding at the store. Stage i (κ_i = 2^i·s/2) applies
``F_{i,β} = scale·R_{i,β} + (1 − scale)·I`` (R, not Rᵀ) to the blocks of the
π_i-permuted channels, ``π_i(p) = ⌊p/2κ_i⌋·2κ_i + (p mod 2)·κ_i + ⌊(p mod 2κ_i)/2⌋``;
``y = u^m ⊙ rescale − diff·x``.

The kernel families are diag-OFT's (``oft.py``), with the channel map of each
stage computed in-kernel from κ_i (a launch argument) and the GEMM dtype fixed
to fp32 (TF32 hi + lo split, ~fp32 accuracy):

``boft_fwd``: ONE Cayley launch for all m·nb blocks (groups of NB blocks, NB a
    power of two dividing nb, so a group never straddles two stages; the
    rescale is folded into the rows of the last stage), then one apply launch
    per stage: stage 0 reads x, stages write fp32 ping-pong scratch, the last
    stage stores y in x's dtype and subtracts x when ``diff``.
``boft_bwd`` (the plain chain, docs/ops.md §2.6.2): ONE Cayley launch for F and Fᵀ, m − 1
    apply launches to keep the stage inputs u^1 … u^{m−1} (fp32 scratch), then
    per stage from the last one streaming launch (``gx = g·F``, fp32 partials
    ``P = Σ g_βᵀ·u_β`` in the permuted block basis) and ONE chain launch over
    all groups (``gR = scale·P``, ``gQ = 2Mᵀ·gR·Mᵀ``, ``gB = cscale·(gQ − gQᵀ)``).

The run kernels (``stage_runs_kernel``, ``stream_runs_kernel``; channels last, 16-bit x, a
``run_groups`` size): the same launches without the element-wise channel map. A group's
channels at stage i are one TMA box of the view (NP, C/2κ', 2, κ'), its matrices are stored
in that box's order (the run basis), and the values between stages are (hi, lo) pairs of x's
dtype with three-term GEMMs (see the block comment above ``stage_runs_kernel``). Composed
units (``boft_compose.py``): up to ``COMPOSE_MOST`` consecutive stages a launch as ONE
matrix on a 2^L-run box, forward and backward (the backward's 96-wide units on mma.sync);
the leading stages that share one box (κ <= GC/2) as one GC-wide matrix through the single
stage kernels.

Layouts: channels last (axis −1), weight (axis 0, (C, rest…)) and channels
first ((N, C, *spatial)) all run (x read as (pre, C, post), contiguous).
Tile configs: the streaming kernels' positions per tile and threads come from oft.py's
``APPLY`` / ``STREAM``, or a tuned ``cfg`` over them (backends/tilelang/tuning/boft.py: ``TILELANG``).

Scope: s <= 64 (``scope.py``), fp16 / bf16 / fp32.
"""

import torch

from lycoris_ops.backends.tilelang.common import (CPU_ARCH, SMEM_SM90A, aligned, arch_of, kernel, launch_config, tl_dtype,
                                                  without_wgmma)
from lycoris_ops.backends.tilelang.common import smem_limit as _smem_limit
from lycoris_ops.backends.tilelang.kernels.oft import (_BT_BWD, _BT_FWD, _THREADS, APPLY, STREAM, apply_kernel,
                                                       bwd_stream_kernel, direct_stages, position_view, tiling)
from lycoris_ops.backends.tilelang.kernels.oft_cayley import cayley_kernel, chain_blocks, chain_kernel
from lycoris_ops.backends.tilelang.kernels.oft import _cayley as _oft_cayley
from lycoris_ops.backends.tilelang.kernels.boft_compose import (COMPOSE_BWD_SPLIT, COMPOSE_MOST, batch_partials,
                                                                compose_units, one_box, unit_matrices)

__all__ = ["boft_fwd", "boft_bwd", "boft_groups", "run_groups", "runs_for", "runs_fit", "runs_smem", "smem_limit",
           "stage_runs_kernel", "stream_runs_kernel", "compile_specs"]

_F32 = "float32"
#: the composed stream kernel's least threads at W = 128: its W x W fp32 accumulator of A is
#: 128 registers a thread with 128 threads (255 in all at sm_90a, 164 with 256)
_COMPOSE_BWD_THREADS = 256
#: the most shared memory a run kernel may ask for (sm_90's opt-in per-block limit, as oft's
#: fused kernels; less where the device's own limit is lower, ``smem_limit``); a tile config
#: over it takes the gather path
_RUNS_SMEM = SMEM_SM90A


# --------------------------------------------------------------------------- run kernels
#
# The channels of a BOFT group at stage i are two contiguous runs of GC/2 channels, κ_i apart
# (or GC contiguous channels while 2κ_i <= GC). Seen as x.view(NP, C/2κ', 2, κ') with
# κ' = max(κ_i, GC/2), a group's tile of BT positions is ONE box [p0:p0+BT, seg, 0:2,
# j0:j0+GC/2]: one T.copy (TMA on sm_90a) in, one out. The box's row-major order is the
# group's *run basis* (``oft_cayley.run_slot``), in which the Cayley kernel stores the group
# matrices and the chain kernel reads the partials, so the stream needs no channel map.
# Between stages a value is a (hi, lo) pair of x's 16-bit dtype (hi = the fp32 value rounded,
# lo = the rest: ~2^-16 relative, far below the 16-bit output's rounding; the same bytes as
# an fp32 scratch), and each GEMM is split in three: U_hi·F_hi + U_hi·F_lo + U_lo·F_hi.


def _split_gemm(T):
    """The macro ``gemm3(ah, al, bh, bl, c, a_lo, b_lo, ta, tb)``: ``c += a·b`` for 16-bit (hi, lo)
    operands as ``ah·bh (+ ah·bl when b_lo) (+ al·bh when a_lo)`` (the lo·lo term is below the
    pairs' accuracy); ``ta`` / ``tb``: T.gemm's transposes."""

    @T.macro
    def gemm3(ah, al, bh, bl, c, a_lo, b_lo, ta, tb):
        T.gemm(ah, bh, c, transpose_A=ta, transpose_B=tb)
        if b_lo:
            T.gemm(ah, bl, c, transpose_A=ta, transpose_B=tb)
        if a_lo:
            T.gemm(al, bh, c, transpose_A=ta, transpose_B=tb)

    return gemm3


def stage_runs_kernel(d: str, GC: int, GP: int, BT: int, threads_: int = _THREADS, stages: int = 1,
                      has_lo: bool = True, out_pair: bool = True, diff: bool = False, R: int = 2,
                      cpu: bool = False):
    """One BOFT stage on the run views (see above), channels last: ``y = u·Fᵀ`` per group
    (F pair [goff + g] in the run basis, GP x GP: the group's GC channels, zero-padded to GP,
    a width every warp partition of T.gemm covers), u = U (+ UL when ``has_lo``), stored as a
    (hi, lo) pair Y, YL (``out_pair``) or once in Y, minus X0 (``diff``). Every operand is a
    view (NP, C/Rκ', R, κ') of dtype d; a box is R runs of GC/R channels. R = 2^L: L stages as
    ONE matrix F = E_{L-1}···E_0 in the box basis (``composed_matrices``).
    Program (g, split) walks tiles split·tps … split·tps + tps − 1."""
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    H = GC // R
    gemm3 = _split_gemm(T)
    NP, NSEG, KP, NG = T.dynamic("NP NSEG KP NG")
    vshape = (NP, NSEG, R, KP)
    one = (1, 1, 1)

    @T.prim_func
    def boft_stage_runs(U: T.Tensor(vshape, d), UL: T.Tensor(vshape, d), X0: T.Tensor(vshape, d),
                        FH: T.Tensor((NG, GP, GP), d), FL: T.Tensor((NG, GP, GP), d), Y: T.Tensor(vshape, d),
                        YL: T.Tensor(vshape, d), goff: T.int32, nsplit: T.int32, tps: T.int32):
        with T.Kernel(NSEG * KP * R // GC, nsplit, threads=threads) as (g, sp):
            Fh = alloc_s((GP, GP), d)
            Fl = alloc_s((GP, GP), d)
            U3 = alloc_s((BT, R, H), d)
            UL3 = alloc_s((BT, R, H) if has_lo else one, d)
            X3 = alloc_s((BT, R, H) if diff else one, d)
            Uh = alloc_s((BT, GP), d)
            Ul = alloc_s((BT, GP) if has_lo else (1, 1), d)
            acc = alloc_f((BT, GP), "float32")
            Y3 = alloc_s((BT, R, H), d)
            YL3 = alloc_s((BT, R, H) if out_pair else one, d)
            seg = T.alloc_var("int32", init=(g * GC) // (R * KP))
            j0 = T.alloc_var("int32", init=((g * GC) % (R * KP)) // R)
            T.copy(FH[goff + g, 0, 0], Fh)
            T.copy(FL[goff + g, 0, 0], Fl)
            for tt in T.Pipelined(tps, num_stages=stages):
                p0 = (sp * tps + tt) * BT
                T.copy(U[p0:p0 + BT, seg, 0:R, j0:j0 + H], U3)
                if has_lo:
                    T.copy(UL[p0:p0 + BT, seg, 0:R, j0:j0 + H], UL3)
                if diff:
                    T.copy(X0[p0:p0 + BT, seg, 0:R, j0:j0 + H], X3)
                for t, l in par(BT, GP):  # the box's (R, H) rows -> the GEMM's row (zeros past GC)
                    Uh[t, l] = T.if_then_else(l < GC, U3[t, l // H, l % H], T.cast(0, d))
                    if has_lo:
                        Ul[t, l] = T.if_then_else(l < GC, UL3[t, l // H, l % H], T.cast(0, d))
                T.clear(acc)
                gemm3(Uh, Ul, Fh, Fl, acc, has_lo, True, False, True)
                for t, l in par(BT, GP):  # over the fragment's own shape: its layout needs no split
                    if l < GC:
                        if diff:
                            v = acc[t, l] - T.cast(X3[t, l // H, l % H], "float32")
                        else:
                            v = acc[t, l]
                        Y3[t, l // H, l % H] = T.cast(v, d)
                        if out_pair:
                            YL3[t, l // H, l % H] = T.cast(v - T.cast(T.cast(v, d), "float32"), d)
                T.copy(Y3, Y[p0:p0 + BT, seg, 0:R, j0:j0 + H])
                if out_pair:
                    T.copy(YL3, YL[p0:p0 + BT, seg, 0:R, j0:j0 + H])

    return boft_stage_runs


def stream_runs_kernel(d: str, GC: int, GP: int, BT: int, threads_: int = _THREADS, stages: int = 1,
                       g_lo: bool = True, u_lo: bool = True, out_pair: bool = True, R: int = 2,
                       gx: bool = True, cpu: bool = False):
    """The backward of one BOFT stage on the run views: ``gx = g·F`` (from the Fᵀ pair
    [goff + g], run basis, GP x GP as ``stage_runs_kernel``) stored as a pair GX, GXL
    (``out_pair``) or once in GX, and the fp32 partials ``P[split, goff + g] = Σ_t gᵀ·u`` over
    the program's positions (run basis), from g = G (+ GL when ``g_lo``) and the stage input
    u = U (+ UL when ``u_lo``). Positions past the end load as zeros (the copies' predicate)
    and add nothing to P. R = 2^L: the composed unit of L stages on its 2^L-run box, F = Jᵀ,
    P in the box basis. Without ``gx`` (``COMPOSE_BWD_SPLIT``): the partials only (F, GX, GXL
    untouched)."""
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    H = GC // R
    NP, NSEG, KP, NG, NS, NGP = T.dynamic("NP NSEG KP NG NS NGP")
    vshape = (NP, NSEG, R, KP)
    one = (1, 1, 1)

    @T.prim_func
    def boft_stream_runs(G: T.Tensor(vshape, d), GL: T.Tensor(vshape, d), U: T.Tensor(vshape, d),
                         UL: T.Tensor(vshape, d), FH: T.Tensor((NG, GP, GP), d), FL: T.Tensor((NG, GP, GP), d),
                         GX: T.Tensor(vshape, d), GXL: T.Tensor(vshape, d), P: T.Tensor((NS, NGP, GP, GP), _F32),
                         goff: T.int32, tps: T.int32):
        with T.Kernel(NSEG * KP * R // GC, NS, threads=threads) as (g, sp):
            Fh = alloc_s((GP, GP) if gx else (1, 1), d)
            Fl = alloc_s((GP, GP) if gx else (1, 1), d)
            G3 = alloc_s((BT, R, H), d)
            GL3 = alloc_s((BT, R, H) if g_lo else one, d)
            U3 = alloc_s((BT, R, H), d)
            UL3 = alloc_s((BT, R, H) if u_lo else one, d)
            Gh = alloc_s((BT, GP), d)
            Gl = alloc_s((BT, GP) if g_lo else (1, 1), d)
            Uh = alloc_s((BT, GP), d)
            Ul = alloc_s((BT, GP) if u_lo else (1, 1), d)
            acc = alloc_f((BT, GP) if gx else (1, 1), "float32")
            accp = alloc_f((GP, GP), "float32")
            Y3 = alloc_s((BT, R, H) if gx else one, d)
            YL3 = alloc_s((BT, R, H) if out_pair and gx else one, d)
            seg = T.alloc_var("int32", init=(g * GC) // (R * KP))
            j0 = T.alloc_var("int32", init=((g * GC) % (R * KP)) // R)
            if gx:
                T.copy(FH[goff + g, 0, 0], Fh)
                T.copy(FL[goff + g, 0, 0], Fl)
            T.clear(accp)
            for tt in T.Pipelined(tps, num_stages=stages):
                p0 = (sp * tps + tt) * BT
                T.copy(G[p0:p0 + BT, seg, 0:R, j0:j0 + H], G3)
                if g_lo:
                    T.copy(GL[p0:p0 + BT, seg, 0:R, j0:j0 + H], GL3)
                T.copy(U[p0:p0 + BT, seg, 0:R, j0:j0 + H], U3)
                if u_lo:
                    T.copy(UL[p0:p0 + BT, seg, 0:R, j0:j0 + H], UL3)
                for t, l in par(BT, GP):  # zeros past GC
                    Gh[t, l] = T.if_then_else(l < GC, G3[t, l // H, l % H], T.cast(0, d))
                    Uh[t, l] = T.if_then_else(l < GC, U3[t, l // H, l % H], T.cast(0, d))
                    if g_lo:
                        Gl[t, l] = T.if_then_else(l < GC, GL3[t, l // H, l % H], T.cast(0, d))
                    if u_lo:
                        Ul[t, l] = T.if_then_else(l < GC, UL3[t, l // H, l % H], T.cast(0, d))
                if gx:
                    T.clear(acc)
                    T.gemm(Gh, Fh, acc, transpose_B=True)
                    T.gemm(Gh, Fl, acc, transpose_B=True)
                T.gemm(Gh, Uh, accp, transpose_A=True)
                if g_lo:
                    if gx:
                        T.gemm(Gl, Fh, acc, transpose_B=True)
                    T.gemm(Gl, Uh, accp, transpose_A=True)
                if u_lo:
                    T.gemm(Gh, Ul, accp, transpose_A=True)
                if gx:
                    for t, l in par(BT, GP):  # over the fragment's own shape: its layout needs no split
                        if l < GC:
                            Y3[t, l // H, l % H] = T.cast(acc[t, l], d)
                            if out_pair:
                                YL3[t, l // H, l % H] = T.cast(acc[t, l] - T.cast(T.cast(acc[t, l], d), "float32"),
                                                               d)
                    T.copy(Y3, GX[p0:p0 + BT, seg, 0:R, j0:j0 + H])
                    if out_pair:
                        T.copy(YL3, GXL[p0:p0 + BT, seg, 0:R, j0:j0 + H])
            T.copy(accp, P[sp, goff + g, 0, 0])

    # GP a multiple of 32 only (the backward's 96-wide units, unpadded: measured faster than
    # padded to 128 or one launch a stage): Σ gᵀ·u has GP rows, WGMMA takes 64 at a time
    return without_wgmma(boft_stream_runs) if GP % 64 and not cpu else boft_stream_runs


def run_groups(s: int, nb: int, esize: int):
    """(GC, NB, GP) of the run kernels: the fewest blocks NB (a power of two dividing nb) whose
    GC = NB·s channels are at least 32 with runs of GC/2 elements a multiple of 16 bytes (a
    TMA box row; cp.async's 16-byte copies), and GP the power of two >= GC the GEMMs run at
    (T.gemm has no warp partition of 4 or 8 warps for a 48 x 48 tile); None when no GC <= 64
    qualifies."""
    n = 1
    while n <= nb and n * s <= 64:
        if nb % n == 0 and n * s >= 32 and (n * s // 2) * esize % 16 == 0:
            return n * s, n, 32 if n * s <= 32 else 64
        n *= 2
    return None


def runs_smem(GC: int, GP: int, BT: int, esize: int, stages: int, bwd: bool, gx: bool = True) -> int:
    """Shared-memory bytes of the run kernels at their largest (lo halves present): the F
    pairs, ``stages`` copies of the loaded boxes, the GEMM operands and the output boxes.
    ``gx`` False: the partials-only stream (no F, no output boxes)."""
    box, op, mat = BT * GC * esize, BT * GP * esize, GP * GP * esize
    if bwd and not gx:
        return stages * 4 * box + 4 * op
    if bwd:
        return 2 * mat + stages * 4 * box + 4 * op + 2 * box
    return 2 * mat + stages * 3 * box + 2 * op + 2 * box


def smem_limit(device: torch.device) -> int:
    """The run kernels' shared-memory budget on ``device`` (``_common.smem_limit``)."""
    return _smem_limit(device, _RUNS_SMEM)


def runs_for(x, cf, s, nb, arch):
    """(GC, NB, GP) when the run kernels can take this call at some tile, else None: channels
    last, x 16-bit (the CPU twins' exact fp32 GEMM too), a ``run_groups`` size."""
    if cf or (x.dtype == torch.float32 and arch != CPU_ARCH):
        return None
    return run_groups(s, nb, x.element_size())


def runs_fit(runs, bt, esize, arch, bwd, limit) -> bool:
    """Whether a tile of ``bt`` positions of the run kernels fits ``limit`` bytes of shared memory."""
    return runs_smem(runs[0], runs[2], bt, esize, direct_stages(arch), bwd) <= limit


def _runs_plan(x, cf, s, nb, arch, bt, bwd):
    """(GC, NB, GP) when this call takes the run kernels, else None: ``runs_for``, and a tile
    of ``bt`` positions that fits the device (``smem_limit``)."""
    r = runs_for(x, cf, s, nb, arch)
    if r is None or not runs_fit(r, bt, x.element_size(), arch, bwd, smem_limit(x.device)):
        return None
    return r


def _run_view(t, s, i, GC):
    """The (NP, C/2κ', 2, κ') view of a channels-last (NP, C) tensor at stage i."""
    kp = max((s // 2) << i, GC // 2)
    return t.view(t.shape[0], t.shape[1] // (2 * kp), 2, kp)


def boft_groups(s: int, nb: int):
    """(GP, NB, GC): group width, blocks per group (a power of two dividing nb), used channels."""
    gp = 32 if s <= 32 else 64
    n = 1
    while 2 * n * s <= gp and nb % (2 * n) == 0:
        n *= 2
    return gp, n, n * s


def _setup(blocks, x, axis):
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    ax = axis % x.dim()
    GP, NB, GC = boft_groups(s, nb)
    gps = nb // NB
    xc, cf, xv = position_view(x, ax)
    pre, post = (xv.shape[0], xv.shape[2]) if cf else (xv.shape[0], 1)
    return m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post


def _cayley(bc, rs, m, nb, s, NB, GP, gps, trans, cscale, scale, arch):
    """All stages' (hi, lo) fp32 group matrices; rescale ``rs`` folded into the last stage's rows."""
    return _oft_cayley(bc.view(m * nb, s, s), rs, torch.float32, s, NB, GP, True, True, trans, cscale, scale,
                       (m - 1) * gps, (s // 2) << (m - 1), m * gps, arch)


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, cfg=None):
    """BOFT forward (docs/ops.md §2.6.1, see ``reference.boft.boft_fwd``): 1 + m launches; ``cfg``:
    the apply kernels' tuned {BT, threads} over oft's ``APPLY`` (every stage the same)."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post = _setup(blocks, x, axis)
    arch = arch_of(x.device)
    bc = aligned(blocks.contiguous())
    rs = None if rescale is None else aligned(rescale.reshape(-1).contiguous())
    p = launch_config(APPLY, cfg)
    runs = _runs_plan(x, cf, s, nb, arch, p["BT"], False)
    if runs is not None:
        _fwd_runs(bc, rs, xv, y.view(xv.shape), m, nb, s, runs, cscale, scale, diff, p, arch)
        return y
    fh, fl = _cayley(bc, rs, m, nb, s, NB, GP, gps, False, cscale, scale, arch)
    nsplit, tps = tiling(cf, pre, post, p["BT"], gps, x.device)
    xd = tl_dtype(x.dtype)
    scratch = [torch.empty(xv.shape, device=x.device, dtype=torch.float32) for _ in range(min(m - 1, 2))]
    src = xv
    for i in range(m):
        last = i == m - 1
        dst = y.view(xv.shape) if last else scratch[i % 2]
        k = kernel(apply_kernel, arch, tl_dtype(src.dtype), tl_dtype(dst.dtype), xd, _F32, GP, GC, p["BT"], cf, True,
                   bool(diff) and last, p["threads"])
        k(src, xv, fh, fl, dst, i * gps, (s // 2) << i, nsplit, tps)
        src = dst
    return y


def _runs_cayley(bc, rs, m, nb, s, runs, trans, cscale, scale, cdt, arch):
    """Every stage's (hi, lo) group matrices in the run basis, (m·gps, GP, GP)."""
    GC, NBr, GP = runs
    gps = nb // NBr
    return _oft_cayley(bc.view(m * nb, s, s), rs, cdt, s, NBr, GP, True, True, trans, cscale, scale,
                       (m - 1) * gps, (s // 2) << (m - 1), m * gps, arch, gps=gps)


def _compose_bt(W, bt, esize, arch, device, bwd=False, gx=True):
    """The largest tile of ``bt`` halved (at least 16) whose composed unit of width W fits
    shared memory (``bwd``: the stream kernel's, ``gx``: with its gx); the CPU twins' buffers
    are local."""
    while bt > 16 and arch != CPU_ARCH and runs_smem(W, W, bt, esize, direct_stages(arch), bwd, gx=gx) > smem_limit(device):
        bt //= 2
    return bt


def _fwd_runs(bc, rs, xv, yv, m, nb, s, runs, cscale, scale, diff, p, arch):
    """boft_fwd by the run kernels: one Cayley launch, then one launch per unit (a stage, or up
    to ``COMPOSE_MOST`` stages as one matrix, ``compose_units``): the first reads x, units
    between keep (hi, lo) pairs in two buffers in turn, the last stores y."""
    gps = nb // runs[1]
    fh, fl = _runs_cayley(bc, rs, m, nb, s, runs, False, cscale, scale, xv.dtype, arch)
    bufs = [tuple(torch.empty_like(xv) for _ in range(2)) for _ in range(2)]
    src = (xv, None)
    units = compose_units(m, s, runs, COMPOSE_MOST)
    mats = unit_matrices(fh, fl, units, s, runs[0], gps, runs[2], xv.dtype)
    for n, (i, k) in enumerate(units):
        last = n == len(units) - 1
        dst = (yv, None) if last else bufs[n % 2]
        _launch_unit(src, xv, fh, fl, dst, i, k, s, runs, gps, p, arch, bool(diff) and last, mats)
        src = dst


def _launch_unit(src, x0, fh, fl, dst, i, k, s, runs, gps, p, arch, diff, mats):
    """The forward unit (i, k) of ``compose_units``: one stage (``_launch_stage``) or k stages
    as one matrix (J's pair of ``mats``, ``unit_matrices``, by ``_launch_composed``); ``src`` /
    ``dst``: (hi, lo or None), (NP, C)."""
    if k == 1:
        _launch_stage(src, x0, fh, fl, dst, i, s, runs, gps, p, arch, diff)
        return
    b, n = mats[(i, k)]
    if b.box:  # the stage kernel with J in place of F
        _launch_stage(src, x0, *b.pair, dst, i, s, runs, gps, p, arch, diff, goff=0)
    else:
        _launch_composed(src, x0, b.rows(b.pair, n), dst, i, k, s, runs, gps, p, arch, diff)


def _box_view(t, s, i, R):
    """The (NP, C/Rκ, R, κ) view of a channels-last (NP, C) tensor whose boxes are the R runs
    of a composed unit from stage i (κ = κ_i)."""
    kappa = (s // 2) << i
    return t.view(t.shape[0], t.shape[1] // (R * kappa), R, kappa)


def _launch_composed(src, x0, mats, dst, i, L, s, runs, gps, p, arch, diff):
    """Stages i … i + L − 1 as one matrix (``mats``: its (hi, lo) pair, ``composed_matrices``)
    by ``stage_runs_kernel`` on the 2^L-run box view, W = 2^(L-1)·GC wide, at the largest tile
    that fits (``_compose_bt``)."""
    GC = runs[0]
    W, R = GC << (L - 1), 1 << L
    bt = _compose_bt(W, p["BT"], x0.element_size(), arch, x0.device)
    kern = kernel(stage_runs_kernel, arch, tl_dtype(x0.dtype), W, W, bt, p["threads"], direct_stages(arch),
                  src[1] is not None, dst[1] is not None, diff, R)
    nsplit, tps = tiling(False, x0.shape[0], 1, bt, gps >> (L - 1), x0.device)
    v = [_box_view(t, s, i, R) for t in (*_halves(src), x0, *_halves(dst))]
    kern(*v[:3], *mats, *v[3:], 0, nsplit, tps)


def _stream_composed(g, u, dst, part, i, L, s, runs, gps, p, arch, mats):
    """The backward of the composed unit (i, L): ``gx = g·J`` (the Jᵀ pair)
    stored as a pair or once in ``dst``, and A = Σ gᵀ·u (fp32 partials per split, box basis, in
    its batch's ``pg`` at the unit's rows: ``batch_partials`` forms the stages' partials after the
    last stream) by ``stream_runs_kernel`` on the 2^L-run box, W wide, at the largest tile that
    fits (``_compose_bt``, ``_COMPOSE_BWD_THREADS``). ``COMPOSE_BWD_SPLIT`` (W at least that):
    two launches, gx by the forward's composed kernel (``stage_runs_kernel`` with the Jᵀ pair:
    u·Fᵀ with F = Jᵀ), then A alone (no J, no gx tile: its W x W accumulator the only big
    fragment, so tiles of 64 positions fit where the one-launch stream takes 32 at W = 128)."""
    GC = runs[0]
    W, R, x0 = GC << (L - 1), 1 << L, g[0]
    GP = W  # the stream's GEMM width
    b, n = mats[(i, L)]
    split, jt = b.split, b.tpair
    if split:
        _launch_composed(g, x0, b.rows(b.tpair, n), dst, i, L, s, runs, gps, APPLY, arch, False)
        jt, dst = (x0.new_empty((1, GP, GP)),) * 2, (g[0], None)  # placeholders the partials-only kernel never reads
    bt = _compose_bt(W, p["BT"], x0.element_size(), arch, x0.device, bwd=True, gx=not split)
    nsplit, tps = tiling(False, x0.shape[0], 1, bt, gps >> (L - 1), x0.device)
    pg = b.partials(nsplit, GP, x0.device)
    threads = max(p["threads"], _COMPOSE_BWD_THREADS) if GP % 128 == 0 else p["threads"]  # 8 warps: no 96-row partition
    ks = kernel(stream_runs_kernel, arch, tl_dtype(x0.dtype), W, GP, bt, threads, direct_stages(arch),
                g[1] is not None, u[1] is not None, dst[1] is not None, R, not split)
    v = [_box_view(t, s, i, R) for t in (*_halves(g), *_halves(u), *_halves(dst))]
    ks(*v[:4], *jt, *v[4:], pg, n * b.npg, tps)  # the unit's rows of the batch's Jᵀ pair and partials


def _stream_stage(g, u, dst, th, tl_, part, i, s, runs, gps, p, arch, tps, goff=None):
    """The backward of stage i on its two-run box by ``stream_runs_kernel``: gx = g·F from the
    Fᵀ pair (th, tl_) into ``dst``, the fp32 partials Σ gᵀ·u per split into ``part``, both at the
    group offset ``goff`` (i·gps); ``g`` / ``u`` / ``dst``: (hi, lo or None), (NP, C)."""
    GC, _, GP = runs
    ks = kernel(stream_runs_kernel, arch, tl_dtype(g[0].dtype), GC, GP, p["BT"], p["threads"], direct_stages(arch),
                g[1] is not None, u[1] is not None, dst[1] is not None)
    v = [_run_view(t, s, i, GC) for t in (*_halves(g), *_halves(u), *_halves(dst))]
    ks(*v[:4], th, tl_, *v[4:], part, i * gps if goff is None else goff, tps)


def _stream_box(g, u, dst, part, i, L, s, runs, gps, p, arch, mats, tiles):
    """The backward of the leading stages' unit (i, L) (``one_box``): ``_stream_stage`` with the
    unit's Jᵀ (gx = g·J), its partials A = Σ gᵀ·u (the stages' shared run basis) in its batch's
    ``pg`` (``batch_partials`` forms the stages' after the last stream); ``tiles``: the single
    stages' (nsplit, tiles per split)."""
    b, _ = mats[(i, L)]
    nsplit, tps = tiles
    _stream_stage(g, u, dst, *b.tpair, b.partials(nsplit, runs[2], g[0].device), i, s, runs, gps, p, arch, tps,
                  goff=0)


def _launch_stage(src, x0, fh, fl, dst, i, s, runs, gps, p, arch, diff, goff=None):
    """Stage i on its two-run box (the stage's run-basis matrices, from ``goff``: i·gps) by
    ``stage_runs_kernel``; ``src`` / ``dst``: (hi, lo or None), (NP, C)."""
    GC, _, GP = runs
    kern = kernel(stage_runs_kernel, arch, tl_dtype(x0.dtype), GC, GP, p["BT"], p["threads"],
                  direct_stages(arch), src[1] is not None, dst[1] is not None, diff, 2)
    nsplit, tps = tiling(False, x0.shape[0], 1, p["BT"], gps, x0.device)
    v = [_run_view(t, s, i, GC) for t in (*_halves(src), x0, *_halves(dst))]
    kern(*v[:3], fh, fl, *v[3:], i * gps if goff is None else goff, nsplit, tps)


def _halves(pair):
    """(hi, lo) of a stage value (hi, lo or None); a value without lo passes hi again as the
    placeholder of the operand its kernel variant never touches."""
    return pair[0], pair[1] if pair[1] is not None else pair[0]


def _bwd_runs(bc, gv, xv, gxv, g_blocks, m, nb, s, runs, cscale, scale, cfg, arch):
    """boft_bwd by the run kernels: the forward replay keeps each unit's input (a stage, or up to
    ``COMPOSE_MOST`` composed, ``compose_units``) as a (hi, lo) pair, then per
    unit from the last one stream launch (gx as a pair, the last one in x's dtype; partials in
    the run basis of each stage group, a composed unit's from its batch's, ``batch_partials``),
    then one chain launch."""
    GC, NBr, GP = runs
    gps = nb // NBr
    dev = xv.device
    p = launch_config(STREAM, cfg)
    units = compose_units(m, s, runs, COMPOSE_MOST)
    singles = any(k == 1 for _, k in units)
    # F (the replay) and, where a stage streams alone, Fᵀ (its stream) from one Cayley launch
    pairs = _runs_cayley(bc, None, m, nb, s, runs, "both" if singles else False, cscale, scale, xv.dtype, arch)
    fh, fl = pairs[:2]
    mats = unit_matrices(fh, fl, units, s, GC, gps, GP, xv.dtype, bwd=True, split=COMPOSE_BWD_SPLIT)
    us = [(xv, None)]
    for i, k in units[:-1]:
        dst = tuple(torch.empty_like(xv) for _ in range(2))
        _launch_unit(us[-1], xv, fh, fl, dst, i, k, s, runs, gps, APPLY, arch, False, mats)
        us.append(dst)
    # the single stages' partials per split; a composed unit's stages' go to split 0 only (the
    # others' rows zeroed), so where every stage is in one the chain reads one split
    nsplit, tps = tiling(False, xv.shape[0], 1, p["BT"], gps, dev)
    part = torch.empty((nsplit if singles else 1, m * gps, GP, GP), device=dev, dtype=torch.float32)
    if singles:
        for i, k in units:
            if k > 1:
                part[1:, i * gps:(i + k) * gps].zero_()
    gbuf = [tuple(torch.empty_like(xv) for _ in range(2)) for _ in range(2)]
    g = (gv, None)
    for n in reversed(range(len(units))):
        i, k = units[n]
        dst = (gxv, None) if n == 0 else gbuf[n % 2]
        u = us[n]
        if one_box(i, k, s, GC):
            _stream_box(g, u, dst, part, i, k, s, runs, gps, p, arch, mats, (nsplit, tps))
        elif k > 1:
            _stream_composed(g, u, dst, part, i, k, s, runs, gps, p, arch, mats)
        else:
            _stream_stage(g, u, dst, *pairs[2:], part, i, s, runs, gps, p, arch, tps)
        g = dst
    for b in {id(b): b for b, _ in mats.values()}.values():
        batch_partials(b, part, s, GC, gps)
    bd = tl_dtype(g_blocks.dtype)
    kc = kernel(chain_kernel, arch, bd, bd, s, NBr, GP, True, False, True, chain_blocks(s, NBr))
    kc(part, bc.view(m * nb, s, s), bc.view(-1), g_blocks.view(m * nb, s, s),
       torch.empty((1,), device=dev, dtype=g_blocks.dtype), float(cscale), float(scale), gps)


def boft_bwd(grad, blocks, x, axis, cscale, scale, cfg=None):
    """BOFT backward of the plain chain (docs/ops.md §2.6.2): returns gx (x's shape and dtype)
    and g_blocks (blocks' shape and dtype). ``cfg``: the stream kernels' tuned {BT, threads}
    over oft's ``STREAM``; the forward replay keeps ``APPLY`` (its kernels are the forward's
    fixed ones, so a tuned key builds one kernel per candidate)."""
    gx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    g_blocks = torch.empty(blocks.shape, device=x.device, dtype=blocks.dtype)
    if x.numel() == 0:
        g_blocks.zero_()
        return gx, g_blocks
    m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post = _setup(blocks, x, axis)
    _, _, gv = position_view(grad, ax)
    dev = x.device
    arch = arch_of(dev)
    bc = aligned(blocks.contiguous())
    ng = m * gps
    xd = tl_dtype(x.dtype)
    runs = _runs_plan(x, cf, s, nb, arch, launch_config(STREAM, cfg)["BT"], True)
    if runs is not None and grad.dtype == x.dtype and runs_fit(runs, APPLY["BT"], x.element_size(), arch, False,
                                                               smem_limit(dev)):
        _bwd_runs(bc, gv, xv, gx.view(xv.shape), g_blocks, m, nb, s, runs, cscale, scale, cfg, arch)
        return gx, g_blocks
    # forward replay: stage inputs u^0 = x, u^1 … u^{m-1} (fp32)
    fh, fl, th, tl_ = _cayley(bc, None, m, nb, s, NB, GP, gps, "both", cscale, scale, arch)  # F and Fᵀ, one launch
    nsplit_f, tps_f = tiling(cf, pre, post, APPLY["BT"], gps, dev)
    us = [xv]
    for i in range(m - 1):
        dst = torch.empty(xv.shape, device=dev, dtype=torch.float32)
        k = kernel(apply_kernel, arch, tl_dtype(us[-1].dtype), _F32, xd, _F32, GP, GC, APPLY["BT"], cf, True, False,
                   APPLY["threads"])
        k(us[-1], xv, fh, fl, dst, i * gps, (s // 2) << i, nsplit_f, tps_f)
        us.append(dst)
    # backward through the stages
    p = launch_config(STREAM, cfg)
    nsplit, tps = tiling(cf, pre, post, p["BT"], gps, dev)
    part = torch.empty((nsplit, ng, GP, GP), device=dev, dtype=torch.float32)
    g = gv
    for i in reversed(range(m)):
        dst = gx.view(xv.shape) if i == 0 else torch.empty(xv.shape, device=dev, dtype=torch.float32)
        k = kernel(bwd_stream_kernel, arch, tl_dtype(g.dtype), tl_dtype(us[i].dtype), tl_dtype(dst.dtype), _F32,
                   GP, GC, p["BT"], cf, True, p["threads"])
        k(g, us[i], th, tl_, dst, part, i * gps, (s // 2) << i, tps)
        g = dst
    kc = kernel(chain_kernel, arch, tl_dtype(blocks.dtype), tl_dtype(blocks.dtype), s, NB, GP, True, False,
                False, chain_blocks(s, NB))
    kc(part, bc.view(m * nb, s, s), bc.view(-1), g_blocks.view(m * nb, s, s),
       torch.empty((1,), device=dev, dtype=blocks.dtype), float(cscale), float(scale), 1)
    return gx, g_blocks


def compile_specs(dtype: torch.dtype):
    """(builder, args) of the BOFT-specific configurations (permuted channel map, fp32
    GEMMs, diff) at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (cayley_kernel, (d, d, _F32, 4, 8, 32, True, True, True, False)),
        (apply_kernel, (d, _F32, d, _F32, 32, 32, _BT_FWD, False, True, False)),
        (apply_kernel, (_F32, d, d, _F32, 32, 32, _BT_FWD, True, True, True)),
        (bwd_stream_kernel, (d, d, d, _F32, 32, 32, _BT_BWD, False, True)),
        (chain_kernel, (d, d, 4, 8, 32, True, False)),
        (cayley_kernel, (d, d, d, 8, 4, 32, True, True, True, False, True)),
        # the backward's F and Fᵀ pairs from one solve (gather path, and the run basis)
        (cayley_kernel, (d, d, _F32, 4, 8, 32, True, False, True, "both")),
        (cayley_kernel, (d, d, d, 8, 4, 32, True, False, True, "both", True)),
        (chain_kernel, (d, d, 8, 4, 32, True, False, True)),
        # the small bench shape's s = 24 (2 blocks in 64): the Gauss–Jordan steps over the
        # blocks' entries alone, and the chain's blocks form
        (cayley_kernel, (d, d, d, 24, 2, 64, True, False, True, False, True)),
        (chain_kernel, (d, d, 24, 2, 64, True, False, True)),
        (chain_kernel, (d, d, 24, 2, 64, True, False, True, True)),
    ] + ([] if dtype == torch.float32 else [  # the run kernels: 16-bit streams only on a GPU
        (stage_runs_kernel, (d, 32, 32, _BT_FWD, _THREADS, 1, False, True, False)),
        (stage_runs_kernel, (d, 48, 64, _BT_FWD, _THREADS, 1, True, False, True)),
        (stream_runs_kernel, (d, 32, 32, _BT_BWD, _THREADS, 1, True, True, True)),
        (stream_runs_kernel, (d, 48, 64, _BT_BWD, _THREADS, 1, False, False, False)),
        (stage_runs_kernel, (d, 128, 128, 64, _THREADS, 1, True, True, True, 8)),  # 3 stages composed
        (stage_runs_kernel, (d, 96, 96, 64, _THREADS, 1, False, True, False, 4)),  # 2 stages at GC = 48
        (stream_runs_kernel, (d, 128, 128, 32, 256, 1, True, True, True, 8)),  # the backward's 3 stages
        (stream_runs_kernel, (d, 128, 128, 64, 256, 1, True, True, False, 8, False)),  # split: partials only
        (stream_runs_kernel, (d, 96, 96, 64, _THREADS, 1, True, True, False, 4, False)),  # 96 wide: mma.sync
        (stream_runs_kernel, (d, 96, 96, 32, _THREADS, 1, True, True, True, 4)),
    ])
