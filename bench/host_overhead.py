"""Host time per call on tiny tensors (the device idles): one torch.add, the eager
LoRA formula, and torch.ops.lycoris.lora_bypass_fwd / add_scaled without and with
autograd, so the Python kernel and Python autograd layers show separately.

    python bench/host_overhead.py [--device cpu|cuda] [--calls 3000]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import lycoris_ops  # noqa: F401


def per_call_us(fn, calls, sync):
    for _ in range(200):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(grad)

    x, up, down, base = t(16, 64), t(64, 8), t(8, 64), t(16, 64)
    upg, downg = up.detach().clone().requires_grad_(), down.detach().clone().requires_grad_()
    a, b = t(4, 4), t(4, 4)
    op, add = torch.ops.lycoris.lora_bypass_fwd, torch.ops.lycoris.add_scaled
    rows = [
        ("torch.add", lambda: torch.add(a, b, alpha=0.5)),
        ("eager LoRA formula", lambda: base + 0.5 * F.linear(F.linear(x, down), up)),
        ("lycoris.add_scaled, no_grad", lambda: _no_grad(add, a, b, 0.5)),
        ("lycoris.add_scaled", lambda: add(a, b, 0.5)),
        ("lycoris.lora_bypass_fwd, no_grad", lambda: _no_grad(op, x, up, down, 0.5, base)),
        ("lycoris.lora_bypass_fwd", lambda: op(x, up, down, 0.5, base)),
        ("lycoris.lora_bypass_fwd, factors need grad", lambda: op(x, upg, downg, 0.5, base)),
    ]
    ref = None
    print(f"host us/call on {dev} (torch {torch.__version__}, {args.calls} calls each)")
    for name, fn in rows:
        us = per_call_us(fn, args.calls, sync)
        ref = ref or us
        print(f"  {name:45s} {us:8.1f} us  ({us / ref:5.1f}x torch.add)")


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


if __name__ == "__main__":
    main()
