"""A/B of TileLang's streaming kernels (IA3's backward split, DoRA's row tiles), in one
process, on a GPU:

    python bench/experiments/tilelang_stream_variants.py [--op ia3|dora] [--shapes large,small] [--variants ...]

It times constants of the kernels' launch rules that the tuner does not time (the tuner
times tile configs), to revisit them on new hardware.

For each bench shape and each variant the op-set launcher is called directly (no tuner, the
fixed tile config) and the table gives its device time (``timing.DeviceTimer``: L2 flushed,
median), the ratio to the first variant, the ratio to the memory floor (the operands read
once and the results written once, over the copy bandwidth) and the largest relative
difference of the results from the first variant's.

``--op ia3`` (bench.py's ``ia3`` inputs: x (32768, 4096) / (8192, 3072), channel last):
``ia3.ia3_bwd``; a variant sets ``ia3.BWD_PER_SM``, the programs per SM the token split aims
at (``per_sm N``): the streaming program walks its row tiles with no prefetch, so the bytes
in flight on an SM grow with the programs on it, and so do the fp32 partials of the channel
sums. Floor: G, x read, gx written. ``--layout first``: the same tokens as
(8, channels, tokens/8), channels first (axis 1, a conv's layout), which ``BWD_PER_SM`` also
steers.

``--op dora`` (bench.py's ``dora`` inputs: W (4096, 4096) / (3072, 3072), norms per row):
``dora.dora_fwd`` and ``dora.dora_bwd``; a variant sets ``dora.ROW_BC``, the vectors of a
row one column tile takes (``bc N``): each pass walks the program's tiles one load latency a
step. Floor: the forward's W read and y written.

Ratios within one run are what to compare; the machines are shared.
``--smoke``: CPU twins at fp32, tiny sizes (the script runs; CI).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: specs, timing
import specs  # noqa: E402
import timing as T  # noqa: E402

#: name -> (tokens, channels)
SHAPES = {"large": (32768, 4096), "small": (8192, 3072)}
SMOKE = {"large": (1000, 48), "small": (536, 24)}  # 16 and 9 IA3 row tiles: the splits differ; 8 | tokens
VARIANTS = {f"per_sm {n}": dict(BWD_PER_SM=n) for n in (2, 4, 8, 16)}
#: DoRA: variant -> dora.ROW_BC
DORA_VARIANTS = {f"bc {n}": n for n in (128, 256, 512)}
#: DoRA's smoke widths (fp32, vectors of 4): 1032 channels (258 vectors: tiles of 128, 256, 512
#: differ), 520 (130 vectors)
DORA_SMOKE = {"large": 1032, "small": 520}


def ia3_table(args, dt, dev, timer, bw) -> None:
    from lycoris_ops.backends.tilelang.kernels import ia3

    print(f"{'shape':6} {'variant':9} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        N, D = (SMOKE if args.smoke else SHAPES)[name]
        cpu = torch.Generator().manual_seed(0)  # the spec builders draw on the CPU; G continues their stream
        x, w = specs.build_ia3(specs.Geo(N, D, 1), dt, dev, cpu).values()
        G = torch.randn(N, D, generator=cpu).to(device=dev, dtype=dt)
        axis = -1
        if args.layout == "first":  # (8, D, N/8): the same values, channels first
            x, G = (t.view(8, N // 8, D).transpose(1, 2).contiguous() for t in (x, G))
            axis = 1
        floor = 3 * N * D * x.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(VARIANTS)).split(","):
            res = rows.row(f"{name:6} {v:9}", [(ia3, VARIANTS[v])],
                           lambda: ia3.ia3_bwd(G, x, w, axis, specs.IA3_ALPHA, specs.IA3_GAMMA))
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:9} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")


def dora_table(args, dt, dev, timer, bw) -> None:
    from lycoris_ops.backends.tilelang.kernels import dora

    print(f"{'shape':6} {'variant':8} {'fwd ms':>8} {'x first':>8} {'x floor':>8} {'bwd ms':>8} {'x first':>8} "
          f"{'max rel diff':>12}")
    for name in args.shapes.split(","):
        D = DORA_SMOKE[name] if args.smoke else SHAPES[name][1]
        cpu = torch.Generator().manual_seed(0)  # the spec builders draw on the CPU; G continues their stream
        W, m = specs.build_dora(specs.Geo(1, D, 1), dt, dev, cpu).values()
        G = torch.randn(D, D, generator=cpu).to(device=dev, dtype=dt)
        floor = 2 * D * D * W.element_size() / bw * 1e3 if bw else math.nan
        mult = specs.DORA_MULT
        norms = dora.dora_fwd(W, m, mult, 0)[1]
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(DORA_VARIANTS)).split(","):
            res = rows.row(f"{name:6} {v:8}", [(dora, dict(ROW_BC=DORA_VARIANTS[v]))],
                           lambda: dora.dora_fwd(W, m, mult, 0), lambda: dora.dora_bwd(G, W, m, norms, mult, 0))
            if res:
                (tf, tb), (xf, xb), diff = res
                print(f"{name:6} {v:8} {tf:8.3f} {xf:8.2f} {tf / floor:8.2f} {tb:8.3f} {xb:8.2f} {diff:12.2e}")


def main(argv=None) -> int:
    ap = T.variants_parser("large,small", VARIANTS, None)
    ap.add_argument("--op", default="ia3", choices=("ia3", "dora"))
    ap.add_argument("--layout", default="last", choices=("last", "first"), help="IA3's channel axis")
    args = ap.parse_args(argv)
    dt, dev, timer, _ = T.variants_device(args)
    bw = None if args.smoke else T.copy_bandwidth(dev)  # bytes / s
    (ia3_table if args.op == "ia3" else dora_table)(args, dt, dev, timer, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
