"""Triton LoRA kernels (lycoris_ops/backends/triton/kernels/lora.py) against an fp64 oracle.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET=1) on CPU tensors; bf16 dots are upcast there (see
_common.dot_dtype). The compile-only test builds every kernel for sm_90 in a
subprocess without the interpreter. The oracle is an einsum / autograd
formulation in fp64 from the operands rounded to the compute dtype.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from lycoris_ops.backends import scope

triton = pytest.importorskip("triton")

from lycoris_ops.reference import lora as REF  # noqa: E402
from lycoris_ops.testing import REL_TOL, make, rel_err  # noqa: E402
from lycoris_ops.backends.triton.kernels import lora as TL  # noqa: E402
from lycoris_ops.backends.triton import ops  # noqa: E402
from triton_harness import run_compile_check  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and __name__ != "__main__":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
T, I, O, R = 37, 45, 29, 5
GAMMA = 0.7


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def mk(shape, dtype, gen, nc=False, scale=1.0):
    return make(shape, dtype, DEV, gen=gen, noncontiguous=nc, scale=scale)


def mk_t(shape, dtype, gen):
    """A transposed (column-major) view of the given shape."""
    return make(shape[::-1], dtype, DEV, gen=gen).t()


def cd_of(*ts):
    return TL.compute_dtype(*(t.dtype for t in ts if t is not None))


def d64(t, c):
    """Operand as the kernel sees it: rounded to the compute dtype, then fp64."""
    return t.detach().to(c).double().cpu()


def close(actual, expected, tol, what):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


# ----------------------------------------------------------------------------- oracles (fp64)


def o_bypass(x, up, down, gamma, base):
    c = cd_of(x, up, down)
    y = gamma * torch.einsum("ti,ri,or->to", d64(x, c), d64(down, c), d64(up, c))
    if base is not None:
        y = y + base.detach().double().cpu()
    return y


def o_bypass_grads(grad, x, up, down, gamma):
    c = cd_of(x, up, down)
    xs, us, ds = (d64(t, c).requires_grad_() for t in (x, up, down))
    y = gamma * torch.einsum("ti,ri,or->to", xs, ds, us)
    return torch.autograd.grad(y, (xs, us, ds), d64(grad, c))


def o_merge(a1, b1, a2, b2, base, gamma, mode):
    c = cd_of(a1, b1) if mode == "plain" else cd_of(a1, b1, a2, b2)
    p1 = torch.einsum("or,ri->oi", d64(a1, c), d64(b1, c))
    if mode == "hada":
        p1 = p1 * torch.einsum("or,ri->oi", d64(a2, c), d64(b2, c))
    elif mode == "sum":
        p1 = p1 + torch.einsum("or,ri->oi", d64(a2, c), d64(b2, c))
    y = gamma * p1
    if base is not None:
        y = y + base.detach().double().cpu()
    return y


def o_merge_grads(grad, up, down, gamma):
    c = cd_of(up, down)
    us, ds = d64(up, c).requires_grad_(), d64(down, c).requires_grad_()
    y = gamma * torch.einsum("or,ri->oi", us, ds)
    return torch.autograd.grad(y, (us, ds), d64(grad, c))


# ----------------------------------------------------------------------------- lora_bypass_fwd

BYPASS_FWD_VARIANTS = ["plain", "base_nc", "tiles", "mixed"]


def _bypass_fwd_args(dtype, variant, gen):
    fdt = torch.float32 if variant == "mixed" else dtype
    x = mk((T, I), dtype, gen, nc=variant in ("base_nc", "tiles"))
    up = mk_t((O, R), fdt, gen) if variant == "base_nc" else mk((O, R), fdt, gen)
    down = mk((R, I), fdt, gen)
    base = None
    if variant != "plain":
        base = mk((T, O), torch.float32 if variant == "mixed" else dtype, gen, nc=variant == "tiles")
    return x, up, down, base


@pytest.mark.parametrize("variant", BYPASS_FWD_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_bypass_fwd(dtype, variant):
    x, up, down, base = _bypass_fwd_args(dtype, variant, _gen(1))
    cfg = TL.BypassFwdCfg(block_t=16, block_i=16, block_o=16, o_split=2) if variant == "tiles" else None
    y = TL.bypass_fwd(x, up, down, GAMMA, base, cfg=cfg) if cfg else ops.lora_bypass_fwd(x, up, down, GAMMA, base)
    ((shape, dt),) = REF.check_lora_bypass_fwd(x, up, down, GAMMA, base)
    assert y.shape == shape and y.dtype == dt and y.is_contiguous()
    tol = REL_TOL[cd_of(x, up, down)]
    close(y, o_bypass(x, up, down, GAMMA, base), tol, "oracle")
    close(y, REF.lora_bypass_fwd(x, up, down, GAMMA, base), tol, "eager")


# ----------------------------------------------------------------------------- lora_bypass_bwd

#: "one_program": a grid of one program (every token, every column) with several I and O
#: steps, so the weight gradients come from the same launch (FUSE_GW); "tiles_split": token
#: tiles and I ranges over several programs, then the reduction kernel
BYPASS_BWD_VARIANTS = ["plain", "nc", "tiles_split", "one_program", "mixed"]


@pytest.mark.parametrize("variant", BYPASS_BWD_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_bypass_bwd(dtype, variant):
    gen = _gen(2)
    fdt = torch.float32 if variant == "mixed" else dtype
    nc = variant in ("nc", "tiles_split")
    x = mk((T, I), dtype, gen, nc=nc)
    up = mk((O, R), fdt, gen)
    down = mk_t((R, I), fdt, gen) if nc else mk((R, I), fdt, gen)
    grad = mk((T, O), torch.float32 if variant == "mixed" else dtype, gen, nc=nc)
    if variant == "tiles_split":
        cfg = TL.BypassBwdCfg(block_t=16, block_i=16, block_o=16, i_split=2,
                              red=TL.SkinnyCfg(block_m=16, block_k=16, block_r=16, split=3, reduce_block=64))
        out = TL.bypass_bwd(grad, x, up, down, GAMMA, cfg=cfg)
    elif variant == "one_program":
        cfg = TL.BypassBwdCfg(block_t=64, block_i=16, block_o=16, i_split=1)
        assert TL._bypass_bwd_plan(grad.stride(), x.shape, x.stride(), up.shape, up.stride(), down.stride(),
                                   x.dtype, up.dtype, down.dtype, x.device, cfg)[1] == (1,)
        out = TL.bypass_bwd(grad, x, up, down, GAMMA, cfg=cfg)
    else:
        out = ops.lora_bypass_bwd(grad, x, up, down, GAMMA)
    spec = REF.check_lora_bypass_bwd(grad, x, up, down, GAMMA)
    tol = REL_TOL[cd_of(x, up, down)]
    eager = REF.lora_bypass_bwd(grad, x, up, down, GAMMA)
    for name, got, (shape, dt), want, ref in zip(("gx", "g_up", "g_down"), out, spec,
                                                  o_bypass_grads(grad, x, up, down, GAMMA), eager):
        assert got.shape == shape and got.dtype == dt and got.is_contiguous(), name
        close(got, want, tol, name)
        close(got, ref, tol, name + " vs eager")


# ----------------------------------------------------------------------------- lora_merge_fwd

MERGE_VARIANTS = ["plain", "base_out", "nc_tiles"]


@pytest.mark.parametrize("variant", MERGE_VARIANTS)
@pytest.mark.parametrize("mode", ["plain", "hada", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_merge_fwd(dtype, mode, variant):
    gen = _gen(3)
    r1 = 37 if variant == "nc_tiles" else R  # a rank loop of 3 steps with block_r=16
    r2 = r1 if mode == "hada" else r1 + 2
    a1 = mk_t((O, r1), dtype, gen) if variant == "nc_tiles" else mk((O, r1), dtype, gen)
    b1 = mk((r1, I), dtype, gen, nc=variant == "nc_tiles")
    a2 = mk((O, r2), torch.float32 if variant == "base_out" else dtype, gen, scale=0.5)
    b2 = mk((r2, I), dtype, gen)
    base = mk((O, I), torch.float32, gen) if variant == "base_out" else None
    out_dtype = torch.float32 if variant == "base_out" else None
    if variant == "nc_tiles":
        y = TL.merge_fwd(a1, b1, a2, b2, base, GAMMA, mode, out_dtype, cfg=TL.MergeFwdCfg(16, 16, 16, 4, 2))
    else:
        y = ops.lora_merge_fwd(a1, b1, a2, b2, base, GAMMA, mode, out_dtype)
    ((shape, dt),) = REF.check_lora_merge_fwd(a1, b1, a2, b2, base, GAMMA, mode, out_dtype)
    assert y.shape == shape and y.dtype == dt and y.is_contiguous()
    c = cd_of(a1, b1) if mode == "plain" else cd_of(a1, b1, a2, b2)
    close(y, o_merge(a1, b1, a2, b2, base, GAMMA, mode), REL_TOL[c], "oracle")
    close(y, REF.lora_merge_fwd(a1, b1, a2, b2, base, GAMMA, mode, out_dtype), REL_TOL[c], "eager")


# ----------------------------------------------------------------------------- lora_merge_bwd

MERGE_BWD_VARIANTS = ["plain", "nc_split", "mixed"]


@pytest.mark.parametrize("variant", MERGE_BWD_VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_merge_bwd(dtype, variant):
    gen = _gen(4)
    r = 37 if variant == "nc_split" else R  # 3 rank tiles of 16
    grad = mk((O, I), dtype, gen, nc=variant == "nc_split")
    up = mk((O, r), torch.float32 if variant == "mixed" else dtype, gen)
    down = mk_t((r, I), dtype, gen) if variant == "nc_split" else mk((r, I), dtype, gen)
    if variant == "nc_split":
        out = TL.merge_bwd(grad, up, down, GAMMA, cfg=TL.SkinnyCfg(16, 16, 16, split=2, reduce_block=128))
    else:
        out = ops.lora_merge_bwd(grad, up, down, GAMMA)
    spec = REF.check_lora_merge_bwd(grad, up, down, GAMMA)
    tol = REL_TOL[cd_of(up, down)]
    eager = REF.lora_merge_bwd(grad, up, down, GAMMA)
    for name, got, (shape, dt), want, ref in zip(("g_up", "g_down"), out, spec,
                                                  o_merge_grads(grad, up, down, GAMMA), eager):
        assert got.shape == shape and got.dtype == dt and got.is_contiguous(), name
        close(got, want, tol, name)
        close(got, ref, tol, name + " vs eager")


# ----------------------------------------------------------------------------- shared case table


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_shared_cases(dtype):
    """Every LoRA case of lycoris_ops.testing.lora that has a Triton kernel, vs the eager body."""
    from lycoris_ops.testing import lora as CASES

    cases = [c for c in CASES.cases(dtype=dtype, device=DEV, gen=_gen(8)) if hasattr(ops, c.op)]
    assert len(cases) >= 8
    for case in cases:
        got = getattr(ops, case.op)(*case.args)
        want = getattr(REF, case.op)(*case.args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        mats = [a for a in case.args if isinstance(a, torch.Tensor)][1 if case.op.endswith("bwd") else 0:]
        tol = REL_TOL[cd_of(*mats[:3])]
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), (case.id, k)
            close(a, b, tol, f"{case.id}[{k}]")


# ----------------------------------------------------------------------------- edges


def test_zero_sizes():
    gen = _gen(5)
    f = torch.float32
    x0, up, down = mk((0, I), f, gen), mk((O, R), f, gen), mk((R, I), f, gen)
    assert ops.lora_bypass_fwd(x0, up, down, GAMMA).shape == (0, O)
    gx, gu, gd = ops.lora_bypass_bwd(mk((0, O), f, gen), x0, up, down, GAMMA)
    assert gx.shape == (0, I) and gu.abs().sum() == 0 and gd.abs().sum() == 0
    # rank 0: the bypass adds nothing
    x, u0, d0, base = mk((T, I), f, gen), mk((O, 0), f, gen), mk((0, I), f, gen), mk((T, O), f, gen)
    assert torch.equal(ops.lora_bypass_fwd(x, u0, d0, GAMMA, base), base)
    gx, gu, gd = ops.lora_bypass_bwd(mk((T, O), f, gen), x, u0, d0, GAMMA)
    assert gx.abs().sum() == 0 and gu.shape == (O, 0) and gd.shape == (0, I)
    y = ops.lora_merge_fwd(u0, d0, None, None, None, GAMMA, "plain")
    assert y.shape == (O, I) and y.abs().sum() == 0
    gu, gd = ops.lora_merge_bwd(mk((O, I), f, gen), u0, d0, GAMMA)
    assert gu.shape == (O, 0) and gd.shape == (0, I)


def test_rank_limit_and_plan_cache():
    assert TL.supported_bypass(128) and not TL.supported_bypass(129)
    assert TL.MAX_BYPASS_RANK == scope.limit("lora_bypass_fwd", "rank", "triton") == 128
    assert scope.limit("lora_merge_fwd", "rank", "triton") is None
    gen = _gen(6)
    x, up, down = mk((T, I), torch.float16, gen), mk((O, R), torch.float16, gen), mk((R, I), torch.float16, gen)
    ops.lora_bypass_fwd(x, up, down, GAMMA)
    hits = TL._bypass_fwd_plan.cache_info().hits
    ops.lora_bypass_fwd(x, up, down, GAMMA)
    assert TL._bypass_fwd_plan.cache_info().hits == hits + 1


def test_idx64_paths(monkeypatch):
    """The 64-bit index variants (tensors past 2**31 elements) compute the same."""
    for plan in (TL._bypass_fwd_plan, TL._bypass_bwd_plan, TL._merge_fwd_plan, TL._merge_bwd_plan):
        plan.cache_clear()
    monkeypatch.setattr(TL, "needs_idx64", lambda *views: True)
    try:
        gen = _gen(7)
        f = torch.float16
        x, up, down, base = mk((T, I), f, gen), mk((O, R), f, gen), mk((R, I), f, gen), mk((T, O), f, gen)
        y = ops.lora_bypass_fwd(x, up, down, GAMMA, base)
        assert TL._bypass_fwd_plan(x.shape, x.stride(), up.shape, up.stride(), down.stride(), f, f, f,
                                   (f, base.stride()), x.device, None)[3]["IDX64"]
        close(y, o_bypass(x, up, down, GAMMA, base), REL_TOL[f], "fwd")
        grad = mk((T, O), f, gen)
        cfg = TL.BypassBwdCfg(16, 16, 16, 2, red=TL.SkinnyCfg(16, 16, 16, split=2, reduce_block=64))
        for got, want in zip(TL.bypass_bwd(grad, x, up, down, GAMMA, cfg=cfg),
                             o_bypass_grads(grad, x, up, down, GAMMA)):
            close(got, want, REL_TOL[f], "bwd")
        close(ops.lora_merge_fwd(up, down, up, down, None, GAMMA, "hada"),
              o_merge(up, down, up, down, None, GAMMA, "hada"), REL_TOL[f], "merge")
        gw = mk((O, I), f, gen)
        for got, want in zip(ops.lora_merge_bwd(gw, up, down, GAMMA), o_merge_grads(gw, up, down, GAMMA)):
            close(got, want, REL_TOL[f], "merge bwd")
    finally:
        for plan in (TL._bypass_fwd_plan, TL._bypass_bwd_plan, TL._merge_fwd_plan, TL._merge_bwd_plan):
            plan.cache_clear()


# ----------------------------------------------------------------------------- compile-only (sm_90)


def _compile_all(dtype_names):
    """Compile every LoRA kernel for sm_90 with realistic specializations
    (unit strides, 16-aligned pointers). Runs without TRITON_INTERPRET."""
    import triton.language as tl

    from lycoris_ops.backends.triton.common import compile_only

    for dn in dtype_names:
        t = {"fp16": tl.float16, "bf16": tl.bfloat16}[dn]
        com = dict(CD=t, DOT=t, IDX64=dn == "bf16")  # bf16 builds the 64-bit index variants
        jobs = [
            (TL._bypass_fwd_kernel, ("x_ptr", "up_ptr", "down_ptr", "base_ptr", "y_ptr"),
             dict(HAS_BASE=True, BLOCK_T=64, BLOCK_I=64, BLOCK_O=64, BLOCK_R=32, **com),
             ("s_xi", "s_ur", "s_di", "s_bo", "s_yo"), 4),
            (TL._bypass_bwd_tok_kernel, ("g_ptr", "x_ptr", "up_ptr", "down_ptr", "gx_ptr", "h_ptr", "q_ptr"),
             dict(BLOCK_T=64, BLOCK_I=64, BLOCK_O=64, BLOCK_R=32, FUSE_GW=False, **com),
             ("s_go", "s_xi", "s_ur", "s_di", "s_gxi"), 4),
            (TL._bypass_bwd_tok_kernel, ("g_ptr", "x_ptr", "up_ptr", "down_ptr", "gx_ptr", "h_ptr", "q_ptr"),
             dict(BLOCK_T=64, BLOCK_I=64, BLOCK_O=64, BLOCK_R=32, FUSE_GW=True, **com),
             ("s_go", "s_xi", "s_ur", "s_di", "s_gxi"), 4),
            (TL._skinny_pair_kernel, ("a_big", "a_small", "a_out", "b_big", "b_small", "b_out"),
             dict(DIRECT=False, BLOCK_M=128, BLOCK_K=64, BLOCK_R=32, **com),
             ("sa_bm", "sa_sr", "sa_or", "sb_bm", "sb_sr", "sb_om"), 4),
            (TL._pair_reduce_kernel, ("a_out", "b_out"), dict(IDX64=dn == "bf16", BLOCK=1024), ("sa_or", "sb_om"), 4),
            (TL._merge_fwd_kernel, ("a1_ptr", "b1_ptr", "a2_ptr", "b2_ptr", "base_ptr", "y_ptr"),
             dict(MODE=1, HAS_BASE=True, BLOCK_O=128, BLOCK_I=128, BLOCK_R=32, **com),
             ("s_a1r", "s_b1i", "s_a2r", "s_b2i", "s_bi", "s_yi"), 8),
        ]
        for fn, ptrs, cx, ones, warps in jobs:
            pointers = {p: dn for p in ptrs}
            pointers.setdefault("part_ptr", "fp32")
            k = compile_only(fn, pointers, cx, ones=ones, num_warps=warps)
            assert k.asm.get("cubin"), fn.__name__
            print(f"ok {fn.__name__} {dn}", flush=True)


def test_compile_sm90():
    out = run_compile_check(__file__, ["fp16", "bf16"])
    assert out.count("ok ") == 12, out


if __name__ == "__main__" and sys.argv[1:2] == ["--compile"]:
    _compile_all(sys.argv[2:])
