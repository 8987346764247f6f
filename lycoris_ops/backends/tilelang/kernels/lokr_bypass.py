"""TileLang kernels of the LoKr bypass (docs/ops.md §2.3): ``lokr_bypass_fwd``,
``lokr_bypass_bwd``; the merges are ``lokr.py``.

Kronecker convention as ``lokr.py``; per token ``Y_t = γ·w1·X_t·w2ᵀ``, X_t = x_t as (b, d),
on tensor cores. Written from the math and ``reference/lokr.py``.

``kron_apply_kernel`` - program = BTt tokens. Stage 1 is one ``T.gemm`` of the
    tokens' X rows stacked as (BTt·Bp, Dp) with w2ᵀ: ``Z[(t,v), i]`` (fp32
    fragment). Z is written to shared memory permuted to (Bp, BTt·Cp) - token
    blocks side by side - so stage 2 is again one ``T.gemm``:
    ``Y[u, (t,i)] = Σ_v w1[u,v]·Z[(t,v), i]``. The reference keeps Z in fp32;
    a tensor-core operand is 16-bit, so Z enters stage 2 as a two-term split
    ``Z ≈ hi + lo`` (hi = round(Z), lo = round(Z - hi), both in the compute
    dtype; two GEMMs into the same fp32 accumulator): ~16 significant bits for
    bf16, ~22 for fp16, far below the output rounding. (fp16: |Z| must stay
    below 65504.) The same kernel gives ``gx`` of the backward with
    (G, w1ᵀ, w2ᵀ). A program walks a static number of token tiles
    (``APPLY_KPER``) in a pipelined loop, w1 and w2 loaded once; where it fits
    (and a config's ``staged`` key is not False) the output and base blocks go
    through shared memory.
``kron_wgrad1_kernel`` - ``g_w1 = γ·Σ_t G_t·(X_t·w2ᵀ)ᵀ``: Z as above (hi/lo),
    G tokens laid side by side (Ap, BTt·Cp), one GEMM per term over K = (t, i).
``kron_wgrad2_kernel`` - ``g_w2 = γ·Σ_t G_tᵀ·(w1·X_t)``: P = w1·X (X tokens
    side by side), written back token-stacked (BTt·Ap, Dp) as hi/lo; G
    token-stacked (BTt·Ap, Cp); one transposed-A GEMM per term over K = (t, u).
    Both split the token tiles over ``nsplit`` programs (fp32 partials),
    pipelined over a static step count (``WGRAD_KPER``). The backward's
    fallback where the one-pass kernel below does not fit.
``kron_wgrads_kernel`` - both weight gradients in one pass, and with ``gxdt`` gx
    too (the whole backward where it fits): X and G read once; g_w1 and gx both
    from U = G·W2 (so 8 MMAs a step, not 9); its partials finished by
    ``lokr.kron_finish_kernel``.

Padded sizes Ap..Dp are powers of two >= 16 (``T.copy`` zero-fills the pad); the kernels
keep whole padded factors in shared memory, hence the scope cap (every factor dim <= 128,
``scope.py``). The token count is ``T.dynamic``.

Launch config: ``BYPASS`` with a tuned ``cfg`` (backends/tilelang/tuning/lokr.py) merged over
it: the most token rows per program and the most threads, and (timed only) the forward
apply's ``staged`` epilogue. The token loops are ``T.Pipelined`` over static step counts,
compiled without warp specialization. fp32 calls step down (TF32).
"""
import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, cdiv, kernel, launch_config, num_sms, smem_limit,
                                                  tl_dtype, without_warp_specialization)
from lycoris_ops.backends.tilelang.kernels.lokr import finish_launch, whole_job
from lycoris_ops.backends.tilelang.kernels.lora import _scopes, compute_dtype, dummy, fresh, pad_rank, prep
from lycoris_ops.tuner.cost import SMEM_MARGIN as _SMEM_MARGIN

__all__ = ["kron_apply_kernel", "kron_wgrad1_kernel", "kron_wgrad2_kernel", "kron_wgrads_kernel", "bypass_fwd",
           "bypass_bwd", "compile_specs"]

_ACC = "float32"
#: the fixed launch config (the tuner's untimed pick): the most token rows (BTt·padded factor
#: dim) of a program and the most threads (fewer where the program's smallest GEMM cannot
#: feed that many warps)
BYPASS = dict(rows=128, threads=128)
#: ``kron_apply_kernel(kper=...)``: each program walks a static number of token tiles (the
#: largest of these that leaves two programs an SM: ``_steps``) in a pipelined loop, the
#: factors loaded once, instead of one tile (2 tokens at 64-wide factors) and both factors a
#: program: measured faster at both bench shapes
APPLY_KPER = (4, 16, 64)
#: the wgrad kernels' static step counts (``_wgrad_split``, ``_wgrads``): each step's loads
#: in flight during the last step's products, as ``APPLY_KPER``
WGRAD_KPER = (4, 16, 64)


def _threads(*mn, most: int = 128) -> int:
    """Threads for a program whose smallest ``T.gemm`` output is (M, N): each warp must own
    at least 16 rows x 8 columns, at most ``most`` threads; more than one warpgroup only
    when every GEMM has >= 128 rows (sm_90's WGMMA: one warpgroup per 64 rows)."""
    w = min(most // 32, min((m // 16) * (n // 8) for m, n in mn))
    if w > 4 and min(m for m, _ in mn) < 128:
        w = 4
    return 32 * max(1, w)


def _tok_tile(p: int, q: int, rows: int = 128) -> int:
    """Tokens per program so that p·BTt and q·BTt stay <= rows."""
    return max(1, rows // max(p, q))


def apply_geometry(a: int, b: int, c: int, d: int, rows: int = 128, most: int = 128):
    """(tokens per program, threads) of ``kron_apply_kernel``."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt = _tok_tile(Bp, Cp, rows)
    return BTt, _threads((BTt * Bp, Cp), (Ap, BTt * Cp), most=most)


def wgrad1_geometry(a: int, b: int, c: int, d: int, rows: int = 128, most: int = 128):
    """(tokens per program step, threads) of ``kron_wgrad1_kernel``."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt = _tok_tile(Bp, Cp, rows)
    return BTt, _threads((BTt * Bp, Cp), (Ap, Bp), most=most)


def wgrad2_geometry(a: int, b: int, c: int, d: int, rows: int = 128, most: int = 128):
    """(tokens per program step, threads) of ``kron_wgrad2_kernel``."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt = _tok_tile(Ap, Dp, rows)
    return BTt, _threads((Ap, BTt * Dp), (Cp, Dp), most=most)


# --------------------------------------------------------------------------- kernels

def _token_blocks_store(T, par, Rp: int, Np: int, R: int, N: int, BTt: int, Tn, odt: str, staged: bool):
    """The T.macro ``store(acc, gamma, t0, Out, outs, Base, bs)`` of the bypass kernels: acc
    (Rp, BTt·Np) fp32 holds BTt token blocks side by side; ``Out[t0 + t, :R, :N] = round(γ·acc
    (+ Base))`` in odt (``Base`` None: no base). ``staged``: the base block is copied into bs
    whole and added into acc by a loop of its own, then the output block is written into outs
    (BTt, R, N) in Out's order and stored by one copy (one loop reading the base block and
    writing the output block got a barrier in each step of the pipelined token loop's epilogue:
    TileLang's sync planning around the double-buffered base block). Else each element is
    stored (and its base read) from the registers, tokens past Tn skipped. Tn and the extents
    are closed over (as macro arguments TileLang would rename the kernel's dynamic ones)."""

    @T.macro
    def store(acc, gamma, t0, Out, outs, Base, bs):
        if staged:
            if Base is not None:
                T.copy(Base[t0:t0 + BTt, 0:R, 0:N], bs)
            if Base is not None:  # the base added in the accumulator first
                for u, n in par(Rp, BTt * Np):
                    if u < R and n % Np < N:
                        acc[u, n] = acc[u, n] * gamma + T.cast(bs[n // Np, u, n % Np], _ACC)
            for u, n in par(Rp, BTt * Np):
                if u < R and n % Np < N:
                    if Base is not None:
                        outs[n // Np, u, n % Np] = T.cast(acc[u, n], odt)
                    else:
                        outs[n // Np, u, n % Np] = T.cast(acc[u, n] * gamma, odt)
            T.copy(outs, Out[t0:t0 + BTt, 0:R, 0:N])
        else:
            for u, n in par(Rp, BTt * Np):
                t = t0 + n // Np
                i = n % Np
                if u < R and i < N and t < Tn:
                    if Base is not None:
                        Out[t, u, i] = T.cast(acc[u, n] * gamma + T.cast(Base[t, u, i], _ACC), odt)
                    else:
                        Out[t, u, i] = T.cast(acc[u, n] * gamma, odt)

    return store


def kron_apply_kernel(a: int, b: int, c: int, d: int, dt: str, bdt, odt: str,
                      rows: int = 128, max_threads: int = 128, staged: bool = False, kper: int = 4,
                      cpu: bool = False):
    """``Y[t] = γ·W1·X[t]·W2ᵀ (+ base[t])``: X (T, b, d), W1 (a, b), W2 (c, d), Y (T, a, c).

    ``staged``: the program's BTt·a·c output elements - one contiguous block of Y - are staged
    in shared memory in Y's order and stored as whole rows, and the base block is copied in
    whole, instead of the accumulator's registers storing (and reading the base) element by
    element with a row stride of c.

    A program walks ``kper`` token tiles in a pipelined loop (the next tile's X loads while
    this one multiplies; tiles past the end load zeros and store nothing) with W1, W2 loaded
    once; compiled without warp specialization (the loop's body ends in a serial epilogue)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = apply_geometry(a, b, c, d, rows, max_threads)
    Tn = T.dynamic("T")
    has_base = bdt is not None
    bsh = (Tn, a, c) if has_base else (1,)
    bdt = bdt or _ACC

    store = _token_blocks_store(T, par, Ap, Cp, a, c, BTt, Tn, odt, staged)

    @T.macro
    def tile(X, Base, Y, gamma, t0, xs, w1s, w2s, zs, z, y, ys, bs):
        """One tile of BTt tokens from t0: its X rows are in xs (the caller loads them)."""
        T.gemm(xs, w2s, z, transpose_B=True, clear_accum=True)  # Z[(t,v), i] = Σ_j X[t,v,j]·W2[i,j]
        for m, i in par(BTt * Bp, Cp):  # hi term, tokens side by side
            zs[m % Bp, (m // Bp) * Cp + i] = T.cast(z[m, i], dt)
        T.gemm(w1s, zs, y, clear_accum=True)
        for m, i in par(BTt * Bp, Cp):  # lo term
            zs[m % Bp, (m // Bp) * Cp + i] = T.cast(z[m, i] - T.cast(T.cast(z[m, i], dt), _ACC), dt)
        T.gemm(w1s, zs, y)
        store(y, gamma, t0, Y, ys, Base if has_base else None, bs)

    @T.prim_func
    def kron_apply(X: T.Tensor((Tn, b, d), dt), W1: T.Tensor((a, b), dt), W2: T.Tensor((c, d), dt),
                   Base: T.Tensor(bsh, bdt), Y: T.Tensor((Tn, a, c), odt), gamma: T.float32):
        with T.Kernel(T.ceildiv(Tn, BTt * max(kper, 1)), threads=nthreads(threads)) as bt:
            xs = shared((BTt * Bp, Dp), dt)
            w1s = shared((Ap, Bp), dt)
            w2s = shared((Cp, Dp), dt)
            zs = shared((Bp, BTt * Cp), dt)
            z = frag((BTt * Bp, Cp), _ACC)
            y = frag((Ap, BTt * Cp), _ACC)
            ys = shared((BTt, a, c), odt) if staged else None
            bs = shared((BTt, a, c), bdt) if staged and has_base else None
            T.copy(W1[0:Ap, 0:Bp], w1s)
            T.copy(W2[0:Cp, 0:Dp], w2s)
            for kk in T.Pipelined(kper, num_stages=2):
                t0 = (bt * kper + kk) * BTt
                for t in T.serial(BTt):
                    T.copy(X[t0 + t, 0:Bp, 0:Dp], xs[t * Bp:(t + 1) * Bp, 0:Dp])
                tile(X, Base, Y, gamma, t0, xs, w1s, w2s, zs, z, y, ys, bs)

    return kron_apply if cpu else without_warp_specialization(kron_apply)


def kron_wgrad1_kernel(a: int, b: int, c: int, d: int, dt: str, odt: str, direct: bool,
                       rows: int = 128, max_threads: int = 128, kper_static: int = 4, cpu: bool = False):
    """``g_w1 (a, b) = γ·Σ_t G_t·(X_t·W2ᵀ)ᵀ``; G (T, a, c), X (T, b, d). Program = split s of
    the token tiles, ``kper_static`` steps pipelined (tiles past the end read as zeros; the
    ``kper`` argument is unused). direct: Out (a, b); else fp32 partials (nsplit·Ap, Bp)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = wgrad1_geometry(a, b, c, d, rows, max_threads)
    Tn = T.dynamic("T")
    oshape = (a, b) if direct else (T.dynamic("P"), Bp)
    odt = odt if direct else _ACC

    @T.prim_func
    def kron_wgrad1(Gr: T.Tensor((Tn, a, c), dt), X: T.Tensor((Tn, b, d), dt), W2: T.Tensor((c, d), dt),
                    Out: T.Tensor(oshape, odt), gamma: T.float32, kper: T.int32, nsplit: T.int32):
        with T.Kernel(nsplit, threads=nthreads(threads)) as s:
            xs = shared((BTt * Bp, Dp), dt)
            w2s = shared((Cp, Dp), dt)
            gs = shared((Ap, BTt * Cp), dt)
            zs = shared((Bp, BTt * Cp), dt)
            z = frag((BTt * Bp, Cp), _ACC)
            g1 = frag((Ap, Bp), _ACC)
            T.copy(W2[0:Cp, 0:Dp], w2s)
            T.clear(g1)
            for kk in T.Pipelined(kper_static, num_stages=2):
                t0 = (s * kper_static + kk) * BTt
                for t in T.serial(BTt):
                    T.copy(X[t0 + t, 0:Bp, 0:Dp], xs[t * Bp:(t + 1) * Bp, 0:Dp])
                    T.copy(Gr[t0 + t, 0:Ap, 0:Cp], gs[0:Ap, t * Cp:(t + 1) * Cp])
                T.gemm(xs, w2s, z, transpose_B=True, clear_accum=True)
                for m, i in par(BTt * Bp, Cp):
                    zs[m % Bp, (m // Bp) * Cp + i] = T.cast(z[m, i], dt)
                T.gemm(gs, zs, g1, transpose_B=True)
                for m, i in par(BTt * Bp, Cp):
                    zs[m % Bp, (m // Bp) * Cp + i] = T.cast(z[m, i] - T.cast(T.cast(z[m, i], dt), _ACC), dt)
                T.gemm(gs, zs, g1, transpose_B=True)
            for u, v in par(Ap, Bp):
                g1[u, v] = g1[u, v] * gamma
            if direct:
                T.copy(g1, Out[0, 0])
            else:
                T.copy(g1, Out[s * Ap, 0])

    return kron_wgrad1 if cpu else without_warp_specialization(kron_wgrad1)


def kron_wgrad2_kernel(a: int, b: int, c: int, d: int, dt: str, odt: str, direct: bool,
                       rows: int = 128, max_threads: int = 128, kper_static: int = 4, cpu: bool = False):
    """``g_w2 (c, d) = γ·Σ_t G_tᵀ·(W1·X_t)``; G (T, a, c), X (T, b, d). Program = split s of
    the token tiles, as ``kron_wgrad1_kernel``. direct: Out (c, d); else fp32 partials
    (nsplit·Cp, Dp)."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = wgrad2_geometry(a, b, c, d, rows, max_threads)
    Tn = T.dynamic("T")
    oshape = (c, d) if direct else (T.dynamic("P"), Dp)
    odt = odt if direct else _ACC

    @T.prim_func
    def kron_wgrad2(Gr: T.Tensor((Tn, a, c), dt), X: T.Tensor((Tn, b, d), dt), W1: T.Tensor((a, b), dt),
                    Out: T.Tensor(oshape, odt), gamma: T.float32, kper: T.int32, nsplit: T.int32):
        with T.Kernel(nsplit, threads=nthreads(threads)) as s:
            xs = shared((Bp, BTt * Dp), dt)
            w1s = shared((Ap, Bp), dt)
            gs = shared((BTt * Ap, Cp), dt)
            ps = shared((BTt * Ap, Dp), dt)
            p = frag((Ap, BTt * Dp), _ACC)
            g2 = frag((Cp, Dp), _ACC)
            T.copy(W1[0:Ap, 0:Bp], w1s)
            T.clear(g2)
            for kk in T.Pipelined(kper_static, num_stages=2):
                t0 = (s * kper_static + kk) * BTt
                for t in T.serial(BTt):
                    T.copy(X[t0 + t, 0:Bp, 0:Dp], xs[0:Bp, t * Dp:(t + 1) * Dp])
                    T.copy(Gr[t0 + t, 0:Ap, 0:Cp], gs[t * Ap:(t + 1) * Ap, 0:Cp])
                T.gemm(w1s, xs, p, clear_accum=True)  # P[u, (t,j)] = Σ_v W1[u,v]·X[t,v,j]
                for u, n in par(Ap, BTt * Dp):
                    ps[(n // Dp) * Ap + u, n % Dp] = T.cast(p[u, n], dt)
                T.gemm(gs, ps, g2, transpose_A=True)
                for u, n in par(Ap, BTt * Dp):
                    ps[(n // Dp) * Ap + u, n % Dp] = T.cast(p[u, n] - T.cast(T.cast(p[u, n], dt), _ACC), dt)
                T.gemm(gs, ps, g2, transpose_A=True)
            for i, j in par(Cp, Dp):
                g2[i, j] = g2[i, j] * gamma
            if direct:
                T.copy(g2, Out[0, 0])
            else:
                T.copy(g2, Out[s * Cp, 0])

    return kron_wgrad2 if cpu else without_warp_specialization(kron_wgrad2)


def wgrads_geometry(a: int, b: int, c: int, d: int, rows: int = 128, most: int = 128):
    """(tokens per program step, threads) of ``kron_wgrads_kernel``: half the rows of the
    single-gradient kernels (its four fp32 fragments live at once)."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt = max(1, (rows // 2) // max(Ap, Bp, Cp, Dp))
    return BTt, _threads((BTt * Bp, Cp), (Ap, Bp), (Ap, BTt * Dp), (Cp, Dp), most=most)


def wgrads_smem(a: int, b: int, c: int, d: int, rows: int, most: int, esize: int, gx_size: int = 0) -> int:
    """Shared-memory bytes of ``kron_wgrads_kernel`` (esize-byte operands; gx_size: gx's
    element bytes, 0: no gx): the factors, one step's X and G tiles (two stages: the pipelined
    loop), the hi/lo staging of U and P, and with gx its staged block."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, _ = wgrads_geometry(a, b, c, d, rows, most)
    loads = BTt * (Bp * Dp + Ap * Cp)  # one step's X and G tiles
    n = Ap * Bp + Cp * Dp + 2 * loads + 2 * BTt * Ap * Dp
    staged = gx_size and wgrads_gx_stageable(a, b, c, d, rows, most, gx_size)
    return n * esize + (BTt * b * d * gx_size if staged else 0)


#: fp32 accumulator registers a thread of ``kron_wgrads_kernel`` may hold (``wgrads_fragment_regs``):
#: the register file's per-thread limit, past which the accumulators spill to local memory
WGRADS_MAX_FRAGMENT_REGS = 255


def wgrads_fragment_regs(a: int, b: int, c: int, d: int, rows: int, most: int, gx: bool) -> float:
    """fp32 accumulator elements a thread of ``kron_wgrads_kernel`` holds (U, P, g_w1, g_w2 and
    with gx its block): 160 at the bench's 64-wide factors, 352 at w1 (64, 64), w2 (128, 128)."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = wgrads_geometry(a, b, c, d, rows, most)
    return (2 * BTt * Ap * Dp + Ap * Bp + Cp * Dp + (Bp * BTt * Dp if gx else 0)) / threads


def wgrads_gx_stageable(a: int, b: int, c: int, d: int, rows: int, most: int, size: int) -> bool:
    """Whether ``kron_wgrads_kernel``'s gx block (BTt·b·d elements of ``size`` bytes) copies in
    whole 16-byte vectors, one a thread (as ``apply_stageable``: TileLang cannot lay out some
    other block copies); else gx is stored from the accumulator."""
    BTt, threads = wgrads_geometry(a, b, c, d, rows, most)
    return _whole_vectors(BTt * b * d, threads, size)


def wgrads_async_fits(a: int, b: int, c: int, d: int, rows: int, most: int) -> bool:
    """Whether every GEMM of ``kron_wgrads_kernel`` can be a Hopper WGMMA (M a multiple of 64
    per warpgroup): the condition of its ``async_mma`` form."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = wgrads_geometry(a, b, c, d, rows, most)
    return threads % 128 == 0 and all(m % (64 * (threads // 128)) == 0 for m in (BTt * Ap, Ap, Bp, Cp))


def kron_wgrads_kernel(a: int, b: int, c: int, d: int, dt: str, odt: str, direct: bool,
                       rows: int = 128, max_threads: int = 128, kper_static: int = 4, gxdt=None,
                       async_mma: bool = False, cpu: bool = False):
    """Both weight gradients in one pass over the tokens: with
    ``U_t = G_t·W2`` (a, d) and ``P_t = W1·X_t`` (a, d), ``g_w1 (a, b) = γ·Σ_t U_t·X_tᵀ`` and
    ``g_w2 (c, d) = γ·Σ_t G_tᵀ·P_t``, each step's X and G tiles read from DRAM once instead of
    once per gradient kernel. U and P are fp32 and enter the next product as hi + lo 16-bit
    halves (two MMAs each: fp32-accurate). Program = split s of the token tiles,
    ``kper_static`` steps pipelined (tiles past the end read as zeros). direct: Out1 (a, b),
    Out2 (c, d); else fp32 partials (nsplit·Ap, Bp) and (nsplit·Cp, Dp).

    ``gxdt``: the same pass also writes ``GX[t] = γ·W1ᵀ·U_t`` (T, b, d) in that
    dtype from the same hi / lo halves of U that g_w1 takes: the whole backward reads X and G
    once and makes 8 MMAs a step (U, P, and the hi / lo pairs of g_w1, g_w2 and gx). The gx
    block goes through shared memory and one store where it copies whole (16-byte vectors;
    the CPU twin stores from the accumulator).

    ``async_mma`` (sm_90a where ``wgrads_async_fits``): each group of independent GEMMs issued
    as asynchronous WGMMAs but the last, a synchronous one whose wait covers the group (the
    next writes of their shared operands, the next stage's copies, and reads of their
    accumulators come after it): 3 waits a step instead of 8, measured faster."""
    import tilelang.language as T

    shared, frag, par, nthreads = _scopes(T, cpu)
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt, threads = wgrads_geometry(a, b, c, d, rows, max_threads)
    async_mma = async_mma and not cpu
    mma = T.wgmma_gemm if async_mma else T.gemm
    Tn = T.dynamic("T")
    o1 = (a, b) if direct else (T.dynamic("P1"), Bp)
    o2 = (c, d) if direct else (T.dynamic("P2"), Dp)
    odt = odt if direct else _ACC
    kper = kper_static
    with_gx = gxdt is not None
    gxsh = (Tn, b, d) if with_gx else (1,)
    gxdt = gxdt or _ACC
    gx_staged = with_gx and wgrads_gx_stageable(a, b, c, d, rows, max_threads, getattr(torch, gxdt).itemsize)
    store_gx = _token_blocks_store(T, par, Bp, Dp, b, d, BTt, Tn, gxdt, gx_staged)

    @T.prim_func
    def kron_wgrads(Gr: T.Tensor((Tn, a, c), dt), X: T.Tensor((Tn, b, d), dt), W1: T.Tensor((a, b), dt),
                    W2: T.Tensor((c, d), dt), Out1: T.Tensor(o1, odt), Out2: T.Tensor(o2, odt),
                    GX: T.Tensor(gxsh, gxdt), gamma: T.float32):
        with T.Kernel(T.ceildiv(Tn, BTt * kper), threads=nthreads(threads)) as s:
            w1s = shared((Ap, Bp), dt)
            w2s = shared((Cp, Dp), dt)
            xs = shared((Bp, BTt * Dp), dt)  # X[v, (t, j)]: tokens side by side
            gs = shared((BTt * Ap, Cp), dt)  # G[(t, u), i]: token-stacked rows
            us = shared((Ap, BTt * Dp), dt)  # a half of U[u, (t, j)]
            ps = shared((BTt * Ap, Dp), dt)  # a half of P[(t, u), j]
            uf = frag((BTt * Ap, Dp), _ACC)
            p = frag((Ap, BTt * Dp), _ACC)
            g1 = frag((Ap, Bp), _ACC)
            g2 = frag((Cp, Dp), _ACC)
            gxf = frag((Bp, BTt * Dp), _ACC) if with_gx else None
            gxs = shared((BTt, b, d), gxdt) if gx_staged else None
            T.copy(W1[0:Ap, 0:Bp], w1s)
            T.copy(W2[0:Cp, 0:Dp], w2s)
            T.clear(g1)
            T.clear(g2)
            for kk in T.Pipelined(kper, num_stages=2):
                t0 = (s * kper + kk) * BTt
                for t in T.serial(BTt):
                    T.copy(X[t0 + t, 0:Bp, 0:Dp], xs[0:Bp, t * Dp:(t + 1) * Dp])
                    T.copy(Gr[t0 + t, 0:Ap, 0:Cp], gs[t * Ap:(t + 1) * Ap, 0:Cp])
                # each group: its GEMMs issued together (``async_mma``), the last one synchronous, whose
                # wait covers the group; the software pipeline's next-stage copies into xs / gs come
                # after the last GEMM reading them, so that one must have waited
                mma(gs, w2s, uf, clear_accum=True)  # U[(t,u), j] = Σ_i G[t,u,i]·W2[i,j]
                T.gemm(w1s, xs, p, clear_accum=True)  # P[u, (t,j)] = Σ_v W1[u,v]·X[t,v,j]
                for m, j in par(BTt * Ap, Dp):  # hi halves
                    us[m % Ap, (m // Ap) * Dp + j] = T.cast(uf[m, j], dt)
                for u, n in par(Ap, BTt * Dp):
                    ps[(n // Dp) * Ap + u, n % Dp] = T.cast(p[u, n], dt)
                if with_gx:
                    mma(w1s, us, gxf, transpose_A=True, clear_accum=True)  # GX[v, (t,j)] = Σ_u W1[u,v]·U
                mma(us, xs, g1, transpose_B=True)  # g1[u, v] += Σ_(t,j) U[u,(t,j)]·X[v,(t,j)]
                T.gemm(gs, ps, g2, transpose_A=True)  # g2[i, j] += Σ_(t,u) G[(t,u),i]·P[(t,u),j]
                for m, j in par(BTt * Ap, Dp):  # lo halves
                    us[m % Ap, (m // Ap) * Dp + j] = T.cast(uf[m, j] - T.cast(T.cast(uf[m, j], dt), _ACC), dt)
                for u, n in par(Ap, BTt * Dp):
                    ps[(n // Dp) * Ap + u, n % Dp] = T.cast(p[u, n] - T.cast(T.cast(p[u, n], dt), _ACC), dt)
                if with_gx:
                    mma(w1s, us, gxf, transpose_A=True)
                mma(us, xs, g1, transpose_B=True)
                T.gemm(gs, ps, g2, transpose_A=True)
                if with_gx:
                    store_gx(gxf, gamma, t0, GX, gxs, None, None)
            for u, v in par(Ap, Bp):
                g1[u, v] = g1[u, v] * gamma
            for i, j in par(Cp, Dp):
                g2[i, j] = g2[i, j] * gamma
            if direct:
                T.copy(g1, Out1[0, 0])
                T.copy(g2, Out2[0, 0])
            else:
                T.copy(g1, Out1[s * Ap, 0])
                T.copy(g2, Out2[s * Cp, 0])

    return kron_wgrads if cpu else without_warp_specialization(kron_wgrads)


# --------------------------------------------------------------------------- launchers

def _steps(tiles: int, kpers, device) -> int:
    """The static step count of a pipelined token loop: the largest of ``kpers`` that leaves
    two programs an SM (else the smallest)."""
    want = 2 * num_sms(device)
    return next((k for k in sorted(kpers, reverse=True) if cdiv(tiles, k) >= want), min(kpers))


def _wgrad_split(tiles: int, device) -> tuple:
    """(nsplit, token tiles per split, the kernels' static step count) of a wgrad launch:
    ``_steps`` of ``WGRAD_KPER``, every split that many steps (tiles past the end read as
    zeros)."""
    k = _steps(tiles, WGRAD_KPER, device)
    return cdiv(tiles, k), k, k


def apply_smem(a: int, b: int, c: int, d: int, rows: int, esize: int, osize: int, bsize: int) -> int:
    """Shared-memory bytes of ``kron_apply_kernel``'s staged form (esize-byte operands; the
    staged output and base blocks osize / bsize bytes an element, bsize 0: no base): the
    pipelined loop's loads, X and the staged base block, are held in two stages."""
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    BTt = _tok_tile(Bp, Cp, rows)
    n = (2 * BTt * Bp * Dp + Ap * Bp + Cp * Dp + Bp * BTt * Cp) * esize
    return n + BTt * a * c * (osize + 2 * bsize)


def _whole_vectors(elems: int, threads: int, size: int) -> bool:
    """Whether a block of ``elems`` elements of ``size`` bytes is a whole number of rounds of
    one 16-byte vector a thread: the staged block copies TileLang lays out on every shape."""
    return elems % (threads * 16 // size) == 0


def apply_stageable(a: int, b: int, c: int, d: int, rows: int, most: int, osize: int, bsize: int) -> bool:
    """Whether ``kron_apply_kernel``'s staged blocks copy in whole 16-byte vectors: the
    BTt·a·c elements of the output (and base) block a multiple of the threads' one vector
    each. TileLang fails to lay out the block copies of some other blocks (sm_90a: a = 5,
    c = 4, 16 tokens; fp32 bases of 320 or 1664 elements), so those keep the register
    epilogue (the bench shapes' blocks are 6144 and 8192 elements)."""
    BTt, threads = apply_geometry(a, b, c, d, rows, most)
    return all(_whole_vectors(BTt * a * c, threads, size) for size in (osize, bsize) if size)


def apply_staged_fits(a: int, b: int, c: int, d: int, rows: int, most: int, esize: int, osize: int, bsize: int,
                      limit: int) -> bool:
    """Whether the staged apply epilogue can run: its blocks copy whole (``apply_stageable``)
    and the kernel (two stages of its loads) fits ``limit`` bytes of shared memory with the
    planners' margin (at factors of 128 with a base it does not). The launcher's check
    (``_apply_staged``) and the planner's (backends/tilelang/tuning/lokr.py)."""
    return (apply_stageable(a, b, c, d, rows, most, osize, bsize)
            and apply_smem(a, b, c, d, rows, esize, osize, bsize) * _SMEM_MARGIN <= limit)


def _apply_staged(p: dict, a, b, c, d, dt, odt, bdt, device) -> bool:
    """The staged epilogue unless the config's ``staged`` key says False (the tuner times both:
    the staged one is faster at large token counts, the register one can be at small), where
    it can run on ``device`` (``apply_staged_fits``)."""
    return bool(p.get("staged", True)) and apply_staged_fits(
        a, b, c, d, p["rows"], p["threads"], dt.itemsize, odt.itemsize, 0 if bdt is None else bdt.itemsize,
        smem_limit(device))


def _apply(x3, w1, w2, base3, gamma, odt, cfg=None):
    T_ = x3.shape[0]
    a, b = w1.shape
    c, d = w2.shape
    dev = x3.device
    p = launch_config(BYPASS, cfg)
    y = torch.empty((T_, a * c), device=dev, dtype=odt)
    bdt = None if base3 is None else base3.dtype
    staged = _apply_staged(p, a, b, c, d, x3.dtype, odt, bdt, dev)
    tiles = cdiv(T_, apply_geometry(a, b, c, d, p["rows"], p["threads"])[0])
    kper = _steps(tiles, APPLY_KPER, dev)
    k = kernel(kron_apply_kernel, arch_of(dev), a, b, c, d, tl_dtype(x3.dtype),
               None if base3 is None else tl_dtype(base3.dtype), tl_dtype(odt), p["rows"], p["threads"], staged, kper)
    k(x3, w1, w2, dummy(dev, torch.float32) if base3 is None else base3, y.view(T_, a, c), float(gamma))
    return y


def bypass_fwd(x, w1, w2, gamma, base=None, cfg=None):
    c = compute_dtype(x, w1, w2)
    a, b = w1.shape
    cc, d = w2.shape
    T_ = x.shape[0]
    odt = x.dtype if base is None else base.dtype
    b3 = None if base is None else aligned(base.contiguous()).view(T_, a, cc)
    return _apply(prep(x, c).view(T_, b, d), prep(w1, c), prep(w2, c), b3, gamma, odt, cfg)


#: the separate wgrad kernels' fp32 partials' sum (``_sum_partials``): first over runs of this
#: many partials (ns/k times the outputs: a torch reduction over the outer dim of a (ns, 4096)
#: view runs few programs), then over the rest (0: one ``sum(0)``); 8 measured faster than 1
#: or 32
PARTIAL_SUM_RUN = 8


def _sum_partials(part: torch.Tensor, ns: int, P0: int, P1: int) -> torch.Tensor:
    """Σ_s part[s] of ``part`` (ns·P0, P1) fp32, as (P0, P1) (``PARTIAL_SUM_RUN``)."""
    k = PARTIAL_SUM_RUN
    if k > 1 and ns >= 2 * k and ns % k == 0:
        return part.view(ns // k, k, P0 * P1).sum(1).sum(0).view(P0, P1)
    return part.view(ns, P0, P1).sum(0)


def _wgrad(builder, g3, x3, w, out_shape, pads, p, q, gamma, odt, cfg=None):
    """Launch a kron_wgrad kernel with a token split; returns the gradient in odt."""
    T_ = g3.shape[0]
    a, c = g3.shape[1:]
    b, d = x3.shape[1:]
    dev = g3.device
    arch = arch_of(dev)
    dt = tl_dtype(g3.dtype)
    cf = launch_config(BYPASS, cfg)
    launch = (cf["rows"], cf["threads"])
    tiles = cdiv(T_, _tok_tile(p, q, cf["rows"]))
    ns, per, static = _wgrad_split(tiles, dev)
    if ns == 1:
        out = torch.empty(out_shape, device=dev, dtype=odt)
        k = kernel(builder, arch, a, b, c, d, dt, tl_dtype(odt), True, *launch, static)
        k(g3, x3, w, out, float(gamma), per, 1)
        return out
    P0, P1 = pads
    part = torch.empty((ns * P0, P1), device=dev, dtype=torch.float32)
    kernel(builder, arch, a, b, c, d, dt, "float32", False, *launch, static)(g3, x3, w, part, float(gamma), per, ns)
    r0, r1 = out_shape
    return fresh(_sum_partials(part, ns, P0, P1)[:r0, :r1], odt)


def _wgrads(g3, x3, w1, w2, gamma, dtypes, cfg=None, gx_dtype=None):
    """(g_w1, g_w2) by one ``kron_wgrads_kernel`` launch: direct where one program covers the
    tokens and both gradients share a dtype, else fp32 partials summed and cast by one
    ``kron_finish_kernel`` launch (torch's sums and casts would be four to six). gx_dtype:
    (gx (T, b·d) in it, g_w1, g_w2), gx from the same pass."""
    T_ = g3.shape[0]
    a, c = g3.shape[1:]
    b, d = x3.shape[1:]
    dev = g3.device
    gx = None if gx_dtype is None else torch.empty((T_, b * d), device=dev, dtype=gx_dtype)
    head = () if gx is None else (gx,)
    if T_ == 0:
        return head + (torch.zeros((a, b), device=dev, dtype=dtypes[0]),
                       torch.zeros((c, d), device=dev, dtype=dtypes[1]))
    cf = launch_config(BYPASS, cfg)
    tiles = cdiv(T_, wgrads_geometry(a, b, c, d, cf["rows"], cf["threads"])[0])
    k = _steps(tiles, WGRAD_KPER, dev)
    ns = cdiv(tiles, k)
    args = (arch_of(dev), a, b, c, d, tl_dtype(g3.dtype))
    gxa = dummy(dev, torch.float32) if gx is None else gx.view(T_, b, d)
    asy = arch_of(dev) == "sm_90a" and wgrads_async_fits(a, b, c, d, cf["rows"], cf["threads"])
    tail = (cf["rows"], cf["threads"], k, None if gx is None else tl_dtype(gx_dtype), asy)
    direct = ns == 1 and dtypes[0] == dtypes[1]
    out = (torch.empty((a, b), device=dev, dtype=dtypes[0]), torch.empty((c, d), device=dev, dtype=dtypes[1]))
    if direct:
        kernel(kron_wgrads_kernel, *args, tl_dtype(dtypes[0]), True, *tail)(g3, x3, w1, w2, *out, gxa, float(gamma))
        return head + out
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, c, d))
    p1 = torch.empty((ns * Ap, Bp), device=dev, dtype=torch.float32)
    p2 = torch.empty((ns * Cp, Dp), device=dev, dtype=torch.float32)
    kernel(kron_wgrads_kernel, *args, "float32", False, *tail)(g3, x3, w1, w2, p1, p2, gxa, float(gamma))
    finish_launch(dev, [whole_job(p1, ns, out[0], (Ap, Bp)), whole_job(p2, ns, out[1], (Cp, Dp))])
    return head + out


def bypass_bwd(grad, x, w1, w2, gamma, cfg=None):
    c = compute_dtype(x, w1, w2)
    a, b = w1.shape
    cc, d = w2.shape
    T_ = x.shape[0]
    g3 = prep(grad, c).view(T_, a, cc)
    x3 = prep(x, c).view(T_, b, d)
    w1c, w2c = prep(w1, c), prep(w2, c)
    cf = launch_config(BYPASS, cfg)

    def fits(gx_size: int) -> bool:  # else (wide factors: shared memory or accumulator registers) the separate kernels
        need = wgrads_smem(a, b, cc, d, cf["rows"], cf["threads"], g3.element_size(), gx_size)
        regs = wgrads_fragment_regs(a, b, cc, d, cf["rows"], cf["threads"], gx_size > 0)
        return need * _SMEM_MARGIN <= smem_limit(x.device) and regs <= WGRADS_MAX_FRAGMENT_REGS

    # the whole backward in one pass where it fits; else gx by the apply kernel and the weight
    # gradients in one pass; else the separate kernels
    if fits(x.element_size()):
        return _wgrads(g3, x3, w1c, w2c, gamma, (w1.dtype, w2.dtype), cfg, x.dtype)
    gx = _apply(g3, aligned(w1c.t().contiguous()), aligned(w2c.t().contiguous()), None, gamma, x.dtype, cfg)
    if fits(0):
        return (gx,) + _wgrads(g3, x3, w1c, w2c, gamma, (w1.dtype, w2.dtype), cfg)
    Ap, Bp, Cp, Dp = (pad_rank(n) for n in (a, b, cc, d))
    g_w1 = _wgrad(kron_wgrad1_kernel, g3, x3, w2c, (a, b), (Ap, Bp), Bp, Cp, gamma, w1.dtype, cfg)
    g_w2 = _wgrad(kron_wgrad2_kernel, g3, x3, w1c, (cc, d), (Cp, Dp), Ap, Dp, gamma, w2.dtype, cfg)
    return gx, g_w1, g_w2


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (kron_apply_kernel, (3, 5, 7, 4, d, d, d)),
        (kron_apply_kernel, (3, 5, 7, 4, d, d, d, 128, 128, True)),  # staged
        (kron_apply_kernel, (64, 64, 64, 64, d, None, d, 128, 128, True)),
        (kron_apply_kernel, (64, 64, 64, 64, d, d, d, 128, 128, True, 16)),
        (kron_wgrad1_kernel, (5, 7, 4, 3, d, "float32", False, 128, 128, 4)),
        (kron_wgrad2_kernel, (5, 7, 4, 3, d, d, True, 128, 128, 16)),
        (kron_wgrad1_kernel, (3, 5, 7, 4, d, d, True)),
        (kron_wgrads_kernel, (3, 5, 7, 4, d, "float32", False, 128, 128, 4)),  # weight gradients in one pass
        (kron_wgrads_kernel, (64, 64, 64, 64, d, d, True, 128, 128, 16)),
        (kron_wgrads_kernel, (3, 5, 7, 4, d, "float32", False, 128, 128, 4, d)),  # and gx
        (kron_wgrad2_kernel, (3, 5, 7, 4, d, "float32", False)),
    ]
