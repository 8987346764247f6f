"""Registers, spills and shared memory of the LoKr bypass backward kernel per launch config,
as ptxas reports them for sm_90 - on this host, no GPU (Triton's ptxas; the interpreter off).

    python bench/ptxas_lokr.py [--tokens 32768] [--a 64] [--c 64] [--dtype bf16] [--smoke]

One line per (tokens per program, warps, stages, one pass) at 64x64 factors by default:
what the register model of ``triton/lokr.default_bypass_bwd_cfg`` and plans/lokr is
checked against (bench/RESULTS.md, 2026-12-01 15:30-16:00).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--a", type=int, default=64, help="w1 is a x a")
    ap.add_argument("--c", type=int, default=64, help="w2 is c x c")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--smoke", action="store_true", help="one config (1 token, 4 warps, 1 stage): the CI check")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("ptxas_lokr.py: unset TRITON_INTERPRET (it compiles for sm_90)")
        return 1
    import torch

    from lycoris_ops.plans import compiles
    from lycoris_ops.triton import lokr as TK

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
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
        for launch in dict.fromkeys(sink):
            if launch.kernel.endswith("_bypass_bwd_kernel"):
                u = compiles.ptxas_usage(compiles.build(launch))
                print(f"  tokens {bt} warps {warps} stages {stages}: {u['registers']} registers, spill stores "
                      f"{u['spill_stores']} B, loads {u['spill_loads']} B, shared {u['shared']} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
