"""TileLang kernels of the LoRA / LoCon family (docs/ops.md §2.1): ``lora_bypass_fwd``,
``lora_bypass_bwd``, ``lora_merge_fwd`` (plain / hada / sum), ``lora_merge_bwd``.

Written from the math of docs/ops.md §2.1 and the eager bodies of
``reference/lora.py`` (same dtypes and rounding points). Hopper idioms: every
contraction is a ``T.gemm`` on shared-memory tiles with an fp32 fragment
accumulator (WGMMA on sm_90a, mma.sync on sm_80), global->shared staging with
``T.copy`` inside ``T.Pipelined`` loops (cp.async multi-stage pipelines).

Shapes: the weight sizes (I, O, r) are static (one kernel per layer shape);
the token count T is a ``T.dynamic`` variable, so one compiled kernel serves
every batch size. The rank is padded to ``Rp`` (a power of two >= 16) inside
the kernels: ``T.copy`` zero-fills the rows/columns past r, so the padded
lanes contribute nothing. Partial tiles are bounds-checked by ``T.copy`` and
by explicit guards in the epilogues.

Kernel families (builders; the ``cpu`` flag swaps shared/fragment buffers for
local ones and ``T.Parallel`` for ``T.grid`` so the same builder lowers for
the C target - the CPU twin of the tests):

``bypass_fwd_kernel`` - ``lora_bypass_fwd`` in one launch. Program = (token
    tile, range of ``per`` O tiles). It accumulates ``h = x·downᵀ`` (BT x Rp,
    fp32) over I, rounds it to the compute dtype into shared memory (the
    deliberate rounding of §1.3 rule 8), then walks its O tiles:
    ``Y = γ·h·upᵀ (+ base)`` with one rounding at the store. ``per`` is a
    runtime argument (the grid is sized on the host from T), so no T enters
    the cache key. The O loop is pipelined (``pipe_o``), over every O tile
    where one group holds them, else over groups of a static size.

``bypass_bwd_tok_kernel`` - the token pass of ``lora_bypass_bwd``. Program =
    (token tile, range of I tiles): ``h = x·downᵀ`` and ``q = G·up`` (both
    rounded to the compute dtype; the first I range stores them to a
    (T, Rp) workspace each), then ``gx = γ·q·down`` over its I tiles.

``skinny_kernel`` - ``out (M, r) = γ·Σ_k A'[m,k]·B'[k,n]`` for a long
    reduction and a thin output: ``g_up``/``g_down`` of both LoRA backwards
    (and the LoHa / LoKr reuse). A may be stored (M, K) or (K, M), B (K, N) or
    (N, K), the output (M, r) or transposed (r, M). The K loop is split over
    ``nsplit`` programs (runtime) when the output alone does not fill the GPU:
    fp32 partials then, summed by one torch reduction (deterministic, no
    atomics).

``merge_bwd_pair_kernel`` - ``lora_merge_bwd``'s two skinny products in one launch:
    a program per BM-row band of g_up or of g_downᵀ, whole
    reductions, direct stores.

``merge_stream_kernel`` - ``lora_merge_fwd``, the whole
    rank in one K step: a program per column stripe and group of row tiles,
    the stripe's B tiles loaded once, the row tiles through a pipelined loop
    (the next A and base tiles load during this tile's product and store).

``gemm_kernel`` - ``Y = γ·(A·B | (A·B)⊙(A2·B2) | A·B + A2·B2) (+ base)``:
    ``lora_merge_fwd`` where no stream tile fits or the tuner times it faster
    (rank loop tiled, no rank limit) and, with a dynamic M or K, the dense
    GEMMs of the LoHa/LoKr paths.

Numerics: fp32 accumulation, epilogues in fp32, one rounding per store. fp32
operands would run as TF32 on tensor cores (sm_80+), so fp32 calls are
outside the TileLang scope of these ops (``scope.py``) and step down.
Operands in another dtype than the compute dtype are cast on the host, and
non-contiguous operands are made contiguous on the host (the kernels take
compact row-major buffers).
"""

import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, cdiv, kernel, launch_config, next_pow2, num_sms, smem_limit, tl_dtype, without_warp_specialization)
from lycoris_ops.reference.checks import promote_dtypes

__all__ = [
    "bypass_fwd_kernel", "bypass_bwd_tok_kernel", "skinny_kernel", "merge_bwd_pair_kernel", "gemm_kernel",
    "bypass_fwd", "bypass_bwd", "merge_fwd", "merge_bwd", "skinny", "gemm", "compile_specs",
    "pad_rank", "compute_dtype", "prep", "fresh", "dummy",
]

_ACC = "float32"
_DUMMY = {}


def pad_rank(r: int) -> int:
    """Rank padded to a power of two >= 16 (the MMA K/N granularity)."""
    return max(16, next_pow2(int(r)))


def compute_dtype(*tensors) -> torch.dtype:
    """docs/ops.md §1.3 over the (validated) operands: ``_checks.promote_dtypes``."""
    return promote_dtypes(*(t.dtype for t in tensors if t is not None))


def prep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the kernels read it: the compute dtype, compact row-major, 16-byte aligned."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return aligned(t.contiguous())


def fresh(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor holding ``t`` in ``dtype`` (``Tensor.to`` may return a view)."""
    out = torch.empty(t.shape, device=t.device, dtype=dtype)
    out.copy_(t)
    return out


def dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 1-element tensor standing in for an absent optional operand."""
    key = (device, dtype)
    t = _DUMMY.get(key)
    if t is None:
        t = _DUMMY[key] = torch.zeros(1, device=device, dtype=dtype)
    return t


def _scopes(T, cpu: bool):
    """(shared, fragment, parallel, threads-of) for the GPU or the C-target twin."""
    if cpu:
        return T.alloc_local, T.alloc_local, T.grid, (lambda n: 1)
    return T.alloc_shared, T.alloc_fragment, T.Parallel, (lambda n: n)


# --------------------------------------------------------------------------- builders

def _scaled_tile(T, par, rows: int, cols: int, odt: str):
    """The staged epilogues' T.macro ``scaled(acc, gamma, out_s, base_s)``: ``out_s = round(γ·acc
    (+ base_s))`` in ``odt`` over a (rows, cols) tile; ``base_s`` None: no base."""

    @T.macro
    def scaled(acc, gamma, out_s, base_s):
        for i, j in par(rows, cols):
            if base_s is None:
                out_s[i, j] = T.cast(acc[i, j] * gamma, odt)
            else:
                out_s[i, j] = T.cast(acc[i, j] * gamma + T.cast(base_s[i, j], _ACC), odt)

    return scaled


def _scaled_acc(T, par, rows: int, cols: int, R, C):
    """The register epilogues' T.macro ``scale(acc, gamma, Base, r0, c0)``: ``acc = γ·acc
    (+ Base[r0 + i, c0 + j], read where inside the R x C base)`` in place over a (rows, cols)
    tile, before one copy stores it; ``Base`` None: no base. R, C are the builder's (dynamic)
    extents, closed over: as macro arguments TileLang would rename the kernel's own."""

    @T.macro
    def scale(acc, gamma, Base, r0, c0):
        for i, j in par(rows, cols):
            if Base is None:
                acc[i, j] = acc[i, j] * gamma
            elif r0 + i < R and c0 + j < C:
                acc[i, j] = acc[i, j] * gamma + T.cast(Base[r0 + i, c0 + j], _ACC)

    return scale


def bypass_fwd_kernel(I: int, O: int, r: int, dt: str, bdt, odt: str,
                      BT: int = 64, BO: int = 128, BK: int = 64, stages: int = 2, threads: int = 128,
                      pipe_o: bool = False, pipe_per: int = 0, cpu: bool = False):
    """``Y[T, O] = γ·round(x·downᵀ)·upᵀ (+ base)``; bdt None: no base.

    Program = (group of ``per`` O tiles, T tile): h = round(x·downᵀ) of the T tile once, then
    each O tile of the group, the base tile copied in whole and the output tile leaving through
    shared memory in whole rows; a group past the last O tile redoes the last one (same values:
    no guard). ``pipe_o``: the O loop is pipelined, the next up / base tiles loading during this
    tile's product (one group of every O tile; with ``pipe_per`` > 0, groups of that many O
    tiles: a static extent, the last group's tiles past the last O tile redo it); else serial.
    Compiled without warp specialization (128 threads, several programs an SM instead of one)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Rp = pad_rank(r)
    Tn = T.dynamic("T")
    has_base = bdt is not None
    bshape = (Tn, O) if has_base else (1,)
    bdt = bdt or _ACC
    n_o = -(-O // BO)
    scaled = _scaled_tile(T, par, BT, BO, odt)
    grouped = pipe_per > 0  # (Python values here: inside the prim_func `or` / `and` build TIR)
    all_o = pipe_o and not grouped
    npipe = pipe_per if grouped else n_o

    @T.prim_func
    def lora_bypass_fwd(X: T.Tensor((Tn, I), dt), Up: T.Tensor((O, r), dt), Down: T.Tensor((r, I), dt),
                        Base: T.Tensor(bshape, bdt), Y: T.Tensor((Tn, O), odt), gamma: T.float32, per: T.int32):
        with T.Kernel(T.ceildiv(n_o, per), T.ceildiv(Tn, BT), threads=nthreads(threads)) as (bo, bt):
            xs = shared((BT, BK), dt)
            ds = shared((Rp, BK), dt)
            hs = shared((BT, Rp), dt)
            us = shared((BO, Rp), dt)
            h = frag((BT, Rp), _ACC)
            y = frag((BT, BO), _ACC)
            ys = shared((BT, BO), odt)
            if has_base:
                bs = shared((BT, BO), bdt)
            t0 = bt * BT
            T.clear(h)
            for k in T.Pipelined(T.ceildiv(I, BK), num_stages=stages):
                T.copy(X[t0, k * BK], xs)
                T.copy(Down[0, k * BK], ds)
                T.gemm(xs, ds, h, transpose_B=True)
            T.copy(h, hs)  # the deliberate rounding of h to the compute dtype
            # pipe_o: one group of every O tile (per == n_o) or groups of pipe_per: a static
            # extent (the pipeline's waits need one)
            for j in (T.Pipelined(npipe, num_stages=2) if pipe_o else T.serial(per)):
                o0 = (j if all_o else T.min(bo * (pipe_per if grouped else per) + j, n_o - 1)) * BO
                T.copy(Up[o0, 0], us)
                if has_base:
                    T.copy(Base[t0, o0], bs)
                T.gemm(hs, us, y, transpose_B=True, clear_accum=True)
                scaled(y, gamma, ys, bs if has_base else None)
                T.copy(ys, Y[t0, o0])

    return lora_bypass_fwd if cpu else without_warp_specialization(lora_bypass_fwd)


def bypass_bwd_tok_kernel(I: int, O: int, r: int, dt: str, gxdt: str,
                          BT: int = 64, BK: int = 64, BI: int = 128, stages: int = 2, threads=None,
                          pipe_i: bool = False, cpu: bool = False):
    """h = round(x·downᵀ), q = round(G·up) -> workspaces H, Q (T, Rp) (first I range);
    ``gx = γ·q·down`` over the program's ``per`` I tiles, each leaving through shared memory in
    whole rows (a group past the last I tile redoes it). ``pipe_i`` (one group of every I
    tile): the I loop pipelined, as ``bypass_fwd_kernel``'s ``pipe_o``. Compiled without warp
    specialization."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Rp = pad_rank(r)
    threads = threads or (256 if Rp >= 128 else 128)  # h, q (BT, Rp) and gx (BT, BI) fp32 fragments
    Tn = T.dynamic("T")
    n_i = -(-I // BI)
    scaled = _scaled_tile(T, par, BT, BI, gxdt)

    @T.prim_func
    def lora_bypass_bwd_tok(Gr: T.Tensor((Tn, O), dt), X: T.Tensor((Tn, I), dt), Up: T.Tensor((O, r), dt),
                            Down: T.Tensor((r, I), dt), H: T.Tensor((Tn, Rp), dt), Q: T.Tensor((Tn, Rp), dt),
                            GX: T.Tensor((Tn, I), gxdt), gamma: T.float32, per: T.int32):
        with T.Kernel(T.ceildiv(T.ceildiv(I, BI), per), T.ceildiv(Tn, BT), threads=nthreads(threads)) as (bi, bt):
            xs = shared((BT, BK), dt)
            ds = shared((Rp, BK), dt)
            gs = shared((BT, BK), dt)
            us = shared((BK, Rp), dt)
            qs = shared((BT, Rp), dt)
            hs = shared((BT, Rp), dt)
            d2 = shared((Rp, BI), dt)
            h = frag((BT, Rp), _ACC)
            q = frag((BT, Rp), _ACC)
            gx = frag((BT, BI), _ACC)
            t0 = bt * BT
            if bi == 0:
                T.clear(h)
                for k in T.Pipelined(T.ceildiv(I, BK), num_stages=stages):
                    T.copy(X[t0, k * BK], xs)
                    T.copy(Down[0, k * BK], ds)
                    T.gemm(xs, ds, h, transpose_B=True)
                T.copy(h, hs)
                T.copy(hs, H[t0, 0])
            T.clear(q)
            for k in T.Pipelined(T.ceildiv(O, BK), num_stages=stages):
                T.copy(Gr[t0, k * BK], gs)
                T.copy(Up[k * BK, 0], us)
                T.gemm(gs, us, q)
            T.copy(q, qs)  # q rounded to the compute dtype
            if bi == 0:
                T.copy(qs, Q[t0, 0])
            gxs = shared((BT, BI), gxdt)
            for j in (T.Pipelined(n_i, num_stages=2) if pipe_i else T.serial(per)):
                i0 = (j if pipe_i else T.min(bi * per + j, n_i - 1)) * BI
                T.copy(Down[0, i0], d2)
                T.gemm(qs, d2, gx, clear_accum=True)
                scaled(gx, gamma, gxs, None)
                T.copy(gxs, GX[t0, i0])

    return lora_bypass_bwd_tok if cpu else without_warp_specialization(lora_bypass_bwd_tok)


def skinny_kernel(M: int, K, NB: int, r: int, a_km: bool, b_nk: bool, out_t: bool, direct: bool,
                  dt: str, odt: str, BM: int = 64, BK: int = 64, stages: int = 2, threads: int = 128,
                  cpu: bool = False):
    """``out[m, n] = γ·Σ_k A'[m, k]·B'[k, n]`` for n < r.

    A is stored (M, K) or, with ``a_km``, (K, M); B is stored (K, NB) or, with
    ``b_nk``, (NB, K) (NB = r for a factor, Rp for a workspace). K None: a
    dynamic K (the token count). ``direct``: store γ·acc into Out (M, r) - or
    (r, M) with ``out_t`` - in ``odt``; else fp32 partials P (nsplit·Mp, Rp),
    Mp = M rounded up to BM, summed by the caller. Program = (M tile, split);
    split s reduces the K tiles [s·kper, (s+1)·kper).
    """
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Rp = pad_rank(max(NB, r))
    Kd = T.dynamic("K") if K is None else K
    Mp = cdiv(M, BM) * BM
    ashape = (Kd, M) if a_km else (M, Kd)
    bshape = (NB, Kd) if b_nk else (Kd, NB)
    atile = (BK, BM) if a_km else (BM, BK)
    btile = (Rp, BK) if b_nk else (BK, Rp)
    if direct:
        oshape, odt_ = ((r, M) if out_t else (M, r)), odt
    else:
        oshape, odt_ = None, _ACC

    @T.prim_func
    def skinny(A: T.Tensor(ashape, dt), B: T.Tensor(bshape, dt), Out: T.Tensor(oshape or (T.dynamic("P"), Rp), odt_),
               gamma: T.float32, kper: T.int32, nsplit: T.int32):
        with T.Kernel(T.ceildiv(M, BM), nsplit, threads=nthreads(threads)) as (bm, s):
            As = shared(atile, dt)
            Bs = shared(btile, dt)
            acc = frag((BM, Rp), _ACC)
            m0 = bm * BM
            T.clear(acc)
            for kk in T.Pipelined(kper, num_stages=stages):
                k0 = (s * kper + kk) * BK
                if a_km:
                    T.copy(A[k0, m0], As)
                else:
                    T.copy(A[m0, k0], As)
                if b_nk:
                    T.copy(B[0, k0], Bs)
                else:
                    T.copy(B[k0, 0], Bs)
                T.gemm(As, Bs, acc, transpose_A=a_km, transpose_B=b_nk)
            for i, n in par(BM, Rp):
                acc[i, n] = acc[i, n] * gamma
            if direct:
                if out_t:
                    for i, n in par(BM, Rp):
                        if m0 + i < M and n < r:
                            Out[n, m0 + i] = T.cast(acc[i, n], odt)
                else:
                    T.copy(acc, Out[m0, 0])
            else:
                T.copy(acc, Out[s * Mp + m0, 0])

    return skinny


def merge_bwd_pair_kernel(O: int, I: int, r: int, dt: str, odt_up: str, odt_down: str, BM: int = 64, BK: int = 64,
                          stages: int = 3, threads: int = 128, cpu: bool = False):
    """``lora_merge_bwd`` in ONE launch: ``g_up = γ·G·downᵀ`` (O, r) and ``g_down = γ·upᵀ·G``
    (r, I), each program one BM-row band of one of them, its whole reduction inside.

    Programs [0, ⌈O/BM⌉) walk G's rows m0..m0+BM over I (G tile · Down tileᵀ); programs
    [⌈O/BM⌉, ⌈O/BM⌉ + ⌈I/BM⌉) walk G's columns m0..m0+BM over O (G tileᵀ · Up tile) and
    store the transposed (r, BM) block. No split of the reduction, so no fp32 partials, no
    reduction and no cast launches after it (``skinny`` twice: up to six launches); G is read
    twice, as by the two skinny products, within one launch. Compiled without warp
    specialization (it would double the shared memory: one program an SM).
    """
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Rp = pad_rank(r)
    mu, md = cdiv(O, BM), cdiv(I, BM)

    @T.prim_func
    def merge_bwd_pair(G: T.Tensor((O, I), dt), Up: T.Tensor((O, r), dt), Down: T.Tensor((r, I), dt),
                       GU: T.Tensor((O, r), odt_up), GD: T.Tensor((r, I), odt_down), gamma: T.float32):
        with T.Kernel(mu + md, threads=nthreads(threads)) as b:
            Gs = shared((BM, BK), dt)   # g_up: G[m0 : m0+BM, k0 : k0+BK]
            Ds = shared((Rp, BK), dt)   # Down[:, k0 : k0+BK]
            Gt = shared((BK, BM), dt)   # g_down: G[k0 : k0+BK, m0 : m0+BM]
            Us = shared((BK, Rp), dt)   # Up[k0 : k0+BK, :]
            acc_u = frag((BM, Rp), _ACC)
            acc_d = frag((BM, Rp), _ACC)
            if b < mu:
                m0 = b * BM
                T.clear(acc_u)
                for k in T.Pipelined(T.ceildiv(I, BK), num_stages=stages):
                    T.copy(G[m0, k * BK], Gs)
                    T.copy(Down[0, k * BK], Ds)
                    T.gemm(Gs, Ds, acc_u, transpose_B=True)
                for i, n in par(BM, Rp):
                    acc_u[i, n] = acc_u[i, n] * gamma
                T.copy(acc_u, GU[m0, 0])
            else:
                m0 = (b - mu) * BM
                T.clear(acc_d)
                for k in T.Pipelined(T.ceildiv(O, BK), num_stages=stages):
                    T.copy(G[k * BK, m0], Gt)
                    T.copy(Up[k * BK, 0], Us)
                    T.gemm(Gt, Us, acc_d, transpose_A=True)
                for i, n in par(BM, Rp):
                    if m0 + i < I and n < r:
                        GD[n, m0 + i] = T.cast(acc_d[i, n] * gamma, odt_down)

    return merge_bwd_pair if cpu else without_warp_specialization(merge_bwd_pair)


def gemm_kernel(M, N: int, K1, K2, mode: str, a_km: bool, b_nk: bool, dt: str, bdt, odt: str,
                BM: int = 128, BN: int = 128, BK: int = 64, stages: int = 2, threads: int = 256,
                cpu: bool = False):
    """``Y (M, N) = γ·P (+ base)`` with P = A·B (plain), (A·B)⊙(A2·B2) (hada, K2 = K1)
    or A·B + A2·B2 (sum). A (M, K1) or, ``a_km``, (K1, M); B (K1, N) or,
    ``b_nk``, (N, K1); A2 (M, K2), B2 (K2, N) row-major. M / K1 None: dynamic.
    The base tile is copied in whole and the output tile leaves through shared memory (whole
    rows), not from the accumulator's registers: measured faster in every merge mode."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Md = T.dynamic("M") if M is None else M
    Kd = T.dynamic("K") if K1 is None else K1
    two = mode != "plain"
    ashape = (Kd, Md) if a_km else (Md, Kd)
    bshape = (N, Kd) if b_nk else (Kd, N)
    atile = (BK, BM) if a_km else (BM, BK)
    btile = (BN, BK) if b_nk else (BK, BN)
    a2shape = (Md, K2) if two else (1,)
    b2shape = (K2, N) if two else (1,)
    has_base = bdt is not None
    bsh = (Md, N) if has_base else (1,)
    bdt = bdt or _ACC
    scaled = _scaled_tile(T, par, BM, BN, odt)

    @T.prim_func
    def gemm(A: T.Tensor(ashape, dt), B: T.Tensor(bshape, dt), A2: T.Tensor(a2shape, dt), B2: T.Tensor(b2shape, dt),
             Base: T.Tensor(bsh, bdt), Y: T.Tensor((Md, N), odt), gamma: T.float32):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(Md, BM), threads=nthreads(threads)) as (bn, bm):
            As = shared(atile, dt)
            Bs = shared(btile, dt)
            acc = frag((BM, BN), _ACC)
            if two:
                A2s = shared((BM, BK), dt)
                B2s = shared((BK, BN), dt)
            if mode == "hada":
                acc2 = frag((BM, BN), _ACC)
            m0 = bm * BM
            n0 = bn * BN
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(Kd, BK), num_stages=stages):
                if a_km:
                    T.copy(A[k * BK, m0], As)
                else:
                    T.copy(A[m0, k * BK], As)
                if b_nk:
                    T.copy(B[n0, k * BK], Bs)
                else:
                    T.copy(B[k * BK, n0], Bs)
                T.gemm(As, Bs, acc, transpose_A=a_km, transpose_B=b_nk)
            if mode == "hada":
                T.clear(acc2)
                for k in T.Pipelined(T.ceildiv(K2, BK), num_stages=stages):
                    T.copy(A2[m0, k * BK], A2s)
                    T.copy(B2[k * BK, n0], B2s)
                    T.gemm(A2s, B2s, acc2)
                for i, j in par(BM, BN):
                    acc[i, j] = acc[i, j] * acc2[i, j]
            if mode == "sum":
                for k in T.Pipelined(T.ceildiv(K2, BK), num_stages=stages):
                    T.copy(A2[m0, k * BK], A2s)
                    T.copy(B2[k * BK, n0], B2s)
                    T.gemm(A2s, B2s, acc)
            ys = shared((BM, BN), odt)
            if has_base:
                bs = shared((BM, BN), bdt)
                T.copy(Base[m0, n0], bs)
            scaled(acc, gamma, ys, bs if has_base else None)
            T.copy(ys, Y[m0, n0])

    # without warp specialization (2 consumer warpgroups and a producer take one program an
    # SM): measured faster for the sum and hada merges, level for the others
    return gemm if cpu else without_warp_specialization(gemm)


def merge_stream_kernel(O: int, I: int, r1: int, r2, mode: str, dt: str, bdt, odt: str,
                        BM: int = 64, BN: int = 128, per: int = 4, stages: int = 2, threads: int = 128,
                        cpu: bool = False):
    """The merge ``Y (O, I) = γ·P (+ base)`` (P as ``gemm_kernel``'s modes; A (O, r), B (r, I)
    row-major) with the rank in one K step, streamed: program = (BN-column stripe, group of
    ``per`` BM-row tiles). The stripe's B tiles (Rp x BN) load once; the row tiles run through
    a pipelined loop, so the next A and base tiles load during this tile's product and store
    (``gemm_kernel`` waits for its base tile after the product: a merge at rank <= 64 is all
    base traffic). The last group past the last row tile redoes that tile (same values)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    two = mode != "plain"
    R1p = pad_rank(r1)
    R2p = pad_rank(r2) if two else 16
    n_m = cdiv(O, BM)
    has_base = bdt is not None
    bsh = (O, I) if has_base else (1,)
    bdt = bdt or _ACC
    a2shape = (O, r2) if two else (1,)
    b2shape = (r2, I) if two else (1,)
    scaled = _scaled_tile(T, par, BM, BN, odt)

    @T.prim_func
    def merge_stream(A: T.Tensor((O, r1), dt), B: T.Tensor((r1, I), dt), A2: T.Tensor(a2shape, dt),
                     B2: T.Tensor(b2shape, dt), Base: T.Tensor(bsh, bdt), Y: T.Tensor((O, I), odt),
                     gamma: T.float32):
        with T.Kernel(T.ceildiv(I, BN), T.ceildiv(n_m, per), threads=nthreads(threads)) as (bn, bg):
            Bs = shared((R1p, BN), dt)
            As = shared((BM, R1p), dt)
            acc = frag((BM, BN), _ACC)
            ys = shared((BM, BN), odt)
            if two:
                B2s = shared((R2p, BN), dt)
                A2s = shared((BM, R2p), dt)
            if mode == "hada":
                acc2 = frag((BM, BN), _ACC)
            if has_base:
                bs = shared((BM, BN), bdt)
            n0 = bn * BN
            T.copy(B[0, n0], Bs)
            if two:
                T.copy(B2[0, n0], B2s)
            for j in T.Pipelined(per, num_stages=stages):
                m0 = T.min(bg * per + j, n_m - 1) * BM
                T.copy(A[m0, 0], As)
                if two:
                    T.copy(A2[m0, 0], A2s)
                if has_base:
                    T.copy(Base[m0, n0], bs)
                T.gemm(As, Bs, acc, clear_accum=True)
                if mode == "hada":
                    T.gemm(A2s, B2s, acc2, clear_accum=True)
                    for i, k in par(BM, BN):
                        acc[i, k] = acc[i, k] * acc2[i, k]
                if mode == "sum":
                    T.gemm(A2s, B2s, acc)
                scaled(acc, gamma, ys, bs if has_base else None)
                T.copy(ys, Y[m0, n0])

    return merge_stream if cpu else without_warp_specialization(merge_stream)


# --------------------------------------------------------------------------- launchers

def _per(tiles: int, other: int, device: torch.device) -> int:
    """Tiles per program so that ``other`` x groups programs fill the GPU about twice."""
    groups = max(1, min(tiles, cdiv(2 * num_sms(device), max(other, 1))))
    return cdiv(tiles, groups)


def _tl(dtype: torch.dtype) -> str:
    return tl_dtype(dtype)


#: The fixed launch configs: the ``{}`` candidate of the tuner (``backends/tilelang/runner.py``). A
#: tuned ``cfg`` (the shortlists of ``backends/tilelang/tuning/lora.py``) overrides any key.
#: ``BYPASS_FWD``'s stages: the x·downᵀ loop 4 tiles deep (on sm_90a TileLang overlaps that loop's
#: buffers with the O loop's, so the depth costs no shared memory): measured faster than 2 or 3
BYPASS_FWD = dict(BT=64, BO=128, BK=64, stages=4, threads=128)
#: token kernel (BT, BI, BK, stages, threads; threads 0: by rank) + the skinny pair (sBM, sBK)
BYPASS_BWD = dict(BT=64, BI=128, BK=64, stages=2, threads=0, sBM=64, sBK=64)
#: ``gemm_kernel``'s tile: the merge where no stream tile fits, or timed against the stream
MERGE_FWD = dict(BM=128, BN=128, BK=64, stages=2, threads=256)
#: ``merge_stream_kernel``'s fixed config (the row tiles a program takes: ``_per``): measured
#: faster than the GEMM form's 128 x 128 tile in every merge mode
MERGE_STREAM = dict(BM=64, BN=128, stages=2, threads=128)
#: the pair kernel's tile (BM rows a band, BK a K step): 192 KiB of shared memory at rank 64
#: (``pair_smem``); a smaller K step or fewer stages where that does not fit, else ``skinny``
MERGE_BWD = dict(BM=64, BK=128, stages=3, threads=128)
#: the two skinny products' tile where no pair tile fits (ranks past 128)
MERGE_BWD_SKINNY = dict(BM=64, BK=64, stages=2, threads=128)


def pair_smem(BM: int, BK: int, stages: int, r: int, esize: int) -> int:
    """Shared-memory bytes of ``merge_bwd_pair_kernel``: both branches' pipelined tiles (G and
    a factor each; TileLang does not overlap the two branches)."""
    return stages * 2 * BK * (BM + pad_rank(r)) * esize


def bypass_fwd(x, up, down, gamma, base=None, cfg=None):
    """``lora_bypass_fwd``; a config's ``pipe_o`` False (the cold key's quick twin,
    ``tuning/lora.TL_QUICK``) runs the O loop serially: that kernel builds in about half the time."""
    T_, I = x.shape
    O, r = up.shape
    p = launch_config(BYPASS_FWD, cfg)
    c = compute_dtype(x, up, down)
    odt = x.dtype if base is None else base.dtype
    y = torch.empty((T_, O), device=x.device, dtype=odt)
    BT, BO = p["BT"], p["BO"]
    n_o = cdiv(O, BO)
    per = _per(n_o, cdiv(T_, BT), x.device)
    pipe = p.get("pipe_o", True)
    grouped = pipe and per != n_o  # a static group size: one build each
    k = kernel(bypass_fwd_kernel, arch_of(x.device), I, O, r, _tl(c),
               None if base is None else _tl(base.dtype), _tl(odt), BT, BO, p["BK"], p["stages"], p["threads"],
               pipe, per if grouped else 0)
    b = dummy(x.device, torch.float32) if base is None else aligned(base.contiguous())
    k(prep(x, c), prep(up, c), prep(down, c), b, y, float(gamma), per)
    return y


def skinny(a, b, r, a_km, b_nk, out_t, gamma, out_dtype, compute, K=None, BM=64, BK=64, stages=2, threads=128):
    """Launch ``skinny_kernel``: returns the (M, r) or (r, M) result in ``out_dtype``.
    a, b are already prepared (compute dtype, contiguous); K None: dynamic K
    (taken from the operands)."""
    M = a.shape[1] if a_km else a.shape[0]
    Kv = a.shape[0] if a_km else a.shape[1]
    NB = b.shape[0] if b_nk else b.shape[1]
    dev = a.device
    Rp = pad_rank(max(NB, r))
    mt, kt = cdiv(M, BM), cdiv(Kv, BK)
    kper = _per(kt, mt, dev)
    ns = cdiv(kt, kper)
    arch = arch_of(dev)
    dt = _tl(compute)
    if ns == 1:
        out = torch.empty((r, M) if out_t else (M, r), device=dev, dtype=out_dtype)
        k = kernel(skinny_kernel, arch, M, K, NB, r, a_km, b_nk, out_t, True, dt, _tl(out_dtype), BM, BK, stages,
                   threads)
        k(a, b, out, float(gamma), kper, 1)
        return out
    Mp = mt * BM
    part = torch.empty((ns * Mp, Rp), device=dev, dtype=torch.float32)
    k = kernel(skinny_kernel, arch, M, K, NB, r, a_km, b_nk, out_t, False, dt, "float32", BM, BK, stages, threads)
    k(a, b, part, float(gamma), kper, ns)
    s = part.view(ns, Mp, Rp).sum(0)[:M, :r]
    if out_t:
        s = s.t()
    return fresh(s, out_dtype)


def bypass_bwd(grad, x, up, down, gamma, cfg=None):
    T_, I = x.shape
    O, r = up.shape
    p = launch_config(BYPASS_BWD, cfg)
    c = compute_dtype(x, up, down)
    Rp = pad_rank(r)
    dev = x.device
    g, xc, u, d = prep(grad, c), prep(x, c), prep(up, c), prep(down, c)
    ws = torch.empty((2, T_, Rp), device=dev, dtype=c)
    gx = torch.empty((T_, I), device=dev, dtype=x.dtype)
    BT, BI = p["BT"], p["BI"]
    n_i = cdiv(I, BI)
    per = _per(n_i, cdiv(T_, BT), dev)
    k = kernel(bypass_bwd_tok_kernel, arch_of(dev), I, O, r, _tl(c), _tl(x.dtype), BT, p["BK"], BI, p["stages"],
               p["threads"] or None, per == n_i)
    k(g, xc, u, d, ws[0], ws[1], gx, float(gamma), per)
    sk = dict(BM=p["sBM"], BK=p["sBK"])
    g_up = skinny(g, ws[0], r, True, False, False, gamma, up.dtype, c, **sk)      # γ·Gᵀ·h   (O, r)
    g_down = skinny(xc, ws[1], r, True, False, True, gamma, down.dtype, c, **sk)  # γ·(xᵀ·q)ᵀ (r, I)
    return gx, g_up, g_down


def gemm(a, b, a2, b2, base, gamma, mode, out_dtype, compute, a_km=False, b_nk=False,
         dyn_m=False, dyn_k=False, BM=128, BN=128, BK=64, stages=2, threads=256):
    """Launch ``gemm_kernel`` on prepared operands; returns Y (M, N) in ``out_dtype``."""
    M = a.shape[1] if a_km else a.shape[0]
    K1 = a.shape[0] if a_km else a.shape[1]
    N = b.shape[0] if b_nk else b.shape[1]
    K2 = None if a2 is None else a2.shape[1]
    dev = a.device
    y = torch.empty((M, N), device=dev, dtype=out_dtype)
    bk = BK if dyn_k else min(BK, pad_rank(K1 if K2 is None else max(K1, K2)))  # no T in the key
    k = kernel(gemm_kernel, arch_of(dev), None if dyn_m else M, N, None if dyn_k else K1, K2, mode, a_km, b_nk,
               _tl(compute), None if base is None else _tl(base.dtype), _tl(out_dtype), BM, BN, bk, stages, threads)
    dm = dummy(dev, compute)
    k(a, b, dm if a2 is None else a2, dm if b2 is None else b2,
      dummy(dev, torch.float32) if base is None else base, y, float(gamma))
    return y


def stream_smem(BM: int, BN: int, stages: int, r1: int, r2, esize: int, bsize: int, osize: int) -> int:
    """Shared-memory bytes of ``merge_stream_kernel``: the stripe's B tiles, per stage the A
    tiles and the base tile (``bsize`` 0: no base), the output tile."""
    rp = pad_rank(r1) + (pad_rank(r2) if r2 else 0)
    return rp * BN * esize + stages * (BM * rp * esize + BM * BN * bsize) + BM * BN * osize


def _stream_merge(a1, b1, a2, b2, base, gamma, mode, odt, c, cfg):
    """``merge_stream_kernel``'s launch where its tile fits shared memory (else None): ``per``
    row tiles a program so that the stripes x groups fill the GPU about twice."""
    p = launch_config(MERGE_STREAM, cfg)
    (O, r1), I = a1.shape, b1.shape[1]
    r2 = None if a2 is None else a2.shape[1]
    dev = a1.device
    bsize = 0 if base is None else base.element_size()
    if stream_smem(p["BM"], p["BN"], p["stages"], r1, r2, a1.element_size(), bsize, odt.itemsize) > smem_limit(dev):
        return None
    per = _per(cdiv(O, p["BM"]), cdiv(I, p["BN"]), dev)
    y = torch.empty((O, I), device=dev, dtype=odt)
    k = kernel(merge_stream_kernel, arch_of(dev), O, I, r1, r2, mode, _tl(c),
               None if base is None else _tl(base.dtype), _tl(odt), p["BM"], p["BN"], per, p["stages"], p["threads"])
    dm = dummy(dev, c)
    k(a1, b1, dm if a2 is None else a2, dm if b2 is None else b2,
      dummy(dev, torch.float32) if base is None else base, y, float(gamma))
    return y


def merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None, cfg=None):
    if mode == "plain":
        a2 = b2 = None
        c = compute_dtype(a1, b1)
    else:
        c = compute_dtype(a1, b1, a2, b2)
    odt = out_dtype or a1.dtype
    f = [None if t is None else prep(t, c) for t in (a1, b1, a2, b2)]
    bs = None if base is None else aligned(base.contiguous())
    # a tuned config with BK is a GEMM tile (the planner times the GEMM form against the stream)
    if not (cfg and "BK" in cfg) and a1.shape[0] and b1.shape[1]:
        y = _stream_merge(*f, bs, gamma, mode, odt, c, cfg)
        if y is not None:
            return y
        cfg = None  # no stream tile fits: the GEMM's fixed tile
    return gemm(*f, bs, gamma, mode, odt, c, **launch_config(MERGE_FWD, cfg))


def merge_bwd(grad, up, down, gamma, cfg=None):
    """``lora_merge_bwd`` by one ``merge_bwd_pair_kernel`` launch (no partials, no reduction
    launches), at a smaller K step or fewer stages where the tile does not fit shared memory;
    ranks too large for any pair tile take ``skinny`` twice."""
    c = compute_dtype(up, down)
    g, u, d = prep(grad, c), prep(up, c), prep(down, c)
    r = up.shape[1]
    p = launch_config(MERGE_BWD, cfg)
    (O, I), dev = g.shape, g.device
    limit = smem_limit(dev)
    for bk, st in ((p["BK"], p["stages"]), (64, p["stages"]), (64, 2)):
        if pair_smem(p["BM"], bk, st, r, g.element_size()) <= limit:
            g_up = torch.empty((O, r), device=dev, dtype=up.dtype)
            g_down = torch.empty((r, I), device=dev, dtype=down.dtype)
            k = kernel(merge_bwd_pair_kernel, arch_of(dev), O, I, r, _tl(c), _tl(up.dtype), _tl(down.dtype),
                       p["BM"], bk, st, p["threads"])
            k(g, u, d, g_up, g_down, float(gamma))
            return g_up, g_down
    p = MERGE_BWD_SKINNY  # the tuned cfg, if any, was a pair tile
    g_up = skinny(g, d, r, False, True, False, gamma, up.dtype, c, K=g.shape[1], **p)     # γ·G·downᵀ (O, r)
    g_down = skinny(g, u, r, True, False, True, gamma, down.dtype, c, K=g.shape[0], **p)  # γ·(Gᵀ·up)ᵀ (r, I)
    return g_up, g_down


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (bypass_fwd_kernel, (45, 29, 5, d, d, d)),
        (bypass_fwd_kernel, (45, 29, 5, d, d, d, 64, 16, 64, 2, 128, True, 2)),  # O tiles in pipelined groups
        (bypass_fwd_kernel, (45, 29, 5, d, None, d, 64, 128, 64, 2, 128, True)),
        (bypass_bwd_tok_kernel, (45, 29, 5, d, d)),
        (bypass_bwd_tok_kernel, (45, 29, 5, d, d, 64, 64, 128, 2, None, True)),
        (skinny_kernel, (29, None, 16, 5, True, False, False, True, d, d)),
        (skinny_kernel, (45, 29, 5, 5, True, False, True, False, d, "float32")),
        (merge_bwd_pair_kernel, (45, 29, 5, d, d, d)),
        (merge_bwd_pair_kernel, (45, 29, 5, d, d, d, 64, 64, 3, 128)),
        (merge_stream_kernel, (45, 29, 5, 7, "sum", d, "float32", d)),
        (gemm_kernel, (29, 45, 5, 5, "hada", False, False, d, "float32", d)),
        (gemm_kernel, (None, 45, 5, None, "plain", False, True, d, None, d, 128, 128, 64, 2, 256)),
    ]
