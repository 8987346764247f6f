"""The lycoris-lora bridge on a GPU, in one call: build, tests, and a bf16 training-step
benchmark of lycoris-lora networks on our ops against lycoris-lora's own backends.

    python3 bench/gpu_bridge.py [all|build|tests|bench] [--algos lora,loha,lokr,dora]
        [--models sd,transformer] [--columns ...] [--steps 20] [--warmup 3] [--out bench/out]
    python3 bench/gpu_bridge.py bench --smoke    # CPU, tiny models: the script itself runs

The device has no network: carry lycoris-lora and its pure-Python needs as wheels in .whl/
(ignored by git; name .whl in the device call's carry). Here, once:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_17_x86_64 -d .whl \\
        lycoris-lora==4.1.3 einops toml tqdm safetensors

The script installs them into /tmp/bridge_site and puts that on every child's path.

Stages:

- build: ``pip install --no-build-isolation --no-deps -e .`` (the extension for this torch);
- tests: ``tests/integration/test_lycoris_bridge.py`` without the slow sweep: the CPU parity cases, plus
  the GPU ones (parity on CUDA against lycoris-lora's torch backend in its own process,
  Inductor with fullgraph=True at bf16);
- bench: per model (``sd``: a small UNet-style stack of ResNet and attention blocks on 32×32
  latents; ``transformer``: pre-norm blocks on 2048 tokens) and algorithm, a training step
  (forward, backward, Adam over the adapter parameters) at bf16, median ms over ``--steps``
  after ``--warmup``, per column, each column group in its own process:

  ``bridge-compiled``  lycoris_ops imported first, then lycoris; torch.compile(fullgraph=True)
  ``bridge-eager``     the same network, not compiled
  ``lyco-triton``      lycoris-lora alone, LYCORIS_KERNEL_BACKEND=triton (its fused kernels)
  ``lyco-torch``       lycoris-lora alone, LYCORIS_KERNEL_BACKEND=torch (its eager bodies)
  ``lyco-compiled``    lycoris-lora alone, torch.compile(fullgraph=True) (Inductor over its
                       torch bodies: its own choice goes to torch while compiling)

  Every column starts from the same weights and data; the table gives each one's first and
  last loss relative to ``lyco-torch``'s, and the bridge's report (layers on our ops).
  Writes OUT/bridge.md (the table for bench/RESULTS.md) and OUT/bridge.json, after each cell.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SITE = "/tmp/bridge_site"

#: algorithm -> create_lycoris keywords (ranks sized for the models below)
ALGOS = {
    "lora": dict(algo="locon", linear_dim=16, linear_alpha=16, conv_dim=16, conv_alpha=16),
    "loha": dict(algo="loha", linear_dim=8, linear_alpha=8, conv_dim=8, conv_alpha=8),
    "lokr": dict(algo="lokr", factor=8, linear_dim=16, linear_alpha=16, conv_dim=16, conv_alpha=16),
    "dora": dict(algo="locon", dora_wd=True, linear_dim=16, linear_alpha=16, conv_dim=16, conv_alpha=16),
    "diag-oft": dict(algo="diag-oft", linear_dim=32, conv_dim=32),
    "boft": dict(algo="boft", linear_dim=8, conv_dim=8),
}
#: column group (one process) -> (columns, environment, imports lycoris_ops first)
GROUPS = {
    "bridge": (("bridge-compiled", "bridge-eager"), {}, True),
    "lyco-torch": (("lyco-torch", "lyco-compiled"), {"LYCORIS_KERNEL_BACKEND": "torch"}, False),
    "lyco-triton": (("lyco-triton",), {"LYCORIS_KERNEL_BACKEND": "triton"}, False),
}
COLUMNS = tuple(c for cols, _, _ in GROUPS.values() for c in cols)
REFERENCE = "lyco-torch"


# --------------------------------------------------------------------------- models (worker side)


def build_model(kind, smoke=False):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))

        def forward(self, h):
            b, n, d = h.shape
            q, k, v = (t(h).view(b, n, self.heads, -1).transpose(1, 2) for t in (self.to_q, self.to_k, self.to_v))
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
            return self.to_out(o)

    class Block(nn.Module):  # pre-norm transformer block
        def __init__(self, d, heads):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = Attention(d, heads)
            self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            h = h + self.attn(self.norm1(h))
            return h + self.ff2(F.gelu(self.ff1(self.norm2(h))))

    class ResBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.norm1, self.norm2 = nn.GroupNorm(32, c), nn.GroupNorm(32, c)
            self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

        def forward(self, x):
            return x + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))

    class SpatialTransformer(nn.Module):
        def __init__(self, c, heads):
            super().__init__()
            self.norm = nn.GroupNorm(32, c)
            self.proj_in, self.proj_out = nn.Linear(c, c), nn.Linear(c, c)
            self.block = Block(c, heads)

        def forward(self, x):
            n, c, hh, ww = x.shape
            h = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
            h = self.proj_out(self.block(h))
            return x + h.transpose(1, 2).reshape(n, c, hh, ww)

    class SD(nn.Module):
        """conv_in, (ResNet block, spatial transformer) × 2, conv_out on (2, 4, 32, 32) latents."""

        def __init__(self, c=320, heads=8):
            super().__init__()
            self.conv_in, self.conv_out = nn.Conv2d(4, c, 3, padding=1), nn.Conv2d(c, 4, 3, padding=1)
            self.blocks = nn.Sequential(ResBlock(c), SpatialTransformer(c, heads), ResBlock(c),
                                        SpatialTransformer(c, heads))

        def forward(self, x):
            return self.conv_out(self.blocks(self.conv_in(x)))

    class Transformer(nn.Module):
        """4 pre-norm blocks, D=1024, 16 heads, on (4, 512, 1024) tokens."""

        def __init__(self, d=1024, heads=16, layers=4):
            super().__init__()
            self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))

        def forward(self, h):
            return self.blocks(h)

    g = torch.Generator().manual_seed(1)
    if kind == "sd":
        model, shape = (SD(64, 4), (1, 4, 8, 8)) if smoke else (SD(), (2, 4, 32, 32))
    else:
        model, shape = (Transformer(64, 4, 2), (2, 16, 64)) if smoke else (Transformer(), (4, 512, 1024))
    return model, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def run_worker(args):
    """One column group: every (model, algo) cell, JSON lines on stdout."""
    if GROUPS[args.group][2]:
        import lycoris_ops  # noqa: F401  (first: the bridge)
        from lycoris_ops import report
    import torch
    from lycoris import create_lycoris

    columns = [c for c in GROUPS[args.group][0] if c in args.columns.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    for model_kind in args.models.split(","):
        for algo in args.algos.split(","):
            for column in columns:
                cell = {"model": model_kind, "algo": algo, "column": column}
                try:
                    torch.manual_seed(0)
                    model, x, target = build_model(model_kind, args.smoke)
                    model.requires_grad_(False)
                    kw = dict(ALGOS[algo])
                    net = create_lycoris(model, 1.0, warn_on_unmatched=False, **kw)
                    net.apply_to()
                    g = torch.Generator().manual_seed(2)
                    with torch.no_grad():
                        for p in net.parameters():
                            p.add_(torch.randn(p.shape, generator=g) * 0.02)
                    model.to(device, torch.bfloat16)
                    net.to(device, torch.bfloat16)
                    x, target = x.to(device, torch.bfloat16), target.to(device, torch.bfloat16)
                    if GROUPS[args.group][2]:
                        rows = report.explain(net)
                        cell["on_ops"] = f"{sum(r.fused for r in rows)}/{len(rows)}"
                    fwd = torch.compile(model, fullgraph=True) if column.endswith("compiled") else model
                    cell.update(time_steps(fwd, net, x, target, args.steps, args.warmup, device))
                except Exception as exc:  # a column that cannot run says why
                    cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                print("CELL " + json.dumps(cell), flush=True)
                torch._dynamo.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def time_steps(model, net, x, target, steps, warmup, device):
    import torch

    cuda = device.type == "cuda"
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - target.float()).square().mean()
        loss.backward()
        opt.step()
        return loss

    t0 = time.perf_counter()
    losses = [step().item()]  # the first loss: every column starts from the same weights
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t) * 1e3)
    losses.append(loss.item())
    return {"ms": statistics.median(times), "first_s": first_s, "loss0": losses[0], "loss_last": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}


# --------------------------------------------------------------------------- driver


def child_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if os.path.isdir(SITE):
        env["PYTHONPATH"] = SITE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def install_wheels():
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if not wheels:
        return
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--upgrade", "--target", SITE, *wheels], capture_output=True, text=True)
    print(f"wheels: {len(wheels)} into {SITE}" if proc.returncode == 0 else proc.stderr[-2000:], flush=True)


def build():
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e",
                           "."], cwd=ROOT, env=dict(child_env(), MAX_JOBS="16"), capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:])
        sys.exit("build failed")
    print(f"built in {time.time() - t0:.0f} s", flush=True)


def tests(seconds):
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "tests/integration/test_lycoris_bridge.py"]
    print("== tests: " + " ".join(cmd[2:]), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=seconds)
        print(proc.stdout[-6000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        return proc.returncode == 0
    except subprocess.TimeoutExpired as exc:
        print((exc.stdout or b"")[-6000:].decode(errors="replace") if isinstance(exc.stdout, bytes)
              else (exc.stdout or "")[-6000:], f"\ntests: stopped after {seconds} s", flush=True)
        return False


def bench(args):
    cells = []
    out_json = os.path.join(args.out, "bridge.json")
    for group, (cols, env, _) in GROUPS.items():
        wanted = [c for c in cols if c in args.columns.split(",")]
        if not wanted:
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--group", group, "--columns", ",".join(wanted),
               "--models", args.models, "--algos", args.algos, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else [])
        print(f"== bench: {group}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(child_env(), **env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("CELL "):
                cells.append(json.loads(line[5:]))
                c = cells[-1]
                print(f"  {c['model']:<11} {c['algo']:<9} {c['column']:<16} "
                      + (f"{c['ms']:8.2f} ms" if "ms" in c else c.get("error", "")), flush=True)
                with open(out_json, "w") as f:
                    json.dump(cells, f, indent=1)
                write_table(cells, args)
        proc.wait()
        if proc.returncode:
            print(f"{group}: exit {proc.returncode}\n" + proc.stderr.read()[-3000:], flush=True)
    print("\n" + open(os.path.join(args.out, "bridge.md")).read() if cells else "no cells", flush=True)


def write_table(cells, args):
    import torch

    by = {(c["model"], c["algo"], c["column"]): c for c in cells}
    cols = [c for c in COLUMNS if c in args.columns.split(",")]
    dev = "CPU smoke" if args.smoke else torch.cuda.get_device_name()
    lines = [f"lycoris-lora networks, bf16 training step (forward + backward + Adam on the adapters), "
             f"median ms over {args.steps} steps; {dev}, torch {torch.__version__}. "
             f"loss: first / last loss relative to {REFERENCE}'s.", "",
             "| model | algo | " + " | ".join(cols) + " | bridge-compiled vs lyco-triton | loss (bridge-compiled) "
             "| layers on our ops |",
             "|---|---|" + "---|" * len(cols) + "---|---|---|"]
    for m in args.models.split(","):
        for a in args.algos.split(","):
            row = []
            for col in cols:
                c = by.get((m, a, col))
                row.append("" if c is None else f"{c['ms']:.2f}" if "ms" in c else "error")
            ours, theirs, ref = by.get((m, a, "bridge-compiled")), by.get((m, a, "lyco-triton")), by.get(
                (m, a, REFERENCE))
            speed = f"{theirs['ms'] / ours['ms']:.2f}x" if ours and theirs and "ms" in ours and "ms" in theirs else ""
            loss = ""
            if ours and ref and "ms" in ours and "ms" in ref:
                loss = (f"{abs(ours['loss0'] - ref['loss0']) / abs(ref['loss0']):.1e} / "
                        f"{abs(ours['loss_last'] - ref['loss_last']) / abs(ref['loss_last']):.1e}")
            on_ops = (by.get((m, a, "bridge-eager")) or ours or {}).get("on_ops", "")
            lines.append(f"| {m} | {a} | " + " | ".join(row) + f" | {speed} | {loss} | {on_ops} |")
    errors = [c for c in cells if "error" in c]
    if errors:
        lines += ["", "Errors:"] + [f"- {c['model']} {c['algo']} {c['column']}: {c['error']}" for c in errors]
    with open(os.path.join(args.out, "bridge.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", nargs="?", default="all", choices=("all", "build", "tests", "bench", "worker"))
    ap.add_argument("--algos", default="lora,loha,lokr,dora")
    ap.add_argument("--models", default="sd,transformer")
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tests-seconds", type=int, default=240)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny models, 2 steps: the script runs (no build, no tests, no timing claim)")
    ap.add_argument("--group", choices=tuple(GROUPS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 2, 1
    if args.stage == "worker":
        return run_worker(args)
    os.makedirs(args.out, exist_ok=True)
    install_wheels()
    if args.stage in ("all", "build") and not args.smoke:
        build()
    ok = True
    if args.stage in ("all", "tests") and not args.smoke:
        ok = tests(args.tests_seconds)
    if args.stage in ("all", "bench"):
        bench(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
