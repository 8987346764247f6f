"""A/B of the TileLang diag-OFT streaming kernels' variants, in one process, on a GPU:

    python bench/tilelang_oft_variants.py [--shapes bypass,merge] [--dtype bf16]

For each shape (``bypass``: activations (32768, 4096), channels last; ``merge``: a
(4096, 4096) weight, channels first; ``bypass_s`` / ``merge_s``: bench.py's small shape,
(8192, 3072) / (3072, 3072); S = 32) and each variant, ``tilelang.oft.oft_fwd`` and
``oft_bwd`` are called directly (no tuner, no op dispatch), and the table gives their device
time (``timing.DeviceTimer``: L2 flushed, median), the ratio to the first variant, and the
largest relative difference of the results from the first variant's:

* ``gather``: ``apply_kernel`` / ``bwd_stream_kernel`` (the element-wise channel-map path);
* ``direct``: the ``T.copy`` kernels storing from the GEMM fragment;
* ``direct+stage``: the same, the output tile stored through shared memory
  (``DIRECT_STAGE_OUT``: the launchers' default per layout);
* ``direct+cayley`` (the default): ``direct+stage`` with each program solving its group's
  Cayley transform in its prologue (``FUSE_CAYLEY``: no Cayley launch, no F pair in memory),
  the positions split for one wave (``FUSED_PER_SM``), ``FUSED_STAGES`` deep;
* ``sN`` / ``wN``: the same with N tiles in flight (``_DIRECT_STAGES`` / ``FUSED_STAGES``)
  / a split for N programs an SM (``SPLIT_PER_SM`` / ``FUSED_PER_SM``);
* ``cayley only``: the Cayley launch every variant starts with (F; the backward's Fᵀ), the
  fixed cost a small shape (the merge's 4096 positions) cannot hide.

Ratios within one run are what to compare; the machines are shared.

``--parity``: first, odd-size cases of the direct kernels (a partial last group, a tail
tile; weight rows, conv activations, channels last) with and without the shared-memory
store, and with the Cayley solve fused (``FUSE_CAYLEY``), against the fp64 reference: one line per case, ``ok`` within the dtype's tolerance.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing as T  # noqa: E402

SHAPES = {"bypass": ((32768, 4096), False), "merge": ((4096, 4096), True),
          "bypass_s": ((8192, 3072), False), "merge_s": ((3072, 3072), True)}
SMOKE = {"bypass": ((300, 64), False), "merge": ((64, 300), True), "bypass_s": ((200, 64), False),
         "merge_s": ((64, 200), True)}  # CPU twins, fp32
#: variant -> the ``tilelang.oft`` module settings it times (the rest at their defaults)
VARIANTS = {
    "gather": dict(direct_apply=lambda *a: False),
    "direct": dict(FUSE_CAYLEY=False, DIRECT_STAGE_OUT=dict(cl=False, cf=False)),
    "direct+stage": dict(FUSE_CAYLEY=False, DIRECT_STAGE_OUT=dict(cl=True, cf=True)),
    "direct s3": dict(FUSE_CAYLEY=False, _DIRECT_STAGES=3),
    "direct s4 w1": dict(FUSE_CAYLEY=False, _DIRECT_STAGES=4, SPLIT_PER_SM=1),
    "direct+cayley": dict(FUSE_CAYLEY=True),
    "cayley s2": dict(FUSE_CAYLEY=True, FUSED_STAGES=dict(fwd=2, bwd=2)),
    "cayley s3": dict(FUSE_CAYLEY=True, FUSED_STAGES=dict(fwd=3, bwd=3)),
    "cayley s4": dict(FUSE_CAYLEY=True, FUSED_STAGES=dict(fwd=4, bwd=4)),
    "cayley w2": dict(FUSE_CAYLEY=True, FUSED_PER_SM=2),
}
DEFAULT_VARIANTS = "direct+stage,direct s3,direct+cayley,cayley s3,cayley w2"


#: (K, S, x shape, weight): S divides the 32-channel group (the direct kernels); 72 channels
#: leave the last group partial, 40 / 37 positions the last tile; rows of 16-byte multiples
#: (the direct kernels' TMA condition), and one that is not (the gather path: 37 columns)
PARITY = [(9, 8, (72, 40), True), (4, 16, (3, 64, 4, 6), False), (9, 8, (37, 72), False), (9, 8, (72, 37), True)]


def parity(dt, dev) -> bool:
    """The direct kernels at odd sizes, both store paths, against the fp64 reference."""
    from lycoris_ops.reference import oft as R
    from lycoris_ops.testing import REL_TOL, rel_err
    from lycoris_ops.backends.tilelang.kernels import oft

    good = True
    gen = torch.Generator().manual_seed(1)
    for K, S, shape, weight in PARITY:
        blocks = 0.2 * torch.randn(K, S, S, generator=gen)
        rs = torch.rand(K * S, 1, generator=gen) + 0.5
        x, g = (torch.randn(*shape, generator=gen).to(dt) for _ in range(2))
        want = (R.oft_fwd(blocks.double(), x.double(), rs.double(), 0.8, True, weight),) + tuple(
            R.oft_bwd(g.double(), blocks.double(), x.double(), rs.double(), 0.8, True, weight))
        for stage, fused in ((False, False), (True, False), (True, True)):
            with T.module_settings((oft, dict(DIRECT_STAGE_OUT=dict.fromkeys(("cl", "cf"), stage),
                                              FUSE_CAYLEY=fused))):
                b, xd, gd, r = (t.to(dev) for t in (blocks, x, g, rs))
                got = (oft.oft_fwd(b, xd, r, 0.8, True, weight),) + tuple(oft.oft_bwd(gd, b, xd, r, 0.8, True, weight))
            errs = [rel_err(a.cpu(), w) for a, w in zip(got, want)]
            ok = max(errs) <= REL_TOL[dt]
            good &= ok
            print(f"parity {str(dt)[6:]:8} {str(shape):14} {'weight' if weight else 'act':6} "
                  f"stage={int(stage)} fused={int(fused)}  y/gx/gB/gR rel err {' '.join(f'{e:.1e}' for e in errs)}  "
                  f"{'ok' if ok else 'FAIL'}")
    return good


def main(argv=None) -> int:
    ap = T.variants_parser("bypass,merge", VARIANTS, DEFAULT_VARIANTS)
    ap.add_argument("--parity", action="store_true", help="odd-size parity of the direct kernels first")
    args = ap.parse_args(argv)
    from lycoris_ops.backends.tilelang.kernels import oft

    dt, dev, timer, gen = T.variants_device(args)
    if args.parity and not parity(dt, dev):
        return 1
    print(f"{'shape':8} {'variant':14} {'fwd ms':>8} {'x first':>8} {'bwd ms':>8} {'x first':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        shape, weight = (SMOKE if args.smoke else SHAPES)[name]
        S = 32
        K = shape[0 if weight else 1] // S
        blocks = (0.02 * torch.randn(K, S, S, generator=gen, device=dev)).to(dt)
        x = torch.randn(shape, generator=gen, device=dev).to(dt)
        g = torch.randn(shape, generator=gen, device=dev).to(dt)
        rows = T.VariantRows(timer)
        for v in args.variants.split(","):
            # the backward's first two results (g_blocks, g_x); its third is the weight's
            res = rows.row(f"{name:8} {v:14}", [(oft, VARIANTS[v])],
                           lambda: oft.oft_fwd(blocks, x, None, 1.0, True, weight),
                           lambda: oft.oft_bwd(g, blocks, x, None, 1.0, True, weight)[:2])
            if res:
                (tf, tb), (xf, xb), diff = res
                print(f"{name:8} {v:14} {tf:8.3f} {xf:8.2f} {tb:8.3f} {xb:8.2f} {diff:12.2e}")
        if rows.first is not None:  # the fixed part every variant shares: the Cayley launch (F; Fᵀ)
            ref = cayley(oft, blocks, dt, False)  # the default Gauss–Jordan's F pair
            for pp in (False, True):  # GJ_PINGPONG: one barrier a Gauss–Jordan step
                with T.module_settings((oft, dict(GJ_PINGPONG=pp))):
                    cf, cb = (timer.time(lambda t=t: cayley(oft, blocks, dt, t))["median_ms"] for t in (False, True))
                    (fh, fl), (rh, rl) = cayley(oft, blocks, dt, False), ref
                    diff = ((fh.float() + fl.float()) - (rh.float() + rl.float())).abs().max().item()
                print(f"{name:8} {'cayley only' + (' pp' if pp else ''):14} {cf:8.3f} {cf / rows.first[0][0]:8.2f} "
                      f"{cb:8.3f} {cb / rows.first[0][1]:8.2f} {diff:12.2e}")
    return 0


def cayley(oft, blocks, dt, trans):
    """The Cayley launch of ``oft_fwd`` (trans: ``oft_bwd``'s Fᵀ) alone."""
    from lycoris_ops.backends.tilelang.common import arch_of, cdiv
    K, S = blocks.shape[0], blocks.shape[1]
    GP, NB, _ = oft.group_plan(S)
    return oft._cayley(blocks, None, oft.gemm_dtype(dt), S, NB, GP, False, False, trans, 1.0, 1.0, 0, 0,
                       cdiv(K, NB), arch_of(blocks.device))


if __name__ == "__main__":
    sys.exit(main())
