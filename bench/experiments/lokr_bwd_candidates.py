"""Which ``lokr_bypass_bwd`` launch configs disagree with the fp64 eager body on a GPU.

A GPU matrix run saw the tuner reject three candidates at T=8192, w1 40x16, w2 64x20 (bf16:
g_w2 with swap=0, g_w1 with swap=1 wrong or non-finite; block_t 2 or 4, one pass); run one
after another, a later config then hit an illegal memory access. Under Triton's interpreter
on the CPU every config is exact. Each config runs here in its own process (a fault kills
only that one), eight at a time:

    python bench/experiments/lokr_bwd_candidates.py 8192              # the default shapes
    python bench/experiments/lokr_bwd_candidates.py 8192 40,16,64,20  # a,b,c,d of w1 (a,b), w2 (c,d)

Each line: the shape, the config, the plan's (programs, d chunks) grid and BT/BA/BB/BC/BD,
and the relative error of gx, g_w1, g_w2 against fp64 (or how the process ended).
"""
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = ["40,16,64,20", "64,64,64,64", "16,16,16,16", "8,8,128,128"]


def one(T, a, b, c, d, kw):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from timing import rel_err

    import lycoris_ops  # noqa: F401  (registers the ops)
    from lycoris_ops.backends.triton.kernels import lokr_bypass as TKB
    from lycoris_ops.reference import lokr as R

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, b * d, generator=g, device="cuda").to(dt)
    w1 = torch.randn(a, b, generator=g, device="cuda").to(dt)
    w2 = torch.randn(c, d, generator=g, device="cuda").to(dt)
    G = torch.randn(T, a * c, generator=g, device="cuda").to(dt)
    ref = R.lokr_bypass_bwd(G.double(), x.double(), w1.double(), w2.double(), 0.7)
    cfg = TKB.BypassBwdCfg(**kw)
    got = TKB.bypass_bwd(G, x, w1, w2, 0.7, cfg)
    torch.cuda.synchronize()
    _, _, grid, _, _, meta = TKB._bypass_bwd_plan(T, a, b, c, d, (), dt, x.device, cfg)
    errs = ["inf" if not torch.isfinite(o).all() else "%.1e" % rel_err(o, r) for o, r in zip(got, ref)]
    tiles = "BT%d BA%d BB%d BC%d BD%d" % tuple(meta[k] for k in ("BT", "BA", "BB", "BC", "BD"))
    print(grid, tiles, errs, flush=True)


def main():
    if sys.argv[1] == "--one":
        T, a, b, c, d = json.loads(sys.argv[2])
        return one(T, a, b, c, d, json.loads(sys.argv[3]))
    T = int(sys.argv[1])
    shapes = sys.argv[2:] or SHAPES
    jobs = []
    for shape in shapes:
        a, b, c, d = map(int, shape.split(","))
        for bt, swap, passes, programs in itertools.product((1, 2, 4, 8), (False, True), (1, 2), (0,)):
            kw = dict(block_t=bt, swap=swap, passes=passes, programs=programs, num_warps=4, num_stages=2)
            jobs.append(([T, a, b, c, d], kw))

    def run(job):
        dims, kw = job
        p = subprocess.run([sys.executable, __file__, "--one", json.dumps(dims), json.dumps(kw)],
                           capture_output=True, text=True, timeout=120)
        tail = p.stdout.strip().splitlines()[-1:] or [f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["?"])[-1][:120]]
        return f"{dims[1:]} {kw} {tail[0]}"

    with ThreadPoolExecutor(8) as pool:
        for line in pool.map(run, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
