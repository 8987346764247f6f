"""A/B of TileLang's LoRA bypass forward (``lora_bypass_fwd``) and merge (``lora_merge_fwd``)
kernel forms, in one process, on a GPU:

    python bench/tilelang_lora_variants.py [--op bypass|bypass_bwd|merge|merge_bwd|hada_bwd|lokr|lokr_merge_fwd|lokr_merge_bwd] [--shapes large,small] [--variants ...]

For each bench shape (``large``: 32768 tokens, 4096 channels, rank 64; ``small``: 8192,
3072, rank 32; with the base, as bench.py's ``lora_bypass``) and each variant,
``tilelang.lora.bypass_fwd`` is called directly (no tuner, no op dispatch, the fixed tile
config) and the table gives its device time (``timing.DeviceTimer``: L2 flushed, median),
the ratio to the first variant, the ratio to the memory floor (x and base read once, y
written once, over the copy bandwidth) and the largest relative difference from the first
variant's result. The variants set ``lora.BYPASS_FWD_FORM``:

* ``ws``: TileLang's producer / consumer warp specialization (256 threads, one program an
  SM), a serial O loop whose output leaves from the registers;
* ``no-ws``: the same program without warp specialization (128 threads, several an SM);
* ``staged``: no warp specialization; base and output tiles through shared memory;
* ``staged pipe``: ``staged`` with the O loop pipelined (the next up / base tiles load
  during this tile's product);
* ``staged pipe ws``: that with warp specialization;
* ``staged pipe k2`` / ``k3`` / ``k4``: ``staged pipe`` (the default form) with 2 / 3 / 4 x tiles
  in flight in the x·downᵀ loop (``lora.BYPASS_FWD["stages"]``: 4 in the fixed config since
  2026-12-02 13:30, the other rows run that; 2 before): TileLang
  overlaps that loop's buffers with the O loop's, so the program's shared memory (88 KiB,
  two programs an SM) does not grow; forward only;
* ``staged pipe g``: the pipelined O loop also where the O tiles are split into groups
  (``pipe_groups``: a static group size; at the small shape 3 groups of 8 O tiles, whose loop
  is serial in the other rows); ``staged pipe 1g``: never split (``one_group``: one program a
  token tile, the O loop pipelined); forward only.

``--op bypass_bwd``: the same five forms of the backward's token kernel (``lora.BYPASS_BWD_FORM``:
the gx = γ·q·down loop), timing the whole backward op (``lora.bypass_bwd``: the token kernel
and the two skinny products); floor: G, x read, gx written.

``--op merge``: ``W + γ·P`` at (channels, channels) for P = up·down (``plain``), the
LoHa ``hada`` and the ``sum`` of two chains, ``lora.GEMM_STAGED`` off (``regs``: the output
leaves from the accumulator's registers) and on (``staged``: base and output tiles through
shared memory), and ``stream`` (``lora.MERGE_FWD_FORM``: ``merge_stream_kernel``, a program per
column stripe and group of row tiles, the next base tile loading during this tile's product;
``s3``: 3 stages, ``n256``: 256-wide stripes, ``m128``: 128-row tiles on 256 threads); floor: W
read, the result written.

``--op merge_bwd``: ``lora_merge_bwd`` at (channels, channels): ``skinny`` (the two split
skinny products, fp32 partials summed by torch) against ``pair`` (``lora.MERGE_BWD_FORM``: one
launch, a program per row band of g_up or g_downᵀ, whole reductions; ``ws``: warp-specialized),
64- or 128-wide K steps, 3 or 4 stages; floor: G read once.

``--op hada_bwd``: ``loha_merge_bwd`` at (channels, channels), four factors at the shape's
rank: ``split`` (the two split jobs, fp32 partials summed by torch) against ``pair``
(``loha.GRADS_FORM``: one launch, a program per band of g_a or g_b, whole reductions), band
width 64 or 32, 1 to 3 stages; floor: G read once.

``--op lokr``: LoKr's bypass (``tilelang.lokr``, bench.py's ``lokr_bypass`` inputs: near-square
factors of the channels, 64 x 64 both at 4096), forward with base and the backward op,
``lokr.APPLY_STAGED`` off (``regs``) and on (``staged``: the program's output block and
base block through shared memory), and ``staged+pipe`` (``lokr.WGRAD_KPER``: the weight-
gradient kernels' token loop pipelined over a static step count), ``persistent`` and
``persist regs`` (also ``lokr.APPLY_KPER``: each apply program walks a static number of
token tiles in a pipelined loop, the factors loaded once; staged / register epilogue),
``fused wgrads`` (also ``lokr.WGRADS_FUSED``: both weight gradients in one pass),
``persist split`` (``persistent`` with ``lokr.APPLY_SPLIT_BASE``: the staged epilogue's base
add in its own loop), ``fused bwd`` (``lokr.BWD_FUSED``: gx and both weight gradients in one
pass over the tokens), ``fused bwd sum8`` / ``sum32`` (also ``lokr.PARTIAL_SUM_RUN``: the
fp32 partials summed over runs of 8 / 32 first, then over the rest), ``fused bwd async``
(also ``lokr.WGRADS_ASYNC``: the one pass's GEMM groups issued as async WGMMAs, sm_90a),
``fused bwd finish`` (also ``lokr.WGRADS_FINISH``: the fp32 partials summed and cast by one
``kron_finish_kernel`` launch instead of torch's sums), ``fused bwd async finish`` (both; the
module default since 2026-12-05);
floor: the forward's x, base read and y written.

``--op lokr_merge_bwd``: ``lokr.merge_bwd`` on bench.py's ``lokr_merge`` inputs, the two-pass
gradient kernels against the one pass over G (``GRADS["one_pass"]``, registers or ``stages``
3, two tile sizes, 256 threads); floor: G read once. ``--op lokr_merge_fwd``: ``lokr.merge_fwd``
(with the base), the output-tile kernel against the stream per tile of w2 (``KRON["stream"]``,
registers or ``stages`` 3, three tiles); floor: base read, output written.

Ratios within one run are what to compare; the machines are shared.
``--smoke``: CPU twins at fp32, tiny sizes (the script runs; CI).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specs  # noqa: E402
import timing as T  # noqa: E402

#: name -> (tokens, channels, rank)
SHAPES = {"large": (32768, 4096, 64), "small": (8192, 3072, 32)}
SMOKE = {"large": (150, 45, 5), "small": (70, 37, 3)}
#: variant -> lora.BYPASS_FWD_FORM (staged, pipelined O loop, warp specialization)
VARIANTS = {
    "ws": dict(staged=False, pipe_o=False, ws=True),
    "no-ws": dict(staged=False, pipe_o=False, ws=False),
    "staged": dict(staged=True, pipe_o=False, ws=False),
    "staged pipe": dict(staged=True, pipe_o=True, ws=False),
    "staged pipe ws": dict(staged=True, pipe_o=True, ws=True),
    "staged pipe k2": dict(staged=True, pipe_o=True, ws=False, stages=2),
    "staged pipe k3": dict(staged=True, pipe_o=True, ws=False, stages=3),
    "staged pipe k4": dict(staged=True, pipe_o=True, ws=False, stages=4),
    "staged pipe g": dict(staged=True, pipe_o=True, ws=False, pipe_groups=True),
    "staged pipe 1g": dict(staged=True, pipe_o=True, ws=False, one_group=True),
}
_GEMM = dict(MERGE_FWD_FORM=dict(stream=False))
_STREAM = dict(MERGE_FWD_FORM=dict(stream=True))
#: merge variant -> lora settings (GEMM_STAGED, MERGE_FWD_FORM, MERGE_STREAM)
MERGE_VARIANTS = {
    "regs": dict(GEMM_STAGED=False, **_GEMM),
    "staged": dict(GEMM_STAGED=True, **_GEMM),
    "stream": dict(MERGE_STREAM=dict(BM=64, BN=128, stages=2, threads=128), **_STREAM),
    "stream s3": dict(MERGE_STREAM=dict(BM=64, BN=128, stages=3, threads=128), **_STREAM),
    "stream n256": dict(MERGE_STREAM=dict(BM=64, BN=256, stages=2, threads=128), **_STREAM),
    "stream m128": dict(MERGE_STREAM=dict(BM=128, BN=128, stages=2, threads=256), **_STREAM),
}
#: lokr variant -> lokr settings (APPLY_STAGED, WGRAD_KPER)
LOKR_VARIANTS = {"regs": dict(APPLY_STAGED=False, WGRAD_KPER=(), APPLY_KPER=()),
                 "staged": dict(APPLY_STAGED=True, WGRAD_KPER=(), APPLY_KPER=()),
                 "staged+pipe": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=()),
                 "persistent": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64)),
                 "persist regs": dict(APPLY_STAGED=False, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64)),
                 "fused wgrads": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                      WGRADS_FUSED=True),
                 "persist split": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                       APPLY_SPLIT_BASE=True),
                 "fused bwd": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64), BWD_FUSED=True,
                                   WGRADS_ASYNC=False, WGRADS_FINISH=False),
                 "fused bwd sum8": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                        BWD_FUSED=True, PARTIAL_SUM_RUN=8),
                 "fused bwd sum32": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                         BWD_FUSED=True, PARTIAL_SUM_RUN=32),
                 "fused bwd async": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                         BWD_FUSED=True, WGRADS_ASYNC=True, WGRADS_FINISH=False),
                 "fused bwd finish": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                          BWD_FUSED=True, WGRADS_ASYNC=False, WGRADS_FINISH=True),
                 "fused bwd async finish": dict(APPLY_STAGED=True, WGRAD_KPER=(4, 16, 64), APPLY_KPER=(4, 16, 64),
                                                BWD_FUSED=True, WGRADS_ASYNC=True, WGRADS_FINISH=True)}


def lokr_table(args, dt, dev, timer, bw) -> None:
    from lycoris_ops.backends.tilelang.kernels import lokr

    print(f"{'shape':6} {'variant':11} {'fwd ms':>8} {'x first':>8} {'x floor':>8} {'bwd ms':>8} {'x first':>8} "
          f"{'max rel diff':>12}")
    for name in args.shapes.split(","):
        N, D, r = (SMOKE if args.smoke else SHAPES)[name]
        cpu = torch.Generator().manual_seed(0)  # the spec builders draw on the CPU; G continues their stream
        x, w1, w2, base = specs.build_lokr_bypass(specs.Geo(N, D, r), dt, dev, cpu).values()
        G = torch.randn(N, D, generator=cpu).to(device=dev, dtype=dt)
        floor = 3 * N * D * x.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(LOKR_VARIANTS)).split(","):
            res = rows.row(f"{name:6} {v:11}", [(lokr, LOKR_VARIANTS[v])],
                           lambda: lokr.bypass_fwd(x, w1, w2, 0.75, base), lambda: lokr.bypass_bwd(G, x, w1, w2, 0.75))
            if res:
                (tf, tb), (xf, xb), diff = res
                print(f"{name:6} {v:11} {tf:8.3f} {xf:8.2f} {tf / floor:8.2f} {tb:8.3f} {xb:8.2f} {diff:12.2e}")

#: lokr_merge_bwd variant -> lokr.GRADS (the fixed config each row runs): the two-pass kernels
#: (kron_grad1 + kron_grad2) against the one pass over G (kron_grads_kernel), its G tiles in
#: registers or a pipelined shared-memory ring of 3 stages, at the fixed tile and at 2048 elements
LOKR_MERGE_BWD_VARIANTS = {
    "two-pass": dict(GRADS=dict(elems=4096, threads=128)),
    "one-pass": dict(GRADS=dict(elems=4096, threads=128, one_pass=True)),
    "one-pass s3": dict(GRADS=dict(elems=4096, threads=128, one_pass=True, stages=3)),
    "one-pass e2048": dict(GRADS=dict(elems=2048, threads=128, one_pass=True)),
    "one-pass e2048 s3": dict(GRADS=dict(elems=2048, threads=128, one_pass=True, stages=3)),
    "one-pass t256 s3": dict(GRADS=dict(elems=4096, threads=256, one_pass=True, stages=3)),
}
#: lokr_merge_fwd variant -> lokr.KRON: the output-tile kernel (kron_kernel, after lora's w2 GEMM)
#: against the stream per tile of w2 (kron_stream_kernel, w2's tiles generated in it), its base
#: blocks in registers or a 3-stage pipeline
LOKR_MERGE_FWD_VARIANTS = {
    "tiles": dict(KRON=dict(BM=32, BN=128, threads=128)),
    "stream": dict(KRON=dict(BM=32, BN=128, threads=128, stream=True)),
    "stream s3": dict(KRON=dict(BM=32, BN=128, threads=128, stream=True, stages=3)),
    "stream 16x128 s3": dict(KRON=dict(BM=16, BN=128, threads=128, stream=True, stages=3)),
    "stream 64x64 s3": dict(KRON=dict(BM=64, BN=64, threads=128, stream=True, stages=3)),
}


def lokr_merge_table(args, dt, dev, timer, gen, bw, fwd: bool) -> None:
    """``lokr.merge_fwd`` (with the base) or ``lokr.merge_bwd`` on bench.py's ``lokr_merge``
    inputs (w1 whole (a, a), w2 = w2a·w2b with the big side c = 256); floor: base read and the
    output written (forward), G read once (backward)."""
    from lycoris_ops.backends.tilelang.kernels import lokr

    variants = LOKR_MERGE_FWD_VARIANTS if fwd else LOKR_MERGE_BWD_VARIANTS
    print(f"{'shape':6} {'variant':17} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        N, D, r = (SMOKE if args.smoke else SHAPES)[name]
        W, w1, w2a, w2b = specs.build_lokr_merge(specs.Geo(N, D, r), dt, dev, torch.Generator().manual_seed(0)).values()
        a, c = w1.shape[0], w2a.shape[0]
        W = W[:a * c, :a * c].contiguous()  # D x D where c divides D (the bench shapes)
        G = torch.randn(a * c, a * c, generator=gen, device=dev).to(dt)
        floor = (2 if fwd else 1) * G.numel() * G.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(variants)).split(","):
            call = (lambda: lokr.merge_fwd(w1, None, w2a, w2b, [a, a, c, c], W, 0.75)) if fwd else (
                lambda: lokr.merge_bwd(G, w1, None, w2a, w2b, [a, a, c, c], 0.75))
            res = rows.row(f"{name:6} {v:17}", [(lokr, variants[v])], call)
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:17} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")


def merge_table(args, lora, dt, dev, timer, gen, bw) -> None:
    print(f"{'shape':6} {'mode':6} {'variant':11} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        _, D, r = (SMOKE if args.smoke else SHAPES)[name]

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=dev)).to(dt)

        W = rnd(D, D)
        floor = 2 * D * D * W.element_size() / bw * 1e3 if bw else math.nan
        for mode in ("plain", "hada", "sum"):
            two = mode != "plain"
            f = (rnd(D, r, scale=r ** -0.5), rnd(r, D, scale=D ** -0.5))
            f2 = (rnd(D, r, scale=r ** -0.5), rnd(r, D, scale=D ** -0.5)) if two else (None, None)
            rows = T.VariantRows(timer)
            for v in (args.variants or ",".join(MERGE_VARIANTS)).split(","):
                res = rows.row(f"{name:6} {mode:6} {v:11}", [(lora, MERGE_VARIANTS[v])],
                               lambda: lora.merge_fwd(f[0], f[1], f2[0], f2[1], W, 0.75, mode))
                if res:
                    (t,), (x1,), diff = res
                    print(f"{name:6} {mode:6} {v:11} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")

#: merge_bwd variant -> lora settings (MERGE_BWD_FORM, MERGE_BWD's tile)
MERGE_BWD_VARIANTS = {
    "skinny": dict(MERGE_BWD_FORM=dict(pair=False, ws=False)),
    "pair ws": dict(MERGE_BWD_FORM=dict(pair=True, ws=True), MERGE_BWD=dict(BM=64, BK=64, stages=3, threads=128)),
    "pair": dict(MERGE_BWD_FORM=dict(pair=True, ws=False), MERGE_BWD=dict(BM=64, BK=64, stages=3, threads=128)),
    "pair s4": dict(MERGE_BWD_FORM=dict(pair=True, ws=False), MERGE_BWD=dict(BM=64, BK=64, stages=4, threads=128)),
    "pair k128": dict(MERGE_BWD_FORM=dict(pair=True, ws=False), MERGE_BWD=dict(BM=64, BK=128, stages=3,
                                                                                  threads=128)),
}


def merge_bwd_table(args, lora, dt, dev, timer, gen, bw) -> None:
    """``lora.merge_bwd`` (G (D, D), up (D, r), down (r, D)): the two skinny products against
    the one-launch pair kernel; floor: G read once."""
    print(f"{'shape':6} {'variant':13} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        _, D, r = (SMOKE if args.smoke else SHAPES)[name]
        G = torch.randn(D, D, generator=gen, device=dev).to(dt)
        up = (r ** -0.5 * torch.randn(D, r, generator=gen, device=dev)).to(dt)
        down = (D ** -0.5 * torch.randn(r, D, generator=gen, device=dev)).to(dt)
        floor = D * D * G.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(MERGE_BWD_VARIANTS)).split(","):
            res = rows.row(f"{name:6} {v:13}", [(lora, MERGE_BWD_VARIANTS[v])], lambda: lora.merge_bwd(G, up, down, 0.75))
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:13} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")


#: hada_bwd variant -> loha settings (GRADS_FORM, GRADS_PAIR's band and depth)
HADA_BWD_VARIANTS = {
    "split": dict(GRADS_FORM=dict(pair=False)),
    "pair": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=64, stages=2)),
    "pair s1": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=64, stages=1)),
    "pair s3": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=64, stages=3)),
    "pair 32": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=32, stages=2)),
    "pair 32 s3": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=32, stages=3)),
    # K steps wider than the band: a program's serial chain of steps halves / quarters
    "pair 32 k64": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=32, BK=64, stages=2)),
    "pair 32 k128": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=32, BK=128, stages=2)),
    "pair 32 k128 s1": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=32, BK=128, stages=1)),
    "pair 64 k128": dict(GRADS_FORM=dict(pair=True), GRADS_PAIR=dict(BM=64, BK=128, stages=2)),
}


def hada_bwd_table(args, dt, dev, timer, gen, bw) -> None:
    """``loha.merge_bwd`` (G (D, D), four factors at the shape's rank): the two split jobs
    (fp32 partials summed by torch) against the one-launch pair kernel; floor: G read once."""
    from lycoris_ops.backends.tilelang.kernels import loha

    print(f"{'shape':6} {'variant':13} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        _, D, r = (SMOKE if args.smoke else SHAPES)[name]
        G = torch.randn(D, D, generator=gen, device=dev).to(dt)
        f = [(s * torch.randn(*shape, generator=gen, device=dev)).to(dt)
             for shape, s in (((D, r), r ** -0.5), ((r, D), 1.0)) * 2]
        floor = D * D * G.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        for v in (args.variants or ",".join(HADA_BWD_VARIANTS)).split(","):
            res = rows.row(f"{name:6} {v:13}", [(loha, HADA_BWD_VARIANTS[v])], lambda: loha.merge_bwd(G, *f, 0.75))
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:13} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")


def main(argv=None) -> int:
    ap = T.variants_parser("large,small", VARIANTS, None)
    ap.add_argument("--op", default="bypass", choices=("bypass", "bypass_bwd", "merge", "merge_bwd", "hada_bwd",
                                                      "lokr", "lokr_merge_fwd", "lokr_merge_bwd"))
    args = ap.parse_args(argv)
    from lycoris_ops.backends.tilelang.kernels import lora

    dt, dev, timer, gen = T.variants_device(args)
    bw = None if args.smoke else T.copy_bandwidth(dev)  # bytes / s
    if args.op == "merge":
        merge_table(args, lora, dt, dev, timer, gen, bw)
        return 0
    if args.op == "merge_bwd":
        merge_bwd_table(args, lora, dt, dev, timer, gen, bw)
        return 0
    if args.op == "hada_bwd":
        hada_bwd_table(args, dt, dev, timer, gen, bw)
        return 0
    if args.op == "lokr":
        lokr_table(args, dt, dev, timer, bw)
        return 0
    if args.op in ("lokr_merge_fwd", "lokr_merge_bwd"):
        lokr_merge_table(args, dt, dev, timer, gen, bw, args.op == "lokr_merge_fwd")
        return 0
    print(f"{'shape':6} {'variant':15} {'ms':>8} {'x first':>8} {'x floor':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        N, D, r = (SMOKE if args.smoke else SHAPES)[name]

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=dev)).to(dt)

        x, up, down, base = rnd(N, D), rnd(D, r, scale=r ** -0.5), rnd(r, D, scale=D ** -0.5), rnd(N, D)
        floor = 3 * N * D * x.element_size() / bw * 1e3 if bw else math.nan
        rows = T.VariantRows(timer)
        bwd = args.op == "bypass_bwd"
        for v in (args.variants or ",".join(VARIANTS)).split(","):
            form = VARIANTS[v]
            if bwd and {"stages", "pipe_groups", "one_group"} & set(form):
                continue  # forward-only rows
            if bwd:  # the same forms; the backward's pipelined loop walks I
                setting = dict(BYPASS_BWD_FORM=dict(staged=form["staged"], pipe_i=form["pipe_o"], ws=form["ws"]))
                fn = lambda: lora.bypass_bwd(base, x, up, down, 0.75)  # noqa: E731  (base as G)
            else:
                form = dict(form)
                stages = form.pop("stages", None)
                setting = dict(BYPASS_FWD_FORM=form)
                if stages:
                    setting["BYPASS_FWD"] = {**lora.BYPASS_FWD, "stages": stages}
                fn = lambda: lora.bypass_fwd(x, up, down, 0.75, base)  # noqa: E731
            res = rows.row(f"{name:6} {v:15}", [(lora, setting)], fn)
            if res:
                (t,), (x1,), diff = res
                print(f"{name:6} {v:15} {t:8.3f} {x1:8.2f} {t / floor:8.2f} {diff:12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
