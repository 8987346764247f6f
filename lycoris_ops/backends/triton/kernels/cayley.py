"""In-register Cayley transform helpers shared by the diag-OFT and BOFT kernels.

For a raw block B (S×S) and a constraint factor ``cscale``:
``Q = cscale·(B − Bᵀ)`` (skew-symmetric), ``M = (I − Q)⁻¹`` and
``R = (I + Q)·M = 2M − I`` (because ``I + Q = 2I − (I − Q)``).

``I − Q`` has symmetric part ``I`` (positive definite), so Gauss–Jordan
elimination without pivoting is stable and never meets a zero pivot. The
helpers work on a *batch* of blocks held in registers as a 3-D tensor
``(NB, SP, SP)`` (SP = S padded to a power of two, padded rows/columns hold the
identity), so the elimination takes SP sequential steps whatever the number of
blocks a program owns; ``block_diag`` then lays the batch out as one
``(NB·SP, NB·SP)`` block-diagonal matrix for ``tl.dot``.

Everything is fp32. Nothing here is written to memory.

Gradient of the map (docs/ops.md §2.5): ``dR = (I + R)·dQ·M = 2·M·dQ·M``, so
``gQ = 2·Mᵀ·gR·Mᵀ`` and ``gB = cscale·(gQ − gQᵀ)`` (``cayley_grad``).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["skew_q", "skew_system", "batched_inverse", "block_diag", "cayley_grad", "neumann_inverse", "cayley_m"]


@triton.jit
def skew_q(b, bt, cscale, valid):
    """``Q = cscale·(B − Bᵀ)`` of a batch (NB, SP, SP), 0 outside ``valid``.

    ``b`` holds B[n, p, q] and ``bt`` holds B[n, q, p] (both fp32, 0 where
    masked); ``valid`` (NB, SP, SP) marks the real entries."""
    return tl.where(valid, cscale * (b - bt), 0.0)


@triton.jit
def skew_system(b, bt, cscale, valid, NB: tl.constexpr, SP: tl.constexpr):
    """``A = I − Q`` of a batch (NB, SP, SP) (``skew_q``). Padding becomes the identity,
    so the padded system stays invertible and its inverse is I there."""
    p = tl.arange(0, SP)
    eye = (p[:, None] == p[None, :])[None, :, :]
    return tl.where(eye, 1.0, 0.0) - skew_q(b, bt, cscale, valid)


@triton.jit
def batched_inverse(a, n, NB: tl.constexpr, SP: tl.constexpr):
    """Inverse of each (SP, SP) matrix of ``a`` (NB, SP, SP) by Gauss–Jordan
    without pivoting (valid for ``I − Q``, Q skew). ``n`` (<= SP) sequential steps: rows
    and columns n.. of ``a`` are the identity's (the padding of an n×n block), where a step
    changes nothing; the row/column extractions are masked reductions inside each block."""
    p = tl.arange(0, SP)
    r3 = p[None, :, None]
    c3 = p[None, None, :]
    inv = tl.where(r3 == c3, 1.0, 0.0) + tl.zeros((NB, SP, SP), dtype=tl.float32)
    for k in range(n):
        row_a = tl.sum(tl.where(r3 == k, a, 0.0), axis=1)        # (NB, SP): A[n, k, :]
        row_i = tl.sum(tl.where(r3 == k, inv, 0.0), axis=1)      # (NB, SP): inv[n, k, :]
        col_a = tl.sum(tl.where(c3 == k, a, 0.0), axis=2)        # (NB, SP): A[n, :, k]
        piv = tl.sum(tl.where(p[None, :] == k, row_a, 0.0), axis=1)  # (NB,)
        rcp = 1.0 / piv
        row_a = row_a * rcp[:, None]
        row_i = row_i * rcp[:, None]
        f = tl.where(p[None, :] == k, 0.0, col_a)                # eliminate every other row
        a = a - f[:, :, None] * row_a[:, None, :]
        inv = inv - f[:, :, None] * row_i[:, None, :]
        a = tl.where(r3 == k, row_a[:, None, :], a)
        inv = tl.where(r3 == k, row_i[:, None, :], inv)
    return inv


#: ``neumann_inverse`` stops once the next factor's ‖P‖_F² is at most this (‖P‖_F <= 2⁻²⁴: the
#: tail it leaves out is below fp32's rounding of the result) ...
NEUMANN_TOL2 = tl.constexpr(2.0 ** -48)
#: ... or after this many squarings (terms up to N^(2^(steps+1)); ρ(N) up to ~0.9), when
#: ``cayley_m`` falls back to Gauss–Jordan
NEUMANN_MAX_STEPS = tl.constexpr(6)
#: the series' dots: "ieee" (FMA, fp32). They take 255 registers a thread (ptxas, sm_90) and
#: cap a streaming program's residency at two per SM; "tf32x3" takes 243 (the same two) and
#: gave wrong streams with Triton 3.6 in the (N, C, H, W) layout at 16 bits: not understood,
#: not used
NEUMANN_PREC = tl.constexpr("ieee")


@triton.jit
def neumann_inverse(q, GP: tl.constexpr):
    """``(M, e)`` with ``M = (I − Q)⁻¹`` for a skew-symmetric (GP, GP) fp32 Q, by fp32 dots
    instead of Gauss–Jordan's GP serial elimination steps, and ``e`` the squared Frobenius
    norm of the first factor left out (``e <= NEUMANN_TOL2``: M is fp32-accurate; else it
    is not, and the caller solves again).

    ``(I − Q)(I + Q) = I + N`` with ``N = QᵀQ = −Q²`` symmetric positive semidefinite, so
    ``M = (I + Q)·(I + N)⁻¹`` and ``(I + N)⁻¹ = Π_j (I + P_j)`` with ``P_0 = −N``,
    ``P_{j+1} = P_j²``: after the factors up to P_j the rest is ``P_{j+1}·(I + N)⁻¹``, whose
    norm is at most ‖P_{j+1}‖_F (‖(I + N)⁻¹‖₂ <= 1): a rigorous, computed stopping rule that
    converges quadratically whenever ‖Q‖₂ < 1. Everything is a polynomial in Q, so a
    block-diagonal Q gives a block-diagonal M (the off-block zeros stay exact)."""
    l = tl.arange(0, GP)
    eye = tl.where(l[:, None] == l[None, :], 1.0, 0.0)
    n = -tl.dot(q, q, input_precision=NEUMANN_PREC)
    x = eye - n
    p = tl.dot(n, n, input_precision=NEUMANN_PREC)
    e = tl.sum(tl.sum(p * p, axis=1), axis=0)
    j = 0
    while (e > NEUMANN_TOL2) & (j < NEUMANN_MAX_STEPS):
        x = x + tl.dot(x, p, input_precision=NEUMANN_PREC)
        p = tl.dot(p, p, input_precision=NEUMANN_PREC)
        e = tl.sum(tl.sum(p * p, axis=1), axis=0)
        j += 1
    return tl.dot(eye + q, x, input_precision=NEUMANN_PREC), e


@triton.jit
def cayley_m(b, bt, cscale, valid, NB: tl.constexpr, SP: tl.constexpr, NEUMANN: tl.constexpr):
    """The block-diagonal (NB·SP, NB·SP) ``M = (I − Q)⁻¹`` of a batch of raw blocks (see
    ``skew_system``): Gauss–Jordan per block, or (NEUMANN) ``neumann_inverse`` of the
    block-diagonal Q, with Gauss–Jordan only where that has not converged (a uniform
    branch: one side per program)."""
    a = skew_system(b, bt, cscale, valid, NB, SP)
    if NEUMANN:
        m, e = neumann_inverse(block_diag(skew_q(b, bt, cscale, valid), NB, SP), NB * SP)
        if e <= NEUMANN_TOL2:  # (written so that a diverged, NaN e falls back too)
            m = m
        else:
            m = block_diag(batched_inverse(a, SP, NB, SP), NB, SP)
    else:
        m = block_diag(batched_inverse(a, SP, NB, SP), NB, SP)
    return m


@triton.jit
def block_diag(m3, NB: tl.constexpr, SP: tl.constexpr):
    """(NB, SP, SP) -> the (NB·SP, NB·SP) block-diagonal matrix, row/col index n·SP + p."""
    n = tl.arange(0, NB)
    same = (n[:, None, None, None] == n[None, None, :, None])
    m4 = tl.where(same, m3[:, :, None, :], 0.0)                  # (NB, SP, NB, SP)
    return tl.reshape(m4, (NB * SP, NB * SP))


@triton.jit
def cayley_grad(g_r, m, cscale):
    """``cscale·(gQ − gQᵀ)`` with ``gQ = 2·Mᵀ·gR·Mᵀ`` (square fp32 matrices,
    dims >= 16; block-diagonal inputs give a block-diagonal result)."""
    mt = tl.trans(m)
    t = tl.dot(mt, g_r, input_precision="ieee")
    g_q = 2.0 * tl.dot(t, mt, input_precision="ieee")
    return cscale * (g_q - tl.trans(g_q))
