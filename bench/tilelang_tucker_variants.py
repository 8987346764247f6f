"""A/B of TileLang's tucker rebuild (``lora_tucker_fwd``) kernel forms, in one process, on a GPU:

    python bench/tilelang_tucker_variants.py [--shapes large,small] [--dtype bf16]

For each bench shape (``large``: 4096 channels, rank 64; ``small``: 3072, rank 32; a 3x3
kernel, as bench.py's ``lora_tucker``), one and two chains, and each variant,
``tilelang.tucker.tucker_fwd`` is called directly (no tuner, no op dispatch, the fixed tile
config), and the table gives its device time (``timing.DeviceTimer``: L2 flushed, median),
the ratio to the first variant, the output's bytes over the copy bandwidth (``floor``), and
the largest relative difference of the result from the first variant's:

* ``per-k``: one κ a program, every Kk-th element of Y stored (``ALL_K = False``);
* ``all-k``: every κ of an (O, I) tile in one program, the output tile staged in shared
  memory and stored as whole rows (``ALL_K = True``);
* ``all-k pipe``: that with the κ loop pipelined (``ALL_K_PIPE``: the next core slices load
  during this κ's products; compiled without warp specialization);
* ``all-k pre``: a·t precomputed for every κ by one torch matmul, then one product a κ in a
  pipelined loop (``ALL_K_PRE``, ``tucker_pre_kernel``; the time includes the matmul).

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

#: name -> (channels, rank)
SHAPES = {"large": (4096, 64), "small": (3072, 32)}
SMOKE = {"large": (70, 5), "small": (45, 3)}
KK = 9
VARIANTS = {"per-k": dict(ALL_K=False), "all-k": dict(ALL_K=True, ALL_K_PIPE=False, ALL_K_PRE=False),
            "all-k pipe": dict(ALL_K=True, ALL_K_PIPE=True, ALL_K_PRE=False),
            "all-k pre": dict(ALL_K=True, ALL_K_PRE=True)}


def main(argv=None) -> int:
    args = T.variants_parser("large,small", VARIANTS, ",".join(VARIANTS)).parse_args(argv)
    from lycoris_ops.backends.tilelang.kernels import tucker

    dt, dev, timer, gen = T.variants_device(args)
    bw = None if args.smoke else T.copy_bandwidth(dev)  # bytes / s
    print(f"{'shape':6} {'chains':6} {'variant':8} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        D, r = (SMOKE if args.smoke else SHAPES)[name]

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=dev)).to(dt)

        chain = (rnd(D, r, scale=r ** -0.5), rnd(r, r, KK, scale=r ** -0.5), rnd(r, D, scale=D ** -0.5))
        for two in (False, True):
            ops = chain + (tuple(rnd(*c.shape) for c in chain) if two else (None, None, None)) + (0.75,)
            floor = D * D * KK * torch.empty((), dtype=dt).element_size() / bw * 1e3 if bw else math.nan
            rows = T.VariantRows(timer)
            for v in args.variants.split(","):
                res = rows.row(f"{name:6} {1 + two:6} {v:8}", [(tucker, VARIANTS[v])], lambda: tucker.tucker_fwd(*ops))
                if res:
                    (t,), (x1,), diff = res
                    print(f"{name:6} {1 + two:6} {v:8} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
