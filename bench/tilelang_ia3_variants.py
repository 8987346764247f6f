"""A/B of TileLang's IA3 backward (``ia3_bwd``) reduction split, in one process, on a GPU:

    python bench/tilelang_ia3_variants.py [--shapes large,small] [--dtype bf16] [--variants ...]

For each bench shape (``large``: x (32768, 4096); ``small``: (8192, 3072); channel last,
w (channels,), as bench.py's ``ia3``) and each variant, ``tilelang.ia3.ia3_bwd`` is called
directly (no tuner, the fixed tile config) and the table gives its device time
(``timing.DeviceTimer``: L2 flushed, median), the ratio to the first variant, the ratio to
the memory floor (G and x read once, gx written once, over the copy bandwidth), and the
largest relative difference of (gx, gw) from the first variant's. A variant sets
``ia3.BWD_PER_SM``, the programs per SM the token split aims at (``per_sm N``): the
streaming program walks its row tiles with no prefetch, so the bytes in flight on an SM
grow with the programs on it, and so do the fp32 partials of the channel sums.

Ratios within one run are what to compare; the machines are shared.
``--smoke``: CPU twins at fp32, tiny sizes (the script runs; CI).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing as T  # noqa: E402

#: name -> (tokens, channels)
SHAPES = {"large": (32768, 4096), "small": (8192, 3072)}
SMOKE = {"large": (1000, 48), "small": (530, 24)}  # 16 and 9 row tiles: the splits differ
VARIANTS = {f"per_sm {n}": n for n in (2, 4, 8, 16)}


def main(argv=None) -> int:
    args = T.variants_parser("large,small", VARIANTS, ",".join(VARIANTS)).parse_args(argv)
    from lycoris_ops.tilelang import ia3

    dt, dev, timer, gen = T.variants_device(args)
    bw = None if args.smoke else T.copy_bandwidth(dev)  # bytes / s
    print(f"{'shape':6} {'variant':9} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        N, D = (SMOKE if args.smoke else SHAPES)[name]

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=dev)).to(dt)

        G, x, w = rnd(N, D), rnd(N, D), rnd(D, scale=0.1)
        floor = 3 * N * D * x.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in args.variants.split(","):
            res = rows.row(f"{name:6} {v:9}", [(ia3, dict(BWD_PER_SM=VARIANTS[v]))],
                         lambda: ia3.ia3_bwd(G, x, w, -1, 1.0, 0.5))
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:9} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
