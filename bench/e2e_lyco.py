"""``e2e.py``'s ``lyco-*`` rows: lycoris-lora's own network (``LycorisNetwork``) on the same
model, eager and torch.compile'd. Run by ``e2e.py`` in its own process, which must never
import lycoris_ops (its import hook would serve lycoris-lora's kernels); ``e2e.py`` sets
``LYCORIS_KERNEL_BACKEND=torch`` there, lycoris-lora's eager torch bodies.

    python bench/e2e_lyco.py '<json: e2e.py's args, adapters, variants>'

Prints one ``ROW {json}`` line per row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_models as em  # noqa: E402


def build(adapter, args, device, dtype):
    from lycoris import LycorisNetwork

    m = em.make_model(args, device, dtype)
    algo, kw = em.LYCO[adapter]
    dim = em.OFT_DIM if algo in ("diag-oft", "boft") else args.rank
    # exactly e2e.py's target layers, by qualified name (no class-wide preset)
    LycorisNetwork.apply_preset({"enable_conv": True, "target_module": [],
                                 "target_name": em.target_names(m, args.model), "use_fnmatch": False})
    net = LycorisNetwork(m, multiplier=1.0, lora_dim=dim, conv_lora_dim=dim, alpha=dim, conv_alpha=dim,
                         network_module=algo, warn_on_unmatched=False, **kw)
    net.apply_to()
    net.to(device, dtype)
    with torch.no_grad():  # non-zero "up" so the adapter does real work in the backward
        for p in net.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 1e-3)
    params = [p for p in net.parameters() if p.requires_grad]
    return m, params, len(net.loras)


def main():
    cfg = json.loads(sys.argv[1])
    args = argparse.Namespace(**cfg["args"])
    device = args.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    x = em.make_input(args, device, dtype)
    for adapter in cfg["adapters"]:
        for v in cfg["variants"]:
            torch._dynamo.reset()
            row = dict(adapter=adapter, variant=v, baseline="lyco-eager")
            try:
                model, params, n = build(adapter, args, device, dtype)
                row["note"] = f"{n} lycoris-lora modules"
                if v.endswith("compiled"):
                    model = torch.compile(model, fullgraph=True)
                t0 = time.perf_counter()
                step = em.step_fn(model, params, x)
                step()
                row["cold_s"] = time.perf_counter() - t0
                row["ms"], row["peak_gib"] = em.time_steps(step, device, args.warmup, args.reps)
                row["error"] = ""
            except Exception as e:  # keep the other rows
                row.update(ms=float("nan"), peak_gib=float("nan"), cold_s=float("nan"),
                           error=f"{type(e).__name__}: {e}"[:300])
            print("ROW " + json.dumps(row), flush=True)
            model = params = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    # the rows above measured lycoris-lora alone
    assert "lycoris_ops" not in sys.modules, "lycoris_ops was imported into the lycoris-lora process"


if __name__ == "__main__":
    main()
