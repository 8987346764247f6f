"""TileLang kernels of the tucker rebuild (docs/ops.md §2.1.5): ``lora_tucker_fwd``.

``C[o, i, κ] = Σ_q round(Σ_p a[o,p]·t[p,q,κ])·b[q,i]``; ``Y = γ·C1`` or, with
the second chain, ``Y = (γ·C1)⊙C2``. Written from the math and
``reference/lora.py`` (the partial product a·t is rounded to the compute
dtype before ·b, fp32 accumulation, one rounding at the store).

``tucker_pre_kernel`` - where its staged output tile fits (``all_k_fits``): a·t precomputed
    for every κ by one torch matmul, then program = (I tile, O tile) computing every κ of
    its tile, one product a κ, the (BO, BI·Kk) output tile staged in shared memory and stored
    as whole rows (a per-κ program stores every Kk-th element: a 32-byte sector written per
    2-byte element). Measured several times faster than the per-κ kernel.
``tucker_kernel`` - elsewhere: program = (κ, I tile, O tile), κ fastest so the programs
    writing the interleaved κ columns of one (O, I) tile run together. Per
    chain: ``T.gemm`` of the a rows (BO x Rap) with the core slice t[:, :, κ]
    (host-permuted to (Kk, R, R') so the slice is a compact tile) into an fp32
    fragment, rounded into shared memory, then ``T.gemm`` with the b columns
    (Rbp x BI). Output (O, I, Kk) in a1's dtype, stored with the κ stride.

The ranks are padded to powers of two >= 16 (zero-filled; the scope caps them at 64).
fp32 operands would run as TF32: fp32 calls step down (``scope.py``).
Operands are cast to the compute dtype and made contiguous on the host
(a transposed a1, as LoHa passes it, is copied).
"""
import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, kernel, launch_config, tl_dtype, without_warp_specialization)
from lycoris_ops.backends.tilelang.kernels.lora import _scopes, compute_dtype, pad_rank, prep

__all__ = ["tucker_kernel", "tucker_pre_kernel", "tucker_fwd", "compile_specs"]

_ACC = "float32"
#: the fixed launch config (the tuner's ``{}`` candidate); a tuned ``cfg`` (backends/tilelang/tuning/tucker.py:
#: ``TILELANG``) overrides the output tile (BO x BI) and the threads
TUCKER = dict(BO=64, BI=64, threads=128)
#: the all-κ kernel's shared-memory budget: sm_80's 163 KB block, with a margin
_ALL_K_SMEM = 160 * 1024


def all_k_fits(BO: int, BI: int, Kk: int, pa: int, pb: int, chains: int, e: int, eo: int) -> bool:
    """Whether the all-κ kernel's shared memory (per chain the a, t, a·t and b tiles; the
    staged output tile) fits ``_ALL_K_SMEM`` (sm_80's 163 KB block, with a margin)."""
    return chains * (BO * pa + pa * pb + BO * pb + pb * BI) * e + BO * BI * Kk * eo <= _ALL_K_SMEM


def _store_rows(T, par, BO: int, W: int, O: int, IK: int):
    """The all-κ programs' T.macro ``store(ys, Y, o0, col0)``: the staged (BO, W) output tile
    to Y (O, IK) at row o0, column col0, as whole rows (W consecutive elements of Y a row)."""

    @T.macro
    def store(ys, Y, o0, col0):
        for i, j in par(BO, W):
            if o0 + i < O and col0 + j < IK:
                Y[o0 + i, col0 + j] = ys[i, j]

    return store


def tucker_kernel(O: int, I: int, Kk: int, R1a: int, R1b: int, R2a, R2b, dt: str, odt: str,
                  BO: int = 64, BI: int = 64, threads: int = 128, cpu: bool = False):
    """One chain (R2a None) or the hadamard of two. A (O, Ra), Tc (Kk, Ra, Rb), B (Rb, I).
    Grid (κ, I tile, O tile), Y (O, I, Kk)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    two = R2a is not None
    P1a, P1b = pad_rank(R1a), pad_rank(R1b)
    P2a, P2b = (pad_rank(R2a), pad_rank(R2b)) if two else (16, 16)
    s2a = (O, R2a) if two else (1,)
    s2t = (Kk, R2a, R2b) if two else (1,)
    s2b = (R2b, I) if two else (1,)
    KG, KL = Kk, 1  # κ: grid extent, then loop extent in a program

    @T.macro
    def chain(Tc, a_s, t_s, at_s, b_s, f, c, k, pa, pb):
        T.copy(Tc[k, 0:pa, 0:pb], t_s)
        # a·t is BO x (rank <= 64): warps split its rows only (FullRow); with 256 threads the
        # default split halves a 16-wide rank, a B layout sm_90's wgmma rejects
        T.gemm(a_s, t_s, f, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        T.copy(f, at_s)  # a·t rounded to the compute dtype
        T.gemm(at_s, b_s, c, clear_accum=True)

    @T.prim_func
    def tucker(A1: T.Tensor((O, R1a), dt), T1: T.Tensor((Kk, R1a, R1b), dt), B1: T.Tensor((R1b, I), dt),
               A2: T.Tensor(s2a, dt), T2: T.Tensor(s2t, dt), B2: T.Tensor(s2b, dt),
               Y: T.Tensor((O, I, Kk), odt), gamma: T.float32):
        with T.Kernel(KG, T.ceildiv(I, BI), T.ceildiv(O, BO), threads=nthreads(threads)) as (kg, bi, bo):
            a1s = shared((BO, P1a), dt)
            t1s = shared((P1a, P1b), dt)
            at1 = shared((BO, P1b), dt)
            b1s = shared((P1b, BI), dt)
            f1 = frag((BO, P1b), _ACC)
            c1 = frag((BO, BI), _ACC)
            if two:
                a2s = shared((BO, P2a), dt)
                t2s = shared((P2a, P2b), dt)
                at2 = shared((BO, P2b), dt)
                b2s = shared((P2b, BI), dt)
                f2 = frag((BO, P2b), _ACC)
                c2 = frag((BO, BI), _ACC)
            o0 = bo * BO
            i0 = bi * BI
            T.copy(A1[o0, 0], a1s)  # the a rows and b columns of the tile
            T.copy(B1[0, i0], b1s)
            if two:
                T.copy(A2[o0, 0], a2s)
                T.copy(B2[0, i0], b2s)
            for kl in T.serial(KL):
                k = kg + kl  # kl is 0
                chain(T1, a1s, t1s, at1, b1s, f1, c1, k, P1a, P1b)
                if two:
                    chain(T2, a2s, t2s, at2, b2s, f2, c2, k, P2a, P2b)
                for i, j in par(BO, BI):
                    v = c1[i, j] * gamma * c2[i, j] if two else c1[i, j] * gamma
                    if o0 + i < O and i0 + j < I:
                        Y[o0 + i, i0 + j, k] = T.cast(v, odt)

    return tucker


def tucker_pre_kernel(O: int, I: int, Kk: int, R1b: int, R2b, dt: str, odt: str,
                      BO: int = 64, BI: int = 64, threads: int = 128, cpu: bool = False):
    """The all-κ program over a·t precomputed: AT (Kk, O, Rb) = round(a·t[:, :, κ])
    per chain, B (Rb, I); Y (O, I·Kk) = γ·AT1[κ]·B1 (⊙ AT2[κ]·B2). Grid (I tile, O tile); the
    κ loop pipelined (the next AT tiles load during this κ's product), one product a κ and
    chain, the (BO, BI·Kk) output tile staged in shared memory and stored as whole rows.
    Compiled without warp specialization (several programs an SM)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    two = R2b is not None
    P1b = pad_rank(R1b)
    P2b = pad_rank(R2b) if two else 16
    s2at = (Kk, O, R2b) if two else (1,)
    s2b = (R2b, I) if two else (1,)
    W = BI * Kk
    store_rows = _store_rows(T, par, BO, W, O, I * Kk)

    @T.prim_func
    def tucker_pre(AT1: T.Tensor((Kk, O, R1b), dt), B1: T.Tensor((R1b, I), dt), AT2: T.Tensor(s2at, dt),
                   B2: T.Tensor(s2b, dt), Y: T.Tensor((O, I * Kk), odt), gamma: T.float32):
        with T.Kernel(T.ceildiv(I, BI), T.ceildiv(O, BO), threads=nthreads(threads)) as (bi, bo):
            at1 = shared((BO, P1b), dt)
            b1s = shared((P1b, BI), dt)
            c1 = frag((BO, BI), _ACC)
            if two:
                at2 = shared((BO, P2b), dt)
                b2s = shared((P2b, BI), dt)
                c2 = frag((BO, BI), _ACC)
            ys = shared((BO, W), odt)
            o0 = bo * BO
            i0 = bi * BI
            T.copy(B1[0:P1b, i0:i0 + BI], b1s)
            if two:
                T.copy(B2[0:P2b, i0:i0 + BI], b2s)
            for k in T.Pipelined(Kk, num_stages=2):
                T.copy(AT1[k, o0:o0 + BO, 0:P1b], at1)
                T.gemm(at1, b1s, c1, clear_accum=True)
                if two:
                    T.copy(AT2[k, o0:o0 + BO, 0:P2b], at2)
                    T.gemm(at2, b2s, c2, clear_accum=True)
                for i, j in par(BO, BI):
                    ys[i, j * Kk + k] = T.cast(c1[i, j] * gamma * c2[i, j] if two else c1[i, j] * gamma, odt)
            store_rows(ys, Y, o0, i0 * Kk)

    return tucker_pre if cpu else without_warp_specialization(tucker_pre)


def _at(a, t, c):
    """round(a·t[:, :, κ]) for every κ as (Kk, O, Rb), in the compute dtype ``c`` (one fp32-
    accumulated product, rounded once, as the reference's partial product)."""
    Ra, Rb, Kk = t.shape
    at = torch.matmul(prep(a, c), prep(t, c).view(Ra, Rb * Kk))  # (O, Rb·Kk), κ fastest
    return aligned(at.view(-1, Rb, Kk).permute(2, 0, 1).contiguous())


def tucker_fwd(a1, t1, b1, a2, t2, b2, gamma, cfg=None):
    p = launch_config(TUCKER, cfg)
    c = compute_dtype(a1, t1, b1, a2, t2, b2)
    O, R1a = a1.shape
    R1b, I = b1.shape
    Kk = t1.shape[2]
    dev = a1.device
    y = torch.empty((O, I, Kk), device=dev, dtype=a1.dtype)
    two = a2 is not None
    R2a, R2b = (t2.shape[0], t2.shape[1]) if two else (None, None)
    ranks = (R1a, R1b) + ((R2a, R2b) if two else ())
    all_k = all_k_fits(p["BO"], p["BI"], Kk, max(pad_rank(r) for r in ranks[0::2]),
                       max(pad_rank(r) for r in ranks[1::2]), 2 if two else 1, c.itemsize, y.element_size())
    z = None if two else torch.zeros(1, device=dev, dtype=c)  # the absent chain's operands
    if all_k:
        k = kernel(tucker_pre_kernel, arch_of(dev), O, I, Kk, R1b, R2b, tl_dtype(c), tl_dtype(a1.dtype), p["BO"],
                   p["BI"], p["threads"])
        second = (_at(a2, t2, c), prep(b2, c)) if two else (z, z)
        k(_at(a1, t1, c), prep(b1, c), *second, y.view(O, I * Kk), float(gamma))
        return y
    args = [prep(a1, c), prep(t1.permute(2, 0, 1), c), prep(b1, c)]
    args += [prep(a2, c), prep(t2.permute(2, 0, 1), c), prep(b2, c)] if two else [z, z, z]
    k = kernel(tucker_kernel, arch_of(dev), O, I, Kk, R1a, R1b, R2a, R2b, tl_dtype(c), tl_dtype(a1.dtype), p["BO"],
               p["BI"], p["threads"])
    k(*args, y, float(gamma))
    return y


def compile_specs(dtype: torch.dtype):
    """(builder, args) of the kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [(tucker_kernel, (13, 7, 9, 4, 4, 3, 3, d, d)),
            (tucker_kernel, (13, 7, 9, 4, 4, None, None, d, d)),
            (tucker_pre_kernel, (13, 7, 9, 4, 3, d, d)),
            (tucker_pre_kernel, (13, 7, 9, 4, None, d, d))]
