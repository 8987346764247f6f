"""A/B of TileLang BOFT's launch variants, in one process, on a GPU:

    python bench/tilelang_boft_variants.py [--shapes large,small] [--dtype bf16]

For each bench shape (``large``: activations (32768, 4096), s = 32; ``small``: (8192, 3072),
s = 24; m = log2(nb) + 1 stages, channels last) and each variant, ``tilelang.boft.boft_fwd``
and ``boft_bwd`` are called directly (no tuner, no op dispatch, the fixed tile configs), and
the table gives their device time (``timing.DeviceTimer``: L2 flushed, median), the ratio to
the first variant, and the largest relative difference of the results (y, gx, g_blocks) from
the first variant's:

* ``gather``: diag-OFT's element-wise gather kernels once per stage (``RUNS = False``);
* ``runs``: the run kernels, one launch per stage;
* ``runs+composeL``: the forward applies up to L stages a launch as ONE composed matrix
  (``COMPOSE_FWD = L``; 2: 64-wide, 3: 128-wide at GC = 32; 3 is the default), the backward
  one launch a stage;
  ``compose3 bt32`` / ``t256``: the same at tiles of 32 positions / 256 threads (the forward's
  ``APPLY``, also the backward's replay); ``composeL bwd``: the backward's units composed
  too (``COMPOSE_BWD = L``); ``... split``: its stream as two launches, gx by the composed
  forward kernel and the partials alone (``COMPOSE_BWD_SPLIT``); these rows leave the small
  shape's 96-wide units one launch a stage (``COMPOSE_BWD_MMA`` off); ``... pad``: the backward's
  96-wide units (small shape) composed too, their Σ gᵀ·u GEMM padded to 128 (``COMPOSE_BWD_PAD``);
  ``... mma``: those units unpadded, the stream kernel on mma.sync (``COMPOSE_BWD_MMA``);
* ``gj entries`` / ``gj steps``: the defaults (``COMPOSE_BWD_MMA`` on, the stream split from
  W = 128) with ``oft.GJ_PINGPONG = "entries"`` (the default) / ``True`` (each step over the
  whole group);
* ``defaults`` / ``leading``: the defaults with ``COMPOSE_LEADING`` off / on (the leading stages
  that share one box as one unit);
* ``chain blocks`` / ``chain full``: the defaults with ``oft.CHAIN_BLOCKS`` on / off (the chain
  kernel over the blocks' entries alone, or the whole group's);
* ``runs sN`` / ``wN``: the run kernels with N tiles in flight (``oft._DIRECT_STAGES``) / the
  positions split for N programs an SM (``oft.SPLIT_PER_SM``).

Also printed per shape: the forward's composed launch units, and its bytes moved per
variant's pass structure over the copy bandwidth (``floor``: what its passes alone cost).
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

#: name -> (positions, channels, s)
SHAPES = {"large": (32768, 4096, 32), "small": (8192, 3072, 24)}
SMOKE = {"large": (37, 128, 32), "small": (21, 96, 24)}
#: variant -> the settings it times: ``tilelang.boft``'s, and under "oft" those of
#: ``tilelang.oft`` whose helpers the run kernels share (pipeline depth, position split)
VARIANTS = {
    "gather": dict(RUNS=False, COMPOSE_FWD=0, COMPOSE_BWD=0),
    "runs": dict(RUNS=True, COMPOSE_FWD=0, COMPOSE_BWD=0),
    "runs+compose2": dict(RUNS=True, COMPOSE_FWD=2, COMPOSE_BWD=0),
    "runs+compose3": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=0),
    "compose3 bt32": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=0, APPLY=dict(BT=32, threads=128)),
    "compose3 t256": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=0, APPLY=dict(BT=64, threads=256)),
    "compose2 bwd": dict(RUNS=True, COMPOSE_FWD=2, COMPOSE_BWD=2, COMPOSE_BWD_MMA=False),
    "compose3 bwd": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_MMA=False),
    "compose3 bwd split": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=True, COMPOSE_BWD_MMA=False),
    "compose2 bwd split": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=2, COMPOSE_BWD_SPLIT=True, COMPOSE_BWD_MMA=False),
    "compose3 bwd split pad": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=True,
                                   COMPOSE_BWD_PAD=True),
    "compose3 bwd split mma": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=True,
                                   COMPOSE_BWD_MMA=True),
    "compose3 bwd mma": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=False, COMPOSE_BWD_MMA=True),
    "compose3 bwd pad": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=False, COMPOSE_BWD_PAD=True),
    # the Cayley / chain kernels' ping-pong Gauss–Jordan over the blocks' entries alone (oft.GJ_PINGPONG
    # "entries", the default: 1152 of 4096 a step at s = 24) against the whole group's ("gj steps"),
    # both with the defaults' units
    "gj entries": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128,
                       oft=dict(GJ_PINGPONG="entries")),
    "gj steps": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128,
                     oft=dict(GJ_PINGPONG=True)),
    # the leading stages that share one box as one unit (COMPOSE_LEADING: s = 24's stages 0 and 1,
    # 4 units for 8 stages instead of 5) against the defaults
    "defaults": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128, COMPOSE_BWD_MMA=True,
                     COMPOSE_LEADING=False),
    "leading": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128, COMPOSE_BWD_MMA=True,
                    COMPOSE_LEADING=True),
    # the chain kernel over the blocks' entries alone (oft.CHAIN_BLOCKS, on) against the whole
    # group's GP x GP entries, both with the leading unit
    "chain blocks": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128, COMPOSE_BWD_MMA=True,
                         COMPOSE_LEADING=True, oft=dict(CHAIN_BLOCKS=True)),
    "chain full": dict(RUNS=True, COMPOSE_FWD=3, COMPOSE_BWD=3, COMPOSE_BWD_SPLIT=128, COMPOSE_BWD_MMA=True,
                       COMPOSE_LEADING=True, oft=dict(CHAIN_BLOCKS=False)),
    "runs s3": dict(RUNS=True, COMPOSE_FWD=0, COMPOSE_BWD=0, oft=dict(_DIRECT_STAGES=3)),
    "runs s4": dict(RUNS=True, COMPOSE_FWD=0, COMPOSE_BWD=0, oft=dict(_DIRECT_STAGES=4)),
    "runs s3 w1": dict(RUNS=True, COMPOSE_FWD=0, COMPOSE_BWD=0, oft=dict(_DIRECT_STAGES=3, SPLIT_PER_SM=1)),
}
DEFAULT_VARIANTS = "gather,runs,runs+compose3"


def _settings(boft, oft, variant) -> tuple:
    """``variant``'s settings as ``timing.module_settings`` takes them."""
    kv = VARIANTS[variant]
    return (boft, {k: v for k, v in kv.items() if k != "oft"}), (oft, kv.get("oft", {}))


def main(argv=None) -> int:
    args = T.variants_parser("large,small", VARIANTS, DEFAULT_VARIANTS).parse_args(argv)
    from lycoris_ops.backends.tilelang.kernels import boft, oft

    dt, dev, timer, gen = T.variants_device(args)
    bw = None if args.smoke else T.copy_bandwidth(dev)  # bytes / s
    print(f"{'shape':6} {'variant':12} {'fwd ms':>8} {'x first':>8} {'bwd ms':>8} {'x first':>8} {'max rel diff':>12}")
    for name in args.shapes.split(","):
        npos, C, s = (SMOKE if args.smoke else SHAPES)[name]
        nb = C // s
        m = int(math.log2(nb)) + 1
        blocks = (0.02 * torch.randn(m, nb, s, s, generator=gen, device=dev)).to(dt)
        x = torch.randn(npos, C, generator=gen, device=dev).to(dt)
        g = torch.randn(npos, C, generator=gen, device=dev).to(dt)
        runs = boft.run_groups(s, nb, x.element_size())
        if runs is not None:
            print(f"{name:6} m={m} nb={nb} s={s} run groups {runs}; "
                  f"composed (L <= 3): {boft._compose_units(m, s, runs, 3)}")
        rows = T.VariantRows(timer)
        for v in args.variants.split(","):
            res = rows.row(f"{name:6} {v:12}", _settings(boft, oft, v),
                           lambda: boft.boft_fwd(blocks, x, -1, 1.0, 1.0, None, False),
                           lambda: boft.boft_bwd(g, blocks, x, -1, 1.0, 1.0))
            if res:
                (tf, tb), (xf, xb), diff = res
                print(f"{name:6} {v:12} {tf:8.3f} {xf:8.2f} {tb:8.3f} {xb:8.2f} {diff:12.2e}")
        if bw and runs is not None:  # the forward's passes: x in, (hi, lo) pairs between, y out (4p - 2 values)
            per_pass = npos * C * x.element_size()
            for v, passes in (("runs", m), ("runs+compose3", len(boft._compose_units(m, s, runs, 3)))):
                moved = per_pass * (1 + 2 * (passes - 1) + 2 * (passes - 1) + 1)
                print(f"{name:6} {v:12} forward floor of its {passes} passes: {moved / bw * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
