"""Export an adapted model and ship it as an AOTInductor package.

Two inference artifacts from one model with LoRA (bypass) and LoKr adapters:
  1. adapters kept: the exported graph holds torch.ops.lycoris.* nodes, so the
     process that loads the package must `import lycoris_ops` first;
  2. adapters merged into the base weights (lycoris_ops.nn.merge_adapters): a
     plain graph that needs nothing from us at load time.
Each package is loaded and run in a fresh process and checked against the model.

    python examples/export_aoti.py [--device cuda] [--out DIR]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

import torch
from torch import nn

import lycoris_ops  # noqa: F401
from lycoris_ops import nn as lnn


def build(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(device)
    lnn.add_adapters(model, "lora", rank=8, include=["0"])
    lnn.add_adapters(model, "lokr", rank=8, include=["2"])
    with torch.no_grad():  # a non-zero delta, as after training
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def package(model, x, path):
    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    ops = sorted({str(n.target) for n in ep.graph.nodes if "lycoris" in str(n.target)})
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
    return ops


def run_fresh(path, xs_path, needs_ops):
    code = textwrap.dedent(f"""
        import torch
        {'import lycoris_ops  # the package calls torch.ops.lycoris.*' if needs_ops else ''}
        runner = torch._inductor.aoti_load_package({path!r})
        io = torch.load({xs_path!r})
        torch.testing.assert_close(runner(io["x"]), io["y"], rtol=2e-4, atol=2e-5)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="lycoris_aoti_")
    os.makedirs(out, exist_ok=True)
    model = build(args.device)
    x = torch.randn(5, 64, device=args.device)
    x2 = torch.randn(11, 64, device=args.device)  # another batch size at load time

    with torch.no_grad():
        ops = package(model, x, f"{out}/adapted.pt2")
        torch.save({"x": x2, "y": model(x2)}, f"{out}/io_adapted.pt")
        run_fresh(f"{out}/adapted.pt2", f"{out}/io_adapted.pt", needs_ops=True)
        print(f"adapted: {out}/adapted.pt2 holds {', '.join(ops)}; fresh process: ok")

        lnn.merge_adapters(model)
        ops = package(model, x, f"{out}/merged.pt2")
        torch.save({"x": x2, "y": model(x2)}, f"{out}/io_merged.pt")
        run_fresh(f"{out}/merged.pt2", f"{out}/io_merged.pt", needs_ops=False)
        print(f"merged:  {out}/merged.pt2 holds {len(ops)} lycoris ops; fresh process without lycoris_ops: ok")


if __name__ == "__main__":
    main()
