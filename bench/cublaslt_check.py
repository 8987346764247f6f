"""``_cublaslt.addmm`` against the fp64 formula and ``torch.addmm`` on a GPU, shape by shape:

    python bench/cublaslt_check.py

Per shape and layout: the plan's algorithm (``_cublaslt.describe``: tile, split-K, reduction
scheme, workspace, out-of-place support), then the largest distance in units of the dtype's
epsilon and the share of elements more than one rounding apart, for D != C (the path),
D == C (cuBLASLt in place, as torch runs it) and torch.addmm. A diagnostic: the tests
(tests/backends/test_cublaslt.py) assert; this prints what to look at when they fail.
"""
from __future__ import annotations

import sys

import torch

from lycoris_ops.reference import cublaslt as _cublaslt


def _ulps(got, want):
    g, w = got.double(), want.double()
    scale = torch.maximum(g.abs(), w.abs()).clamp_min(torch.finfo(want.dtype).tiny) * torch.finfo(want.dtype).eps
    u = (g - w).abs() / scale
    return u.max().item(), (u > 1).double().mean().item()


def main() -> int:
    if not torch.cuda.is_available():
        print("cublaslt_check.py: no CUDA device")
        return 0
    print("cuBLASLt loaded:", _cublaslt.available())
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M, K, N in ((37, 61, 45), (1024, 520, 768), (1024, 512, 768), (4096, 4096, 4096), (32768, 4096, 4096)):
        for dtype in (torch.bfloat16, torch.float16):
            a = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            b = (torch.randn(K, N, device="cuda", generator=gen) * 0.1).to(dtype)
            base = torch.randn(M, N, device="cuda", generator=gen).to(dtype)
            want = (0.75 * (a.double() @ b.double()) + base.double()).to(dtype)
            info = _cublaslt.describe(base, a, b)
            rows = {"D!=C": _cublaslt.addmm(base, a, b, 0.75), "torch.addmm": torch.addmm(base, a, b, alpha=0.75)}
            plan = _cublaslt._prepare(base, a, b)
            if plan is not None:
                inplace = base.clone()
                st = _cublaslt._matmul(plan, a, b, inplace, inplace, 0.75)
                rows["D==C"] = inplace if st == 0 else None
            print(f"{M}x{K}x{N} {str(dtype)[6:]}: {info}")
            for name, got in rows.items():
                if got is None:
                    print(f"    {name:12s} declined")
                    continue
                mx, share = _ulps(got, want)
                print(f"    {name:12s} max {mx:.2f} eps, share > 1: {share:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
