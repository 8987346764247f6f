"""TileLang kernels of IA3 (docs/ops.md §2.7): ``ia3_fwd`` and ``ia3_bwd``.

x (any rank, read contiguous) is seen as (A, C, B): A = the dims before
``channel_axis``, C = the channel dim, B = the dims after it. Two tilings:

* channel last (B = 1: linear activations, the in-feature axis of a linear
  weight): x viewed as ``(A, CV, VEC)`` (C = CV·VEC), tiles of BR rows x BCV
  vectors, w read as ``(CV, VEC)`` vectors;
* channel inside (B > 1: conv layouts, the out-feature axis of a weight): x
  viewed as ``(A, C, BV, VEC)`` (B = BV·VEC), tiles of BC channels x BBV
  vectors for one a; w[c] once per channel row.

VEC (static, 8/4/2/1) makes every access a 16-byte vector; every size (A, C,
BV, CV) is a ``T.dynamic`` variable, so one compiled kernel serves every shape
of one (dtypes, layout, VEC) class. Operands are read in their own dtypes, the
math is fp32, each output is rounded once.

``ia3_fwd``: one kernel, ``y = x·(α + γ·w[c])`` (dtype ``promote_types(x, w)``).
``ia3_bwd``: one streaming kernel writes ``gx = G·(α + γ·w[c])`` (x's dtype) and
reduces ``Σ G·x`` per channel in an fp32 fragment over its share of the
reduced axis; when one program covers a whole channel reduction it stores
``gw = γ·Σ`` directly (w's dtype), otherwise fp32 partials ``(K, C)`` and a tiny
column-sum kernel finish ``gw`` (deterministic, no atomics).
"""

import math

import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, cdiv, kernel, launch_config, next_pow2, num_sms, tl_dtype, without_warp_specialization)

__all__ = ["ia3_fwd_kernel", "ia3_bwd_kernel", "colsum_kernel", "ia3_fwd", "ia3_bwd", "compile_specs"]

_THREADS = 128
_TILE_VECS = 512  # vectors per tile (4 per thread)
#: the fixed launch config (the tuner's ``{}`` candidate); a tuned ``cfg`` (backends/tilelang/tuning/ia3.py:
#: ``tl_plan_*``) overrides the vectors per tile and the threads of the streaming kernel
IA3 = dict(vecs=_TILE_VECS, threads=_THREADS)


def _tile(nv: int, vecs: int = _TILE_VECS):
    """(rows, vectors) of a tile of ``vecs`` vectors whose minor extent covers ``nv`` vectors
    (at most 32)."""
    bv = min(32, next_pow2(max(nv, 1)))
    return max(1, vecs // bv), bv


def ia3_fwd_kernel(xd: str, wd: str, yd: str, ch_rows: bool, VEC: int, BM: int, BN: int, threads_: int = _THREADS,
                   cpu: bool = False):
    """y = x·(α + γ·w[c]). ch_rows=False: x (A, CV, VEC), w (CV, VEC), tile BM rows x BN vectors.
    ch_rows=True: x (A, C, BV, VEC), w (C,), tile BM channels x BN vectors, one a per program."""
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    threads = 1 if cpu else threads_
    if not ch_rows:
        A, CV = T.dynamic("A CV")

        @T.prim_func
        def ia3_fwd_cols(X: T.Tensor((A, CV, VEC), xd), W: T.Tensor((CV, VEC), wd), Y: T.Tensor((A, CV, VEC), yd),
                         alpha: T.float32, gamma: T.float32):
            with T.Kernel(T.ceildiv(A, BM), T.ceildiv(CV, BN), threads=threads) as (bx, by):
                r0 = bx * BM
                c0 = by * BN
                for i, j, v in par(BM, BN, VEC):
                    if r0 + i < A and c0 + j < CV:
                        Y[r0 + i, c0 + j, v] = T.cast(
                            T.cast(X[r0 + i, c0 + j, v], "float32")
                            * (alpha + gamma * T.cast(W[c0 + j, v], "float32")), yd)

        return ia3_fwd_cols

    A, C, BV = T.dynamic("A C BV")

    @T.prim_func
    def ia3_fwd_rows(X: T.Tensor((A, C, BV, VEC), xd), W: T.Tensor((C,), wd), Y: T.Tensor((A, C, BV, VEC), yd),
                     alpha: T.float32, gamma: T.float32):
        with T.Kernel(A * T.ceildiv(BV, BN), T.ceildiv(C, BM), threads=threads) as (bx, by):
            nbt = T.ceildiv(BV, BN)
            a = bx // nbt
            b0 = (bx % nbt) * BN
            c0 = by * BM
            for i, j, v in par(BM, BN, VEC):
                if c0 + i < C and b0 + j < BV:
                    Y[a, c0 + i, b0 + j, v] = T.cast(
                        T.cast(X[a, c0 + i, b0 + j, v], "float32")
                        * (alpha + gamma * T.cast(W[c0 + i], "float32")), yd)

    return ia3_fwd_rows


def ia3_bwd_kernel(gd: str, xd: str, wd: str, ch_rows: bool, direct: bool, VEC: int, BM: int, BN: int,
                   threads_: int = _THREADS, cpu: bool = False):
    """gx = G·(α + γ·w[c]) and Σ G·x per channel over this program's share.

    ch_rows=False: x, G (A, CV, VEC); program (channel-vector tile, split s) walks
    ``tps`` row tiles from s·tps; partial -> P[s, c] (direct: gw[c] = γ·Σ). The G and x tiles
    are copied into shared memory in a pipelined loop (the next tile loads during this one's
    arithmetic; rows past A read as zeros: measured faster than reading them straight),
    compiled without warp specialization.
    ch_rows=True: x, G (A, C, BV, VEC); program (a·nsplit + s, channel tile) walks
    ``tps`` vector tiles; partial -> P[a·nsplit + s, c] (direct: gw[c] = γ·Σ).
    """
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc = T.alloc_local if cpu else T.alloc_fragment
    shared = T.alloc_local if cpu else T.alloc_shared
    threads = 1 if cpu else threads_
    if not ch_rows:
        A, CV, K, C = T.dynamic("A CV K C")

        @T.prim_func
        def ia3_bwd_cols(G: T.Tensor((A, CV, VEC), gd), X: T.Tensor((A, CV, VEC), xd), W: T.Tensor((CV, VEC), wd),
                         GX: T.Tensor((A, CV, VEC), xd), P: T.Tensor((K, C), "float32"), GW: T.Tensor((C,), wd),
                         alpha: T.float32, gamma: T.float32, tps: T.int32):
            with T.Kernel(T.ceildiv(CV, BN), K, threads=threads) as (bx, by):
                c0 = bx * BN
                acc = alloc((BM, BN * VEC), "float32")
                tot = alloc((BN * VEC,), "float32")
                T.clear(acc)
                gs = shared((BM, BN, VEC), gd)
                xs = shared((BM, BN, VEC), xd)
                for t in T.Pipelined(tps, num_stages=2):
                    r0 = (by * tps + t) * BM
                    T.copy(G[r0:r0 + BM, c0:c0 + BN, 0:VEC], gs)
                    T.copy(X[r0:r0 + BM, c0:c0 + BN, 0:VEC], xs)
                    for i, j, v in par(BM, BN, VEC):
                        g = T.cast(gs[i, j, v], "float32")
                        if r0 + i < A and c0 + j < CV:
                            GX[r0 + i, c0 + j, v] = T.cast(g * (alpha + gamma * T.cast(W[c0 + j, v], "float32")),
                                                           xd)
                        acc[i, j * VEC + v] += g * T.cast(xs[i, j, v], "float32")
                T.reduce_sum(acc, tot, dim=0)
                for jv in par(BN * VEC):
                    if c0 * VEC + jv < C:
                        if direct:
                            GW[c0 * VEC + jv] = T.cast(gamma * tot[jv], wd)
                        else:
                            P[by, c0 * VEC + jv] = tot[jv]

        return ia3_bwd_cols if cpu else without_warp_specialization(ia3_bwd_cols)

    A, C, BV, K = T.dynamic("A C BV K")

    @T.prim_func
    def ia3_bwd_rows(G: T.Tensor((A, C, BV, VEC), gd), X: T.Tensor((A, C, BV, VEC), xd), W: T.Tensor((C,), wd),
                     GX: T.Tensor((A, C, BV, VEC), xd), P: T.Tensor((K, C), "float32"), GW: T.Tensor((C,), wd),
                     alpha: T.float32, gamma: T.float32, tps: T.int32, nsplit: T.int32):
        with T.Kernel(K, T.ceildiv(C, BM), threads=threads) as (bx, by):
            a = bx // nsplit
            s = bx % nsplit
            c0 = by * BM
            acc = alloc((BM, BN * VEC), "float32")
            tot = alloc((BM,), "float32")
            T.clear(acc)
            for t in T.serial(tps):
                b0 = (s * tps + t) * BN
                for i, j, v in par(BM, BN, VEC):
                    if c0 + i < C and b0 + j < BV:
                        g = T.cast(G[a, c0 + i, b0 + j, v], "float32")
                        GX[a, c0 + i, b0 + j, v] = T.cast(g * (alpha + gamma * T.cast(W[c0 + i], "float32")), xd)
                        acc[i, j * VEC + v] += g * T.cast(X[a, c0 + i, b0 + j, v], "float32")
            T.reduce_sum(acc, tot, dim=1)
            for i in par(BM):
                if c0 + i < C:
                    if direct:
                        GW[c0 + i] = T.cast(gamma * tot[i], wd)
                    else:
                        P[bx, c0 + i] = tot[i]

    return ia3_bwd_rows


def colsum_kernel(wd: str, BN: int = 128, cpu: bool = False):
    """gw[c] = γ·Σ_k P[k, c] (P fp32 (K, C)), stored in w's dtype."""
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else _THREADS
    K, C = T.dynamic("K C")

    @T.prim_func
    def ia3_colsum(P: T.Tensor((K, C), "float32"), GW: T.Tensor((C,), wd), gamma: T.float32):
        with T.Kernel(T.ceildiv(C, BN), threads=threads) as bx:
            c0 = bx * BN
            acc = alloc((BN,), "float32")
            T.clear(acc)
            for k in T.serial(K):
                for j in par(BN):
                    if c0 + j < C:
                        acc[j] += P[k, c0 + j]
            for j in par(BN):
                if c0 + j < C:
                    GW[c0 + j] = T.cast(gamma * acc[j], wd)

    return ia3_colsum


# --------------------------------------------------------------------------- host side

def _vec(n: int, *dtypes: torch.dtype) -> int:
    cap = min(16 // torch.empty((), dtype=d).element_size() for d in dtypes)
    for v in (8, 4, 2, 1):
        if v <= cap and n % v == 0:
            return v
    return 1


def _geometry(shape, channel_axis):
    ax = channel_axis % len(shape)
    A = math.prod(shape[:ax])
    B = math.prod(shape[ax + 1:])
    return A, shape[ax], B


def ia3_fwd(x: torch.Tensor, w: torch.Tensor, channel_axis: int, alpha: float, gamma: float, cfg=None) -> torch.Tensor:
    """``y = x·(α + γ·w[c])``; x's shape, dtype ``promote_types(x, w)``, contiguous."""
    p = launch_config(IA3, cfg)
    y = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, w.dtype))
    if y.numel() == 0:
        return y
    A, C, B = _geometry(tuple(x.shape), channel_axis)
    xc = aligned(x.contiguous())
    wc = aligned(w.reshape(-1).contiguous())
    arch = arch_of(x.device)
    dts = (tl_dtype(x.dtype), tl_dtype(w.dtype), tl_dtype(y.dtype))
    if B == 1:
        vec = _vec(C, x.dtype, y.dtype)
        bm, bn = _tile(C // vec, p["vecs"])
        k = kernel(ia3_fwd_kernel, arch, *dts, False, vec, bm, bn, p["threads"])
        k(xc.view(A, C // vec, vec), wc.view(C // vec, vec), y.view(A, C // vec, vec), float(alpha), float(gamma))
    else:
        vec = _vec(B, x.dtype, y.dtype)
        bn_, bm_ = _tile(B // vec, p["vecs"])  # (rows = channels, vectors)
        k = kernel(ia3_fwd_kernel, arch, *dts, True, vec, bn_, bm_, p["threads"])
        k(xc.view(A, C, B // vec, vec), wc, y.view(A, C, B // vec, vec), float(alpha), float(gamma))
    return y


#: programs per SM the backward's reduction split aims at: a program is 128 threads walking
#: its tiles, so the bytes in flight on an SM scale with its programs (2 measured slower,
#: more than 4 no faster)
BWD_PER_SM = 4


def _split(tiles: int, other: int, device: torch.device, per_sm: int = 2) -> tuple:
    """(nsplit, tiles per split) so that other·nsplit programs fill the GPU ``per_sm`` times."""
    want = max(1, cdiv(per_sm * num_sms(device), max(other, 1)))
    nsplit = max(1, min(want, tiles))
    tps = cdiv(tiles, nsplit)
    return cdiv(tiles, tps), tps


def ia3_bwd(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, channel_axis: int, alpha: float, gamma: float,
            cfg=None):
    """``gx = G·(α + γ·w[c])`` (x's dtype) and ``gw[c] = γ·Σ G·x`` (w's dtype and shape)."""
    p = launch_config(IA3, cfg)
    gx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    gw = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    if x.numel() == 0:
        gw.zero_()
        return gx, gw
    A, C, B = _geometry(tuple(x.shape), channel_axis)
    xc = aligned(x.contiguous())
    gc = aligned(grad.contiguous())
    wc = aligned(w.reshape(-1).contiguous())
    gwv = gw.view(-1)
    arch = arch_of(x.device)
    dts = (tl_dtype(grad.dtype), tl_dtype(x.dtype), tl_dtype(w.dtype))
    if B == 1:
        vec = _vec(C, x.dtype, grad.dtype)
        cv = C // vec
        bm, bn = _tile(cv, p["vecs"])
        ctiles = cdiv(cv, bn)
        nsplit, tps = _split(cdiv(A, bm), ctiles, x.device, BWD_PER_SM)
        direct = nsplit == 1
        part = torch.empty((1 if direct else nsplit, C), device=x.device, dtype=torch.float32)
        k = kernel(ia3_bwd_kernel, arch, *dts, False, direct, vec, bm, bn, p["threads"])
        k(gc.view(A, cv, vec), xc.view(A, cv, vec), wc.view(cv, vec), gx.view(A, cv, vec), part, gwv,
          float(alpha), float(gamma), tps)
    else:
        vec = _vec(B, x.dtype, grad.dtype)
        bv = B // vec
        bm, bn = _tile(bv, p["vecs"])  # bm channels, bn vectors
        ctiles = cdiv(C, bm)
        nsplit, tps = _split(cdiv(bv, bn), A * ctiles, x.device, BWD_PER_SM)
        direct = nsplit * A == 1
        part = torch.empty((A * nsplit, C), device=x.device, dtype=torch.float32)
        k = kernel(ia3_bwd_kernel, arch, *dts, True, direct, vec, bm, bn, p["threads"])
        k(gc.view(A, C, bv, vec), xc.view(A, C, bv, vec), wc, gx.view(A, C, bv, vec), part, gwv,
          float(alpha), float(gamma), tps, nsplit)
    if not direct:
        kc = kernel(colsum_kernel, arch, tl_dtype(w.dtype))
        kc(part, gwv, float(gamma))
    return gx, gw


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (ia3_fwd_kernel, (d, d, d, False, 8, 16, 32)),
        (ia3_fwd_kernel, (d, "float32", "float32", True, 8, 16, 32)),
        (ia3_bwd_kernel, (d, d, d, False, False, 8, 16, 32)),
        (ia3_bwd_kernel, (d, d, d, True, True, 8, 16, 32)),
        (colsum_kernel, (d,)),
    ]
