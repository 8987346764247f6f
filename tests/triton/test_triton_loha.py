"""Triton LoHa kernels (lycoris_ops/backends/triton/kernels/loha.py) and the tucker rebuild
(lycoris_ops/backends/triton/kernels/tucker.py, used by LoHa tucker and LoCon conv) against an
fp64 oracle.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1) on CPU tensors; bf16 dots are upcast there (see
_common.dot_dtype). The oracle is einsum / autograd in fp64 from the operands
rounded to the compute dtype (it skips the deliberate intermediate roundings,
which stay far inside the tolerances). The compile-only test builds every
kernel for sm_90 in a subprocess without the interpreter.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from lycoris_ops.testing import REL_TOL, make, rel_err  # noqa: E402
from lycoris_ops.backends.triton.kernels import loha as TH  # noqa: E402
from lycoris_ops.backends.triton.kernels import tucker as TT  # noqa: E402
from triton_harness import run_compile_check  # noqa: E402
from lycoris_ops.backends.triton.kernels.fusedkit import compute_dtype  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and __name__ != "__main__":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
T, O, I, R = 37, 19, 23, 5
GAMMA = 0.7
SMALL = dict(block_m=16, block_n=16, block_k=16)  # several tiles per dim at these sizes


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def mk(shape, dtype, g, nc=False):
    return make(shape, dtype, DEV, gen=g, noncontiguous=nc)


def mk_t(shape, dtype, g):
    """A transposed (column-major) view of the given shape."""
    return make(shape[::-1], dtype, DEV, gen=g).t()


def cd_of(*ts):
    return compute_dtype(*(t.dtype for t in ts if t is not None))


def d64(t, c):
    return None if t is None else t.detach().to(c).double().cpu()


def close(actual, expected, tol, what):
    assert actual.device.type == DEV
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def factors(dtype, g, r=R):
    """a1 (O, r) strided, b1 (r, I) non-contiguous, a2 column-major, b2 plain."""
    return mk((O, r), dtype, g, nc=True), mk((r, I), dtype, g, nc=True), mk_t((O, r), dtype, g), mk((r, I), dtype, g)


def o_delta(a1, b1, a2, b2):
    return torch.einsum("or,ri->oi", a1, b1) * torch.einsum("or,ri->oi", a2, b2)


def o_bypass(x, a1, b1, a2, b2, gamma, base=None):
    y = gamma * torch.einsum("ti,oi->to", x, o_delta(a1, b1, a2, b2))
    return y if base is None else y + base


# ----------------------------------------------------------------------------- bypass


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("strategy", ["regen", "materialize"])
def test_bypass(dtype, strategy):
    g = gen(1)
    x = mk((T, I), dtype, g, nc=True)
    a1, b1, a2, b2 = factors(dtype, g)
    base = mk((T, O), dtype, g, nc=True) if strategy == "regen" else None
    cd = cd_of(x, a1, b1, a2, b2)
    cfg = TH.ApplyCfg(strategy=strategy, **SMALL)
    y = TH.bypass_fwd(x, a1, b1, a2, b2, GAMMA, base, cfg)
    assert y.shape == (T, O) and y.dtype == dtype and y.is_contiguous()
    ops64 = [d64(t, cd) for t in (x, a1, b1, a2, b2)]
    close(y, o_bypass(*ops64, GAMMA, d64(base, torch.float64)), REL_TOL[dtype], "bypass fwd")

    grad = mk((T, O), dtype, g, nc=True)
    ps = [t.clone().requires_grad_() for t in ops64]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    # GW = Gᵀ·x with its own tiles (gw_cfg; its strategy is ignored) under regen, cfg's under materialize
    gw_cfg = TH.ApplyCfg(block_m=32, block_n=16, block_k=32, strategy="regen", num_warps=4) \
        if strategy == "regen" else None
    got = TH.bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA, cfg, TH.GradCfg(block_m=16, block_n=16, split=2), gw_cfg,
                        small=False)
    for name, gt, p, src in zip(("gx", "g_a1", "g_b1", "g_a2", "g_b2"), got, ps, (x, a1, b1, a2, b2)):
        assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
        close(gt, p.grad, REL_TOL[dtype], f"bypass bwd {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("geo", [(37, 19, 23, 5), (70, 64, 33, 16), (3, 1, 64, 1)], ids=str)
def test_bypass_bwd_small(dtype, geo):
    """The one-program backward (``_bypass_bwd_small_kernel``): several token tiles, odd and
    full-tile O / I, rank 1; non-contiguous G, x and factors, mixed factor dtypes; against
    the fp64 oracle, the eager body and the general path (GW materialized, the merge jobs)."""
    from lycoris_ops.reference import loha as RL

    Tn, On, In, Rn = geo
    assert TH.small_bypass_bwd(Tn, On, In, Rn)
    g = gen(21)
    x = mk((Tn, In), dtype, g, nc=True)
    a1, b1 = mk((On, Rn), dtype, g, nc=True), mk((Rn, In), dtype, g)
    a2, b2 = mk((On, Rn), torch.float32, g), mk((Rn, In), dtype, g, nc=True)
    grad = mk((Tn, On), dtype, g, nc=True)
    cd = cd_of(x, a1, b1, a2, b2)
    ops64 = [d64(t, cd) for t in (x, a1, b1, a2, b2)]
    ps = [t.clone().requires_grad_() for t in ops64]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    got = TH.bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA)
    general = TH.bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA, small=False)
    ref = RL.loha_bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA)
    for name, gt, p, src, gen_, r in zip(("gx", "g_a1", "g_b1", "g_a2", "g_b2"), got, ps, (x, a1, b1, a2, b2),
                                         general, ref):
        assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
        close(gt, p.grad, REL_TOL[cd], f"small bwd {name}")
        close(gt, r.double(), REL_TOL[cd], f"small bwd {name} vs the eager body")
        close(gt, gen_.double(), REL_TOL[cd], f"small bwd {name} vs the general path")
    assert not TH.small_bypass_bwd(Tn, 65, In, Rn) and not TH.small_bypass_bwd(1000, On, In, Rn)


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_bypass_fwd_vendor_gemm(dtype, with_base):
    """``vendor=True``: ΔW by the tile kernel, then the eager body's GEMM (γ and base in its
    epilogue); non-contiguous x and base, odd sizes; against the fp64 oracle and the eager body."""
    from lycoris_ops.reference import loha as RL

    g = gen(13)
    x = mk((T, I), dtype, g, nc=True)
    a1, b1, a2, b2 = factors(dtype, g)
    base = mk((T, O), dtype, g, nc=True) if with_base else None
    cd = cd_of(x, a1, b1, a2, b2)
    got = TH.bypass_fwd(x, a1, b1, a2, b2, GAMMA, base, TH.ApplyCfg(strategy="materialize", **SMALL), vendor=True)
    ref = RL.loha_bypass_fwd(x, a1, b1, a2, b2, GAMMA, base)
    want = o_bypass(*[d64(t, cd) for t in (x, a1, b1, a2, b2)], GAMMA, None if base is None else d64(base, torch.float64))
    assert got.shape == (T, O) and got.dtype == ref.dtype and got.is_contiguous()
    close(got, want, REL_TOL[dtype], "vendor bypass fwd")
    close(got, ref.double(), REL_TOL[dtype], "vendor bypass fwd vs the eager body")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_bypass_bwd_vendor_gemms(dtype):
    """``vendor=True``: gx and GW by torch's GEMM (the eager body's rounding), ΔW and the
    factor gradients by the Triton kernels; non-contiguous G and x, odd sizes."""
    from lycoris_ops.reference import loha as RL

    g = gen(11)
    x = mk((T, I), dtype, g, nc=True)
    a1, b1, a2, b2 = factors(dtype, g)
    grad = mk((T, O), dtype, g, nc=True)
    cd = cd_of(x, a1, b1, a2, b2)
    ops64 = [d64(t, cd) for t in (x, a1, b1, a2, b2)]
    ps = [t.clone().requires_grad_() for t in ops64]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    ref = RL.loha_bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA)
    for merge_vendor in (False, True):  # the factor gradients by the fused jobs / the merge's vendor path
        got = TH.bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA, TH.ApplyCfg(strategy="materialize", **SMALL),
                            TH.GradCfg(block_m=16, block_n=16, split=2), None, vendor=True, merge_vendor=merge_vendor)
        for name, gt, p, src, r in zip(("gx", "g_a1", "g_b1", "g_a2", "g_b2"), got, ps, (x, a1, b1, a2, b2), ref):
            assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
            close(gt, p.grad, REL_TOL[dtype], f"vendor bwd {name} (merge vendor {merge_vendor})")
            close(gt, r.double(), REL_TOL[dtype], f"vendor bwd {name} vs the eager body")


def test_bypass_promotion_ops_and_large_rank():
    """fp32 factors with an fp16 x compute in fp16 (base's dtype sets the output);
    the op-set entries; a padded rank > 128 goes through ``materialize``."""
    g = gen(2)
    x = mk((9, I), torch.float16, g)
    a1, b1, a2, b2 = factors(torch.float32, g, r=130)
    base = mk((9, O), torch.float32, g)
    cd = torch.float16
    ops64 = [d64(t, cd) for t in (x, a1, b1, a2, b2)]
    y = TH.bypass_fwd(x, a1, b1, a2, b2, GAMMA / 16, base)
    assert y.dtype == torch.float32
    close(y, o_bypass(*ops64, GAMMA / 16, base.double().cpu()), REL_TOL[cd], "fwd rank 130")
    a1, b1, a2, b2 = factors(torch.float32, g)
    ops64 = [d64(t, cd) for t in (x, a1, b1, a2, b2)]
    grad = mk((9, O), torch.float32, g)
    got = TH.bypass_bwd(grad, x, a1, b1, a2, b2, GAMMA)
    assert [t.dtype for t in got] == [torch.float16] + [torch.float32] * 4
    ps = [t.clone().requires_grad_() for t in ops64]
    o_bypass(*ps, GAMMA).backward(d64(grad, cd))
    for gt, p in zip(got, ps):
        close(gt, p.grad, REL_TOL[cd], "bwd")
    assert TH.supported(128) and not TH.supported(129)


# ----------------------------------------------------------------------------- merge backward


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split", [1, 3])
def test_merge_bwd(dtype, split):
    g = gen(3)
    a1, b1, a2, b2 = factors(dtype, g)
    grad = mk((O, I), dtype, g, nc=True)
    cd = cd_of(a1, b1, a2, b2)
    ps = [d64(t, cd).requires_grad_() for t in (a1, b1, a2, b2)]
    (GAMMA * o_delta(*ps)).backward(d64(grad, cd))
    got = TH.merge_bwd(grad, a1, b1, a2, b2, GAMMA, cfg=TH.GradCfg(block_m=16, block_n=16, split=split))
    for name, gt, p, src in zip(("g_a1", "g_b1", "g_a2", "g_b2"), got, ps, (a1, b1, a2, b2)):
        assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
        close(gt, p.grad, REL_TOL[dtype], f"merge bwd {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_merge_bwd_vendor_gemms(dtype):
    """``vendor=True``: E1, E2 by one Triton pass (P regenerated), the four contractions by
    torch's GEMM - the eager body's rounding; non-contiguous G, a transposed factor, odd sizes."""
    from lycoris_ops.reference import loha as RL

    g = gen(12)
    a1, b1, a2, b2 = factors(dtype, g)  # strided, non-contiguous, column-major, plain
    grad = mk((O, I), dtype, g, nc=True)
    cd = cd_of(a1, b1, a2, b2)
    ps = [d64(t, cd).requires_grad_() for t in (a1, b1, a2, b2)]
    (GAMMA * o_delta(*ps)).backward(d64(grad, cd))
    got = TH.merge_bwd(grad, a1, b1, a2, b2, GAMMA, vendor=True)
    ref = RL.loha_merge_bwd(grad, a1, b1, a2, b2, GAMMA)
    for name, gt, p, src, r in zip(("g_a1", "g_b1", "g_a2", "g_b2"), got, ps, (a1, b1, a2, b2), ref):
        assert gt.shape == src.shape and gt.dtype == src.dtype and gt.is_contiguous()
        close(gt, p.grad, REL_TOL[dtype], f"vendor merge bwd {name}")
        close(gt, r.double(), REL_TOL[dtype], f"vendor merge bwd {name} vs the eager body")


def test_merge_bwd_op_mixed_dtypes():
    """Factors of mixed fp32/bf16 compute in bf16; each gradient in its input's dtype."""
    g = gen(4)
    a1, b1, a2, b2 = factors(torch.float32, g)
    b2 = b2.to(torch.bfloat16)
    grad = mk((O, I), torch.float32, g)
    cd = torch.bfloat16
    got = TH.merge_bwd(grad, a1, b1, a2, b2, GAMMA)
    assert [t.dtype for t in got] == [torch.float32] * 3 + [torch.bfloat16]
    ps = [d64(t, cd).requires_grad_() for t in (a1, b1, a2, b2)]
    (GAMMA * o_delta(*ps)).backward(d64(grad, cd))
    for gt, p in zip(got, ps):
        close(gt, p.grad, REL_TOL[cd], "merge bwd mixed")


# ----------------------------------------------------------------------------- tucker


def o_tucker(a, t, b):
    return torch.einsum("op,pqk,qi->oik", a, t, b)


@pytest.mark.quick_if(lambda dtype, two, Kk, block_o, o_pack: dtype == torch.bfloat16 and Kk in (5, 17))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("two", [False, True], ids=["one", "hada"])
@pytest.mark.parametrize("Kk,block_o", [(5, 4), (9, 1), (1, 3), (17, 2)], ids=["k5-4rows", "k9-1row", "k1", "k17"])
@pytest.mark.parametrize("o_pack", [1, 3], ids=["row", "pack3"])
def test_tucker(dtype, two, Kk, block_o, o_pack):
    """Columns (i, κ) with κ padded to a dot's width (16, or 32 for Kk 17): several o per
    program, the last program's o past O (O = 19 is no multiple of 4, 3 or 2), one o per
    program; O, I not multiples of the tile; the a·t core in its own kernel (columns
    (q, κ), transposed a, non-contiguous t). o_pack 3: three rows o side by side in one dot
    (Kk 9: 27 of 32 columns; Kk 17: 51 of 64), block_o rounded up to whole packs, the last
    pack past O (19 = 6·3 + 1)."""
    g = gen(5)
    a1 = mk_t((O, 4), dtype, g)  # LoHa passes a transposed "up"
    t1 = mk((4, 3, Kk), dtype, g, nc=two)
    b1 = mk((3, I), dtype, g, nc=True)
    a2, t2, b2 = (mk((O, 6), dtype, g), mk((6, 6, Kk), dtype, g), mk((6, I), torch.float32, g)) if two else (None,) * 3
    cd = cd_of(a1, t1, b1, a2, t2, b2)
    y = TT.tucker_fwd(a1, t1, b1, a2, t2, b2, GAMMA, TT.TuckerCfg(block_o=block_o, block_i=16, o_pack=o_pack))
    assert y.shape == (O, I, Kk) and y.dtype == dtype and y.is_contiguous()
    want = GAMMA * o_tucker(d64(a1, cd), d64(t1, cd), d64(b1, cd))
    if two:
        want = want * o_tucker(d64(a2, cd), d64(t2, cd), d64(b2, cd))
    close(y, want, REL_TOL[dtype], "tucker")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("two", [False, True], ids=["one", "hada"])
@pytest.mark.parametrize("Kk,o_pack", [(9, 1), (9, 3), (1, 16)], ids=["k9", "k9-pack3", "k1-pack16"])
def test_tucker_small_call_is_one_launch(dtype, two, Kk, o_pack, monkeypatch):
    """A one-program call with few core tiles builds AT in its own program (``CORE``, then a
    barrier): one launch, the same output as the core launches before it, and float64's."""
    g = gen(9)
    a1, t1, b1 = mk_t((O, 4), dtype, g), mk((4, 3, Kk), dtype, g, nc=True), mk((3, I), dtype, g, nc=True)
    a2, t2, b2 = (mk((O, 6), dtype, g), mk((6, 5, Kk), dtype, g), mk((5, I), dtype, g)) if two else (None,) * 3
    cfg = TT.TuckerCfg(block_o=32, block_i=64, o_pack=o_pack)  # O, I in one program
    launched = []
    real_fast = TT.fast
    monkeypatch.setattr(TT, "fast", lambda k: launched.append(k.__name__) or real_fast(k))
    y = TT.tucker_fwd(a1, t1, b1, a2, t2, b2, GAMMA, cfg)
    assert launched == ["_tucker_kernel"], launched
    monkeypatch.setattr(TT, "CORE_FUSE_TILES", 0)
    launched.clear()
    y2 = TT.tucker_fwd(a1, t1, b1, a2, t2, b2, GAMMA, cfg)
    assert launched == ["_core_kernel"] * (2 if two else 1) + ["_tucker_kernel"], launched
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    cd = cd_of(a1, t1, b1, a2, t2, b2)
    want = GAMMA * o_tucker(d64(a1, cd), d64(t1, cd), d64(b1, cd))
    if two:
        want = want * o_tucker(d64(a2, cd), d64(t2, cd), d64(b2, cd))
    close(y, want, REL_TOL[dtype], "tucker one launch")


def test_tucker_op_and_scope():
    from lycoris_ops.backends.triton import ops

    g = gen(6)
    a, t, b = mk((7, 3), torch.float32, g), mk((3, 3, 1), torch.float32, g), mk((3, 5), torch.float32, g)
    y = ops.lora_tucker_fwd(a, t, b, None, None, None, 1.5)
    close(y, 1.5 * o_tucker(a.double().cpu(), t.double().cpu(), b.double().cpu()), REL_TOL[torch.float32], "tucker op")
    assert TT.supported(128, 64) and not TT.supported(129)
    # rows per dot: the fewest wasted columns within the width (ties: fewer rows)
    assert [TT.o_pack_for(k, 32) for k in (9, 1, 5, 17, 49)] == [3, 16, 3, 1, 1]
    assert [TT.pack_width(k, p) for k, p in ((9, 3), (9, 1), (1, 16), (17, 3))] == [32, 16, 16, 64]
    for compute in (torch.float32, torch.float16, torch.bfloat16):  # every default names its packing
        for two in (False, True):
            for rmax in (8, 100):
                d = TT.default_tucker_cfg(64, 64, 9, rmax, two, compute)
                assert d.o_pack >= 1 and d.block_o >= 1 and d.block_i >= 1, (compute, two, rmax, d)
    for name in ("loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd"):
        assert name in ops.__all__ and callable(getattr(ops, name))  # wraps the tuned launcher


# ----------------------------------------------------------------------------- compile-only (sm_90)


def _compile_all(dtype_names):
    """Compile every LoHa / tucker kernel for sm_90 with realistic
    specializations (unit inner strides, 16-aligned pointers and outer strides).
    Runs without TRITON_INTERPRET."""
    import triton.language as tl

    from lycoris_ops.backends.triton.common import compile_only

    for dn in dtype_names:
        t = {"fp16": tl.float16, "bf16": tl.bfloat16}[dn]
        com = dict(CD=t, DOT=t, IDX64=dn == "bf16")  # bf16 builds the 64-bit index variants
        tucker_ptrs = dict(at1_ptr=dn, b1_ptr=dn, at2_ptr=dn, b2_ptr=dn, y_ptr=dn, a1_ptr=dn, t1_ptr=dn, a2_ptr=dn,
                           t2_ptr=dn)
        no_core = dict(CORE=False, CBR1=16, CBR2=16, KKC=16)
        ptr7 = dict(x_ptr=dn, a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn, base_ptr=dn, y_ptr=dn)
        jobs = [
            (TH._hada_apply_kernel, ptr7, dict(REGEN=True, HAS_BASE=True, GROUP_M=8, BM=64, BN=128, BK=64, BR=64,
                                               **com), ("s_xk", "s_a1r", "s_b1k", "s_a2r", "s_b2k", "s_bn", "s_yn"), 8),
            (TH._hada_apply_kernel, ptr7, dict(REGEN=False, HAS_BASE=False, GROUP_M=8, BM=128, BN=128, BK=64, BR=16,
                                               **com), ("s_xk", "s_a1r", "s_yn"), 8),
            (TH._hada_tile_kernel, dict(a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn, d_ptr=dn),
             dict(BN=64, BK=64, BR=32, **com), ("s_a1r", "s_b1k", "s_a2r", "s_b2k", "s_dk"), 4),
            (TH._hada_e_kernel, dict(g_ptr=dn, a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn, e1_ptr=dn, e2_ptr=dn),
             dict(BN=64, BK=64, BR=32, **com), ("s_gk", "s_a1r", "s_b1k", "s_a2r", "s_b2k", "s_ek"), 4),
            (TH._hada_grad_kernel, dict(g_ptr=dn, a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn, o1_ptr="fp32",
                                        o2_ptr="fp32"),
             dict(BM=64, BN=64, BR=64, **com), ("s_gn", "s_a1r", "s_b1n", "s_a2r", "s_b2n", "s_o1r", "s_o2r"), 8),
            (TH._hada_grad_pair_kernel, dict(g_ptr=dn, a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn, ga1_ptr=dn,
                                             gb1_ptr=dn, ga2_ptr=dn, gb2_ptr=dn),
             dict(BM=64, BN=64, BR=64, **com),
             ("s_gi", "s_a1r", "s_b1i", "s_a2r", "s_b2i", "s_ga1r", "s_gb1i", "s_ga2r", "s_gb2i"), 8),
            (TH._bypass_bwd_small_kernel, dict(g_ptr=dn, x_ptr=dn, a1_ptr=dn, b1_ptr=dn, a2_ptr=dn, b2_ptr=dn,
                                               gx_ptr=dn, ga1_ptr=dn, gb1_ptr=dn, ga2_ptr=dn, gb2_ptr=dn),
             dict(CD=t, DOT=t, BT=16, BO=64, BI=64, BR=64),
             ("s_go", "s_xi", "s_a1r", "s_b1i", "s_a2r", "s_b2i", "s_gxi", "s_ga1r", "s_gb1i", "s_ga2r", "s_gb2i"), 4),
            (TT._tucker_kernel, tucker_ptrs,
             dict(TWO=True, GROUP_O=8, BO=8, OPK=1, NP=32, BI=64, BR1=32, BR2=32, **no_core, **com),
             ("s_b1i", "s_b2i", "s_yk"), 8),
            (TT._tucker_kernel, tucker_ptrs,
             dict(TWO=False, GROUP_O=8, BO=16, OPK=1, NP=16, BI=128, BR1=64, BR2=16, **no_core, **com),
             ("s_b1i", "s_b2i", "s_yk"), 8),
            (TT._tucker_kernel, tucker_ptrs,  # 3 rows o a dot
             dict(TWO=False, GROUP_O=8, BO=15, OPK=3, NP=32, BI=64, BR1=32, BR2=16, **no_core, **com),
             ("s_b1i", "s_b2i", "s_yk"), 4),
            (TT._tucker_kernel, tucker_ptrs,  # a small call: AT built in the one program first
             dict(TWO=True, GROUP_O=8, BO=32, OPK=1, NP=16, BI=128, BR1=16, BR2=16,
                  **dict(no_core, CORE=True), **com), ("s_b1i", "s_b2i", "s_yk"), 4),
            (TT._core_kernel, dict(a_ptr=dn, t_ptr=dn, at_ptr=dn),
             dict(BO=64, BN=64, BR=32, BRB=32, KKP=16, OPK=1, NP=16, **com), ("s_ap", "s_tk"), 4),
            (TT._core_kernel, dict(a_ptr=dn, t_ptr=dn, at_ptr=dn),
             dict(BO=64, BN=64, BR=32, BRB=32, KKP=16, OPK=3, NP=32, **com), ("s_ap", "s_tk"), 4),
        ]
        for fn, pointers, cx, ones, warps in jobs:
            div16 = [p.name for p in fn.params if p.name.startswith("s_") and p.name not in ones]
            k = compile_only(fn, pointers, cx, ones=ones, div16=div16, num_warps=warps, num_stages=3)
            assert k.asm.get("cubin"), fn.__name__
            print(f"ok {fn.__name__} {dn}", flush=True)


def test_compile_sm90():
    out = run_compile_check(__file__, ["bf16"])
    assert out.count("ok ") == 13, out


if __name__ == "__main__" and sys.argv[1:2] == ["--compile"]:
    _compile_all(sys.argv[2:])
