"""The Cayley algebra of the diag-OFT and BOFT kernels (device code): the per-group
Gauss–Jordan solve and the group matrices F (``cayley_kernel``, and the direct kernels'
prologue ``group_f_macro``), and the backward's chain (``chain_kernel``). The launches are
``oft.py``'s and ``boft.py``'s.

Per block k: ``Q_k = cscale·(B_k − B_kᵀ)``, ``M_k = (I − Q_k)⁻¹``, ``R_k = 2M_k − I``;
diag-OFT's ``F_k = diag(ρ_k)·R_kᵀ − shift·I``, BOFT's ``F = scale·R + (1 − scale)·I`` per
stage. NB = GP // S consecutive blocks form one group of GC = NB·S channels, padded to GP (a
power of two, 32 or 64): the group matrix is block-diagonal with zero padding.

``cayley_kernel`` (one program per group, tiny): the fp32 Cayley transform of the group's
    blocks from the fp32-upcast raw blocks — Gauss–Jordan without pivoting on the
    block-diagonal ``I − Q`` (valid: its symmetric part is I), in shared memory, the group's
    NB blocks side by side: S steps of one barrier each (two buffer pairs, each step reading
    one and writing the other, over the blocks' entries alone where there are enough of
    them) — then F (or Fᵀ) with rescale / shift / scale folded in, stored as a hi + lo pair
    in the GEMM dtype (hi = F rounded to a 16-bit type, or to TF32 for fp32 GEMMs; lo = F −
    hi), so that the tensor-core GEMMs reproduce fp32 F to about 2^-16 (16-bit) / 2^-21 (TF32).
``chain_kernel`` (one program per group, tiny): sums the partials, rebuilds M by
    Gauss–Jordan, ``g_rescale = rowsum(P ⊙ Rᵀ)``, ``gR = (diag(ρ)·P)ᵀ`` (OFT) or ``scale·P``
    (BOFT), ``gQ = 2·Mᵀ·gR·Mᵀ``, ``g_blocks = cscale·(gQ − gQᵀ)`` (fp32 scalar loops, no TF32),
    stored in blocks' dtype.
"""
__all__ = ["cayley_kernel", "chain_kernel", "chain_blocks", "group_f_macro", "tf32_hi", "hi_lo", "perm", "run_slot",
           "THREADS"]

#: threads of a Cayley / chain program (and the streaming kernels' default)
THREADS = 128
#: the fewest block entries (NB·S²) for the Gauss–Jordan step over the blocks' entries alone
#: (``_cayley_macros``) and the chain kernel's ``blocks`` form (``chain_blocks``): at least the
#: threads of any kernel that solves (the direct kernels run up to 384)
_GJ_ENTRIES_MIN = 512
#: the fp32 partials' dtype: a name in the kernels' annotations (pyflakes reads a string
#: literal there as a forward reference)
_F32 = "float32"


def tf32_hi(T, f):
    """f with its low 13 mantissa bits cleared (exactly representable in TF32)."""
    bits = T.reinterpret(f, "uint32")
    return T.reinterpret(T.bitwise_and(bits, T.uint32(0xFFFFE000)), "float32")


def hi_lo(T, f, cdt):
    """(hi, lo) of the fp32 value f in the GEMM dtype cdt."""
    if cdt == "float32":
        hi = tf32_hi(T, f)
        return hi, f - hi
    hi = T.cast(f, cdt)
    return hi, T.cast(f - T.cast(hi, "float32"), cdt)


def perm(pos, kappa, has_perm):
    """BOFT stage permutation π(pos) = ⌊pos/2κ⌋·2κ + (pos mod 2)·κ + ⌊(pos mod 2κ)/2⌋."""
    if not has_perm:
        return pos
    two = 2 * kappa
    return (pos // two) * two + (pos % 2) * kappa + (pos % two) // 2


def run_slot(T, pos, kappa, half):
    """BOFT's run basis (``boft.py``: the stage kernels read a group as two runs of ``half``
    channels): the slot of stage position ``pos`` (κ = ``kappa``) in its group's tile. Channel
    c = π(pos) in the view (·, C/2κ', 2, κ') with κ' = max(κ, half): slot = h·half + (j mod
    half), h = ⌊(c mod 2κ')/κ'⌋, j = c mod κ' (a group is one 2κ' segment's two runs).
    Truncating division (every operand is >= 0): with ``//`` / ``%`` TVM cannot prove the
    signs of these runtime values, writes each floor division as nested sign tests, and its
    Simplify pass took seconds of every build of a kernel with this table."""
    div, mod = T.truncdiv, T.truncmod
    two = 2 * kappa
    c = div(pos, two) * two + mod(pos, 2) * kappa + div(mod(pos, two), 2)  # π(pos), as perm
    kp = T.if_then_else(kappa > half, kappa, half)
    return div(mod(c, 2 * kp), kp) * half + mod(mod(c, kp), half)


def _cayley_macros(T, par, alloc_s, S, NB, GP):
    """Macros of the per-group Cayley algebra (closures over the static sizes)."""
    GC = NB * S

    @T.macro
    def build_system(B, A, Mi, g, cscale, KB):
        # A = I − cscale·(B_k − B_kᵀ) on the group's valid block entries (identity padding), Mi = I;
        # one store per entry (a store then an update of A made TileLang put a barrier between
        # them, so each thread's block loads ran one after the other)
        for i, j in par(GP, GP):
            A[i, j] = T.if_then_else(i == j, 1.0, 0.0) - T.if_then_else(
                i < GC and j < GC and i // S == j // S and g * NB + i // S < KB,
                cscale * (T.cast(B[g * NB + i // S, i % S, j % S], "float32")
                          - T.cast(B[g * NB + i // S, j % S, i % S], "float32")), 0.0)
            Mi[i, j] = T.if_then_else(i == j, 1.0, 0.0)

    # The system is block diagonal (NB blocks of S, identity padding past GC), so Gauss–Jordan
    # runs the NB blocks side by side: step kk pivots on row kk of each block, S steps instead of
    # GP (GP = 64 at s = 24: 24 for 64). Within a block the operations are the full solve's, in
    # its order (its steps on other blocks only subtracted exact zeros); the entries off the
    # blocks (zeros, the padding's identity) never change. The steps alternate between two
    # buffer pairs, one barrier a step. ``entries``: a step loops over the blocks' NB·S² entries
    # alone (1152 of 4096 at s = 24) where they are at least ``_GJ_ENTRIES_MIN``: a parallel loop
    # shorter than the threads becomes one thread-guarded branch, and TileLang refuses the
    # barrier the next step then needs inside it (S = 6, NB <= 2 at sm_90a:
    # bench/tilelang_compile_sweep.py).
    entries = NB * S * S >= _GJ_ENTRIES_MIN

    @T.macro
    def gj_entry(A, Mi, A2, M2, i, j, pv):
        # entry (i, j) of a block after the step whose pivot (of i's block) is row pv
        rp = 1.0 / A[pv, pv]
        if i == pv:
            A2[i, j] = A[pv, j] * rp
            M2[i, j] = Mi[pv, j] * rp
        else:
            A2[i, j] = A[i, j] - A[i, pv] * (A[pv, j] * rp)
            M2[i, j] = Mi[i, j] - A[i, pv] * (Mi[pv, j] * rp)

    @T.macro
    def gj_step(A, Mi, A2, M2, kk):
        # step kk of the block-parallel Gauss–Jordan from (A, Mi) into (A2, M2): nothing read is
        # written, so the step needs the one barrier before the next step reads (A2, M2). The
        # blocks' entries alone (``entries``; the rest copied once, gauss_jordan_pingpong), or
        # every entry of the group (the rest copied each step)
        if entries:
            for b, r, c in par(NB, S, S):
                gj_entry(A, Mi, A2, M2, b * S + r, b * S + c, b * S + kk)
        else:
            for i, j in par(GP, GP):
                if i < GC and j < GC and i // S == j // S:
                    gj_entry(A, Mi, A2, M2, i, j, i // S * S + kk)
                else:
                    A2[i, j] = A[i, j]
                    M2[i, j] = Mi[i, j]

    @T.macro
    def gauss_jordan_pingpong(A, Mi, A2, M2):
        # Mi <- A⁻¹ (A destroyed), no pivoting: the steps alternate between the two buffer pairs;
        # an odd S's last step lands in (A2, M2) and is copied back. ``entries``: the second pair
        # takes the first's entries off the blocks first (only those: a copy of the blocks too
        # would race the first step's stores)
        if entries:
            for i, j in par(GP, GP):
                if i >= GC or j >= GC or i // S != j // S:
                    A2[i, j] = A[i, j]
                    M2[i, j] = Mi[i, j]
        for k2 in T.serial(S // 2):
            gj_step(A, Mi, A2, M2, 2 * k2)
            gj_step(A2, M2, A, Mi, 2 * k2 + 1)
        if S % 2 == 1:
            gj_step(A, Mi, A2, M2, S - 1)
            for i, j in par(GP, GP):
                A[i, j] = A2[i, j]
                Mi[i, j] = M2[i, j]

    @T.macro
    def invert_with(A, Mi, A2, M2):
        # Mi <- A⁻¹ with (A2, M2) as the second buffer pair (free buffers of the caller)
        gauss_jordan_pingpong(A, Mi, A2, M2)

    @T.macro
    def invert(A, Mi):
        # invert_with, the second buffer pair its own
        A2 = alloc_s((GP, GP), "float32")
        M2 = alloc_s((GP, GP), "float32")
        invert_with(A, Mi, A2, M2)

    @T.macro
    def run_slots(slot, g, gps):
        # BOFT's run basis (``runs``): the slot of each group position, an index table (simpler
        # lowering than the expression at each use); the padding slots are themselves
        for i in par(GP):
            slot[i] = T.if_then_else(
                i < GC, run_slot(T, T.truncmod(g, gps) * GC + i, (S // 2) << T.truncdiv(g, gps), GC // 2), i)

    @T.macro
    def load_rho(RS, rho, g, g_rs, kappa, KB, has_rescale, has_perm):
        # ρ of the group's rows (1 where there is no rescale, or before BOFT's last stage)
        for i in par(GP):
            if has_rescale:  # one store (see build_system)
                rho[i] = T.if_then_else(g >= g_rs and i < GC and g * NB + i // S < KB,
                                        T.cast(RS[perm((g - g_rs) * GC + i, kappa, has_perm)], "float32"), 1.0)
            else:
                rho[i] = 1.0

    def f_entry(Mi, rho, i, j, g, fcoef, KB, boft):
        # entry (i, j) of the group matrix F from M = (I − Q)⁻¹ (an expression; 0 off the blocks)
        eye = T.if_then_else(i == j, 1.0, 0.0)
        if boft:
            f = rho[i] * (fcoef * (2.0 * Mi[i, j] - eye) + (1.0 - fcoef) * eye)
        else:
            f = rho[i] * (2.0 * Mi[j, i] - eye) - fcoef * eye
        # (a Python function, not parsed: T.And where the kernels write ``and``)
        return T.if_then_else(T.And(T.And(i < GC, j < GC), T.And(i // S == j // S, g * NB + i // S < KB)), f, 0.0)

    return build_system, (invert, invert_with), run_slots, load_rho, f_entry


def cayley_kernel(bd: str, rd: str, cdt: str, S: int, NB: int, GP: int, boft: bool, has_rescale: bool,
                  has_perm: bool, trans: bool, runs: bool = False, cpu: bool = False):
    """Group matrices F (trans: Fᵀ; ``"both"``: F and Fᵀ, one solve for the two pairs) as a (hi,
    lo) pair in cdt, (NG, GP, GP) each.

    OFT (boft=False): F = diag(ρ)·Rᵀ − fcoef·I (fcoef = shift). BOFT: F = fcoef·R +
    (1 − fcoef)·I (fcoef = scale), rows scaled by ρ[π(pos)] for groups g >= g_rs
    (the last stage; π with ``kappa`` when has_perm). OFT uses g_rs = 0 and
    pos = g·GC + i. Blocks B (KB, S, S); group g holds blocks g·NB … g·NB + NB − 1.
    ``runs`` (BOFT): rows and columns stored in the run basis of the group's stage
    (``run_slot``: stage g // gps, κ = S/2·2^stage) instead of stage positions; the
    padding slots GC … GP − 1 stay where they are (zeros).
    """
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    threads = 1 if cpu else THREADS
    GC = NB * S
    KB, NR, NG = T.dynamic("KB NR NG")
    build_system, (invert, _), run_slots, load_rho, f_entry = _cayley_macros(T, par, alloc_s, S, NB, GP)

    @T.macro
    def solve(B, RS, cscale, g_rs, kappa, gps, g, A, Mi, rho, slot):
        build_system(B, A, Mi, g, cscale, KB)
        if runs:
            run_slots(slot, g, gps)
        load_rho(RS, rho, g, g_rs, kappa, KB, has_rescale, has_perm)
        invert(A, Mi)

    want_f = trans in (False, "both")  # the F pair; "both" also the Fᵀ pair, from the same solve
    want_t = trans in (True, "both")

    @T.macro
    def put(H, L, g, r, c, fv):
        H[g, r, c] = hi_lo(T, fv, cdt)[0]
        L[g, r, c] = hi_lo(T, fv, cdt)[1]

    @T.macro
    def group(B, RS, FH, FL, TH, TL, cscale, fcoef, g_rs, kappa, gps, g):
        # A's rows padded by one word: after the solve it holds Fᵀ, written down its columns
        # (GP + 1 words apart: a different bank each) and read along its rows
        A = alloc_s((GP, GP + 1), "float32")
        Mi = alloc_s((GP, GP), "float32")
        rho = alloc_s((GP,), "float32")
        slot = alloc_s((GP if runs else 1,), "int32")
        solve(B, RS, cscale, g_rs, kappa, gps, g, A, Mi, rho, slot)
        for i, j in par(GP, GP):
            fv = f_entry(Mi, rho, i, j, g, fcoef, KB, boft)
            if want_f:
                put(FH, FL, g, slot[i] if runs else i, slot[j] if runs else j, fv)
            if want_t:
                A[j, i] = fv
        if want_t:
            # Fᵀ stored along its rows: a warp's stores to TH / TL are consecutive words of a row
            # (storing F's entries at (c, r) wrote one word a row, GP rows apart)
            for i, j in par(GP, GP):
                put(TH, TL, g, slot[i] if runs else i, slot[j] if runs else j, A[i, j])

    if trans == "both":
        # the backward's F (replay) and Fᵀ (stream) pairs from one solve: the Gauss–Jordan steps
        # are the launch's time, the second pair's stores are GP² entries a group
        @T.prim_func
        def cayley_both(B: T.Tensor((KB, S, S), bd), RS: T.Tensor((NR,), rd), FH: T.Tensor((NG, GP, GP), cdt),
                        FL: T.Tensor((NG, GP, GP), cdt), TH: T.Tensor((NG, GP, GP), cdt),
                        TL: T.Tensor((NG, GP, GP), cdt), cscale: T.float32, fcoef: T.float32, g_rs: T.int32,
                        kappa: T.int32, gps: T.int32):
            with T.Kernel(NG, threads=threads) as g:
                group(B, RS, FH, FL, TH, TL, cscale, fcoef, g_rs, kappa, gps, g)

        return cayley_both

    @T.prim_func  # one pair: F, or Fᵀ where trans (stored through the TH / TL slots of ``group``)
    def cayley(B: T.Tensor((KB, S, S), bd), RS: T.Tensor((NR,), rd), FH: T.Tensor((NG, GP, GP), cdt),
               FL: T.Tensor((NG, GP, GP), cdt), cscale: T.float32, fcoef: T.float32, g_rs: T.int32,
               kappa: T.int32, gps: T.int32):
        with T.Kernel(NG, threads=threads) as g:
            group(B, RS, FH, FL, FH, FL, cscale, fcoef, g_rs, kappa, gps, g)

    return cayley


def group_f_macro(T, cpu: bool, GP: int, cdt: str, cayley: tuple, trans: bool):
    """The direct kernels' prologue when they solve the Cayley transform themselves
    (``cayley`` = (blocks dtype, rescale dtype, S, has_rescale); None when they read an F
    pair): diag-OFT's F (``trans``: Fᵀ) of group g as a (hi, lo) pair in shared tiles."""
    if not cayley:
        return None
    _, _, S, has_rescale = cayley
    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    build_system, (invert, _), _, load_rho, f_entry = _cayley_macros(T, par, alloc_s, S, GP // S, GP)

    @T.macro
    def group_f(B, RS, Fh, Fl, g, cscale, fcoef, KB):
        A = alloc_s((GP, GP), "float32")
        Mi = alloc_s((GP, GP), "float32")
        rho = alloc_s((GP,), "float32")
        build_system(B, A, Mi, g, cscale, KB)
        load_rho(RS, rho, g, 0, 0, KB, has_rescale, False)
        invert(A, Mi)
        for i, j in par(GP, GP):
            fv = f_entry(Mi, rho, i, j, g, fcoef, KB, False)
            if trans:
                Fh[j, i] = hi_lo(T, fv, cdt)[0]
                Fl[j, i] = hi_lo(T, fv, cdt)[1]
            else:
                Fh[i, j] = hi_lo(T, fv, cdt)[0]
                Fl[i, j] = hi_lo(T, fv, cdt)[1]

    return group_f


def chain_kernel(bd: str, rd: str, S: int, NB: int, GP: int, boft: bool, has_rescale: bool, runs: bool = False,
                 blocks: bool = False, cpu: bool = False):
    """Cayley-chain backward per group from the fp32 partials P (NS, NG, GP, GP) (``runs``:
    BOFT's partials in the run basis of the group's stage, ``run_slot``; stage g // gps).

    OFT: g_rescale[g·GC + i] = Σ_j P[i,j]·R[j,i] (has_rescale), gR = (diag(ρ)·P)ᵀ;
    BOFT: gR = fcoef·P (fcoef = scale). Then gQ = 2·Mᵀ·gR·Mᵀ and
    GB[k] = cscale·(gQ − gQᵀ) on each block, in blocks' dtype. ``blocks`` (``chain_blocks``):
    the split sum and the
    two products over the blocks' NB·S² entries alone (every other entry of gR, Mᵀ·gR and gQ is
    zero or unused), the products' sums in registers.
    """
    import tilelang.language as T

    par = T.grid if cpu else T.Parallel
    alloc_s = T.alloc_local if cpu else T.alloc_shared
    alloc_f = T.alloc_local if cpu else T.alloc_fragment
    threads = 1 if cpu else THREADS
    GC = NB * S
    KB, NR, NGR, NG, NS = T.dynamic("KB NR NGR NG NS")
    build_system, (_, invert_with), run_slots, load_rho, _ = _cayley_macros(T, par, alloc_s, S, NB, GP)
    full_chain, block_chain = _chain_macros(T, par, alloc_s, alloc_f, S, NB, GP, boft, has_rescale, runs, bd,
                                            invert_with)

    @T.prim_func
    def oft_chain(P: T.Tensor((NS, NG, GP, GP), _F32), B: T.Tensor((KB, S, S), bd), RS: T.Tensor((NR,), rd),
                  GB: T.Tensor((KB, S, S), bd), GR: T.Tensor((NGR,), bd), cscale: T.float32, fcoef: T.float32,
                  gps: T.int32):
        with T.Kernel(NG, threads=threads) as g:
            A = alloc_s((GP, GP), "float32")
            Mi = alloc_s((GP, GP), "float32")
            rho = alloc_s((GP,), "float32")
            Ps = alloc_s((GP, GP), "float32")
            gR = alloc_s((GP, GP), "float32")
            T1 = alloc_s((GP, GP), "float32")
            slot = alloc_s((GP if runs else 1,), "int32")
            build_system(B, A, Mi, g, cscale, KB)
            load_rho(RS, rho, g, 0, 0, KB, has_rescale, False)
            if runs:
                run_slots(slot, g, gps)
            if blocks:
                block_chain(P, GB, GR, cscale, fcoef, g, A, Mi, rho, Ps, gR, T1, slot, KB, NS)
            else:
                full_chain(P, GB, GR, cscale, fcoef, g, A, Mi, rho, Ps, gR, T1, slot, KB, NS)

    return oft_chain


def _chain_macros(T, par, alloc_s, alloc_f, S, NB, GP, boft, has_rescale, runs, bd, invert_with):
    """The two bodies of ``chain_kernel`` after the system is built: ``full_chain`` over the
    group's GP x GP entries, ``block_chain`` over its blocks' entries alone."""
    GC = NB * S

    @T.macro
    def rescale_grad(GR, Ps, Mi, g, KB, accr, full):
        # g_rescale[i] = Σ_j Ps[i, j]·R[j, i], R = 2M − I (Ps is zero off the blocks: ``full`` sums
        # the whole row, else the S columns of row i's block)
        T.clear(accr)
        for jj in T.serial(GP if full else S):
            for i in par(GP):
                if full:
                    accr[i] += Ps[i, jj] * (2.0 * Mi[jj, i] - T.if_then_else(i == jj, 1.0, 0.0))
                elif i < GC:
                    accr[i] += Ps[i, i // S * S + jj] * (2.0 * Mi[i // S * S + jj, i]
                                                         - T.if_then_else(i == i // S * S + jj, 1.0, 0.0))
        for i in par(GP):
            if i < GC and g * NB + i // S < KB:
                GR[g * GC + i] = T.cast(accr[i], bd)

    @T.macro
    def full_chain(P, GB, GR, cscale, fcoef, g, A, Mi, rho, Ps, gR, T1, slot, KB, NS):
        acc = alloc_f((GP, GP), "float32")
        T.clear(acc)
        for s in T.serial(NS):
            for i, j in par(GP, GP):
                if runs:
                    acc[i, j] += P[s, g, slot[i], slot[j]]
                else:
                    acc[i, j] += P[s, g, i, j]
        for i, j in par(GP, GP):
            Ps[i, j] = T.if_then_else(
                i < GC and j < GC and i // S == j // S and g * NB + i // S < KB, acc[i, j], 0.0)
        invert_with(A, Mi, gR, T1)  # gR and T1 are free until after the solve
        if boft:
            for i, j in par(GP, GP):
                gR[i, j] = fcoef * Ps[i, j]
        else:
            for i, j in par(GP, GP):
                gR[i, j] = rho[j] * Ps[j, i]
            if has_rescale:
                accr = alloc_f((GP,), "float32")
                rescale_grad(GR, Ps, Mi, g, KB, accr, True)
        # T1 = Mᵀ·gR, then gQ = 2·T1·Mᵀ (kept in A). M is block diagonal, so each sum runs over
        # the S indices of a block (row i's for Mᵀ·gR, column j's for ·Mᵀ): only gQ's diagonal
        # blocks are used. Rows past GC (padding) sum nothing.
        T.clear(acc)
        for ll in T.serial(S):
            for i, j in par(GP, GP):
                if i < GC:
                    acc[i, j] += Mi[i // S * S + ll, i] * gR[i // S * S + ll, j]
        T.copy(acc, T1)
        T.clear(acc)
        for ll in T.serial(S):
            for i, j in par(GP, GP):
                if j < GC:
                    acc[i, j] += T1[i, j // S * S + ll] * Mi[j, j // S * S + ll]
        T.copy(acc, A)
        for i, j in par(GP, GP):
            if i < GC and j < GC and i // S == j // S and g * NB + i // S < KB:
                GB[g * NB + i // S, i % S, j % S] = T.cast(2.0 * cscale * (A[i, j] - A[j, i]), bd)

    @T.macro
    def block_chain(P, GB, GR, cscale, fcoef, g, A, Mi, rho, Ps, gR, T1, slot, KB, NS):
        # full_chain's algebra on the blocks' entries (b, r, c) -> (b·S + r, b·S + c) alone: gR,
        # Mᵀ·gR and gQ are block diagonal, so every sum runs over a block's S indices; the two
        # products accumulate in a (NB, S, S) fragment (NB·S² / threads entries a thread)
        accb = alloc_f((NB, S, S), "float32")
        T.clear(accb)
        for s in T.serial(NS):
            for b, r, c in par(NB, S, S):
                if runs:
                    accb[b, r, c] += P[s, g, slot[b * S + r], slot[b * S + c]]
                else:
                    accb[b, r, c] += P[s, g, b * S + r, b * S + c]
        for b, r, c in par(NB, S, S):
            Ps[b * S + r, b * S + c] = accb[b, r, c]
        invert_with(A, Mi, gR, T1)  # gR and T1 are free until after the solve
        for b, r, c in par(NB, S, S):
            if boft:
                gR[b * S + r, b * S + c] = fcoef * Ps[b * S + r, b * S + c]
            else:
                gR[b * S + r, b * S + c] = rho[b * S + c] * Ps[b * S + c, b * S + r]
        if has_rescale and not boft:
            accr = alloc_f((GP,), "float32")
            rescale_grad(GR, Ps, Mi, g, KB, accr, False)
        # Mᵀ's blocks into A (free after the solve): the second product then reads along rows (a
        # thread's neighbours in c read neighbouring words, not one bank GP words apart)
        for b, r, c in par(NB, S, S):
            A[b * S + r, b * S + c] = Mi[b * S + c, b * S + r]
        T.clear(accb)
        for ll in T.serial(S):
            for b, r, c in par(NB, S, S):
                accb[b, r, c] += Mi[b * S + ll, b * S + r] * gR[b * S + ll, b * S + c]
        for b, r, c in par(NB, S, S):
            T1[b * S + r, b * S + c] = accb[b, r, c]
        T.clear(accb)
        for ll in T.serial(S):
            for b, r, c in par(NB, S, S):
                accb[b, r, c] += T1[b * S + r, b * S + ll] * A[b * S + ll, b * S + c]
        for b, r, c in par(NB, S, S):
            Ps[b * S + r, b * S + c] = accb[b, r, c]  # gQ / 2 (Ps is read no more)
        for b, r, c in par(NB, S, S):
            if g * NB + b < KB:
                GB[g * NB + b, r, c] = T.cast(2.0 * cscale * (Ps[b * S + r, b * S + c] - Ps[b * S + c, b * S + r]),
                                              bd)

    return full_chain, block_chain


def chain_blocks(S: int, NB: int) -> bool:
    """``chain_kernel``'s ``blocks`` form (the sums and products over the blocks' entries alone,
    not the whole GP x GP group: 1152 of 4096 entries at BOFT's s = 24), where the blocks have at
    least ``_GJ_ENTRIES_MIN`` entries (a parallel loop over fewer than the threads is one guarded
    branch) and a whole number of them a thread (TileLang finds no layout for the (NB, S, S)
    fragment otherwise: S = 24 or 40 alone at 128 threads, sm_90a)."""
    n = NB * S * S
    return n >= _GJ_ENTRIES_MIN and n % THREADS == 0
