"""A/B of launch variants of one kernel family, in one process (the tuner's shortlist aside).

    python bench/experiments/variants.py tucker|boft|oft|lokr|loha|lokr_merge [--shapes small,large] [--phases fwd,bwd] [--profile] [--smoke]

Each variant is one config of the family's Triton launcher, called directly (no tuner,
no op dispatch): device time per call (``timing.DeviceTimer``: L2 flushed, launch gaps
hidden, median), its ratio to the first variant ("base") of the same shape, and the
relative difference of its result from base's (a variant that changes the numerics
shows it here). ``--profile`` (boft): torch.profiler's device time per kernel of one
forward and one backward at base. Ratios within one run are what to compare; the
machines are shared. On CPU (``--smoke``: tiny sizes, Triton's interpreter) it only
checks that every variant still runs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: timing
import timing as T  # noqa: E402

SHAPES = {  # family -> shape name -> geometry
    "tucker": {"small": dict(D=3072, R=32, Kk=9), "large": dict(D=4096, R=64, Kk=9), "smoke": dict(D=40, R=5, Kk=9)},
    "boft": {"small": dict(P=8192, D=3072, s=24), "large": dict(P=32768, D=4096, s=32),
             "smoke": dict(P=24, D=48, s=6)},
    # "tile": one position tile per program at the large width: the fixed part (Cayley rebuild, launch)
    "oft": {"small": dict(P=8192, D=3072, S=32), "large": dict(P=32768, D=4096, S=32), "smoke": dict(P=40, D=64, S=8),
            "tile": dict(P=640, D=4096, S=32)},
    "lokr": {"small": dict(T=8192, a=48, c=64), "large": dict(T=32768, a=64, c=64), "smoke": dict(T=24, a=6, c=5)},
    "lokr_merge": {"small": dict(D=3072, r=32), "large": dict(D=4096, r=64), "smoke": dict(D=512, r=5)},
    "loha": {"small": dict(T=8192, D=3072, r=32), "large": dict(T=32768, D=4096, r=64), "smoke": dict(T=24, D=40, r=5)},
}


def _rand(gen, shape, dtype, dev, scale=1.0):
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dev, dtype)


def tucker(geo, dtype, dev, gen):
    from lycoris_ops.reference import lora as RL
    from lycoris_ops.backends.triton.kernels import tucker as TT

    D, R, Kk = geo["D"], geo["R"], geo["Kk"]
    a, t, b = _rand(gen, (D, R), dtype, dev, 0.1), _rand(gen, (R, R, Kk), dtype, dev, 0.1), _rand(gen, (R, D), dtype,
                                                                                                   dev, 0.1)
    Cfg = TT.TuckerCfg
    rows = [("default", lambda c=None: TT.tucker_fwd(a, t, b, None, None, None, 0.75, c))]
    for bo, bi, st in ((16, 128, 2), (32, 64, 2), (32, 128, 3), (8, 256, 3)):
        c = Cfg(block_o=bo, block_i=bi, num_warps=4, num_stages=st, o_pack=1)
        rows.append((f"{bo}x{bi} s{st}", lambda c=c: TT.tucker_fwd(a, t, b, None, None, None, 0.75, c)))
    # rows o packed side by side in one dot (fp32's default: its FMA dots pay for padded columns)
    pk = TT.o_pack_for(Kk, 32)
    for bo, bi, st, w in ((16, 64, 2, 4), (32, 64, 2, 4), (8, 64, 2, 4), (16, 32, 2, 4), (16, 64, 3, 4),
                          (16, 128, 2, 8), (32, 128, 3, 4)):
        c = Cfg(block_o=bo, block_i=bi, num_warps=w, num_stages=st, o_pack=pk)
        rows.append((f"pack{pk} {bo}x{bi} s{st} w{w}", lambda c=c: TT.tucker_fwd(a, t, b, None, None, None, 0.75, c)))
    c = Cfg(block_o=16, block_i=64, num_warps=4, num_stages=2, o_pack=1)
    rows.append(("row 16x64 s2 (fp32's old default)", lambda c=c: TT.tucker_fwd(a, t, b, None, None, None, 0.75, c)))
    rows.append(("eager body", lambda: RL.lora_tucker_fwd(a, t, b, None, None, None, 0.75)))
    rows.append(("einsum (a view)", lambda: 0.75 * torch.einsum("op,pqk,qi->oik", a, t, b)))
    return {"fwd": rows}


def boft(geo, dtype, dev, gen):
    from lycoris_ops.backends.triton.kernels import boft as TB
    from lycoris_ops.backends.triton.kernels.oft import BF16X3, SPLIT16

    P, D, s = geo["P"], geo["D"], geo["s"]
    nb = D // s
    m = int(math.log2(nb)) + 1
    blocks = _rand(gen, (m, nb, s, s), dtype, dev, 0.02)
    x, g = _rand(gen, (P, D), dtype, dev), _rand(gen, (P, D), dtype, dev)
    small = P < 4096  # smoke: tiles the interpreter runs quickly
    # the tuner's pick at both bench shapes (H200, 2026-12-01): bf16x3, max_group 64, 32-position
    # tiles; the rows: the position split (programs per group; 0 = auto_split, one wave of
    # WAVE per SM), which decides the streaming kernels' occupancy
    base = TB.BoftCfg(max_group=16 if small else 64, block_p=16 if small else 32, bwd_block_p=16 if small else 32,
                      num_warps=4, num_stages=2 if small else 3, dot_prec=BF16X3)
    variants = [("bf16x3 auto split", {}), ("tf32x3", dict(dot_prec="tf32x3")), ("split16", dict(dot_prec=SPLIT16))] + \
        [(f"split {n}", dict(split=n)) for n in (4, 9, 12, 18, 24)] + \
        [(f"block_p 64 split {n}", dict(block_p=64, bwd_block_p=64, split=n)) for n in (0, 12)] + \
        [("2 stages split 12", dict(num_stages=2, split=12)), ("8 warps split 12", dict(num_warps=8, split=12))]
    variants += [(f"cayley {w} warps", dict(cayley_warps=w)) for w in (1, 2)]
    variants += [("max_group x2", dict(max_group=2 * base.max_group)), ("pad slots", dict(dense=False))]

    def with_cayley_warps(w, fn):  # the Cayley launch's warps are a module constant, not a config field
        def run():
            with T.module_settings((TB, {"CAYLEY_WARPS": w or TB.CAYLEY_WARPS})):
                return fn()
        return run

    out = {"fwd": [], "bwd": []}
    for name, kw in variants:
        w = kw.pop("cayley_warps", 0)
        c = base._replace(**kw)
        out["fwd"].append((name, with_cayley_warps(w, lambda c=c: TB.boft_fwd(blocks, x, -1, 1.0, 1.0, None, True,
                                                                              cfg=c))))
        out["bwd"].append((name, with_cayley_warps(w, lambda c=c: TB.boft_bwd(g, blocks, x, -1, 1.0, 1.0, cfg=c)[1])))
    return out


def oft(geo, dtype, dev, gen):
    from lycoris_ops.backends.triton.kernels import oft as TO

    P, D, S = geo["P"], geo["D"], geo["S"]
    blocks = _rand(gen, (D // S, S, S), dtype, dev, 0.02)
    x, g = _rand(gen, (P, D), dtype, dev), _rand(gen, (P, D), dtype, dev)
    small = D < 1024  # smoke sizes (the "tile" shape keeps the real tiles)
    base = TO.OftCfg(block_p=16 if small else 128, bwd_block_p=16 if small else 64, num_warps=4, num_stages=2,
                     dot_prec=TO.SPLIT16)
    nm = dict(neumann=True)  # the Cayley factor by _cayley.neumann_inverse (dots, no serial elimination)
    # stages and tile: the positions in flight per program; split 2: one wave at the two programs
    # per SM that neumann's registers leave (ptxas: 243 a thread against the default's 74)
    fwd = [("base split16", {}), ("s3", dict(num_stages=3)), ("s4", dict(num_stages=4)),
           ("block_p x2 s3", dict(block_p=2 * base.block_p, num_stages=3)), ("block_p /2 s4", dict(
               block_p=base.block_p // 2, num_stages=4)), ("neumann", nm), ("neumann s3", dict(nm, num_stages=3)),
           ("neumann s4", dict(nm, num_stages=4))] + \
        [(f"neumann split 2 s{st}", dict(nm, split=2, num_stages=st)) for st in (3, 4, 6)] + \
        [("neumann split 2 bp x2 s4", dict(nm, split=2, block_p=2 * base.block_p, num_stages=4)),
         ("neumann split 3 s4", dict(nm, split=3, num_stages=4))] + \
        [(f"neumann bp /{d} s{st}", dict(nm, block_p=base.block_p // d, num_stages=st)) for d, st in
         ((2, 3), (2, 4), (4, 6))] + \
        [("neumann w2 split 4 s3", dict(nm, num_warps=2, split=4, num_stages=3)),  # 4 two-warp programs / SM
         ("neumann w2 split 4 bp /2 s4", dict(nm, num_warps=2, split=4, block_p=base.block_p // 2, num_stages=4)),
         ("neumann w8 split 1 s3", dict(nm, num_warps=8, split=1, num_stages=3))]
    bwd = [("base split16", {}), ("neumann", nm), ("group 64 s3", dict(group=64, num_stages=3)),
           ("s3", dict(num_stages=3)), ("group 64 s4", dict(group=64, num_stages=4))]
    out = {"fwd": [], "bwd": []}
    for name, kw in fwd:
        c = base._replace(**kw)
        out["fwd"].append((name, lambda c=c: TO.oft_fwd(blocks, x, None, 1.0, True, False, cfg=c)))
    for name, kw in bwd:
        c = base._replace(**kw)
        out["bwd"].append((name, lambda c=c: TO.oft_bwd(g, blocks, x, None, 1.0, True, False, cfg=c)[0]))
    return out


def lokr(geo, dtype, dev, gen):
    """The LoKr bypass backward: one pass (gx, g_w1, g_w2 in one launch) over tokens per
    program x warps x stages x one or two persistent programs per SM; two and three passes."""
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TK

    T, a, c = geo["T"], geo["a"], geo["c"]
    x, g = _rand(gen, (T, a * c), dtype, dev), _rand(gen, (T, a * c), dtype, dev)
    w1, w2 = _rand(gen, (a, a), dtype, dev, a ** -0.5), _rand(gen, (c, c), dtype, dev, c ** -0.5)
    Cfg = TK.BypassBwdCfg
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    rows = [("launcher default", lambda: TK.bypass_bwd(g, x, w1, w2, 0.75)[1])]  # compared by g_w1
    vs = [dict(passes=1, block_t=bt, num_warps=w, num_stages=s, programs=k * n_sm)
          for bt in (1, 2, 4) for w in (4, 8) for s in (1, 2) for k in (1, 2) if bt < 4 or (s, k) == (2, 1)]
    vs += [dict(passes=p, block_t=2, num_warps=4, programs=2 * n_sm) for p in (2, 3)]
    # the fp32 intermediates H = G_t·w2 and P = w1·X_t rounded to 16 bits (as eager's are) instead
    # of hi/lo split: 5 dots a token tile instead of 8
    vs += [dict(passes=1, block_t=bt, num_warps=4, programs=2 * n_sm, split=False) for bt in (1, 2)]
    for v in vs:
        c_ = Cfg(**v)
        name = (f"p{v['passes']} bt{v['block_t']} w{v['num_warps']} s{v.get('num_stages', 2)}"
                + f" {v['programs'] // n_sm}/SM" + (" nosplit" if v.get("split") is False else ""))
        rows.append((name, lambda c_=c_: TK.bypass_bwd(g, x, w1, w2, 0.75, c_)[1]))
    # the forward: Z = X_t·w2ᵀ unrounded (hi/lo pair, the default) or rounded to 16 bits
    # (split False, as eager rounds it); warps, stages and tokens per program around the
    # default (0 = the launcher's automatic value)
    F = TK.BypassFwdCfg
    fwd = [("launcher default", lambda: TK.bypass_fwd(x, w1, w2, 0.75))]
    for name, kw in (("nosplit", dict(split=False)), ("s1", dict(num_stages=1)),
                     ("nosplit s1", dict(split=False, num_stages=1)),
                     ("nosplit 4 warps", dict(split=False, num_warps=4)),
                     ("nosplit bt2 4 warps", dict(split=False, block_t=2, num_warps=4)),
                     ("nosplit bt8", dict(split=False, block_t=8))):
        c_ = F(**kw)
        fwd.append((name, lambda c_=c_: TK.bypass_fwd(x, w1, w2, 0.75, cfg=c_)))
    return {"bwd": rows, "fwd": fwd}  # g_w1 of each backward


def loha(geo, dtype, dev, gen):
    """The LoHa bypass backward at the bench shapes: ``grad``, the factor gradients
    (``merge_bwd`` on GW (D, D)) per tile config, split and vendor form; ``gemm``, the gx GEMM
    ``γ·G·ΔW`` (T·D·D) in cuBLAS call forms (the ones marked "other rounding" are not the
    op's numerics: timing yardsticks); ``bwd``, the whole ``bypass_bwd`` vendor paths;
    ``fwd``, ``γ·x·ΔWᵀ + base`` by torch's addmm (base copied into the output first) and by
    one cuBLASLt call reading base in place, and the vendor forward."""
    from lycoris_ops.reference import gemm_epilogue, mm_rounded
    from lycoris_ops.backends.triton.kernels import loha as TH

    Tn, D, r = geo["T"], geo["D"], geo["r"]
    x, g = _rand(gen, (Tn, D), dtype, dev), _rand(gen, (Tn, D), dtype, dev)
    a1, a2 = _rand(gen, (D, r), dtype, dev, 0.1), _rand(gen, (D, r), dtype, dev, 0.1)
    b1, b2 = _rand(gen, (r, D), dtype, dev, 0.1), _rand(gen, (r, D), dtype, dev, 0.1)
    gw = mm_rounded(g.t(), x, dtype) if dev.type == "cuda" else (g.t().float() @ x.float()).to(dtype)
    Cfg = TH.GradCfg
    grad = [("launcher default", lambda: TH.merge_bwd(gw, a1, b1, a2, b2, 0.75)[0])]
    for bm, bn, w, s, sp in ((64, 64, 8, 2, 1), (64, 64, 8, 3, 0), (64, 64, 4, 2, 0), (64, 32, 4, 3, 0),
                             (128, 64, 8, 2, 0), (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 32, 8, 3, 0),
                             (64, 128, 8, 2, 0), (128, 128, 8, 2, 1), (64, 64, 8, 2, 2), (64, 64, 8, 2, 4),
                             (128, 64, 8, 2, 2), (32, 64, 4, 2, 1), (32, 64, 4, 2, 0),
                             (64, 32, 4, 3, 1), (64, 32, 4, 4, 0), (32, 32, 4, 3, 0), (64, 32, 8, 3, 0)):
        c = Cfg(block_m=bm, block_n=bn, split=sp, num_warps=w, num_stages=s)
        grad.append((f"{bm}x{bn} w{w} s{s} split{sp or 'auto'}",
                     lambda c=c: TH.merge_bwd(gw, a1, b1, a2, b2, 0.75, cfg=c)[0]))
    grad.append(("vendor (E + 4 GEMMs)", lambda: TH.merge_bwd(gw, a1, b1, a2, b2, 0.75, vendor=True)[0]))
    dw = ((a1.float() @ b1.float()) * (a2.float() @ b2.float())).to(dtype)  # ΔW (O, I)
    dwt = dw.t().contiguous()  # ΔWᵀ stored (I, O): gx = G·(ΔWᵀ)ᵀ, the NT form
    gemm = [("addmm beta0 (op)", lambda: gemm_epilogue(g, dw, dtype, 0.75)),
            ("addmm beta0, NT", lambda: gemm_epilogue(g, dwt.t(), dtype, 0.75)),
            ("mm, other rounding", lambda: torch.mm(g, dw)),
            ("mm NT, other rounding", lambda: torch.mm(g, dwt.t())),
            ("mm + mul_, other rnd", lambda: torch.mm(g, dw).mul_(0.75))]
    if dev.type == "cuda":
        out = torch.empty((Tn, D), device=dev, dtype=dtype)
        gemm.insert(2, ("addmm out= beta0", lambda: torch.addmm(out, g, dw, beta=0, alpha=0.75, out=out)))
    bwd = [("vendor", lambda: TH.bypass_bwd(g, x, a1, b1, a2, b2, 0.75, vendor=True)[1]),
           ("vendor + merge vendor", lambda: TH.bypass_bwd(g, x, a1, b1, a2, b2, 0.75, vendor=True,
                                                           merge_vendor=True)[1]),
           ("vendor, grad 128x64 s1", lambda: TH.bypass_bwd(
               g, x, a1, b1, a2, b2, 0.75, vendor=True, grad_cfg=Cfg(block_m=128, block_n=64, split=1))[1])]
    base = _rand(gen, (Tn, D), dtype, dev)
    fwd = [("addmm: base copied first", lambda: gemm_epilogue(x, dw.t(), dtype, 0.75, base)),
           ("cuBLASLt: base in place", lambda: gemm_epilogue(x, dw.t(), dtype, 0.75, base, base_in_place=True)),
           ("vendor bypass_fwd (op)", lambda: TH.bypass_fwd(x, a1, b1, a2, b2, 0.75, base,
                                                            TH.ApplyCfg(strategy="materialize"), vendor=True))]
    gws = [("GW mm_rounded (op)", lambda: mm_rounded(g.t(), x, dtype)),
           ("GW mm, default reduction", lambda: torch.mm(g.t(), x))]
    return {"grad": grad, "gemm": gemm, "gw": gws, "bwd": bwd, "fwd": fwd}


def lokr_merge(geo, dtype, dev, gen):
    """The LoKr merge backward of the bench's ``lokr_merge`` spec (w1 (a, a) whole, w2 = w2a·w2b
    (256, r)·(r, 256)): the launcher default against pipelined entry loops (num_stages),
    other splits and tiles of the Kronecker-gradient kernel, the chain step without the presum
    (``triton/lokr.CHAIN_PRESUM``) and other tiles of the chain step that turns the partials
    into the factor gradients; compared by g_w2a (the chain's output)."""
    from lycoris_ops.backends.triton.kernels import lokr as TK

    D, r = geo["D"], geo["r"]
    c = 256
    a = D // c
    g = _rand(gen, (D, D), dtype, dev)
    w1 = _rand(gen, (a, a), dtype, dev, a ** -0.5)
    w2a, w2b = _rand(gen, (c, r), dtype, dev, r ** -0.5), _rand(gen, (r, c), dtype, dev, c ** -0.5)
    d = TK.default_merge_cfg(c, c, a, a, dtype)
    rows = [("launcher default", lambda: TK.merge_bwd(g, w1, None, w2a, w2b, a, a, c, c, 0.75)[2])]
    for name, kw in (("stages 2", dict(num_stages=2)), ("8 warps", dict(num_warps=8)), ("split 9", dict(split=9)),
                     ("split 16", dict(split=16)), ("split 24", dict(split=24)), ("split 32", dict(split=32)),
                     ("16-row tiles", dict(block_m=16)), ("64-col tiles", dict(block_n=64))):
        cfg = d._replace(**kw)
        rows.append((name, lambda cfg=cfg: TK.merge_bwd(g, w1, None, w2a, w2b, a, a, c, c, 0.75, cfg)[2]))

    def chain(block, presum=TK.CHAIN_PRESUM, cfg=None):
        # the chain step's tile (more, smaller programs over the partial stack), the stack
        # depth from which a flat reduce adds it into one plane first, the gradient kernel's tile
        was = TK.CHAIN_BLOCK, TK.CHAIN_PRESUM
        TK.CHAIN_BLOCK, TK.CHAIN_PRESUM = block, presum
        try:
            return TK.merge_bwd(g, w1, None, w2a, w2b, a, a, c, c, 0.75, cfg)[2]
        finally:
            TK.CHAIN_BLOCK, TK.CHAIN_PRESUM = was

    rows.append(("no presum", lambda: chain(TK.CHAIN_BLOCK, 0)))
    for block in ((32, 32, 32), (16, 16, 64), (16, 32, 32), (16, 16, 16)):
        rows.append((f"chain {block[0]}x{block[1]}x{block[2]}", lambda block=block: chain(block)))
    return {"bwd": rows}


FAMILIES = {"tucker": tucker, "boft": boft, "oft": oft, "lokr": lokr, "loha": loha, "lokr_merge": lokr_merge}


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def profile_boft(geo, dtype, dev, gen, reps=5):
    """Device ms per kernel name of one boft forward and one backward at the launcher default."""
    from torch.profiler import ProfilerActivity, profile

    from lycoris_ops.backends.triton.kernels import boft as TB

    P, D, s = geo["P"], geo["D"], geo["s"]
    nb = D // s
    m = int(math.log2(nb)) + 1
    blocks, x, g = _rand(gen, (m, nb, s, s), dtype, dev, 0.02), _rand(gen, (P, D), dtype, dev), _rand(gen, (P, D),
                                                                                                     dtype, dev)
    for phase, fn in (("fwd", lambda: TB.boft_fwd(blocks, x, -1, 1.0, 1.0, None, True)),
                      ("bwd", lambda: TB.boft_bwd(g, blocks, x, -1, 1.0, 1.0))):
        fn()
        T.sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            T.sync(dev)
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:48]] += (getattr(e, "device_time", 0) or e.cuda_time) / reps / 1e3
        print(f"  profile {phase}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(FAMILIES))
    ap.add_argument("--shapes", default="small,large")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--phases", default="fwd,bwd", help="which of the family's phases to time")
    ap.add_argument("--profile", action="store_true", help="boft: device time per kernel at the default config")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: every variant runs (no timing claims)")
    a = ap.parse_args(argv)
    if a.smoke:  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu" and not a.smoke:
        print("variants.py: no CUDA device (use --smoke for the CPU check)")
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.smoke and dtype == torch.bfloat16:
        dtype, a.dtype = torch.float16, "fp16"  # the interpreter's bf16 dots are wrong (TOOLCHAIN.md)
    timer = T.DeviceTimer(dev, min_reps=1 if a.smoke else 5, max_reps=1 if a.smoke else 40, warmup=0 if a.smoke else 2)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for shape in (["smoke"] if a.smoke else a.shapes.split(",")):
        geo = SHAPES[a.family][shape]
        print(f"== {a.family} {shape} {geo} {a.dtype}" + ("" if dev.type == "cuda" else " (CPU smoke)"), flush=True)
        for phase, rows in FAMILIES[a.family](geo, dtype, dev, gen).items():
            if phase not in a.phases.split(","):
                continue
            ref = rows[0][1]()
            t0 = None
            for name, fn in rows:
                try:
                    d = _rel(fn(), ref)
                    ms = timer.time(fn)["median_ms"]
                except Exception as exc:  # a variant out of resources reports, the others still run
                    print(f"  {phase} {name:22s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                t0 = t0 or ms
                print(f"  {phase} {name:22s} {ms:9.4f} ms  x{ms / t0:5.2f} of base   rel diff {d:.1e}", flush=True)
        if a.profile and a.family == "boft" and dev.type == "cuda":
            profile_boft(geo, dtype, dev, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
