"""PEFT LoRA / LoKr ``Conv2d`` layers: PEFT's own forward vs ``patch_peft`` (im2col rows on
``lora_bypass_fwd`` / ``lokr_bypass_fwd``), one training step (forward + backward of the
adapter parameters and the input) per rep.

Prints, per case: median step time (ms) of each row, patched / eager ratio, peak memory
(``torch.cuda.max_memory_allocated`` over the timed steps, MiB). The im2col rows cost
kh·kw times the adapter input's memory: the 3×3 cases show what that costs next to
PEFT's conv chain; the 1×1 ones have no unfold.

    python bench/peft_conv.py              # CUDA, bf16, UNet-sized convs
    python bench/peft_conv.py --smoke      # CPU, tiny dims (runs and checks the rows agree)
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn as nn

import lycoris_ops  # noqa: F401
from lycoris_ops.integrations.peft import patch_peft

#: name: (N, C_in, C_out, H=W, kernel, stride)
CASES = {
    "unet-3x3-320@64": (2, 320, 320, 64, 3, 1),
    "unet-3x3-640@32": (2, 640, 640, 32, 3, 1),
    "unet-3x3-1280@16-s2": (2, 1280, 1280, 32, 3, 2),
    "proj-1x1-640@32": (2, 640, 640, 32, 1, 1),
}
SMOKE = {"tiny-3x3": (2, 8, 12, 9, 3, 1), "tiny-1x1-s2": (2, 8, 12, 9, 1, 2)}


def build(adapter: str, shape, dtype, device):
    import peft
    N, ci, co, hw, k, s = shape
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(ci, co, k, stride=s, padding=k // 2)).to(device, dtype)
    if adapter == "lora":
        cfg = peft.LoraConfig(r=16, lora_alpha=16, target_modules=["0"])
    else:
        cfg = peft.LoKrConfig(r=16, alpha=16, target_modules=["0"])
    m = peft.get_peft_model(base, cfg, autocast_adapter_dtype=False).base_model.model
    with torch.no_grad():  # a non-zero up side, so the adapter does real work in the backward
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 1e-2)
    return m, torch.randn(N, ci, hw, hw, device=device, dtype=dtype)


def step(m, x):
    x = x.detach().requires_grad_()
    m(x).float().square().mean().backward()
    m.zero_grad(set_to_none=True)


def time_ms(fn, device, reps: int) -> float:
    for _ in range(3):
        fn()
    if device == "cpu":
        import time
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(out)
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cases = SMOKE if args.smoke else CASES
    print(f"{'case':<24}{'adapter':<8}{'eager ms':>10}{'patched ms':>12}{'ratio':>8}{'eager MiB':>11}{'patched MiB':>13}")
    for name, shape in cases.items():
        for adapter in ("lora", "lokr"):
            eager, x = build(adapter, shape, dtype, device)
            patched = copy.deepcopy(eager)
            report = patch_peft(patched)
            assert all(r.fused for r in report), report
            with torch.no_grad():
                y0, y1 = eager(x), patched(x)
                err = ((y1.float() - y0.float()).norm() / y0.float().norm()).item()
            assert err < (2e-5 if dtype == torch.float32 else 4e-2), (name, adapter, err)
            row = []
            for m in (eager, patched):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                row.append(time_ms(lambda: step(m, x), device, args.reps))
                row.append(torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan"))
            print(f"{name:<24}{adapter:<8}{row[0]:>10.3f}{row[2]:>12.3f}{row[2] / row[0]:>8.2f}"
                  f"{row[1]:>11.0f}{row[3]:>13.0f}")


if __name__ == "__main__":
    main()
