"""How many TileLang kernels a cold key's shortlist builds, per candidate config, without a GPU:

    python bench/tilelang_cold_kernels.py [--procs 12] [--small]

For BOFT (32768 x 4096, s = 32, m = 8) and the LoRA bypass (32768 x 4096, r = 64), bf16
(``--small``: the small bench shape, 8192 x 3072, s = 24, r = 32), the
TileLang shortlist ``backends/tilelang/tuning/<family>.py`` gives an H200 (``device.synthetic()``) is
run under ``backends/tilelang/common.capturing`` (nothing built or launched; CPU tensors), and each
config's kernels, and the new ones among them, are listed. ``--procs``: the children of one
precompile round; the configs ``runner.precompile_call`` keeps for a cold key are
marked (with ``LYCORIS_TILELANG_DEFER=0``). The last line per op: the kernels a cold call
builds with the default ``DEFER`` (the first config's) and those left to the background (the
rest of the whole shortlist, which then no longer has to fit one round).
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=12)
    ap.add_argument("--small", action="store_true", help="8192 x 3072 (BOFT s = 24, LoRA r = 32)")
    args = ap.parse_args(argv)
    from lycoris_ops.backends.tilelang.tuning import boft as plans_boft
    from lycoris_ops.tuner import device
    from lycoris_ops.backends.tilelang.tuning import lora as plans_lora
    from lycoris_ops.tuner import tune
    from lycoris_ops.backends.tilelang import common as _common
    from lycoris_ops.backends.tilelang.kernels import boft, lora

    dev, bf = device.synthetic(), torch.bfloat16
    m, nb, s, N, D, r = (8, 128, 24, 8192, 3072, 32) if args.small else (8, 128, 32, 32768, 4096, 64)
    blocks, x = torch.zeros(m, nb, s, s, dtype=bf), torch.zeros(N, nb * s, dtype=bf)
    up, down = torch.zeros(D, r, dtype=bf), torch.zeros(r, D, dtype=bf)
    calls = [("boft_fwd", plans_boft, boft.boft_fwd, (blocks, x, -1, 1.0, 1.0, None, False)),
             ("boft_bwd", plans_boft, boft.boft_bwd, (x, blocks, x, -1, 1.0, 1.0)),
             ("lora_bypass_fwd", plans_lora, lora.bypass_fwd, (x, up, down, 1.0, None)),
             ("lora_bypass_bwd", plans_lora, lora.bypass_bwd, (x, x, up, down, 1.0))]
    for op, plans, fn, a in calls:
        seen, total, every, first = set(), 0, set(), None
        print(op)
        for c in plans.TILELANG[op][0](dev, *a).candidates:
            if tune.is_eager(c):
                continue
            with _common.capturing() as listed:
                fn(*a, cfg=c) if c else fn(*a)
            every.update(p.key for p in listed)
            first = len(listed) if first is None else first
            new = [p for p in listed if p.key not in seen]
            kept = not seen or total + len(new) <= args.procs
            if kept:
                seen.update(p.key for p in new)
                total += len(new)
            print(f"  {str(c):70} kernels {len(listed):2}  new {len(new):2}  {'kept' if kept else 'left out'}")
        print(f"  kernels of the kept configs: {total}")
        print(f"  deferred: the cold call builds {first or 0}, the background {len(every) - (first or 0)} "
              f"(the whole shortlist)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
