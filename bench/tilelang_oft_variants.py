"""A/B of the TileLang diag-OFT streaming kernels' variants, in one process, on a GPU:

    python bench/tilelang_oft_variants.py [--shapes bypass,merge] [--dtype bf16]

For each shape (``bypass``: activations (32768, 4096), channels last; ``merge``: a
(4096, 4096) weight, channels first; S = 32) and each variant, ``tilelang.oft.oft_fwd`` and
``oft_bwd`` are called directly (no tuner, no op dispatch), and the table gives their device
time (``timing.DeviceTimer``: L2 flushed, median), the ratio to the first variant, and the
largest relative difference of the results from the first variant's:

* ``gather``: ``apply_kernel`` / ``bwd_stream_kernel`` (the element-wise channel-map path);
* ``direct``: the ``T.copy`` kernels storing from the GEMM fragment;
* ``direct+stage``: the same, the output tile stored through shared memory
  (``DIRECT_STAGE_OUT``).

Ratios within one run are what to compare; the machines are shared.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing as T  # noqa: E402

SHAPES = {"bypass": ((32768, 4096), False), "merge": ((4096, 4096), True)}
SMOKE = {"bypass": ((300, 64), False), "merge": ((64, 300), True)}  # CPU twins, fp32
VARIANTS = ("gather", "direct", "direct+stage")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="bypass,merge")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--smoke", action="store_true", help="CPU twins at fp32, tiny sizes: the script runs")
    args = ap.parse_args(argv)
    from lycoris_ops.tilelang import oft

    dt = torch.float32 if args.smoke else {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dev = torch.device("cpu" if args.smoke else "cuda")
    timer = T.DeviceTimer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    direct = oft.direct_apply
    print(f"{'shape':8} {'variant':14} {'fwd ms':>8} {'x first':>8} {'bwd ms':>8} {'x first':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        shape, weight = (SMOKE if args.smoke else SHAPES)[name]
        S = 32
        K = shape[0 if weight else 1] // S
        blocks = (0.02 * torch.randn(K, S, S, generator=gen, device=dev)).to(dt)
        x = torch.randn(shape, generator=gen, device=dev).to(dt)
        g = torch.randn(shape, generator=gen, device=dev).to(dt)
        first = None
        for v in VARIANTS:
            oft.direct_apply = direct if v != "gather" else (lambda *a: False)
            oft.DIRECT_STAGE_OUT = v == "direct+stage"
            try:
                fwd = lambda: oft.oft_fwd(blocks, x, None, 1.0, True, weight)  # noqa: E731
                bwd = lambda: oft.oft_bwd(g, blocks, x, None, 1.0, True, weight)  # noqa: E731
                outs = (fwd(),) + tuple(bwd()[:2])
                tf, tb = timer.time(fwd)["median_ms"], timer.time(bwd)["median_ms"]
            except Exception as exc:  # a variant that does not build here: say so, go on
                print(f"{name:8} {v:14} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            finally:
                oft.direct_apply, oft.DIRECT_STAGE_OUT = direct, False
            if first is None:
                first = (tf, tb, outs)
            diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                       for a, b in zip(outs, first[2]))
            print(f"{name:8} {v:14} {tf:8.3f} {tf / first[0]:8.2f} {tb:8.3f} {tb / first[1]:8.2f} {diff:12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
