"""TileLang kernels of DoRA (docs/ops.md §2.4): ``dora_fwd`` and ``dora_bwd``.

Same numerics as ``reference/dora.py``: ``M = w + delta`` is read in-kernel
(each operand in its own dtype, summed in fp32) and never stored;
ε = ``finfo(dscale.dtype).eps``; norms are fp32; y and g_M are rounded once
into w's dtype, g_dscale into dscale's dtype; the backward uses the exact
derivative ``n²·‖M_r‖`` (‖M_r‖ recomputed in the same pass as ρ).

Geometry: a *norm vector* r is a row of M (row_axis 0) or a column
(row_axis 1). The matrix is read as ``(R0, R1V, VEC)`` (R1 = R1V·VEC, a static
16-byte vector width), every size a ``T.dynamic`` variable.

* row_axis 0 (``cols=False``): a program owns BR whole rows and walks their
  columns in tiles of BC vectors;
* row_axis 1 (``cols=True``): a program owns BC column vectors (VEC·BC norm
  vectors) and walks all rows in tiles of BR rows — loads stay coalesced along
  the contiguous axis.

One kernel per op, two passes over the program's norm vectors (the second
mostly from L2):

``dora_fwd``: pass 1 ``Σ M²`` in an fp32 fragment -> ``n = ‖M_r‖ + ε``,
  ``s = mult·(dscale/n − 1) + 1`` (norms stored); pass 2 ``y = s·M``.
``dora_bwd``: pass 1 ``ρ = Σ G⊙M`` and ``Σ M²``; ``g_dscale = mult·ρ/n``,
  ``coef = mult·dscale·ρ/(n²·‖M‖)`` (0 for a zero vector); pass 2
  ``g_M = s·G − coef·M``.

The per-vector s and coef live in shared memory: as (BR,) fragments they pinned the second
pass's loop layout to their few owning threads (4 of 128 threads did the whole pass, sm_90a).
"""
import torch

from lycoris_ops.backends.tilelang.common import (aligned, arch_of, cdiv, kernel, launch_config, next_pow2, num_sms, tl_dtype)
from lycoris_ops.backends.tilelang.kernels.lora import _scopes

__all__ = ["dora_fwd_kernel", "dora_bwd_kernel", "dora_fwd", "dora_bwd", "compile_specs"]

_THREADS = 128
_TILE_VECS = 512
#: the fixed launch config (the tuner's ``{}`` candidate); a tuned ``cfg`` (backends/tilelang/tuning/dora.py:
#: ``TILELANG``) overrides the vectors per tile and the threads
DORA = dict(vecs=_TILE_VECS, threads=_THREADS)


def dora_fwd_kernel(wd: str, dd: str, sd: str, cols: bool, has_delta: bool, VEC: int, BR: int, BC: int,
                    threads_: int = _THREADS, cpu: bool = False):
    """y = s·M and norms n (fp32) for M = W (+ D); see the module docstring."""
    import tilelang.language as T

    alloc_s, alloc, par, nthreads = _scopes(T, cpu)
    threads = nthreads(threads_)
    R0, R1V, NR = T.dynamic("R0 R1V NR")
    NV = BC * VEC

    def load_m(W, D, r, c, v):
        m = T.cast(W[r, c, v], "float32")
        if has_delta:
            m = m + T.cast(D[r, c, v], "float32")
        return m

    if not cols:
        @T.prim_func
        def dora_fwd_rows(W: T.Tensor((R0, R1V, VEC), wd), D: T.Tensor((R0, R1V, VEC), dd),
                          S: T.Tensor((NR,), sd), Y: T.Tensor((R0, R1V, VEC), wd), N: T.Tensor((NR,), "float32"),
                          mult: T.float32, eps: T.float32):
            with T.Kernel(T.ceildiv(R0, BR), threads=threads) as bx:
                r0 = bx * BR
                acc = alloc((BR, NV), "float32")
                ss = alloc((BR,), "float32")
                sc = alloc_s((BR,), "float32")
                T.clear(acc)
                for t in T.serial(T.ceildiv(R1V, BC)):
                    for i, j, v in par(BR, BC, VEC):
                        if r0 + i < R0 and t * BC + j < R1V:
                            m = load_m(W, D, r0 + i, t * BC + j, v)
                            acc[i, j * VEC + v] += m * m
                T.reduce_sum(acc, ss, dim=1)
                for i in par(BR):
                    if r0 + i < R0:
                        n = T.sqrt(ss[i]) + eps
                        sc[i] = mult * (T.cast(S[r0 + i], "float32") / n - 1.0) + 1.0
                        N[r0 + i] = n
                for t in T.serial(T.ceildiv(R1V, BC)):
                    for i, j, v in par(BR, BC, VEC):
                        if r0 + i < R0 and t * BC + j < R1V:
                            Y[r0 + i, t * BC + j, v] = T.cast(load_m(W, D, r0 + i, t * BC + j, v) * sc[i], wd)

        return dora_fwd_rows

    @T.prim_func
    def dora_fwd_cols(W: T.Tensor((R0, R1V, VEC), wd), D: T.Tensor((R0, R1V, VEC), dd),
                      S: T.Tensor((NR,), sd), Y: T.Tensor((R0, R1V, VEC), wd), N: T.Tensor((NR,), "float32"),
                      mult: T.float32, eps: T.float32):
        with T.Kernel(T.ceildiv(R1V, BC), threads=threads) as bx:
            c0 = bx * BC
            acc = alloc((BR, NV), "float32")
            ss = alloc((NV,), "float32")
            sc = alloc_s((NV,), "float32")
            T.clear(acc)
            for t in T.serial(T.ceildiv(R0, BR)):
                for i, j, v in par(BR, BC, VEC):
                    if t * BR + i < R0 and c0 + j < R1V:
                        m = load_m(W, D, t * BR + i, c0 + j, v)
                        acc[i, j * VEC + v] += m * m
            T.reduce_sum(acc, ss, dim=0)
            for jv in par(NV):
                if c0 * VEC + jv < NR:
                    n = T.sqrt(ss[jv]) + eps
                    sc[jv] = mult * (T.cast(S[c0 * VEC + jv], "float32") / n - 1.0) + 1.0
                    N[c0 * VEC + jv] = n
            for t in T.serial(T.ceildiv(R0, BR)):
                for i, j, v in par(BR, BC, VEC):
                    if t * BR + i < R0 and c0 + j < R1V:
                        Y[t * BR + i, c0 + j, v] = T.cast(load_m(W, D, t * BR + i, c0 + j, v) * sc[j * VEC + v], wd)

    return dora_fwd_cols


def dora_bwd_kernel(gd: str, wd: str, dd: str, sd: str, nd: str, cols: bool, has_delta: bool, VEC: int, BR: int,
                    BC: int, threads_: int = _THREADS, cpu: bool = False):
    """g_M = s·G − coef·M and g_dscale = mult·ρ/n; see the module docstring."""
    import tilelang.language as T

    alloc_s, alloc, par, nthreads = _scopes(T, cpu)
    threads = nthreads(threads_)
    R0, R1V, NR = T.dynamic("R0 R1V NR")
    NV = BC * VEC

    def load_m(W, D, r, c, v):
        m = T.cast(W[r, c, v], "float32")
        if has_delta:
            m = m + T.cast(D[r, c, v], "float32")
        return m

    if not cols:
        @T.prim_func
        def dora_bwd_rows(G: T.Tensor((R0, R1V, VEC), gd), W: T.Tensor((R0, R1V, VEC), wd),
                          D: T.Tensor((R0, R1V, VEC), dd), S: T.Tensor((NR,), sd), N: T.Tensor((NR,), nd),
                          GM: T.Tensor((R0, R1V, VEC), wd), GS: T.Tensor((NR,), sd), mult: T.float32):
            with T.Kernel(T.ceildiv(R0, BR), threads=threads) as bx:
                r0 = bx * BR
                acc_r = alloc((BR, NV), "float32")
                acc_m = alloc((BR, NV), "float32")
                rho = alloc((BR,), "float32")
                ss = alloc((BR,), "float32")
                sc = alloc_s((BR,), "float32")
                cf = alloc_s((BR,), "float32")
                T.clear(acc_r)
                T.clear(acc_m)
                for t in T.serial(T.ceildiv(R1V, BC)):
                    for i, j, v in par(BR, BC, VEC):
                        if r0 + i < R0 and t * BC + j < R1V:
                            m = load_m(W, D, r0 + i, t * BC + j, v)
                            acc_r[i, j * VEC + v] += T.cast(G[r0 + i, t * BC + j, v], "float32") * m
                            acc_m[i, j * VEC + v] += m * m
                T.reduce_sum(acc_r, rho, dim=1)
                T.reduce_sum(acc_m, ss, dim=1)
                for i in par(BR):
                    if r0 + i < R0:
                        n = T.cast(N[r0 + i], "float32")
                        ds = T.cast(S[r0 + i], "float32")
                        mn = T.sqrt(ss[i])
                        mn = T.if_then_else(mn > 0.0, mn, 1.0)
                        sc[i] = mult * (ds / n - 1.0) + 1.0
                        cf[i] = (mult * ds * rho[i]) / (n * n * mn)
                        GS[r0 + i] = T.cast(mult * rho[i] / n, sd)
                for t in T.serial(T.ceildiv(R1V, BC)):
                    for i, j, v in par(BR, BC, VEC):
                        if r0 + i < R0 and t * BC + j < R1V:
                            GM[r0 + i, t * BC + j, v] = T.cast(
                                sc[i] * T.cast(G[r0 + i, t * BC + j, v], "float32")
                                - cf[i] * load_m(W, D, r0 + i, t * BC + j, v), wd)

        return dora_bwd_rows

    @T.prim_func
    def dora_bwd_cols(G: T.Tensor((R0, R1V, VEC), gd), W: T.Tensor((R0, R1V, VEC), wd),
                      D: T.Tensor((R0, R1V, VEC), dd), S: T.Tensor((NR,), sd), N: T.Tensor((NR,), nd),
                      GM: T.Tensor((R0, R1V, VEC), wd), GS: T.Tensor((NR,), sd), mult: T.float32):
        with T.Kernel(T.ceildiv(R1V, BC), threads=threads) as bx:
            c0 = bx * BC
            acc_r = alloc((BR, NV), "float32")
            acc_m = alloc((BR, NV), "float32")
            rho = alloc((NV,), "float32")
            ss = alloc((NV,), "float32")
            sc = alloc_s((NV,), "float32")
            cf = alloc_s((NV,), "float32")
            T.clear(acc_r)
            T.clear(acc_m)
            for t in T.serial(T.ceildiv(R0, BR)):
                for i, j, v in par(BR, BC, VEC):
                    if t * BR + i < R0 and c0 + j < R1V:
                        m = load_m(W, D, t * BR + i, c0 + j, v)
                        acc_r[i, j * VEC + v] += T.cast(G[t * BR + i, c0 + j, v], "float32") * m
                        acc_m[i, j * VEC + v] += m * m
            T.reduce_sum(acc_r, rho, dim=0)
            T.reduce_sum(acc_m, ss, dim=0)
            for jv in par(NV):
                if c0 * VEC + jv < NR:
                    n = T.cast(N[c0 * VEC + jv], "float32")
                    ds = T.cast(S[c0 * VEC + jv], "float32")
                    mn = T.sqrt(ss[jv])
                    mn = T.if_then_else(mn > 0.0, mn, 1.0)
                    sc[jv] = mult * (ds / n - 1.0) + 1.0
                    cf[jv] = (mult * ds * rho[jv]) / (n * n * mn)
                    GS[c0 * VEC + jv] = T.cast(mult * rho[jv] / n, sd)
            for t in T.serial(T.ceildiv(R0, BR)):
                for i, j, v in par(BR, BC, VEC):
                    if t * BR + i < R0 and c0 + j < R1V:
                        GM[t * BR + i, c0 + j, v] = T.cast(
                            sc[j * VEC + v] * T.cast(G[t * BR + i, c0 + j, v], "float32")
                            - cf[j * VEC + v] * load_m(W, D, t * BR + i, c0 + j, v), wd)

    return dora_bwd_cols


# --------------------------------------------------------------------------- host side

def _vec(n: int, *dtypes: torch.dtype) -> int:
    cap = min(16 // torch.empty((), dtype=d).element_size() for d in dtypes)
    for v in (8, 4, 2, 1):
        if v <= cap and n % v == 0:
            return v
    return 1


def plan(R0: int, R1: int, row_axis: int, vec: int, device: torch.device, vecs: int = _TILE_VECS):
    """(BR, BC) of the tiling of about ``vecs`` vectors (see the module docstring)."""
    return tiling(R0, R1, row_axis, vec, num_sms(device), vecs)


#: row_axis 0: the most vectors of a row one column tile takes. A program's passes walk its
#: rows' tiles serially, each a load latency (the loop is dynamic: no prefetch), so a wider
#: tile means fewer serial steps (512: a 4096-wide bf16 row in one step; measured faster than
#: 128 or 256 at the bench shapes)
ROW_BC = 512


def tiling(R0: int, R1: int, row_axis: int, vec: int, sms: int, vecs: int = _TILE_VECS):
    """``plan`` on a GPU of ``sms`` SMs (also the planner's model: backends/tilelang/tuning/dora.py)."""
    r1v = R1 // vec
    if row_axis == 0:
        bc = min(ROW_BC, vecs, next_pow2(r1v))
        return max(1, vecs // bc), bc
    bc = 1
    for cand in (16, 8, 4, 2):
        if cdiv(r1v, cand) >= sms:
            bc = cand
            break
    return max(1, min(vecs // bc, next_pow2(R0))), bc


def dora_fwd(w, dscale, mult, row_axis, delta=None, cfg=None):
    """DoRA forward (see ``reference.dora.dora_fwd``): one kernel. Returns (y, norms)."""
    p = launch_config(DORA, cfg)
    R0, R1 = w.shape
    rows = w.shape[row_axis]
    y = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    norms = torch.empty((rows,), device=w.device, dtype=torch.float32)
    if w.numel() == 0:
        norms.fill_(torch.finfo(dscale.dtype).eps)
        return y, norms
    dts = [w.dtype] + ([] if delta is None else [delta.dtype])
    vec = _vec(R1, *dts)
    br, bc = plan(R0, R1, row_axis, vec, w.device, p["vecs"])
    wc = aligned(w.contiguous())
    dc = wc if delta is None else aligned(delta.contiguous())
    sc = aligned(dscale.reshape(-1).contiguous())
    k = kernel(dora_fwd_kernel, arch_of(w.device), tl_dtype(w.dtype), tl_dtype(dc.dtype), tl_dtype(dscale.dtype),
               row_axis == 1, delta is not None, vec, br, bc, p["threads"])
    v3 = (R0, R1 // vec, vec)
    k(wc.view(v3), dc.view(v3), sc, y.view(v3), norms, float(mult), float(torch.finfo(dscale.dtype).eps))
    return y, norms


def dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None, cfg=None):
    """DoRA backward (see ``reference.dora.dora_bwd``): one kernel. Returns (g_M, g_dscale)."""
    p = launch_config(DORA, cfg)
    R0, R1 = w.shape
    rows = w.shape[row_axis]
    g_m = torch.empty(w.shape, device=w.device, dtype=w.dtype)
    g_d = torch.empty((rows,), device=w.device, dtype=dscale.dtype)
    if w.numel() == 0:
        g_d.zero_()
        return g_m, g_d
    dts = [w.dtype, grad.dtype] + ([] if delta is None else [delta.dtype])
    vec = _vec(R1, *dts)
    br, bc = plan(R0, R1, row_axis, vec, w.device, p["vecs"])
    wc = aligned(w.contiguous())
    dc = wc if delta is None else aligned(delta.contiguous())
    gc = aligned(grad.contiguous())
    sc = aligned(dscale.reshape(-1).contiguous())
    nc = aligned(norms.contiguous())
    k = kernel(dora_bwd_kernel, arch_of(w.device), tl_dtype(grad.dtype), tl_dtype(w.dtype), tl_dtype(dc.dtype),
               tl_dtype(dscale.dtype), tl_dtype(norms.dtype), row_axis == 1, delta is not None, vec, br, bc,
               p["threads"])
    v3 = (R0, R1 // vec, vec)
    k(gc.view(v3), wc.view(v3), dc.view(v3), sc, nc, g_m.view(v3), g_d, float(mult))
    return g_m, g_d


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (dora_fwd_kernel, (d, d, d, False, True, 8, 4, 128)),
        (dora_fwd_kernel, (d, d, "float32", True, False, 8, 64, 8)),
        (dora_bwd_kernel, (d, d, d, d, "float32", False, True, 8, 4, 128)),
        (dora_bwd_kernel, (d, d, d, "float32", "float32", True, False, 8, 64, 8)),
    ]
