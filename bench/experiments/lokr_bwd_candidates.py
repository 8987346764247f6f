"""Which ``lokr_bypass_bwd`` launch configs disagree with the eager body on a GPU, and whether
only under the tuner's threaded first calls.

A GPU matrix run saw the tuner reject three candidates at T=8192, w1 40x16, w2 64x20 (bf16:
g_w2 with swap=0, g_w1 with swap=1 wrong or non-finite); under Triton's interpreter on the
CPU every config is exact, so the cause is the sm_90 compile of that path or the concurrent
warm-up:

    python bench/experiments/lokr_bwd_candidates.py seq 8192   # one config after another
    python bench/experiments/lokr_bwd_candidates.py thr 8192   # 8 threads, as the tuner warms up

Each line: the config, the plan's grid, and the relative error of gx, g_w1, g_w2 against fp64.
"""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timing import rel_err  # noqa: E402

import lycoris_ops  # noqa: E402,F401  (registers the ops)
from lycoris_ops.backends.triton.kernels import lokr_bypass as TKB  # noqa: E402
from lycoris_ops.reference import lokr as R  # noqa: E402

print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)


def rel(a, b):
    return float("inf") if not torch.isfinite(a).all() else rel_err(a, b)


mode = sys.argv[1]
T = int(sys.argv[2])
a, b, c, d = 40, 16, 64, 20
cfgs = [dict(block_t=2, passes=1, programs=132, split=1, swap=0),
        dict(block_t=2, passes=1, programs=132, split=1, swap=1),
        dict(block_t=4, passes=1, programs=132, split=0, swap=1),
        dict(block_t=2, passes=1, programs=0, split=1, swap=0),
        dict(block_t=4, passes=1, programs=0, split=0, swap=1),
        dict(block_t=2, passes=2, programs=132, split=1, swap=0),
        dict(block_t=2, passes=1, programs=132, split=1, swap=0, num_stages=1),
        dict(block_t=2, passes=1, programs=7, split=1, swap=0),
        dict(block_t=1, passes=1, programs=132, split=1, swap=0),
        dict(), dict(swap=True), dict(swap=False)]
dt = torch.bfloat16
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(T, b*d, generator=g, device="cuda").to(dt)
w1 = torch.randn(a, b, generator=g, device="cuda").to(dt)
w2 = torch.randn(c, d, generator=g, device="cuda").to(dt)
G = torch.randn(T, a*c, generator=g, device="cuda").to(dt)
ref = R.lokr_bypass_bwd(G.double(), x.double(), w1.double(), w2.double(), 0.7)
def one(kw):
    kw = dict(dict(num_warps=4, num_stages=2), **kw)
    cfg = TKB.BypassBwdCfg(**kw)
    got = TKB.bypass_bwd(G, x, w1, w2, 0.7, cfg)
    torch.cuda.synchronize()
    plan = TKB._bypass_bwd_plan(T, a, b, c, d, (), dt, x.device, cfg)
    return kw, plan[2], plan[3], ["%.2e" % rel(o, r) for o, r in zip(got, ref)]
if mode == "seq":
    for kw in cfgs:
        print(*one(kw), flush=True)
        print("  again", one(kw)[3], flush=True)
else:
    dev = torch.cuda.current_device(); st = torch.cuda.current_stream()
    def th(kw):
        torch.cuda.set_device(dev)
        with torch.cuda.stream(st):
            return one(kw)
    with ThreadPoolExecutor(8) as pool:
        for r in pool.map(th, cfgs):
            print("thr", *r, flush=True)
    for kw in cfgs:
        print("after", *one(kw), flush=True)
