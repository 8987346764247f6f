"""Which call of which op faults on the GPU: each named bench spec's forward, then its
forward+backward through autograd, ``--calls`` times each, with a device sync after every
call, compared with the eager formula after the first; prints the first failing call and its
traceback. A CUDA fault poisons the context, so the script stops at the first one; run it
under different settings (LYCORIS_KERNEL_REPLAY=0, LYCORIS_KERNEL_TUNE=0,
CUDA_LAUNCH_BLOCKING=1) in separate processes to tell the replay, the tuner and the kernel
apart.

    python bench/fault_isolate.py --specs lokr_full_merge,lokr_merge --shape large --dtype bf16
"""
import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specs as S  # noqa: E402

import lycoris_ops  # noqa: E402,F401


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", required=True)
    ap.add_argument("--shape", default="large", choices=sorted(S.SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=sorted(S.DTYPES))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    dev, dtype, geo = torch.device(args.device), S.DTYPES[args.dtype], S.SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    settings = {k: os.environ.get(k, "") for k in ("LYCORIS_KERNEL_REPLAY", "LYCORIS_KERNEL_TUNE", "CUDA_LAUNCH_BLOCKING")}
    print(f"settings {settings}", flush=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    by_name = {s.name: s for s in S.SPECS}
    for name in args.specs.split(","):
        spec = by_name[name]
        inp = spec.build(geo, dtype, dev, gen)
        ts = [t.requires_grad_(k in spec.grads) for k, t in inp.items()]
        targets = [t for k, t in zip(inp, ts) if k in spec.grads]
        with torch.no_grad():
            want = spec.eager(*ts)
        G = torch.randn(want.shape, generator=gen).to(device=dev, dtype=want.dtype)
        for phase in ("fwd", "fwd+bwd"):
            for i in range(args.calls):
                try:
                    out = spec.ours(*ts)
                    if phase == "fwd+bwd":
                        torch.autograd.grad(out, targets, G)
                    sync()
                    if i == 0:
                        err = ((out.detach().double() - want.double()).norm() / want.double().norm()).item()
                        print(f"  {name} {phase} call 1 ok, rel err {err:.2e}", flush=True)
                except Exception:
                    print(f"  {name} {phase} call {i + 1} FAILED", flush=True)
                    traceback.print_exc()
                    return 1
            print(f"  {name} {phase}: {args.calls} calls ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
