"""Registers, spills and shared memory of a Triton kernel family's launch configs, as ptxas
reports them for sm_90 - on this host, no GPU (Triton's ptxas; the interpreter off).

    python bench/ptxas.py lokr [--tokens 32768] [--a 64] [--c 64] [--dtype bf16] [--smoke]
    python bench/ptxas.py lokr-fwd [--tokens 8192] [--a 8] [--c 384] [--dtype bf16]
    python bench/ptxas.py oft [--tokens 32768] [--width 4096] [--block 32] [--dtype bf16] [--smoke]
    python bench/ptxas.py boft [--tokens 8192] [--width 3072] [--block 48] [--dtype bf16] [--smoke]

``lokr``: the LoKr bypass backward, one line per (tokens per program, warps, stages, one
pass) at 64x64 factors by default: what the register model of
``triton/lokr.default_bypass_bwd_cfg`` and plans/lokr is checked against (bench/RESULTS.md,
2026-12-01 15:30-16:00).
``lokr-fwd``: the LoKr bypass forward with w1 a x a, w2 c x c (c past the backward's 128:
LoKr factor=4/8/16), the launcher's default config and the tuner's widest token tile.
``oft``: the diag-OFT forward stream and the backward's stream and chain kernels, with the
Cayley factor by Gauss-Jordan or by the Neumann series (``neumann``), at 2 and 3 stages:
the series' registers decide the resident programs a SM (``triton/oft.WAVE_NEUMANN``;
RESULTS 2026-12-01 17:30-18:10).
``boft``: every kernel of a BOFT forward and backward (LyCORIS's stage count for the block),
the launcher's default config (``default_boft_cfg``) at split16 and bf16x3: what a block past 32 costs in
registers, spills and compile seconds (each line times its build; a warm
``TRITON_CACHE_DIR`` makes that time small).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

DTYPES = ("bf16", "fp16", "fp32")


def _report(sink, name: str, kernels=None) -> None:
    from lycoris_ops.backends.triton import compiles

    for launch in dict.fromkeys(sink):
        short = launch.kernel.rsplit(".", 1)[-1]
        if kernels is None or short in kernels:
            t0 = time.perf_counter()
            u = compiles.ptxas_usage(compiles.build(launch))
            print(f"  {name}: {short} {u['registers']} registers, spill stores {u['spill_stores']} B, "
                  f"loads {u['spill_loads']} B, shared {u['shared']} B, built in {time.perf_counter() - t0:.1f} s",
                  flush=True)


def lokr(args, dtype) -> None:
    import torch

    from lycoris_ops.backends.triton import compiles
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TK

    T, a, c = args.tokens, args.a, args.c
    meta = torch.device("meta")
    x, g = (torch.empty(T, a * c, device=meta, dtype=dtype) for _ in range(2))
    w1, w2 = torch.empty(a, a, device=meta, dtype=dtype), torch.empty(c, c, device=meta, dtype=dtype)
    print(f"lokr_bypass_bwd kernel, {T} tokens, {a}x{a} (x) {c}x{c}, {args.dtype}, sm_90, one pass")
    configs = [(1, 4, 1)] if args.smoke else itertools.product((1, 2, 4), (4, 8), (1, 2))
    for bt, warps, stages in configs:
        sink: list = []
        cfg = TK.BypassBwdCfg(block_t=bt, passes=1, num_warps=warps, num_stages=stages, programs=132)
        with compiles._intercept(sink):
            TK.bypass_bwd(g, x, w1, w2, 1.0, cfg)
        _report(sink, f"tokens {bt} warps {warps} stages {stages}", {"_bypass_bwd_kernel"})


def lokr_fwd(args, dtype) -> None:
    import torch

    from lycoris_ops.backends.triton import compiles
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TK

    T, a, c = args.tokens, args.a, args.c
    meta = torch.device("meta")
    x, base = torch.empty(T, a * c, device=meta, dtype=dtype), torch.empty(T, a * c, device=meta, dtype=dtype)
    w1, w2 = torch.empty(a, a, device=meta, dtype=dtype), torch.empty(c, c, device=meta, dtype=dtype)
    print(f"lokr_bypass_fwd kernel, {T} tokens, {a}x{a} (x) {c}x{c}, {args.dtype}, sm_90, with a base")
    configs = [("default", TK.BypassFwdCfg()),
               ("widest", TK.BypassFwdCfg(block_t=16, block_c=128, block_d=64, num_warps=8))]
    for name, cfg in configs[:1] if args.smoke else configs:
        meta_args = TK._bypass_fwd_plan(T, a, a, c, c, (), True, dtype, meta, cfg)[3]
        tiles = " ".join(f"{k} {meta_args[k]}" for k in ("BT", "BB", "BC", "BD", "BA", "num_warps"))
        sink: list = []
        with compiles._intercept(sink):
            TK.bypass_fwd(x, w1, w2, 1.0, base, cfg)
        _report(sink, f"{name} ({tiles})", {"_bypass_fwd_kernel"})


def oft(args, dtype) -> None:
    import torch

    from lycoris_ops.backends.triton import compiles
    from lycoris_ops.backends.triton.kernels import oft as TO

    P, D, S = args.tokens, args.width, args.block
    meta = torch.device("meta")
    x, g = (torch.empty(P, D, device=meta, dtype=dtype) for _ in range(2))
    blocks = torch.empty(D // S, S, S, device=meta, dtype=dtype)
    print(f"diag-OFT kernels, {P} positions x {D} channels, blocks of {S}, {args.dtype}, sm_90, split16")
    configs = [(True, 3)] if args.smoke else itertools.product((False, True), (2, 3))
    for neumann, stages in configs:
        cfg = TO.OftCfg(num_stages=stages, dot_prec=TO.SPLIT16, neumann=neumann)
        name = f"{'neumann' if neumann else 'gauss-jordan'} stages {stages}"
        for phase, call in (("fwd", lambda: TO.oft_fwd(blocks, x, None, 1.0, True, False, cfg=cfg)),
                            ("bwd", lambda: TO.oft_bwd(g, blocks, x, None, 1.0, True, False, cfg=cfg))):
            if args.smoke and phase == "bwd":
                continue
            sink: list = []
            with compiles._intercept(sink):
                call()
            _report(sink, f"{phase} {name}")


def boft(args, dtype) -> None:
    import torch

    from lycoris_ops.backends.triton import compiles
    from lycoris_ops.backends.triton.kernels import boft as TB
    from lycoris_ops.backends.triton.kernels import oft as TO

    P, C, s = args.tokens, args.width, args.block
    nb = C // s
    m = nb.bit_length()  # LyCORIS's butterfly: log2(nb) + 1 stages
    while m > 1 and nb % (1 << (m - 1)):
        m -= 1
    meta = torch.device("meta")
    x, g = (torch.empty(P, C, device=meta, dtype=dtype) for _ in range(2))
    blocks = torch.empty(m, nb, s, s, device=meta, dtype=torch.float32)
    print(f"BOFT kernels, {P} positions x {C} channels, {m} stages of {nb} blocks of {s}, {args.dtype}, sm_90")
    precs = (TO.SPLIT16,) if args.smoke else (TO.SPLIT16, TB.BF16X3)
    for prec in precs:
        cfg = TB.default_boft_cfg(s)._replace(dot_prec=prec)
        calls = (("fwd", lambda: TB.boft_fwd(blocks, x, -1, 1.0, 1.0, None, False, cfg=cfg)),
                 ("bwd", lambda: TB.boft_bwd(g, blocks, x, -1, 1.0, 1.0, cfg=cfg)))
        for phase, call in calls[:1] if args.smoke else calls:
            sink: list = []
            with compiles._intercept(sink):
                call()
            _report(sink, f"{phase} {prec}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=("lokr", "lokr-fwd", "oft", "boft"))
    ap.add_argument("--tokens", type=int, default=32768, help="tokens (lokr) or positions (oft)")
    ap.add_argument("--a", type=int, default=64, help="lokr: w1 is a x a")
    ap.add_argument("--c", type=int, default=64, help="lokr: w2 is c x c")
    ap.add_argument("--width", type=int, default=None, help="oft / boft: channels (default 4096 / 3072)")
    ap.add_argument("--block", type=int, default=None, help="oft / boft: block size (default 32 / 48)")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--smoke", action="store_true", help="one config: the CI check")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("ptxas.py: unset TRITON_INTERPRET (it compiles for sm_90)")
        return 1
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    wide = args.family == "boft"
    args.width = args.width or (3072 if wide else 4096)
    args.block = args.block or (48 if wide else 32)
    {"lokr": lokr, "lokr-fwd": lokr_fwd, "oft": oft, "boft": boft}[args.family](args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
