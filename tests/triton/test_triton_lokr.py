"""Triton LoKr kernels (lycoris_ops/backends/triton/kernels/lokr.py) against an fp64 oracle.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1) on CPU tensors; bf16 dots are upcast there (see
_common.dot_dtype), fp16 runs the real 16-bit dots including the hi/lo split
of the unrounded fp32 intermediates. The oracle is an explicit ``torch.kron``
(merges, bypass) and autograd of it (backward ops) in fp64, from the operands
rounded to the compute dtype. The compile-only test builds every kernel for
sm_90 in a subprocess without the interpreter.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from lycoris_ops.testing import REL_TOL, make, rel_err  # noqa: E402
from lycoris_ops.backends.triton.kernels import lokr as TK  # noqa: E402
from lycoris_ops.backends.triton.kernels import lokr_bypass as TKB  # noqa: E402
from triton_harness import run_compile_check  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and __name__ != "__main__":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
GAMMA = 0.7


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def mk(shape, dtype, g, nc=False):
    return make(shape, dtype, DEV, gen=g, noncontiguous=nc)


def mk_t(shape, dtype, g):
    """A transposed (column-major) view of the given shape."""
    return make(shape[::-1], dtype, DEV, gen=g).t()


def cd_of(*ts):
    return TK.compute_dtype(*(t.dtype for t in ts if t is not None))


def d64(t, c):
    return None if t is None else t.detach().to(c).double().cpu()


def close(actual, expected, tol, what):
    assert actual.device.type == DEV
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def o_kron(w1, w2):
    return torch.kron(w1.contiguous(), w2.contiguous())  # (kron rejects some strided views)


def o_side(wa, wb):
    return wa if wb is None else wa @ wb


# ----------------------------------------------------------------------------- merges


MERGE_CASES = [
    # (a, b, c, d, r1, r2, swap, split)
    (3, 5, 7, 19, 0, 0, False, 0),   # both whole (the lokr_full_merge path)
    (3, 5, 7, 19, 2, 0, False, 3),   # side 1 factored
    (3, 5, 7, 19, 0, 3, None, 0),    # side 2 factored
    (3, 5, 4, 6, 2, 3, True, 2),     # both factored, w1 tiled (swap)
    (3, 5, 4, 6, 2, 3, True, 12),    # both factored, a stack of 12 partials
    (3, 5, 7, 19, 0, 3, False, 13),  # side 2 factored, 13 partials
]


@pytest.mark.quick_if(lambda dtype, case, presum: dtype == torch.bfloat16 and case[7] in (0, 2))
@pytest.mark.parametrize("presum", [0, 2], ids=["chain", "presum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: f"{c[:6]}-swap{c[6]}-split{c[7]}")
def test_merge(dtype, case, presum, monkeypatch):
    """Forward and all four gradients against float64; ``presum``: a factorized side's partial
    stack is first added into one plane by the flat reduce (``triton/lokr.CHAIN_PRESUM``),
    sharing one launch with the other side's reduce."""
    a, b, c, d, r1, r2, swap, split = case
    if presum and not (r1 or r2):
        pytest.skip("no factorized side: nothing to presum")
    monkeypatch.setattr(TK, "CHAIN_PRESUM", presum)
    monkeypatch.setattr(TK, "PRESUM_MIN_PLANE", 0)  # the bench's planes are large, these tiny
    g = gen(1)
    w1a = mk((a, r1 or b), dtype, g, nc=True)
    w1b = mk((r1, b), dtype, g) if r1 else None
    w2a = mk_t((c, r2 or d), dtype, g)
    w2b = mk((r2, d), dtype, g, nc=True) if r2 else None
    base = mk((a * c, b * d), torch.float32, g, nc=True)
    cfg = TK.MergeCfg(block_m=16, block_n=16, swap=swap, split=split)
    cd = cd_of(w1a, w1b, w2a, w2b)
    w1, w2 = o_side(d64(w1a, cd), d64(w1b, cd)), o_side(d64(w2a, cd), d64(w2b, cd))

    out_dtype = torch.float32 if dtype == torch.float32 else dtype
    y = TK.merge_fwd(w1a, w1b, w2a, w2b, a, b, c, d, base, GAMMA, out_dtype, cfg)
    assert y.shape == (a * c, b * d) and y.dtype == out_dtype and y.is_contiguous()
    close(y, GAMMA * o_kron(w1, w2) + base.double().cpu(), REL_TOL[dtype], "merge fwd")

    grad = mk((a * c, b * d), dtype, g, nc=True)
    ps = [None if t is None else t.clone().requires_grad_() for t in
          (d64(w1a, cd), d64(w1b, cd), d64(w2a, cd), d64(w2b, cd))]
    (GAMMA * o_kron(o_side(ps[0], ps[1]), o_side(ps[2], ps[3]))).backward(d64(grad, cd))
    got = TK.merge_bwd(grad, w1a, w1b, w2a, w2b, a, b, c, d, GAMMA, cfg)
    for name, gt, p, src in zip(("g_w1a", "g_w1b", "g_w2a", "g_w2b"), got, ps, (w1a, w1b, w2a, w2b)):
        if src is None:
            assert gt.numel() == 0
            continue
        assert gt.shape == src.shape and gt.dtype == src.dtype
        close(gt, p.grad, REL_TOL[dtype], f"merge bwd {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("case", [(3, 5, 4, 6, 2, 3, False), (3, 5, 4, 6, 2, 3, True), (3, 5, 7, 19, 0, 3, False),
                                  (3, 5, 7, 19, 2, 0, True)],
                         ids=["both-w2tile", "both-w1tile", "side2", "side1-swap"])
def test_merge_bwd_chains_in_the_gradient_kernel(dtype, case, monkeypatch):
    """A one-program merge backward (tile side whole in one tile, no position split) runs its
    factor chains inside ``_kron_grad_kernel`` (``CHAIN``, after a barrier): ONE launch, the
    same gradients as the chain launch after it, and float64's."""
    assert TK._chain_fuses(1, 0, [(4, 6, 3)]) and not TK._chain_fuses(2, 0, [(4, 6, 3)])
    assert not TK._chain_fuses(1, 1, [(4, 6, 3)]) and not TK._chain_fuses(1, 0, [])
    a, b, c, d, r1, r2, swap = case
    g = gen(4)
    w1a = mk((a, r1 or b), dtype, g, nc=True)
    w1b = mk((r1, b), dtype, g) if r1 else None
    w2a = mk_t((c, r2 or d), dtype, g)
    w2b = mk((r2, d), dtype, g, nc=True) if r2 else None
    grad = mk((a * c, b * d), dtype, g, nc=True)
    cfg = TK.MergeCfg(block_m=16, block_n=32, swap=swap, split=1)
    launched = []
    real_fast = TK.fast
    monkeypatch.setattr(TK, "fast", lambda k: launched.append(k.__name__) or real_fast(k))
    fused = TK.merge_bwd(grad, w1a, w1b, w2a, w2b, a, b, c, d, GAMMA, cfg)
    assert launched == ["_kron_grad_kernel"], launched
    monkeypatch.setattr(TK, "CHAIN_FUSE_TILES", 0)
    two = TK.merge_bwd(grad, w1a, w1b, w2a, w2b, a, b, c, d, GAMMA, cfg)
    cd = cd_of(w1a, w1b, w2a, w2b)
    ps = [None if t is None else t.clone().requires_grad_() for t in
          (d64(w1a, cd), d64(w1b, cd), d64(w2a, cd), d64(w2b, cd))]
    (GAMMA * o_kron(o_side(ps[0], ps[1]), o_side(ps[2], ps[3]))).backward(d64(grad, cd))
    for name, gf, gt, p in zip(("g_w1a", "g_w1b", "g_w2a", "g_w2b"), fused, two, ps):
        torch.testing.assert_close(gf, gt, rtol=0, atol=0)  # the same tiles, the same order
        if p is not None:
            close(gf, p.grad, REL_TOL[dtype], f"merge bwd {name}")


def test_full_merge_ops_default_dtype_and_promotion():
    """The op-set entries: out_dtype defaults to w2's dtype; fp32 w1 with bf16 w2
    computes in bf16; each gradient comes back in its own input's dtype."""
    g = gen(2)
    w1 = mk((4, 3), torch.float32, g)
    w2 = mk((5, 6), torch.bfloat16, g, nc=True)
    base = mk((20, 18), torch.float32, g)
    y = TK.lokr_full_merge_fwd(w1, w2, None, GAMMA)
    assert y.dtype == torch.bfloat16
    cd = torch.bfloat16
    close(y, GAMMA * o_kron(d64(w1, cd), d64(w2, cd)), REL_TOL[cd], "full merge")
    y = TK.lokr_full_merge_fwd(w1, w2, base, GAMMA, torch.float32)
    close(y, GAMMA * o_kron(d64(w1, cd), d64(w2, cd)) + base.double().cpu(), REL_TOL[cd], "full merge + base")
    grad = mk((20, 18), torch.float32, g)
    g1, g2 = TK.lokr_full_merge_bwd(grad, w1, w2, GAMMA)
    assert (g1.dtype, g2.dtype) == (torch.float32, torch.bfloat16)
    p1, p2 = d64(w1, cd).requires_grad_(), d64(w2, cd).requires_grad_()
    (GAMMA * o_kron(p1, p2)).backward(d64(grad, cd))
    close(g1, p1.grad, REL_TOL[cd], "g_w1")
    close(g2, p2.grad, REL_TOL[cd], "g_w2")
    y = TK.lokr_merge_fwd(w1, None, w2, None, [4, 3, 5, 6], None, GAMMA)
    assert y.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- bypass


def o_bypass(x, w1, w2, gamma, base=None):
    y = gamma * x @ o_kron(w1, w2).t()
    return y if base is None else y + base


BYPASS_CASES = [
    # (T, a, b, c, d, swap, with base)
    (11, 3, 5, 7, 9, False, True),
    (11, 3, 5, 7, 9, True, False),
    (6, 2, 9, 5, 3, None, True),
    (7, 3, 2, 4, 19, False, False),  # d > 16: several d chunks in the backward
]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("case", BYPASS_CASES, ids=lambda c: f"{c[:5]}-swap{c[5]}-base{c[6]}")
def test_bypass(dtype, case):
    T, a, b, c, d, swap, with_base = case
    g = gen(3)
    x = mk((T, b * d), dtype, g, nc=True)
    w1 = mk((a, b), dtype, g)
    w2 = mk_t((c, d), dtype, g)
    base = mk((T, a * c), dtype, g, nc=True) if with_base else None
    cd = cd_of(x, w1, w2)
    y = TKB.bypass_fwd(x, w1, w2, GAMMA, base, TKB.BypassFwdCfg(swap=swap))
    assert y.shape == (T, a * c) and y.dtype == dtype and y.is_contiguous()
    close(y, o_bypass(d64(x, cd), d64(w1, cd), d64(w2, cd), GAMMA, d64(base, torch.float64)),
          REL_TOL[dtype], "bypass fwd")
    if dtype != torch.float32:  # split False: Z = X_t·w2ᵀ rounded to 16 bits (as eager rounds it)
        y = TKB.bypass_fwd(x, w1, w2, GAMMA, base, TKB.BypassFwdCfg(swap=swap, split=False))
        close(y, o_bypass(d64(x, cd), d64(w1, cd), d64(w2, cd), GAMMA, d64(base, torch.float64)),
              REL_TOL[dtype], "bypass fwd (split=False)")

    grad = mk((T, a * c), dtype, g, nc=True)
    ps = [d64(t, cd).requires_grad_() for t in (x, w1, w2)]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    # split False: H = G_t·w2 and P = w1·X_t rounded to 16 bits (as eager rounds them)
    structures = {torch.float16: [(1, True), (2, True), (3, True), (1, False)],
                  torch.bfloat16: [(0, True), (0, False)]}.get(dtype, [(0, True)])
    for passes, split in structures:
        cfg = TKB.BypassBwdCfg(swap=swap, passes=passes, programs=2, block_d=16 if passes else 0, split=split)
        got = TKB.bypass_bwd(grad, x, w1, w2, GAMMA, cfg)
        for name, gt, p, src in zip(("gx", "g_w1", "g_w2"), got, ps, (x, w1, w2)):
            assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
            close(gt, p.grad, REL_TOL[dtype], f"bypass bwd {name} (passes={passes}, split={split})")


@pytest.mark.parametrize("n_sm", [132, 7])
def test_bypass_bwd_programs_and_the_planners_model(n_sm, monkeypatch):
    """The bypass backward's persistent programs: two per SM at 4 warps (the 16-bit
    default), one at 8 (fp32's), never more than the token tiles; the LoKr work model scores
    the grid the launcher takes, for the automatic count and an explicit one."""
    from lycoris_ops.backends.triton.kernels import fusedkit
    from lycoris_ops.tuner import device as PD
    from lycoris_ops.tuner.models import lokr as models

    monkeypatch.setattr(TKB, "num_sms", lambda device: n_sm)
    TKB._bypass_bwd_plan.cache_clear()  # cached per call signature: another n_sm's grids
    dev = PD.synthetic(sm_count=n_sm)
    a = b = c = d = 64
    for compute, warps in ((torch.bfloat16, 4), (torch.float32, 8)):
        assert TKB.default_bypass_bwd_cfg(32768, a, b, c, d, compute).num_warps == warps
        for T in (32768, 3 * n_sm + 1, 5, 1):
            work, _ = models.bwd_model(dev, T, a, b, c, d, compute, compute, compute, grid=TKB.bwd_grid,
                                        reduce_block=fusedkit.reduce_block)
            for nw in (4, 8):
                for programs in (0, n_sm):
                    cfg = TKB.BypassBwdCfg(block_t=1, passes=1, num_warps=nw, programs=programs)
                    grid = TKB._bypass_bwd_plan(T, a, b, c, d, (), compute, "cpu", cfg)[2]
                    want = min(T, programs or (2 if nw == 4 else 1) * n_sm)
                    assert grid[0] == -(-T // -(-T // want))  # the tiles spread evenly over <= want
                    model = work(dict(block_t=1, passes=1, swap=False, num_warps=nw, num_stages=2,
                                      programs=programs), live=1)
                    assert model[0].grid == grid[0], (T, nw, programs)
    # a tiny problem (T·(a·c + b·d) <= ONE_PROGRAM_ELEMS): one program by default (its
    # gradients stored directly: one launch, no partials); an explicit count is kept
    bf = torch.bfloat16
    work, _ = models.bwd_model(dev, 16, 4, 4, 4, 4, bf, bf, bf, grid=TKB.bwd_grid, reduce_block=fusedkit.reduce_block)
    assert 16 * 32 <= TKB.ONE_PROGRAM_ELEMS
    for programs, want in ((0, 1), (3, 3)):
        cfg = TKB.BypassBwdCfg(block_t=1, passes=1, num_warps=4, programs=programs)
        assert TKB._bypass_bwd_plan(16, 4, 4, 4, 4, (), bf, "cpu", cfg)[2][0] == want
        model = work(dict(block_t=1, passes=1, swap=False, num_warps=4, num_stages=2, programs=programs), live=1)
        assert model[0].grid == want and len(model) == (1 if want == 1 else 2)  # no reduce launch
    TKB._bypass_bwd_plan.cache_clear()


def test_bypass_promotion_and_ops():
    """fp32 factors with a bf16 x compute in bf16; base's dtype sets the output;
    gradients in their inputs' dtypes; the op-set entries."""
    g = gen(4)
    T, a, b, c, d = 5, 2, 3, 4, 5
    x = mk((T, b * d), torch.bfloat16, g)
    w1 = mk((a, b), torch.float32, g)
    w2 = mk((c, d), torch.float32, g, nc=True)
    base = mk((T, a * c), torch.float32, g)
    cd = torch.bfloat16
    y = TKB.bypass_fwd(x, w1, w2, GAMMA, base)
    assert y.dtype == torch.float32
    close(y, o_bypass(d64(x, cd), d64(w1, cd), d64(w2, cd), GAMMA, base.double().cpu()), REL_TOL[cd], "fwd")
    grad = mk((T, a * c), torch.float32, g)
    gx, g1, g2 = TKB.bypass_bwd(grad, x, w1, w2, GAMMA)
    assert (gx.dtype, g1.dtype, g2.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    ps = [d64(t, cd).requires_grad_() for t in (x, w1, w2)]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    for gt, p in zip((gx, g1, g2), ps):
        close(gt, p.grad, REL_TOL[cd], "bwd")


@pytest.mark.parametrize("two", [False, True], ids=["one", "two"])
@pytest.mark.parametrize("S", [1, 8, 37, 101])
def test_reduce_deep_stack(S, two):
    """The split-K reduce (shared by the LoKr/LoHa backward kernels) over a partial stack
    deeper than its tile (S = 37: four full steps of 8 and a masked fifth; S = 101: twelve and a
    masked thirteenth), odd (M, N), strided
    partials and a transposed output."""
    from lycoris_ops.backends.triton.kernels import fusedkit as FK

    g = gen(3)
    M, N = 7, 13
    part = torch.randn(S, 2, N, M, generator=g).to(DEV).transpose(2, 3)  # (S, 2, M, N), strided
    out1 = torch.empty(N, M, device=DEV, dtype=torch.bfloat16).t()
    out2 = torch.empty(M, N, device=DEV, dtype=torch.float16)
    ps = part.stride()
    FK.reduce_launch(part, out1, out2 if two else None, M, N, S, 0.5, ps[0], ps[1], ps[2], ps[3],
                     out1.stride(), out2.stride() if two else None, False)
    want = part.double().sum(0) * 0.5
    assert rel_err(out1.double(), want[0]) < REL_TOL[torch.bfloat16]
    if two:
        assert rel_err(out2.double(), want[1]) < REL_TOL[torch.float16]


@pytest.mark.parametrize("S,T", [(1, 37), (37, 9), (101, 101)])
def test_reduce_pair(S, T):
    """Two reductions of different shapes and depths in one launch (the LoKr backward's
    two weight gradients): each against its own sum, strided partials, a transposed output."""
    from lycoris_ops.backends.triton.kernels import fusedkit as FK

    g = gen(4)
    M, N, K, L = 7, 13, 5, 3
    p = torch.randn(S, N, M, generator=g).to(DEV).transpose(1, 2)  # (S, M, N), strided
    q = torch.randn(T, K, L, generator=g).to(DEV)
    o = torch.empty(N, M, device=DEV, dtype=torch.bfloat16).t()
    u = torch.empty(K, L, device=DEV, dtype=torch.float32)
    FK.reduce_pair_launch(p, o, M, N, S, p.stride(), o.stride(), q, u, K, L, T, q.stride(), u.stride(), 0.5, False)
    assert rel_err(o.double(), p.double().sum(0) * 0.5) < REL_TOL[torch.bfloat16]
    assert rel_err(u.double(), q.double().sum(0) * 0.5) < REL_TOL[torch.float32]


def test_scope_limits():
    assert TKB.supported_bypass(3, 5, 128, 100)
    assert not TKB.supported_bypass(3, 5, 129, 9)
    # the forward holds b (or d, swapped) only
    assert TKB.fwd_swaps(4, 4, 768, 768) == (False,) and TKB.fwd_swaps(768, 768, 4, 4) == (True,)
    assert TKB.fwd_swaps(8, 8, 64, 64) == (False, True) and TKB.fwd_swaps(3, 200, 5, 300) == ()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("dims", [(3, 5, 150, 200, False), (200, 150, 5, 3, True)], ids=["wide-w2", "wide-w1"])
def test_bypass_fwd_past_the_backward_scope(dtype, dims):
    """Factor dims past the backward's 128 (LoKr factor=4/8 gives w2 sides of 384-1792): the
    forward tiles c and loops over d (or the swapped pair), whichever order is asked for."""
    a, b, c, d, must_swap = dims
    g = gen(9)
    T = 5
    x = mk((T, b * d), dtype, g, nc=True)
    w1, w2 = mk((a, b), dtype, g), mk_t((c, d), dtype, g)
    base = mk((T, a * c), dtype, g)
    cd = cd_of(x, w1, w2)
    want = o_bypass(d64(x, cd), d64(w1, cd), d64(w2, cd), GAMMA, d64(base, torch.float64))
    assert TKB.fwd_swaps(a, b, c, d) == (must_swap,)
    for swap in (None, False, True):  # an order it cannot hold falls back to the one it can
        y = TKB.bypass_fwd(x, w1, w2, GAMMA, base, TKB.BypassFwdCfg(swap=swap))
        assert y.shape == (T, a * c) and y.dtype == dtype
        close(y, want, REL_TOL[dtype], f"bypass fwd swap={swap}")


def test_op_set_exports():
    from lycoris_ops.backends.triton import ops

    for name in ("lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
                 "lokr_bypass_fwd", "lokr_bypass_bwd"):
        assert name in ops.__all__ and callable(getattr(ops, name))  # wraps the tuned launcher


# ----------------------------------------------------------------------------- compile-only (sm_90)


def _compile_all(dtype_names):
    """Compile every LoKr kernel (and the shared reduce / chain kernels) for sm_90
    with realistic specializations (unit inner strides, 16-aligned pointers and
    outer strides). Runs without TRITON_INTERPRET."""
    import triton.language as tl

    from lycoris_ops.backends.triton.kernels import fusedkit as FK
    from lycoris_ops.backends.triton.common import compile_only

    for dn in dtype_names:
        t = {"fp16": tl.float16, "bf16": tl.bfloat16}[dn]
        com = dict(CD=t, DOT=t, IDX64=dn == "bf16")  # bf16 builds the 64-bit index variants
        grad_ptrs = dict(g_ptr=dn, ta_ptr=dn, tb_ptr=dn, la_ptr=dn, lb_ptr=dn, pt_ptr="fp32", pl_ptr="fp32",
                         gta_ptr=dn, gtb_ptr=dn, gla_ptr=dn, glb_ptr=dn)
        no_chain = dict(CHAIN=False, CBM=16, CBN=16, CBK=32)
        jobs = [
            (FK._reduce_kernel, dict(p_ptr="fp32", o1_ptr=dn, o2_ptr=dn),
             dict(TWO=True, IDX64=dn == "bf16", BS=8, BE=64), ("s_pn", "s_1n", "s_2n"), 4),
            (FK._reduce_pair_kernel, dict(p_ptr="fp32", o_ptr=dn, q_ptr="fp32", u_ptr=dn),
             dict(IDX64=dn == "bf16", BS=8, BE=64), ("s_pn", "s_on", "s_qn", "s_un"), 4),
            (FK._chain_kernel, dict(p_ptr="fp32", wa_ptr=dn, wb_ptr=dn, ga_ptr=dn, gb_ptr=dn),
             dict(CD=t, IDX64=dn == "bf16", BM=32, BN=32, BK=32), ("s_pn", "s_ar", "s_bn", "s_gar", "s_gbn"), 4),
            (TK._kron_merge_kernel, dict(ta_ptr=dn, tb_ptr=dn, la_ptr=dn, lb_ptr=dn, base_ptr=dn, out_ptr=dn),
             dict(FACT_T=True, FACT_L=True, HAS_BASE=True, BM=32, BN=128, BR=32, BRL=32, **com),
             ("s_tbn", "s_on", "s_bn"), 4),
            (TK._kron_merge_kernel, dict(ta_ptr=dn, tb_ptr=dn, la_ptr=dn, lb_ptr=dn, base_ptr=dn, out_ptr=dn),
             dict(FACT_T=False, FACT_L=False, HAS_BASE=False, BM=32, BN=128, BR=32, BRL=32, **com),
             ("s_tar", "s_on"), 4),
            (TK._kron_grad_kernel, grad_ptrs,
             dict(FACT_T=True, FACT_L=True, BM=32, BN=128, BR=32, BRL=32, **no_chain, **com),
             ("s_tbn", "s_gn", "s_ptn"), 4),
            (TK._kron_grad_kernel, grad_ptrs,  # the chains in the kernel (one-program calls)
             dict(FACT_T=True, FACT_L=True, BM=16, BN=32, BR=16, BRL=16, **dict(no_chain, CHAIN=True), **com),
             ("s_tbn", "s_gn", "s_ptn"), 4),
            (TKB._bypass_fwd_kernel, dict(x_ptr=dn, w1_ptr=dn, w2_ptr=dn, base_ptr=dn, y_ptr=dn),
             dict(HAS_BASE=True, SPLIT=True, BT=4, BB=64, BD=64, BC=64, BA=64, **com),
             ("s_xj", "s_1v", "s_2j", "s_bi", "s_yi"), 8),
            (TKB._bypass_bwd_kernel, dict(g_ptr=dn, x_ptr=dn, w1_ptr=dn, w2_ptr=dn, gx_ptr=dn, p1_ptr="fp32",
                                         p2_ptr="fp32"),
             dict(DO_GX=True, DO_GW1=True, DO_GW2=True, SPLIT=True, BT=1, BA=64, BB=64, BC=64, BD=32, **com),
             ("s_gi", "s_xj", "s_1v", "s_2j", "s_oj", "s_p1v", "s_p2j"), 8),
        ]
        for fn, pointers, cx, ones, warps in jobs:
            div16 = [p.name for p in fn.params if p.name.startswith("s_") and p.name not in ones]
            k = compile_only(fn, pointers, cx, ones=ones, div16=div16, num_warps=warps, num_stages=2)
            assert k.asm.get("cubin"), fn.__name__
            print(f"ok {fn.__name__} {dn}", flush=True)


def test_compile_sm90():
    out = run_compile_check(__file__, ["bf16"])
    assert out.count("ok ") == 9, out


if __name__ == "__main__" and sys.argv[1:2] == ["--compile"]:
    _compile_all(sys.argv[2:])
