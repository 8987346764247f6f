"""TileLang kernels of LoHa (docs/ops.md §2.2): ``loha_merge_bwd``, ``loha_bypass_fwd``,
``loha_bypass_bwd``. (The LoHa merge forward is ``lora_merge_fwd`` mode
``hada``: ``lora.gemm_kernel``; the tucker merge is ``tucker.py``.)

ΔW = (a1·b1) ⊙ (a2·b2) with a1, a2 (O, r) and b1, b2 (r, I); the rank is
padded to Rp (power of two >= 16, zero-filled lanes). Written from the math
and ``reference/loha.py`` (same rounding points):

``hada_apply_kernel`` - ``Y = γ·X·ΔWᵀ (+ base)`` (forward, ``trans=False``:
    X = x (T, I), Y (T, O)) or ``GX = γ·G·ΔW`` (backward, ``trans=True``:
    X = G (T, O), Y = gx (T, I)) without ΔW reaching memory. Program = (token
    tile, output tile); the factor rows of its output tile stay in shared
    memory, and each K step regenerates a ΔW tile: two ``T.gemm`` over the
    padded rank (fp32 fragments P1, P2), ``round(P1 ⊙ P2)`` to the compute
    dtype into shared memory (§1.3 rule 8), then the main ``T.gemm``.
    Regeneration costs ~2·Rp/BT of the main GEMM per token tile, so the host
    takes it only while ``(token tiles - 1)·Rp <= 160`` (small batches); above
    that ΔW is materialized once (``lora.gemm_kernel`` mode hada, compute
    dtype) and multiplied by a plain GEMM (``lora.gemm_kernel``).

``hada_grad_a_kernel`` / ``hada_grad_b_kernel`` - ``loha_merge_bwd``: the
    factor gradients ``g_a1 = E1·b1ᵀ``, ``g_a2 = E2·b2ᵀ`` (reduction over I,
    program = O tile) and ``g_b1 = a1ᵀ·E1``, ``g_b2 = a2ᵀ·E2`` (reduction over
    O, program = I tile), with ``E1 = round(γ·G ⊙ P2)``, ``E2 = round(γ·G ⊙ P1)``
    regenerated tile by tile in both kernels (never stored). The reduction
    is split over ``nsplit`` programs when the outputs alone do not fill the
    GPU (fp32 partials, one torch sum).

``hada_grad_pair_kernel`` - ``loha_merge_bwd`` in one launch (gradients of up to
    ``PAIR_MAX_ELEMS`` elements): the programs of both kernels above side by side, a BM-wide
    band each with its whole reduction (no split, no partials, direct stores).

``loha_bypass_bwd``: ``gx`` as above (``hada_apply_kernel`` with
``trans=True`` or the materialized GEMM); ``GW = round(Gᵀ·x)`` (O, I) by
``lora.gemm_kernel`` (A read transposed, dynamic K = T), then the two
``loha_merge_bwd`` kernels on GW.

A tuned config's ``vendor`` key (``backends/tilelang/tuning/loha.py``, as the Triton op set's
candidate of the same name): the T·O·I GEMMs (the forward's x·ΔWᵀ; the backward's gx and GW)
by torch's GEMM (cuBLAS), rounded as the eager body rounds them, ΔW and the factor gradients
still by the kernels above. The tuner times it against the TileLang GEMMs: at large shapes
cuBLAS's GEMMs can be the faster.

fp32 operands would run as TF32: fp32 calls are outside the TileLang scope of
these ops (``scope.py``). Operands are cast to the compute dtype and made
contiguous on the host when they are not already.
"""
import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, cdiv, kernel, launch_config, num_sms, smem_limit, tl_dtype, without_warp_specialization)
from lycoris_ops.backends.tilelang.kernels.lora import (_scaled_acc, _scopes, compute_dtype, dummy, fresh, gemm, pad_rank, prep)
from lycoris_ops.reference import gemm_epilogue, mm_rounded

__all__ = ["hada_apply_kernel", "hada_grad_a_kernel", "hada_grad_b_kernel", "hada_grad_pair_kernel",
           "bypass_fwd", "bypass_bwd", "merge_bwd", "compile_specs", "REGEN_BUDGET", "PAIR_MAX_ELEMS", "grads_fixed",
           "grads_pair_smem", "pair_form"]

_ACC = "float32"
#: regenerate ΔW inside the apply kernel while (token tiles - 1)·Rp stays below this
REGEN_BUDGET = 160
_BT = 64
#: the fixed launch configs (the tuner's ``{}`` candidate). A tuned ``cfg`` (backends/tilelang/tuning/loha.py:
#: ``TILELANG``) overrides: for the bypass ops, the tile of the large GEMM of the materialized
#: path (x·ΔWᵀ, G·ΔW); for ``loha_merge_bwd``, the gradient kernels' BO x BI tile
APPLY_GEMM = dict(BM=128, BN=128, BK=64, stages=2, threads=256)
GRADS = dict(BO=64, BI=64)
#: ``loha_merge_bwd`` runs ``hada_grad_pair_kernel`` (one launch) for gradients of at most this
#: many elements where a pair tile fits shared memory (``grads_pair_smem``), else the two split
#: jobs (``GRADS``): past it the two tie, and the pair's one kernel (twice a split job's code)
#: builds in twice the time of either split job (built side by side)
PAIR_MAX_ELEMS = 3072 * 3072
#: the pair kernel's fixed config: BM-wide bands, K steps of BK, pipeline depth (measured
#: faster than 64-wide bands, 128-wide steps or a third stage at the bench shapes)
GRADS_PAIR = dict(BM=32, BK=64, stages=2)


def _e_tiles(T, par, rows: int, cols: int, dt: str):
    """The gradient kernels' T.macro ``e_tiles(gs, p1, p2, e1s, e2s, gamma)``: ``E1 = round(γ·G⊙P2)``,
    ``E2 = round(γ·G⊙P1)`` over a (rows, cols) tile into shared memory (§1.3: rounded before
    their contractions)."""

    @T.macro
    def e_tiles(gs, p1, p2, e1s, e2s, gamma):
        for i, j in par(rows, cols):
            e1s[i, j] = T.cast(T.cast(gs[i, j], _ACC) * gamma * p2[i, j], dt)
            e2s[i, j] = T.cast(T.cast(gs[i, j], _ACC) * gamma * p1[i, j], dt)

    return e_tiles


def hada_apply_kernel(trans: bool, N: int, K: int, r: int, dt: str, bdt, odt: str,
                      BT: int = 64, BN: int = 64, BK: int = 64, stages: int = 2, threads: int = 128,
                      cpu: bool = False):
    """trans=False: ``Y (T, N) = γ·X (T, K)·ΔWᵀ (+ base)``, ΔW (N, K) from A (N, r), B (r, K).
    trans=True: ``Y (T, N) = γ·X (T, K)·ΔW``, ΔW (K, N) from A (K, r), B (r, N)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Rp = pad_rank(r)
    Tn = T.dynamic("T")
    scale = _scaled_acc(T, par, BT, BN, Tn, N)
    has_base = bdt is not None
    bshape = (Tn, N) if has_base else (1,)
    bdt = bdt or _ACC
    ashape = (K, r) if trans else (N, r)
    bfshape = (r, N) if trans else (r, K)
    atile = (BK, Rp) if trans else (BN, Rp)
    btile = (Rp, BN) if trans else (Rp, BK)
    ptile = (BK, BN) if trans else (BN, BK)

    @T.prim_func
    def hada_apply(X: T.Tensor((Tn, K), dt), A1: T.Tensor(ashape, dt), B1: T.Tensor(bfshape, dt),
                   A2: T.Tensor(ashape, dt), B2: T.Tensor(bfshape, dt), Base: T.Tensor(bshape, bdt),
                   Y: T.Tensor((Tn, N), odt), gamma: T.float32):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(Tn, BT), threads=nthreads(threads)) as (bn, bt):
            xs = shared((BT, BK), dt)
            a1s = shared(atile, dt)
            a2s = shared(atile, dt)
            b1s = shared(btile, dt)
            b2s = shared(btile, dt)
            dws = shared(ptile, dt)
            p1 = frag(ptile, _ACC)
            p2 = frag(ptile, _ACC)
            acc = frag((BT, BN), _ACC)
            t0 = bt * BT
            n0 = bn * BN
            if trans:
                T.copy(B1[0, n0], b1s)
                T.copy(B2[0, n0], b2s)
            else:
                T.copy(A1[n0, 0], a1s)
                T.copy(A2[n0, 0], a2s)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, BK), num_stages=stages):
                T.copy(X[t0, k * BK], xs)
                if trans:
                    T.copy(A1[k * BK, 0], a1s)
                    T.copy(A2[k * BK, 0], a2s)
                else:
                    T.copy(B1[0, k * BK], b1s)
                    T.copy(B2[0, k * BK], b2s)
                T.gemm(a1s, b1s, p1, clear_accum=True)
                T.gemm(a2s, b2s, p2, clear_accum=True)
                for i, j in par(ptile[0], ptile[1]):
                    dws[i, j] = T.cast(p1[i, j] * p2[i, j], dt)  # the ΔW tile, rounded
                T.gemm(xs, dws, acc, transpose_B=not trans)
            scale(acc, gamma, Base if has_base else None, t0, n0)
            T.copy(acc, Y[t0, n0])

    return hada_apply


def hada_grad_a_kernel(O: int, I: int, r: int, dt: str, o1: str, o2: str, direct: bool,
                       BO: int = 64, BI: int = 64, stages: int = 1, threads=None, cpu: bool = False):
    """``g_a1 = E1·b1ᵀ``, ``g_a2 = E2·b2ᵀ`` (O, r). Program = (O tile, split of the I tiles).
    direct: Out1/Out2 (O, r) in o1/o2; else fp32 partials (nsplit·Op, Rp), Op = O rounded up to BO."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    e_tiles = _e_tiles(T, par, BO, BI, dt)
    Rp = pad_rank(r)
    threads = threads or (256 if Rp >= 128 else 128)  # two (BO, Rp) fp32 accumulators + P tiles
    Op = cdiv(O, BO) * BO
    oshape = (O, r) if direct else (T.dynamic("P"), Rp)
    o1 = o1 if direct else _ACC
    o2 = o2 if direct else _ACC

    @T.prim_func
    def hada_grad_a(Gr: T.Tensor((O, I), dt), A1: T.Tensor((O, r), dt), B1: T.Tensor((r, I), dt),
                    A2: T.Tensor((O, r), dt), B2: T.Tensor((r, I), dt),
                    Out1: T.Tensor(oshape, o1), Out2: T.Tensor(oshape, o2), gamma: T.float32,
                    kper: T.int32, nsplit: T.int32):
        with T.Kernel(T.ceildiv(O, BO), nsplit, threads=nthreads(threads)) as (bo, s):
            gs = shared((BO, BI), dt)
            a1s = shared((BO, Rp), dt)
            a2s = shared((BO, Rp), dt)
            b1s = shared((Rp, BI), dt)
            b2s = shared((Rp, BI), dt)
            e1s = shared((BO, BI), dt)
            e2s = shared((BO, BI), dt)
            p1 = frag((BO, BI), _ACC)
            p2 = frag((BO, BI), _ACC)
            g1 = frag((BO, Rp), _ACC)
            g2 = frag((BO, Rp), _ACC)
            o0 = bo * BO
            T.copy(A1[o0, 0], a1s)
            T.copy(A2[o0, 0], a2s)
            T.clear(g1)
            T.clear(g2)
            for kk in T.Pipelined(kper, num_stages=stages):
                i0 = (s * kper + kk) * BI
                T.copy(Gr[o0, i0], gs)
                T.copy(B1[0, i0], b1s)
                T.copy(B2[0, i0], b2s)
                T.gemm(a1s, b1s, p1, clear_accum=True)
                T.gemm(a2s, b2s, p2, clear_accum=True)
                e_tiles(gs, p1, p2, e1s, e2s, gamma)  # E1 = round(γ·G⊙P2), E2 = round(γ·G⊙P1)
                T.gemm(e1s, b1s, g1, transpose_B=True)
                T.gemm(e2s, b2s, g2, transpose_B=True)
            if direct:
                T.copy(g1, Out1[o0, 0])
                T.copy(g2, Out2[o0, 0])
            else:
                T.copy(g1, Out1[s * Op + o0, 0])
                T.copy(g2, Out2[s * Op + o0, 0])

    # without warp specialization: measured faster (several programs an SM)
    return hada_grad_a if cpu else without_warp_specialization(hada_grad_a)


def hada_grad_b_kernel(O: int, I: int, r: int, dt: str, o1: str, o2: str, direct: bool,
                       BO: int = 64, BI: int = 64, stages: int = 1, threads=None, cpu: bool = False):
    """``g_b1 = a1ᵀ·E1``, ``g_b2 = a2ᵀ·E2`` (r, I). Program = (I tile, split of the O tiles).
    direct: Out1/Out2 (r, I); else fp32 partials (nsplit·Rp, Ip), Ip = I rounded up to BI."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    e_tiles = _e_tiles(T, par, BO, BI, dt)
    Rp = pad_rank(r)
    threads = threads or (256 if Rp >= 128 else 128)
    Ip = cdiv(I, BI) * BI
    oshape = (r, I) if direct else (T.dynamic("P"), Ip)
    o1 = o1 if direct else _ACC
    o2 = o2 if direct else _ACC

    @T.prim_func
    def hada_grad_b(Gr: T.Tensor((O, I), dt), A1: T.Tensor((O, r), dt), B1: T.Tensor((r, I), dt),
                    A2: T.Tensor((O, r), dt), B2: T.Tensor((r, I), dt),
                    Out1: T.Tensor(oshape, o1), Out2: T.Tensor(oshape, o2), gamma: T.float32,
                    kper: T.int32, nsplit: T.int32):
        with T.Kernel(T.ceildiv(I, BI), nsplit, threads=nthreads(threads)) as (bi, s):
            gs = shared((BO, BI), dt)
            a1s = shared((BO, Rp), dt)
            a2s = shared((BO, Rp), dt)
            b1s = shared((Rp, BI), dt)
            b2s = shared((Rp, BI), dt)
            e1s = shared((BO, BI), dt)
            e2s = shared((BO, BI), dt)
            p1 = frag((BO, BI), _ACC)
            p2 = frag((BO, BI), _ACC)
            g1 = frag((Rp, BI), _ACC)
            g2 = frag((Rp, BI), _ACC)
            i0 = bi * BI
            T.copy(B1[0, i0], b1s)
            T.copy(B2[0, i0], b2s)
            T.clear(g1)
            T.clear(g2)
            for kk in T.Pipelined(kper, num_stages=stages):
                o0 = (s * kper + kk) * BO
                T.copy(Gr[o0, i0], gs)
                T.copy(A1[o0, 0], a1s)
                T.copy(A2[o0, 0], a2s)
                T.gemm(a1s, b1s, p1, clear_accum=True)
                T.gemm(a2s, b2s, p2, clear_accum=True)
                e_tiles(gs, p1, p2, e1s, e2s, gamma)  # E1 = round(γ·G⊙P2), E2 = round(γ·G⊙P1)
                T.gemm(a1s, e1s, g1, transpose_A=True)
                T.gemm(a2s, e2s, g2, transpose_A=True)
            if direct:
                T.copy(g1, Out1[0, i0])
                T.copy(g2, Out2[0, i0])
            else:
                T.copy(g1, Out1[s * Rp, i0])
                T.copy(g2, Out2[s * Rp, i0])

    # without warp specialization: measured faster (several programs an SM)
    return hada_grad_b if cpu else without_warp_specialization(hada_grad_b)


def hada_grad_pair_kernel(O: int, I: int, r: int, dt: str, oa1: str, ob1: str, oa2: str, ob2: str,
                          BM: int = 64, stages: int = 2, BK=None, threads=None, cpu: bool = False):
    """``loha_merge_bwd`` in ONE launch: programs [0, ⌈O/BM⌉) are ``hada_grad_a``'s (one BM-row
    band of g_a1, g_a2, the whole reduction over I), programs [⌈O/BM⌉, ⌈O/BM⌉ + ⌈I/BM⌉) are
    ``hada_grad_b``'s (one BM-column band of g_b1, g_b2, the whole reduction over O); K steps
    of BK (None: BM). No split, so no fp32 partials, no torch sum and no cast launches after it
    (the two split jobs: up to six launches); G is read twice, in one launch.

    A program's time is its serial chain of K steps (P = A·B, E = γ·G⊙P, then E·Bᵀ), so a K step
    wider than the band halves the chain at BK = 2·BM. The two branches then tile G as (BM, BK)
    and (BK, BM): separate G, P and E tiles (with BK = BM they share them)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    BK = BK or BM
    e_tiles_a = _e_tiles(T, par, BM, BK, dt)
    e_tiles_b = _e_tiles(T, par, BK, BM, dt) if BK != BM else e_tiles_a
    Rp = pad_rank(r)
    threads = threads or (256 if Rp >= 128 else 128)
    ma, mb = cdiv(O, BM), cdiv(I, BM)

    @T.prim_func
    def hada_grad_pair(Gr: T.Tensor((O, I), dt), A1: T.Tensor((O, r), dt), B1: T.Tensor((r, I), dt),
                       A2: T.Tensor((O, r), dt), B2: T.Tensor((r, I), dt),
                       GA1: T.Tensor((O, r), oa1), GB1: T.Tensor((r, I), ob1),
                       GA2: T.Tensor((O, r), oa2), GB2: T.Tensor((r, I), ob2), gamma: T.float32):
        with T.Kernel(ma + mb, threads=nthreads(threads)) as b:
            gs = shared((BM, BK), dt)    # G[m0 : m0+BM, k0 : k0+BK] (a)
            gt = shared((BK, BM), dt) if BK != BM else gs  # G[k0 : k0+BK, m0 : m0+BM] (b)
            # a fixed tile cannot share a buffer with a stepped one (the pipeline multi-buffers
            # the stepped ones): a's fixed A rows and stepped B columns, b's fixed B and stepped A
            a1f = shared((BM, Rp), dt)
            a2f = shared((BM, Rp), dt)
            b1k = shared((Rp, BK), dt)
            b2k = shared((Rp, BK), dt)
            b1f = shared((Rp, BM), dt)
            b2f = shared((Rp, BM), dt)
            a1k = shared((BK, Rp), dt)
            a2k = shared((BK, Rp), dt)
            e1s = shared((BM, BK), dt)
            e2s = shared((BM, BK), dt)
            e1t = shared((BK, BM), dt) if BK != BM else e1s
            e2t = shared((BK, BM), dt) if BK != BM else e2s
            p1 = frag((BM, BK), _ACC)
            p2 = frag((BM, BK), _ACC)
            p1t = frag((BK, BM), _ACC) if BK != BM else p1
            p2t = frag((BK, BM), _ACC) if BK != BM else p2
            ga1 = frag((BM, Rp), _ACC)
            ga2 = frag((BM, Rp), _ACC)
            gb1 = frag((Rp, BM), _ACC)
            gb2 = frag((Rp, BM), _ACC)
            if b < ma:
                o0 = b * BM
                T.copy(A1[o0, 0], a1f)
                T.copy(A2[o0, 0], a2f)
                T.clear(ga1)
                T.clear(ga2)
                for k in T.Pipelined(T.ceildiv(I, BK), num_stages=stages):
                    T.copy(Gr[o0, k * BK], gs)
                    T.copy(B1[0, k * BK], b1k)
                    T.copy(B2[0, k * BK], b2k)
                    T.gemm(a1f, b1k, p1, clear_accum=True)
                    T.gemm(a2f, b2k, p2, clear_accum=True)
                    e_tiles_a(gs, p1, p2, e1s, e2s, gamma)  # E1 = round(γ·G⊙P2), E2 = round(γ·G⊙P1)
                    T.gemm(e1s, b1k, ga1, transpose_B=True)
                    T.gemm(e2s, b2k, ga2, transpose_B=True)
                T.copy(ga1, GA1[o0, 0])
                T.copy(ga2, GA2[o0, 0])
            else:
                i0 = (b - ma) * BM
                T.copy(B1[0, i0], b1f)
                T.copy(B2[0, i0], b2f)
                T.clear(gb1)
                T.clear(gb2)
                for k in T.Pipelined(T.ceildiv(O, BK), num_stages=stages):
                    T.copy(Gr[k * BK, i0], gt)
                    T.copy(A1[k * BK, 0], a1k)
                    T.copy(A2[k * BK, 0], a2k)
                    T.gemm(a1k, b1f, p1t, clear_accum=True)
                    T.gemm(a2k, b2f, p2t, clear_accum=True)
                    e_tiles_b(gt, p1t, p2t, e1t, e2t, gamma)  # E1 = round(γ·G⊙P2), E2 = round(γ·G⊙P1)
                    T.gemm(a1k, e1t, gb1, transpose_A=True)
                    T.gemm(a2k, e2t, gb2, transpose_A=True)
                T.copy(gb1, GB1[0, i0])
                T.copy(gb2, GB2[0, i0])

    return hada_grad_pair if cpu else without_warp_specialization(hada_grad_pair)


# --------------------------------------------------------------------------- launchers

def _split(tiles: int, other: int, device) -> tuple:
    """(nsplit, tiles per split) so that other·nsplit programs fill the GPU about twice."""
    want = max(1, cdiv(2 * num_sms(device), max(other, 1)))
    ns = max(1, min(want, tiles))
    per = cdiv(tiles, ns)
    return cdiv(tiles, per), per


def _regen(T_: int, r: int) -> bool:
    return (cdiv(T_, _BT) - 1) * pad_rank(r) <= REGEN_BUDGET


def _apply(trans, x, f, base, gamma, odt, c, N):
    """hada_apply_kernel launch: x (T, K) prepared, f = (a1, b1, a2, b2) prepared."""
    T_, K = x.shape
    r = f[0].shape[1]
    dev = x.device
    y = torch.empty((T_, N), device=dev, dtype=odt)
    k = kernel(hada_apply_kernel, arch_of(dev), trans, N, K, r, tl_dtype(c),
               None if base is None else tl_dtype(base.dtype), tl_dtype(odt))
    k(x, *f, dummy(dev, torch.float32) if base is None else base, y, float(gamma))
    return y


def _tiles(cf: dict) -> dict:
    """The GEMM tile keys of a launch config (``vendor`` is not one)."""
    return {k: v for k, v in cf.items() if k != "vendor"}


def _delta(f, c):
    """ΔW = round((a1·b1) ⊙ (a2·b2)) (O, I) in the compute dtype (the materialized path)."""
    return gemm(f[0], f[1], f[2], f[3], None, 1.0, "hada", c, c)


def bypass_fwd(x, a1, b1, a2, b2, gamma, base=None, cfg=None):
    c = compute_dtype(x, a1, b1, a2, b2)
    odt = x.dtype if base is None else base.dtype
    f = tuple(prep(t, c) for t in (a1, b1, a2, b2))
    xc = prep(x, c)
    bs = None if base is None else aligned(base.contiguous())
    cf = launch_config(APPLY_GEMM, cfg)
    if cf.get("vendor") and x.shape[0]:
        return gemm_epilogue(xc, _delta(f, c).t(), odt, gamma, bs, base_in_place=True).contiguous()
    if _regen(x.shape[0], a1.shape[1]):
        return _apply(False, xc, f, bs, gamma, odt, c, a1.shape[0])
    return gemm(xc, _delta(f, c), None, None, bs, gamma, "plain", odt, c, b_nk=True, dyn_m=True, **_tiles(cf))


def pair_form(O: int, I: int) -> bool:
    """Whether ``loha_merge_bwd`` on an (O, I) gradient takes the pair kernel (``PAIR_MAX_ELEMS``)."""
    return O * I <= PAIR_MAX_ELEMS


def grads_fixed(O: int, I: int) -> dict:
    """``merge_bwd``'s fixed config for the form an (O, I) gradient takes (the tuner's untimed pick)."""
    return GRADS_PAIR if pair_form(O, I) else GRADS


def grads_pair_smem(BM: int, stages: int, r: int, esize: int, BK=None) -> int:
    """Shared-memory bytes of ``hada_grad_pair_kernel`` (measured on the sm_90a builds): each
    branch's fixed factor rows (4 BM×Rp tiles), E1 and E2, and per stage the G tile with both
    branches' stepped factor tiles (TileLang does not overlap the two branches). With a K step
    BK ≠ BM each branch has its own E and G tiles."""
    Rp = pad_rank(r)
    BK = BK or BM
    tiles = 1 if BK == BM else 2
    return esize * (4 * BM * Rp + tiles * 2 * BM * BK + stages * (tiles * BM * BK + 4 * BK * Rp))


def _grads(gw, f, gamma, dtypes, c, cfg=None):
    """loha_merge_bwd on prepared operands: gw (O, I), f = (a1, b1, a2, b2); ``cfg`` a tuned
    config of the form this gradient takes (None: ``grads_fixed(O, I)``)."""
    O, I = gw.shape
    r = f[0].shape[1]
    dev = gw.device
    arch = arch_of(dev)
    dt = tl_dtype(c)
    if pair_form(O, I):
        p = launch_config(GRADS_PAIR, cfg)
        limit = smem_limit(dev)
        bk = p.get("BK") if p.get("BK", p["BM"]) != p["BM"] else None  # BK = BM: the key without it
        for st in range(p["stages"], 0, -1):
            if grads_pair_smem(p["BM"], st, r, gw.element_size(), bk) <= limit:
                outs = tuple(torch.empty(t.shape, device=dev, dtype=d) for t, d in zip(f, dtypes))
                k = kernel(hada_grad_pair_kernel, arch, O, I, r, dt, *(tl_dtype(d) for d in dtypes), p["BM"], st,
                           *((bk,) if bk else ()))
                k(gw, *f, *outs, float(gamma))
                return outs
        cfg = None  # no pair tile fits (the tuned cfg was one): the split jobs' fixed tile
    q = launch_config(GRADS, cfg)
    BO, BI = q["BO"], q["BI"]
    Rp = pad_rank(r)
    # g_a1, g_a2: reduction over I
    ns, per = _split(cdiv(I, BI), cdiv(O, BO), dev)
    if ns == 1:
        ga = [torch.empty((O, r), device=dev, dtype=dtypes[0]), torch.empty((O, r), device=dev, dtype=dtypes[2])]
        k = kernel(hada_grad_a_kernel, arch, O, I, r, dt, tl_dtype(dtypes[0]), tl_dtype(dtypes[2]), True, BO, BI)
        k(gw, *f, ga[0], ga[1], float(gamma), per, 1)
    else:
        Op = cdiv(O, BO) * BO
        pa = torch.empty((2, ns * Op, Rp), device=dev, dtype=torch.float32)
        k = kernel(hada_grad_a_kernel, arch, O, I, r, dt, "float32", "float32", False, BO, BI)
        k(gw, *f, pa[0], pa[1], float(gamma), per, ns)
        s = pa.view(2, ns, Op, Rp).sum(1)[:, :O, :r]
        ga = [fresh(s[0], dtypes[0]),
              fresh(s[1], dtypes[2])]
    # g_b1, g_b2: reduction over O
    ns, per = _split(cdiv(O, BO), cdiv(I, BI), dev)
    if ns == 1:
        gb = [torch.empty((r, I), device=dev, dtype=dtypes[1]), torch.empty((r, I), device=dev, dtype=dtypes[3])]
        k = kernel(hada_grad_b_kernel, arch, O, I, r, dt, tl_dtype(dtypes[1]), tl_dtype(dtypes[3]), True, BO, BI)
        k(gw, *f, gb[0], gb[1], float(gamma), per, 1)
    else:
        Ip = cdiv(I, BI) * BI
        pb = torch.empty((2, ns * Rp, Ip), device=dev, dtype=torch.float32)
        k = kernel(hada_grad_b_kernel, arch, O, I, r, dt, "float32", "float32", False, BO, BI)
        k(gw, *f, pb[0], pb[1], float(gamma), per, ns)
        s = pb.view(2, ns, Rp, Ip).sum(1)[:, :r, :I]
        gb = [fresh(s[0], dtypes[1]),
              fresh(s[1], dtypes[3])]
    return ga[0], gb[0], ga[1], gb[1]


def merge_bwd(grad, a1, b1, a2, b2, gamma, cfg=None):
    c = compute_dtype(a1, b1, a2, b2)
    f = tuple(prep(t, c) for t in (a1, b1, a2, b2))
    return _grads(prep(grad, c), f, gamma, tuple(t.dtype for t in (a1, b1, a2, b2)), c, cfg)


def bypass_bwd(grad, x, a1, b1, a2, b2, gamma, cfg=None):
    c = compute_dtype(x, a1, b1, a2, b2)
    f = tuple(prep(t, c) for t in (a1, b1, a2, b2))
    g, xc = prep(grad, c), prep(x, c)
    I = x.shape[1]
    cf = launch_config(APPLY_GEMM, cfg)
    if cf.get("vendor") and x.shape[0]:
        gx = gemm_epilogue(g, _delta(f, c), x.dtype, gamma).contiguous()
        gw = mm_rounded(g.t(), xc, c)  # round(Gᵀ·x) (O, I)
        return (gx,) + _grads(gw, f, gamma, tuple(t.dtype for t in (a1, b1, a2, b2)), c)
    if _regen(x.shape[0], a1.shape[1]):
        gx = _apply(True, g, f, None, gamma, x.dtype, c, I)
    else:
        gx = gemm(g, _delta(f, c), None, None, None, gamma, "plain", x.dtype, c, dyn_m=True, **_tiles(cf))
    gw = gemm(g, xc, None, None, None, 1.0, "plain", c, c, a_km=True, dyn_k=True)  # round(Gᵀ·x) (O, I)
    return (gx,) + _grads(gw, f, gamma, tuple(t.dtype for t in (a1, b1, a2, b2)), c)


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (hada_apply_kernel, (False, 29, 45, 5, d, d, d)),
        (hada_apply_kernel, (True, 45, 29, 5, d, None, d)),
        (hada_grad_a_kernel, (29, 45, 5, d, d, d, True)),
        (hada_grad_b_kernel, (29, 45, 5, d, "float32", "float32", False)),
        (hada_grad_pair_kernel, (29, 45, 5, d, d, "float32", d, d)),
        (hada_grad_pair_kernel, (29, 45, 5, d, d, d, d, d, 32, 2, 64)),  # K steps wider than the band
    ]
