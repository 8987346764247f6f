"""LoHa bypass backward's GW = Gᵀ·x (O x I, K = T tokens) on cuBLAS, three ways, one process:

* ``fp32 out + cast``: ``mm32`` (bf16 operands, fp32 output) then a cast to bf16: the
  vendor path's form today (one rounding, whatever cuBLAS does with the long K);
* ``bf16 out``: torch.mm in bf16 (fp32 accumulation; cuBLAS may add split-K partials in
  bf16 under torch's default ``allow_bf16_reduced_precision_reduction``);
* ``bf16 out, fp32 reduction``: the same with reduced-precision reduction disallowed.

Prints device ms (L2 flushed, median) and whether each result equals the first bit for
bit (a split-K in bf16 would show as a difference).

    python bench/loha_gw_gemm.py [--shapes 32768x4096,8192x3072]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing as T  # noqa: E402

from lycoris_ops.reference import mm32  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32768x4096,8192x3072", help="TOKENSxFEATURES (O = I)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = T.DeviceTimer(dev)
    flag = torch.backends.cuda.matmul

    def bf16_fp32_reduction(g, x):
        was = flag.allow_bf16_reduced_precision_reduction
        flag.allow_bf16_reduced_precision_reduction = False
        try:
            return g.t() @ x
        finally:
            flag.allow_bf16_reduced_precision_reduction = was

    forms = [("fp32 out + cast", lambda g, x: mm32(g.t(), x).to(torch.bfloat16)),
             ("bf16 out", lambda g, x: g.t() @ x),
             ("bf16 out, fp32 reduction", bf16_fp32_reduction)]
    for shape in args.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        g = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
        x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
        first = None
        for name, fn in forms:
            out = fn(g, x)
            first = out if first is None else first
            ms = timer.time(lambda: fn(g, x))["median_ms"]
            same = torch.equal(out, first)
            print(f"{shape:>11} {name:26s} {ms:8.3f} ms  same bits as the first: {same}")


if __name__ == "__main__":
    main()
