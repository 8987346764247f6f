"""Measured tile sweep of the LoRA bypass kernels at given shapes (CUDA): every config of a
grid around the planner's space, timed like bench.py (median device time, L2 flushed
before each rep), against the eager body and the planner's shortlist. Shows how far
the cost model's ranking is from the measured one.

    python bench/sweep_lora.py --shapes 4096x3072x9216,4096x12288x3072 --rank 32 --max-seconds 200
"""
import argparse
import itertools
import time

import torch

from lycoris_ops.backends.triton.tuning import lora as plans
from lycoris_ops.tuner.device import facts
from lycoris_ops.reference import lora as ref
from lycoris_ops.backends.triton.kernels import lora as TL
from timing import DeviceTimer, copy_bandwidth  # bench/ (this script's folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x3072x9216,4096x12288x3072")  # T x I x O
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--max-seconds", type=float, default=200)
    a = ap.parse_args()
    shapes = a.shapes.split(",")
    dev = torch.device("cuda")
    timer = DeviceTimer(dev)
    bw = copy_bandwidth(dev)  # bytes/s, as bench.py's floors

    def bench(fn, reps=20):
        """Median device ms (L2 flushed before each rep, launch gaps hidden: bench.py's timer)."""
        return timer.time(fn, reps=reps)["median_ms"]

    bf = torch.bfloat16
    for shp in shapes:
        t_end = time.time() + a.max_seconds / len(shapes)
        T, I, O = map(int, shp.split("x"))
        R = a.rank
        x = torch.randn(T, I, device=dev, dtype=bf)
        up = torch.randn(O, R, device=dev, dtype=bf) * 0.1
        down = torch.randn(R, I, device=dev, dtype=bf) * 0.1
        base = torch.randn(T, O, device=dev, dtype=bf)
        g = torch.randn(T, O, device=dev, dtype=bf)
        floor_f = (T * I + 2 * T * O) * 2 / bw * 1e3
        floor_b = (T * I * 2 + T * O) * 2 / bw * 1e3
        print(f"\n== {T}x{I}x{O} r{R} (copy {bw / 1e12:.2f} TB/s): floor fwd {floor_f:.4f} ms, "
              f"bwd (x, G read once, gx written) {floor_b:.4f} ms")
        print(f"eager fwd {bench(lambda: ref.lora_bypass_fwd(x, up, down, 0.5, base)):.4f} ms, "
              f"eager bwd {bench(lambda: ref.lora_bypass_bwd(g, x, up, down, 0.5)):.4f} ms")
        pf = plans.plan_bypass_fwd(facts(dev), T, I, O, R, bf, bf, bf, True)
        pb = plans.plan_bypass_bwd(facts(dev), T, I, O, R, bf, bf, bf)
        res = []
        for c in pf.candidates:
            if isinstance(c, dict):
                res.append(("plan-fwd", bench(lambda: TL.bypass_fwd(x, up, down, 0.5, base, cfg=TL.BypassFwdCfg(**c))), c))
        for c in pb.candidates:
            if isinstance(c, dict):
                cfg = TL.BypassBwdCfg(**{**c, "red": TL.SkinnyCfg(**c["red"])})
                res.append(("plan-bwd", bench(lambda: TL.bypass_bwd(g, x, up, down, 0.5, cfg=cfg)), c))
        for kind, t, c in res:
            print(f"  {kind} {t:.4f} ms  {({k: v for k, v in c.items() if k != 'red'})}")
        sweep = []
        for bt, bi, bo, sp, w, st in itertools.product((16, 32, 64), (64, 128, 256), (64, 128, 256), (0, 1), (4,), (3, 4)):
            if time.time() > t_end:
                break
            try:
                cfg = TL.BypassBwdCfg(block_t=bt, block_i=bi, block_o=bo, i_split=sp, num_warps=w, num_stages=st,
                                      red=TL.default_skinny_cfg(R, bf))
                tb = bench(lambda: TL.bypass_bwd(g, x, up, down, 0.5, cfg=cfg), reps=10)
                cf = TL.BypassFwdCfg(block_t=bt, block_i=bi, block_o=bo, o_split=sp, num_warps=w, num_stages=st)
                tf = bench(lambda: TL.bypass_fwd(x, up, down, 0.5, base, cfg=cf), reps=10)
            except Exception as e:  # out of resources
                print("  skip", bt, bi, bo, sp, w, st, type(e).__name__)
                continue
            sweep.append((tf, tb, (bt, bi, bo, sp, w, st)))
        for name, idx in (("fwd", 0), ("bwd (default reduction)", 1)):
            best = sorted(sweep, key=lambda r: r[idx])[:5]
            print(f"  sweep best {name} (block_t, block_i, block_o, split, warps, stages): "
                  + "; ".join(f"{r[idx]:.4f} {r[2]}" for r in best))
        print(f"  swept {len(sweep)} configs", flush=True)


if __name__ == "__main__":
    main()
