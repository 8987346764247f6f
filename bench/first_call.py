"""A process's first-call costs: the first ``lora_bypass_fwd`` call (argument checks,
dispatch, kernel choice; on CUDA also Triton's load or compile and the tuner) and the
time to probe every backend's import (``available_backends``: TileLang, torch._dynamo).
Run it in a fresh process; nothing is timed twice.

    python bench/first_call.py [--device cuda]
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    t = time.perf_counter()
    import lycoris_ops
    from lycoris_ops.backends import registry as dispatch
    print(f"import lycoris_ops: {time.perf_counter() - t:.3f} s")
    dev = torch.device(a.device)
    x, up, down, base = (torch.randn(s, device=dev) for s in ((64, 32), (48, 4), (4, 32), (64, 48)))
    t = time.perf_counter()
    torch.ops.lycoris.lora_bypass_fwd(x, up, down, 0.5, base)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    print(f"first lora_bypass_fwd call ({dev}): {time.perf_counter() - t:.3f} s"
          f" (tier: {lycoris_ops.backends.select.explain('lora_bypass_fwd', x, up, down, 0.5, base)})")
    t = time.perf_counter()
    found = dispatch.available_backends()
    print(f"probing every backend's import: {time.perf_counter() - t:.2f} s ({', '.join(found)})")


if __name__ == "__main__":
    main()
