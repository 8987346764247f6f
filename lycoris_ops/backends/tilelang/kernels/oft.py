"""TileLang kernels of diag-OFT (docs/ops.md §2.5): ``oft_fwd`` and ``oft_bwd``; the
kernel families here are shared with BOFT (``boft.py``); the Cayley algebra (the group
matrices' solve and the backward's chain) is ``oft_cayley.py``.

Written from the math (``reference/oft.py`` is the oracle): diag-OFT applies
``F_k = diag(ρ_k)·R_kᵀ − shift·I`` to the S-channel slab of every position (column of a
weight, token, pixel); BOFT applies ``F = scale·R + (1 − scale)·I`` per stage (boft.py).

Groups. NB = GP // S consecutive blocks are packed densely into one *group* of
GC = NB·S channels, padded to GP (a power of two, 32 or 64): the group matrix
is block-diagonal with zero padding, so one (BT x GP) · (GP x GP) tile GEMM
applies NB blocks at once (``T.gemm`` on shared tiles).

Streaming kernel families (the Cayley launch, ``oft_cayley.cayley_kernel``, writes the F
pairs they read):

``apply_kernel`` (grid: groups x position splits): streams tiles of BT
    positions: the (BT, GP) slab of x is gathered into shared memory (channel
    map ``chs``: identity for OFT, the stage permutation for BOFT) in the GEMM
    dtype — x's own 16-bit dtype (exact), else fp32 split into TF32 hi + lo —
    then ``acc = X·F_hiᵀ + X·F_loᵀ (+ X_lo·F_hiᵀ)`` in an fp32 fragment, staged
    through shared memory and stored once (optionally ``− x0`` for BOFT's diff).
``apply_direct_kernel`` (same grid): diag-OFT's forward where nothing needs the gather
    (GC = GP, 16-bit x, rows of a 16-byte multiple; either layout): the x tile by ``T.copy``
    (TMA on sm_90a) in a ``T.Pipelined`` loop, the output through a shared tile in whole rows
    (``direct_apply`` decides the path). Where its shared memory allows (``fuse_cayley``) each
    program solves its group's F in its prologue (``oft_cayley.group_f_macro``) instead of
    reading the Cayley kernel's pair: one launch, the positions split for one wave.
``stream_direct_kernel``: the backward stream's twin of the same conditions (Fᵀ likewise).
``bwd_stream_kernel`` (same grid): per tile ``gx = G·F`` (as ``G·(Fᵀ)ᵀ`` with
    the Fᵀ pair) stored, and ``P += Gᵀ·X`` (dL/dF, fp32 fragment) over the
    program's positions; the partial P of each (split, group) goes to a small
    fp32 scratch (deterministic, no atomics), which ``oft_cayley.chain_kernel`` reduces.

Layouts: x is seen as (pre, C, post) around the rotated axis. post = 1
(channels last: (T, C) activations) reads (T, C) rows; otherwise the kernel
reads x as (pre, C, post) (weights (C, L): pre = 1; conv activations
(N, C, *spatial)) and walks (pre index, post tile) pairs. Operands are read
contiguous (a non-contiguous input is copied first). Every size is a
``T.dynamic`` variable: one compiled kernel per (dtypes, S, layout, flags, tile
config). The streaming kernels' positions per tile (BT) and threads are ``APPLY`` /
``STREAM``, or a tuned ``cfg`` over them (backends/tilelang/tuning/oft.py: ``TILELANG``).

Scope: S <= 64 (``scope.py``: "block" <= 64 for tilelang); fp16 / bf16 / fp32.
"""
import math

import torch

from lycoris_ops.backends.tilelang.common import (SMEM_SM90A, CPU_ARCH, aligned, arch_of, cdiv, kernel, launch_config,
                                                  num_sms, tl_dtype)
from lycoris_ops.backends.tilelang.kernels.oft_cayley import (THREADS as _THREADS, cayley_kernel, chain_blocks,
                                                              chain_kernel, group_f_macro, perm, tf32_hi)

__all__ = [
    "apply_kernel", "apply_direct_kernel", "bwd_stream_kernel", "stream_direct_kernel", "direct_apply",
    "group_plan", "gemm_dtype", "oft_fwd", "oft_bwd", "compile_specs", "MAX_BLOCK", "APPLY", "STREAM",
    "apply_smem", "stream_smem",
]

MAX_BLOCK = 64
_BT_FWD = 128
_BT_BWD = 64
#: pipeline depth of the direct kernels' tiles (``apply_direct_kernel``, ``stream_direct_kernel``)
#: on sm_90a (TMA); 1 elsewhere (``direct_stages``)
_DIRECT_STAGES = 2
#: the position split (``tiling``) aims at SPLIT_PER_SM programs an SM. On sm_90a a direct
#: kernel is warp-specialized, 256 threads at 240 registers (ptxas): ONE program an SM, so
#: this is about four waves. The kernels that solve the Cayley transform themselves
#: (``fuse_cayley``: measured faster than a Cayley launch before them, and slower when split
#: like the others, every program paying the serial solve) split for one wave of FUSED_PER_SM
#: programs an SM, with FUSED_STAGES tiles in flight per direction (one program an SM needs
#: more in flight than the direct kernels' ``_DIRECT_STAGES``; measured best)
SPLIT_PER_SM = 4
FUSED_PER_SM = 1
FUSED_STAGES = dict(fwd=4, bwd=3)
#: the fixed launch configs of the streaming kernels (the tuner's ``{}`` candidate). A tuned
#: ``cfg`` (backends/tilelang/tuning/oft.py, backends/tilelang/tuning/boft.py: ``TILELANG``) overrides the positions per tile (BT)
#: and the threads: APPLY for the forward's apply kernel, STREAM for the backward's stream
#: kernel (the Cayley and chain kernels are per group, tiny: fixed)
APPLY = dict(BT=_BT_FWD, threads=_THREADS)
STREAM = dict(BT=_BT_BWD, threads=_THREADS)
#: the fp32 partials' dtype: a name in the kernels' annotations (pyflakes reads a string
#: literal there as a forward reference)
_F32 = "float32"


# --------------------------------------------------------------------------- kernel helpers

def _direct_layout(T, cf, BT, GP):
    """(x shape, tile shape, tile, C) of the direct kernels. Channels last: x (NP, C), tiles
    (BT, GP). Channels first: x (PRE, C, NP), tiles (GP, BT) of one pre index (tile n of a
    group: pre index n // ⌈NP/BT⌉, positions from (n mod ⌈NP/BT⌉)·BT). ``tile(buf, g, n)``
    is the region of buf that tile n of group g covers, for ``T.copy`` (past the end, its
    predicate skips what lies outside)."""
    if cf:
        PRE, C, NP = T.dynamic("PRE C NP")

        def tile(buf, g, n):
            per_row = T.ceildiv(NP, BT)
            p0 = (n % per_row) * BT
            return buf[n // per_row, g * GP:g * GP + GP, p0:p0 + BT]
        return (PRE, C, NP), (GP, BT), tile, C
    C, NP = T.dynamic("C NP")

    def tile(buf, g, n):
        return buf[n * BT, g * GP]
    return (NP, C), (BT, GP), tile, C


def _stream_macros(T, par, GP, GC, BT, cdt, cf, has_perm):
    """Macros of the streaming kernels: load a group's channel map and F pair; a tile's
    coordinates; gather a (BT, GP) slab into shared memory."""
    split = cdt == "float32"

    @T.macro
    def load_group(FH, FL, Fh, Fl, chs, g, goff, nch, kappa):
        # chs[l]: the channel of slot l (π with kappa where permuted), 0 past the group's nch
        for l in par(GP):
            chs[l] = T.if_then_else(l < nch, perm(g * GC + l, kappa, has_perm), 0)
        for i, j in par(GP, GP):
            Fh[i, j] = FH[goff + g, i, j]
            Fl[i, j] = FL[goff + g, i, j]

    def tile_coords(tile, NP, PRE):
        # tile number -> (its pre index (channels first), first position, rows in range);
        # expressions, assigned by the kernel to its scalar variables
        if cf:
            a, p0 = tile // T.ceildiv(NP, BT), (tile % T.ceildiv(NP, BT)) * BT
            return a, p0, T.if_then_else(a < PRE, T.min(BT, NP - p0), 0)
        return 0, tile * BT, T.min(BT, NP - tile * BT)

    @T.macro
    def load_slab(src, dst_hi, dst_lo, chs, p0, a, rows, nch, transposed):
        # dst[t, l] (transposed: dst[l, t]) <- src at position p0 + t (CF: (a, ·, p0 + t)),
        # channel chs[l]; 0 outside; fp32: TF32 hi in dst_hi, remainder in dst_lo
        if cf:
            for l, t in par(GP, BT):
                v = T.if_then_else(t < rows and l < nch, T.cast(src[a, chs[l], p0 + t], "float32"), 0.0)
                if split:
                    h = tf32_hi(T, v)
                    if transposed:
                        dst_hi[l, t] = h
                        dst_lo[l, t] = v - h
                    else:
                        dst_hi[t, l] = h
                        dst_lo[t, l] = v - h
                else:
                    if transposed:
                        dst_hi[l, t] = T.cast(v, cdt)
                    else:
                        dst_hi[t, l] = T.cast(v, cdt)
        else:
            for t, l in par(BT, GP):
                v = T.if_then_else(t < rows and l < nch, T.cast(src[p0 + t, chs[l]], "float32"), 0.0)
                if split:
                    h = tf32_hi(T, v)
                    if transposed:
                        dst_hi[l, t] = h
                        dst_lo[l, t] = v - h
                    else:
                        dst_hi[t, l] = h
                        dst_lo[t, l] = v - h
                else:
                    if transposed:
                        dst_hi[l, t] = T.cast(v, cdt)
                    else:
                        dst_hi[t, l] = T.cast(v, cdt)

    return load_group, tile_coords, load_slab


# --------------------------------------------------------------------------- kernels

def apply_kernel(xd: str, yd: str, x0d: str, cdt: str, GP: int, GC: int, BT: int, cf: bool, has_perm: bool,
                 diff: bool, threads_: int = _THREADS, cpu: bool = False):
    """Y = F·X per group and position (row-vector form ``y = x·Fᵀ``), optional − X0.

    CL (cf=False): X, Y, X0 (NP, C). CF: (PRE, C, NP) with tiles of one pre index.
    Group g of this launch uses F pair [goff + g]; channel of slot l is
    π(g·GC + l) (has_perm, ``kappa``) else g·GC + l. Program (g, split) walks
    tiles split·tps … split·tps + tps − 1; ``threads_`` threads per program (the GEMM's
    warpgroups: 256 needs BT >= 128 on sm_90).
    """
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    split = cdt == "float32"
    PRE, C, NP, NG = T.dynamic("PRE C NP NG")
    xshape = (PRE, C, NP) if cf else (NP, C)
    load_group, tile_coords, load_slab = _stream_macros(T, par, GP, GC, BT, cdt, cf, has_perm)

    @T.prim_func
    def oft_apply(X: T.Tensor(xshape, xd), X0: T.Tensor(xshape, x0d), FH: T.Tensor((NG, GP, GP), cdt),
                  FL: T.Tensor((NG, GP, GP), cdt), Y: T.Tensor(xshape, yd), goff: T.int32, kappa: T.int32,
                  nsplit: T.int32, tps: T.int32):
        with T.Kernel(T.ceildiv(C, GC), nsplit, threads=threads) as (g, sp):
            chs = alloc_s((GP,), "int32")
            Fh = alloc_s((GP, GP), cdt)
            Fl = alloc_s((GP, GP), cdt)
            Xh = alloc_s((BT, GP), cdt)
            Xl = alloc_s((BT, GP), cdt)
            Ys = alloc_s((BT, GP), "float32")
            acc = alloc_f((BT, GP), "float32")
            # scalars: the group's channels in range, the tile's pre index (channels first), first
            # position and rows in range (plain index expressions: TileLang lowers them 3x faster)
            nch = T.alloc_var("int32", init=T.min(GC, C - g * GC))
            a = T.alloc_var("int32", init=0)
            p0 = T.alloc_var("int32", init=0)
            rows = T.alloc_var("int32", init=0)
            load_group(FH, FL, Fh, Fl, chs, g, goff, nch, kappa)
            for tt in T.serial(tps):
                a, p0, rows = tile_coords(sp * tps + tt, NP, PRE)
                load_slab(X, Xh, Xl, chs, p0, a, rows, nch, False)
                T.clear(acc)
                T.gemm(Xh, Fh, acc, transpose_B=True)
                T.gemm(Xh, Fl, acc, transpose_B=True)
                if split:
                    T.gemm(Xl, Fh, acc, transpose_B=True)
                T.copy(acc, Ys)
                if cf:
                    for l, t in par(GP, BT):
                        if t < rows and l < nch:
                            if diff:
                                Y[a, chs[l], p0 + t] = T.cast(Ys[t, l] - T.cast(X0[a, chs[l], p0 + t], "float32"), yd)
                            else:
                                Y[a, chs[l], p0 + t] = T.cast(Ys[t, l], yd)
                else:
                    for t, l in par(BT, GP):
                        if t < rows and l < nch:
                            if diff:
                                Y[p0 + t, chs[l]] = T.cast(Ys[t, l] - T.cast(X0[p0 + t, chs[l]], "float32"), yd)
                            else:
                                Y[p0 + t, chs[l]] = T.cast(Ys[t, l], yd)

    return oft_apply


def apply_direct_kernel(xd: str, yd: str, cdt: str, GP: int, BT: int, threads_: int = _THREADS,
                        stages: int = 1, cf: bool = False, cayley: tuple = (), cpu: bool = False):
    """``apply_kernel`` where nothing needs a gather: the identity channel map, every group's
    GP channels used (GC = GP, S divides GP), no diff, and x already in the GEMM dtype
    (16-bit; the CPU twin's exact fp32 GEMM too). The x tile goes to shared memory by
    ``T.copy`` in a ``T.Pipelined`` loop (async copies, ``stages`` deep) instead of element
    by element through the channel map, and the fp32 fragment is stored by ``T.copy`` through a
    shared tile, whole rows (one rounding; measured several times faster than from the
    fragment), out-of-range positions and channels predicated by T.copy.
    Channels last: X, Y (NP, C), tile (BT, GP), ``acc = X·Fᵀ``. Channels first (``cf``):
    X, Y (PRE, C, NP), tile (GP, BT) of one pre index (a weight's rows are its channels),
    ``acc = F·X`` (the same product per position, no transposed operand).
    Group g uses F pair [g]; program (g, split) walks tiles split·tps … split·tps + tps − 1.
    ``cayley`` = (blocks dtype, rescale dtype, S, has_rescale): each program solves its
    group's Cayley transform itself (``cayley_kernel``'s algebra, in its prologue) from the
    blocks B (KB, S, S), rescale RS, cscale and shift instead of reading an F pair: no
    Cayley launch before it, and F never in global memory."""
    import tilelang.language as T

    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    xshape, tshape, tile, C = _direct_layout(T, cf, BT, GP)
    NG = T.dynamic("NG")
    group_f = group_f_macro(T, cpu, GP, cdt, cayley, False)

    @T.macro
    def tiles(X, Y, Fh, Fl, g, sp, tps):
        Xs = alloc_s(tshape, cdt)
        acc = alloc_f(tshape, "float32")
        Ys = alloc_s(tshape, yd)
        for tt in T.Pipelined(tps, num_stages=stages):
            T.copy(tile(X, g, sp * tps + tt), Xs)
            T.clear(acc)
            if cf:  # Y = F·X per column
                T.gemm(Fh, Xs, acc)
                T.gemm(Fl, Xs, acc)
            else:  # y = x·Fᵀ per row
                T.gemm(Xs, Fh, acc, transpose_B=True)
                T.gemm(Xs, Fl, acc, transpose_B=True)
            # through shared memory: whole-row stores instead of fragment pairs
            T.copy(acc, Ys)
            T.copy(Ys, tile(Y, g, sp * tps + tt))

    if cayley:
        bd, rd, S = cayley[:3]
        KB, NR = T.dynamic("KB NR")

        @T.prim_func
        def oft_apply_direct_cayley(X: T.Tensor(xshape, xd), B: T.Tensor((KB, S, S), bd), RS: T.Tensor((NR,), rd),
                                    Y: T.Tensor(xshape, yd), nsplit: T.int32, tps: T.int32, cscale: T.float32,
                                    fcoef: T.float32):
            with T.Kernel(T.ceildiv(C, GP), nsplit, threads=threads) as (g, sp):
                Fh = alloc_s((GP, GP), cdt)
                Fl = alloc_s((GP, GP), cdt)
                group_f(B, RS, Fh, Fl, g, cscale, fcoef, KB)
                tiles(X, Y, Fh, Fl, g, sp, tps)

        return oft_apply_direct_cayley

    @T.prim_func
    def oft_apply_direct(X: T.Tensor(xshape, xd), FH: T.Tensor((NG, GP, GP), cdt), FL: T.Tensor((NG, GP, GP), cdt),
                         Y: T.Tensor(xshape, yd), nsplit: T.int32, tps: T.int32):
        with T.Kernel(T.ceildiv(C, GP), nsplit, threads=threads) as (g, sp):
            Fh = alloc_s((GP, GP), cdt)
            Fl = alloc_s((GP, GP), cdt)
            T.copy(FH[g, 0, 0], Fh)
            T.copy(FL[g, 0, 0], Fl)
            tiles(X, Y, Fh, Fl, g, sp, tps)

    return oft_apply_direct


def bwd_stream_kernel(gd: str, xd: str, gxd: str, cdt: str, GP: int, GC: int, BT: int, cf: bool, has_perm: bool,
                      threads_: int = _THREADS, cpu: bool = False):
    """gx = G·F (row-vector form, from the Fᵀ pair) and fp32 partials P = Σ Gᵀ·X.

    Layouts, groups, channel map and tiling as ``apply_kernel``. P (NS, NGP, GP, GP):
    program (g, split) writes P[split, goff + g] = Σ over its tiles of
    ``P[i, j] = Σ_t g[t, i]·x[t, j]``; ``threads_`` threads per program.
    """
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    split = cdt == "float32"
    PRE, C, NP, NG, NS, NGP = T.dynamic("PRE C NP NG NS NGP")
    xshape = (PRE, C, NP) if cf else (NP, C)
    load_group, tile_coords, load_slab = _stream_macros(T, par, GP, GC, BT, cdt, cf, has_perm)

    @T.prim_func
    def oft_bwd_stream(G: T.Tensor(xshape, gd), X: T.Tensor(xshape, xd), FH: T.Tensor((NG, GP, GP), cdt),
                       FL: T.Tensor((NG, GP, GP), cdt), GX: T.Tensor(xshape, gxd),
                       P: T.Tensor((NS, NGP, GP, GP), _F32), goff: T.int32, kappa: T.int32, tps: T.int32):
        with T.Kernel(T.ceildiv(C, GC), NS, threads=threads) as (g, sp):
            chs = alloc_s((GP,), "int32")
            Fh = alloc_s((GP, GP), cdt)
            Fl = alloc_s((GP, GP), cdt)
            Gh = alloc_s((BT, GP), cdt)
            Gl = alloc_s((BT, GP), cdt)
            Gth = alloc_s((GP, BT), cdt)
            Gtl = alloc_s((GP, BT), cdt)
            Xth = alloc_s((GP, BT), cdt)
            Xtl = alloc_s((GP, BT), cdt)
            Ys = alloc_s((BT, GP), "float32")
            acc = alloc_f((BT, GP), "float32")
            accp = alloc_f((GP, GP), "float32")
            # scalars: the group's channels in range, the tile's pre index (channels first), first
            # position and rows in range (plain index expressions: TileLang lowers them 3x faster)
            nch = T.alloc_var("int32", init=T.min(GC, C - g * GC))
            a = T.alloc_var("int32", init=0)
            p0 = T.alloc_var("int32", init=0)
            rows = T.alloc_var("int32", init=0)
            load_group(FH, FL, Fh, Fl, chs, g, goff, nch, kappa)
            T.clear(accp)
            for tt in T.serial(tps):
                a, p0, rows = tile_coords(sp * tps + tt, NP, PRE)
                load_slab(G, Gh, Gl, chs, p0, a, rows, nch, False)
                load_slab(G, Gth, Gtl, chs, p0, a, rows, nch, True)
                load_slab(X, Xth, Xtl, chs, p0, a, rows, nch, True)
                T.clear(acc)
                T.gemm(Gh, Fh, acc, transpose_B=True)
                T.gemm(Gh, Fl, acc, transpose_B=True)
                T.gemm(Gth, Xth, accp, transpose_B=True)
                if split:
                    T.gemm(Gl, Fh, acc, transpose_B=True)
                    T.gemm(Gtl, Xth, accp, transpose_B=True)
                    T.gemm(Gth, Xtl, accp, transpose_B=True)
                T.copy(acc, Ys)
                if cf:
                    for l, t in par(GP, BT):
                        if t < rows and l < nch:
                            GX[a, chs[l], p0 + t] = T.cast(Ys[t, l], gxd)
                else:
                    for t, l in par(BT, GP):
                        if t < rows and l < nch:
                            GX[p0 + t, chs[l]] = T.cast(Ys[t, l], gxd)
            for i, j in par(GP, GP):
                P[sp, goff + g, i, j] = accp[i, j]

    return oft_bwd_stream


def stream_direct_kernel(gd: str, xd: str, gxd: str, cdt: str, GP: int, BT: int, threads_: int = _THREADS,
                         stages: int = 1, cf: bool = False, cayley: tuple = (), cpu: bool = False):
    """``bwd_stream_kernel`` where nothing needs a gather (as ``apply_direct_kernel``: GC = GP,
    G and x in the 16-bit GEMM dtype; the CPU twin at fp32): the G and x tiles by ``T.copy``
    in a ``T.Pipelined`` loop, gx stored by ``T.copy`` through a shared tile. Positions past the end load as zeros
    (T.copy's predicate), so they add nothing to P.
    Channels last: tiles (BT, GP), ``gx = G·(Fᵀ)ᵀ``, ``P += Gᵀ·X`` (``transpose_A``).
    Channels first (``cf``, (PRE, C, NP)): tiles (GP, BT), ``gx = Fᵀ·G``, ``P += G·Xᵀ``.
    ``cayley``: the program solves its group's Fᵀ itself (``apply_direct_kernel``'s)."""
    import tilelang.language as T

    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else threads_
    xshape, tshape, tile, C = _direct_layout(T, cf, BT, GP)
    NG, NS, NGP = T.dynamic("NG NS NGP")
    group_f = group_f_macro(T, cpu, GP, cdt, cayley, True)

    @T.macro
    def tiles(G, X, GX, P, Fh, Fl, g, sp, tps):
        Gs = alloc_s(tshape, cdt)
        Xs = alloc_s(tshape, cdt)
        acc = alloc_f(tshape, "float32")
        accp = alloc_f((GP, GP), "float32")
        Ys = alloc_s(tshape, gxd)
        T.clear(accp)
        for tt in T.Pipelined(tps, num_stages=stages):
            T.copy(tile(G, g, sp * tps + tt), Gs)
            T.copy(tile(X, g, sp * tps + tt), Xs)
            T.clear(acc)
            if cf:  # gx = Fᵀ·G per column (FH holds Fᵀ), P += G·Xᵀ
                T.gemm(Fh, Gs, acc)
                T.gemm(Fl, Gs, acc)
                T.gemm(Gs, Xs, accp, transpose_B=True)
            else:  # gx = g·(Fᵀ)ᵀ per row, P += Gᵀ·X
                T.gemm(Gs, Fh, acc, transpose_B=True)
                T.gemm(Gs, Fl, acc, transpose_B=True)
                T.gemm(Gs, Xs, accp, transpose_A=True)
            T.copy(acc, Ys)
            T.copy(Ys, tile(GX, g, sp * tps + tt))
        T.copy(accp, P[sp, g, 0, 0])

    if cayley:
        bd, rd, S = cayley[:3]
        KB, NR = T.dynamic("KB NR")

        @T.prim_func
        def oft_stream_direct_cayley(G: T.Tensor(xshape, gd), X: T.Tensor(xshape, xd),
                                     B: T.Tensor((KB, S, S), bd), RS: T.Tensor((NR,), rd),
                                     GX: T.Tensor(xshape, gxd), P: T.Tensor((NS, NGP, GP, GP), _F32), tps: T.int32,
                                     cscale: T.float32, fcoef: T.float32):
            with T.Kernel(T.ceildiv(C, GP), NS, threads=threads) as (g, sp):
                Fh = alloc_s((GP, GP), cdt)
                Fl = alloc_s((GP, GP), cdt)
                group_f(B, RS, Fh, Fl, g, cscale, fcoef, KB)
                tiles(G, X, GX, P, Fh, Fl, g, sp, tps)

        return oft_stream_direct_cayley

    @T.prim_func
    def oft_stream_direct(G: T.Tensor(xshape, gd), X: T.Tensor(xshape, xd), FH: T.Tensor((NG, GP, GP), cdt),
                          FL: T.Tensor((NG, GP, GP), cdt), GX: T.Tensor(xshape, gxd),
                          P: T.Tensor((NS, NGP, GP, GP), _F32), tps: T.int32):
        with T.Kernel(T.ceildiv(C, GP), NS, threads=threads) as (g, sp):
            Fh = alloc_s((GP, GP), cdt)
            Fl = alloc_s((GP, GP), cdt)
            T.copy(FH[g, 0, 0], Fh)
            T.copy(FL[g, 0, 0], Fl)
            tiles(G, X, GX, P, Fh, Fl, g, sp, tps)

    return oft_stream_direct


# --------------------------------------------------------------------------- host side

def apply_smem(GP: int, BT: int, csize: int) -> int:
    """Shared-memory bytes of ``apply_kernel`` (GEMM operands of ``csize`` bytes): the channel
    map, the F pair (GP x GP each), the X pair and the fp32 output stage (BT x GP each)."""
    return 4 * GP + 2 * GP * GP * csize + 2 * BT * GP * csize + 4 * BT * GP


def stream_smem(GP: int, BT: int, csize: int) -> int:
    """Shared-memory bytes of ``bwd_stream_kernel``: the channel map, the Fᵀ pair, the G pair,
    the Gᵀ and Xᵀ pairs and the fp32 gx stage."""
    return 4 * GP + 2 * GP * GP * csize + 6 * BT * GP * csize + 4 * BT * GP


def group_plan(S: int):
    """(GP, NB, GC): group width (power of two >= 32, >= S), blocks per group, used channels."""
    gp = 32 if S <= 32 else 64
    nb = gp // S
    return gp, nb, nb * S


def gemm_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The GEMM operand dtype: the one 16-bit dtype when every streamed operand has it, else fp32."""
    ds = set(dtypes)
    if len(ds) == 1 and next(iter(ds)) in (torch.float16, torch.bfloat16):
        return next(iter(ds))
    return torch.float32


def _oft_axis(x, weight):
    return 0 if weight else (1 if x.dim() >= 3 else x.dim() - 1)


def position_view(t: torch.Tensor, ax: int):
    """(contiguous aligned t, CF layout?, the kernel view): CL (pre, C) when post = 1,
    else CF (pre, C, post)."""
    pre = math.prod(t.shape[:ax])
    post = math.prod(t.shape[ax + 1:])
    tc = aligned(t.contiguous())
    C = t.shape[ax]
    if post == 1:
        return tc, False, tc.view(pre, C)
    return tc, True, tc.view(pre, C, post)


def tiling(cf: bool, pre: int, post: int, bt: int, groups: int, device, one_wave: bool = False) -> tuple:
    """(nsplit, tiles per split) of the position tiles over ``groups`` group programs: about
    ``SPLIT_PER_SM`` programs an SM; ``one_wave``: at most ``FUSED_PER_SM`` an SM (at least
    one program a group)."""
    n_tiles = pre * cdiv(post, bt) if cf else cdiv(pre, bt)
    if one_wave:
        want = max(1, FUSED_PER_SM * num_sms(device) // max(groups, 1))
    else:
        want = max(1, cdiv(SPLIT_PER_SM * num_sms(device), max(groups, 1)))
    nsplit = max(1, min(want, n_tiles))
    tps = cdiv(n_tiles, nsplit)
    return cdiv(n_tiles, tps), tps


def _cayley(blocks, rs, cdt, S, NB, GP, boft, has_perm, trans, cscale, fcoef, g_rs, kappa, ng, arch, gps=0):
    """The (hi, lo) group matrices of ``blocks`` (contiguous), rescale ``rs`` (flat, or None);
    ``gps`` > 0: BOFT's run basis with gps groups per stage (``cayley_kernel``'s ``runs``).
    ``trans="both"``: (fh, fl, th, tl), F's pair and Fᵀ's from one launch."""
    pairs = 2 if trans == "both" else 1
    outs = [torch.empty((ng, GP, GP), device=blocks.device, dtype=cdt) for _ in range(2 * pairs)]
    rsv = _rescale_operand(blocks, rs)
    k = kernel(cayley_kernel, arch, tl_dtype(blocks.dtype), tl_dtype(rsv.dtype), tl_dtype(cdt), S, NB, GP, boft,
               rs is not None, has_perm, trans, gps > 0)
    k(blocks.view(-1, S, S), rsv, *outs, float(cscale), float(fcoef), int(g_rs), int(kappa), max(int(gps), 1))
    return tuple(outs)


def oft_fwd(blocks, x, rescale, cscale, shift, weight, cfg=None):
    """Diag-OFT forward (docs/ops.md §2.5.1, see ``reference.oft.oft_fwd``): one direct kernel that
    solves the Cayley transform itself (``fuse_cayley``), else Cayley + apply kernels;
    ``cfg``: the apply kernel's tuned {BT, threads} over ``APPLY``."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    K, S = blocks.shape[0], blocks.shape[1]
    GP, NB, GC = group_plan(S)
    ng = cdiv(K, NB)
    ax = _oft_axis(x, weight)
    _, cf, xv = position_view(x, ax)
    pre, post = (xv.shape[0], xv.shape[2]) if cf else (xv.shape[0], 1)
    cdt = gemm_dtype(x.dtype)
    arch = arch_of(x.device)
    bc = aligned(blocks.contiguous())
    rs = None if rescale is None else aligned(rescale.reshape(-1).contiguous())
    fcoef = 1.0 if shift else 0.0
    p = launch_config(APPLY, cfg)
    yv = y.view(xv.shape)
    direct = direct_apply(cf, GP, GC, x.dtype, cdt, arch, xv.shape[-1])
    fused = fuse_cayley(direct, arch, GP, p["BT"], cdt.itemsize, False)
    nsplit, tps = tiling(cf, pre, post, p["BT"], ng, x.device, fused)
    if fused:
        rsv = _rescale_operand(bc, rs)
        k = kernel(apply_direct_kernel, arch, tl_dtype(x.dtype), tl_dtype(x.dtype), tl_dtype(cdt), GP, p["BT"],
                   p["threads"], *direct_flags(arch, cf, "fwd"), _cayley_args(bc, rsv, rs is not None))
        k(xv, bc.view(-1, S, S), rsv, yv, nsplit, tps, float(cscale), fcoef)
        return y
    fh, fl = _cayley(bc, rs, cdt, S, NB, GP, False, False, False, cscale, fcoef, 0, 0, ng, arch)
    if direct:
        k = kernel(apply_direct_kernel, arch, tl_dtype(x.dtype), tl_dtype(x.dtype), tl_dtype(cdt), GP, p["BT"],
                   p["threads"], *direct_flags(arch, cf))
        k(xv, fh, fl, yv, nsplit, tps)
        return y
    k = kernel(apply_kernel, arch, tl_dtype(x.dtype), tl_dtype(x.dtype), tl_dtype(x.dtype), tl_dtype(cdt), GP, GC,
               p["BT"], cf, False, False, p["threads"])
    k(xv, xv, fh, fl, yv, 0, 0, nsplit, tps)
    return y


def _rescale_operand(blocks: torch.Tensor, rs) -> torch.Tensor:
    """The kernels' rescale operand: ``rs``, or the blocks as a placeholder when there is no
    rescale (the kernels never read it then)."""
    return blocks.view(-1) if rs is None else rs


def _cayley_args(blocks: torch.Tensor, rsv: torch.Tensor, has_rescale: bool) -> tuple:
    """The direct kernels' ``cayley`` builder argument for these operands."""
    return tl_dtype(blocks.dtype), tl_dtype(rsv.dtype), blocks.shape[-1], has_rescale


def direct_apply(cf: bool, GP: int, GC: int, x_dtype: torch.dtype, cdt: torch.dtype, arch: str,
                 inner: int) -> bool:
    """Whether diag-OFT's forward takes ``apply_direct_kernel`` (and its backward, with G of
    x's dtype, ``stream_direct_kernel``), in either layout (``cf``): every group slot a
    channel, x in the GEMM dtype (16-bit: no TF32 split of x; the CPU twin's GEMM is exact
    fp32, so it takes it at fp32 too), and rows of ``inner`` elements (the kernel view's last
    axis: C channels last, the positions after the channel axis channels first) a multiple of
    16 bytes: a TMA descriptor (sm_90a) takes no other row stride (a (72, 37) bf16 weight's
    74-byte rows were refused), and 16-byte cp.async copies (sm_80) need it too."""
    return (GC == GP and x_dtype == cdt and (cdt != torch.float32 or arch == CPU_ARCH)
            and inner * x_dtype.itemsize % 16 == 0)


def direct_flags(arch: str, cf: bool, fused: str = "") -> tuple:
    """The direct kernels' trailing builder arguments on ``arch``: (pipeline depth, layout);
    ``fused`` ("fwd" / "bwd"): the depth of the kernels that solve the Cayley transform."""
    stages = (FUSED_STAGES[fused] if fused else _DIRECT_STAGES) if arch == "sm_90a" else 1
    return stages, cf


def fuse_cayley(direct: bool, arch: str, GP: int, BT: int, csize: int, bwd: bool) -> bool:
    """Whether the direct kernel solves the Cayley transform itself (one launch, F never in
    global memory): on the direct path, and on sm_90a only where its shared memory with
    ``FUSED_STAGES`` tiles in flight fits a block: the F pair, then the larger of the
    Gauss–Jordan scratch (four fp32 GP x GP buffers; TileLang reuses it for the tiles once
    the solve is done) and the pipelined tiles (x; the backward G and x) with the output
    stage. Elsewhere a Cayley launch writes the F pair the direct kernel reads."""
    if not direct:
        return False
    if arch != "sm_90a":
        return True
    tile = BT * GP * csize
    stages = FUSED_STAGES["bwd" if bwd else "fwd"]
    smem = 2 * GP * GP * csize + max(16 * GP * GP + 4 * GP, (2 if bwd else 1) * stages * tile + tile)
    return smem <= SMEM_SM90A  # one sm_90a block: the fused kernels' deeper pipelines must fit


def direct_stages(arch: str) -> int:
    """The direct kernels' pipeline depth on ``arch``: ``_DIRECT_STAGES`` on sm_90a; 1
    elsewhere, where TileLang 0.1.15's cp.async pipeline of a predicated (partial) tile does
    not compile (sm_80)."""
    return _DIRECT_STAGES if arch == "sm_90a" else 1


def oft_bwd(grad, blocks, x, rescale, cscale, shift, weight, cfg=None):
    """Diag-OFT backward (docs/ops.md §2.5.2): stream (solving Fᵀ itself: ``fuse_cayley``; else after a
    Cayley (Fᵀ) launch) + chain kernels; ``cfg``: the
    stream kernel's tuned {BT, threads} over ``STREAM``.

    Returns gx (x's shape and dtype), g_blocks (blocks' shape and dtype), g_rescale
    ((K·S,) in blocks' dtype, or an empty (0,) tensor when rescale is None)."""
    K, S = blocks.shape[0], blocks.shape[1]
    C = K * S
    dev = x.device
    gx = torch.empty(x.shape, device=dev, dtype=x.dtype)
    g_blocks = torch.empty(blocks.shape, device=dev, dtype=blocks.dtype)
    g_rescale = torch.empty((C,) if rescale is not None else (0,), device=dev, dtype=blocks.dtype)
    if x.numel() == 0 or C == 0:
        g_blocks.zero_()
        g_rescale.zero_()
        return gx, g_blocks, g_rescale
    GP, NB, GC = group_plan(S)
    ng = cdiv(K, NB)
    ax = _oft_axis(x, weight)
    _, cf, xv = position_view(x, ax)
    _, _, gv = position_view(grad, ax)
    pre, post = (xv.shape[0], xv.shape[2]) if cf else (xv.shape[0], 1)
    cdt = gemm_dtype(x.dtype, grad.dtype)
    arch = arch_of(dev)
    bc = aligned(blocks.contiguous())
    rs = None if rescale is None else aligned(rescale.reshape(-1).contiguous())
    fcoef = 1.0 if shift else 0.0
    rsv = _rescale_operand(bc, rs)
    p = launch_config(STREAM, cfg)
    direct = direct_apply(cf, GP, GC, x.dtype, cdt, arch, xv.shape[-1]) and grad.dtype == x.dtype
    fused = fuse_cayley(direct, arch, GP, p["BT"], cdt.itemsize, True)
    nsplit, tps = tiling(cf, pre, post, p["BT"], ng, dev, fused)
    part = torch.empty((nsplit, ng, GP, GP), device=dev, dtype=torch.float32)
    if fused:
        ks = kernel(stream_direct_kernel, arch, tl_dtype(grad.dtype), tl_dtype(x.dtype), tl_dtype(x.dtype),
                    tl_dtype(cdt), GP, p["BT"], p["threads"], *direct_flags(arch, cf, "bwd"),
                    _cayley_args(bc, rsv, rs is not None))
        ks(gv, xv, bc.view(-1, S, S), rsv, gx.view(xv.shape), part, tps, float(cscale), fcoef)
    else:
        fh, fl = _cayley(bc, rs, cdt, S, NB, GP, False, False, True, cscale, fcoef, 0, 0, ng, arch)
        if direct:
            ks = kernel(stream_direct_kernel, arch, tl_dtype(grad.dtype), tl_dtype(x.dtype), tl_dtype(x.dtype),
                        tl_dtype(cdt), GP, p["BT"], p["threads"], *direct_flags(arch, cf))
            ks(gv, xv, fh, fl, gx.view(xv.shape), part, tps)
        else:
            ks = kernel(bwd_stream_kernel, arch, tl_dtype(grad.dtype), tl_dtype(x.dtype), tl_dtype(x.dtype),
                        tl_dtype(cdt), GP, GC, p["BT"], cf, False, p["threads"])
            ks(gv, xv, fh, fl, gx.view(xv.shape), part, 0, 0, tps)
    kc = kernel(chain_kernel, arch, tl_dtype(blocks.dtype), tl_dtype(rsv.dtype), S, NB, GP, False, rs is not None,
                False, chain_blocks(S, NB))
    gr = g_rescale if rs is not None else torch.empty((1,), device=dev, dtype=blocks.dtype)
    kc(part, bc, rsv, g_blocks, gr, float(cscale), 1.0, 1)
    return gx, g_blocks, g_rescale


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (cayley_kernel, (d, d, d, 5, 6, 32, False, True, False, False)),
        (cayley_kernel, (d, d, d, 16, 4, 64, False, True, False, True, False)),
        (apply_kernel, (d, d, d, d, 32, 30, _BT_FWD, False, False, False)),
        (apply_kernel, ("float32", "float32", "float32", "float32", 32, 32, _BT_FWD, True, False, False)),
        (apply_direct_kernel, (d, d, d, 32, _BT_FWD, _THREADS, 1, False)),
        (apply_direct_kernel, (d, d, d, 32, _BT_FWD, _THREADS, 1, True)),
        (bwd_stream_kernel, (d, d, d, d, 32, 30, _BT_BWD, False, False)),
        (bwd_stream_kernel, ("float32", "float32", "float32", "float32", 32, 32, _BT_BWD, True, False)),
        (stream_direct_kernel, (d, d, d, d, 32, _BT_BWD, _THREADS, 1, False)),
        (stream_direct_kernel, (d, d, d, d, 32, _BT_BWD, _THREADS, 1, True)),
        # the group's Cayley solve in the direct kernels' prologue
        (apply_direct_kernel, (d, d, d, 32, _BT_FWD, _THREADS, 1, False, ("float32", "float32", 8, True))),
        (stream_direct_kernel, (d, d, d, d, 64, _BT_BWD, _THREADS, 1, True, (d, d, 16, False))),
        (chain_kernel, (d, d, 5, 6, 32, False, True)),
        (chain_kernel, (d, d, 16, 4, 64, False, True, False)),
        (chain_kernel, (d, d, 16, 4, 64, False, True, False, True)),  # blocks, with g_rescale
    ]
