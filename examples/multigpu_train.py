"""Train a transformer stack with LoRA or LoKr adapters on ``torch.ops.lycoris.*``,
on one GPU or on several under DDP or FSDP2 (``fully_shard``), eager or compiled.

Every run uses the same model (seeded on the CPU, so every rank and every launch
starts from the same weights) and the same stream of global batches; a rank
trains on its slice of each global batch and the logged loss is the mean over
the global batch. So a DDP/FSDP2 run on W GPUs and a single-GPU run of the same
global batch follow the same loss curve, up to the reduction order in bf16.

    # single-GPU reference (also: CPU, tiny dims)
    python examples/multigpu_train.py --out ref.json
    # the same configurations on two GPUs (or two CPU processes with gloo)
    torchrun --nproc-per-node 2 examples/multigpu_train.py --parallel ddp,fsdp2 --out dist.json
    # compare: exit status 1 if a curve differs beyond --rtol
    python examples/multigpu_train.py --compare ref.json dist.json

    # step time (scaling): our ops vs plain eager adapters, per-GPU batch fixed
    python examples/multigpu_train.py --bench --out bench1.json
    torchrun --nproc-per-node 2 examples/multigpu_train.py --bench --parallel ddp --out bench2.json

Each configuration is ``adapter x parallel x compiled``; ``--compile both`` runs
each one eager and with every block ``torch.compile``'d (the pattern FSDP2 users
follow: compile the blocks, then shard them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lycoris_ops  # noqa: E402,F401
from lycoris_ops import nn as lnn  # noqa: E402

TARGETS = ["qkv", "proj", "fc1", "fc2"]


class Block(nn.Module):
    """Pre-norm transformer block (causal attention + GELU MLP)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class EagerLoRA(nn.Module):
    """Plain-torch LoRA (the eager adapter of the scaling comparison)."""

    def __init__(self, base, rank):
        super().__init__()
        self.base, self.scale = base, 1.0
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.down = nn.Parameter(torch.randn(rank, base.in_features, **kw) / math.sqrt(base.in_features))
        self.up = nn.Parameter(torch.randn(base.out_features, rank, **kw) * 1e-3)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.down), self.up) * self.scale


class EagerLoKr(nn.Module):
    """Plain-torch LoKr: the Kronecker product built, then one more GEMM."""

    def __init__(self, base, rank):
        super().__init__()
        self.base = base
        a, c = lnn.factorization(base.out_features)
        b, d = lnn.factorization(base.in_features)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.w1 = nn.Parameter(torch.randn(a, b, **kw) * 0.02)
        self.w2 = nn.Parameter(torch.randn(c, d, **kw) * 1e-3)

    def forward(self, x):
        return self.base(x) + F.linear(x, torch.kron(self.w1, self.w2))


def build(args, adapter, impl, device, dtype):
    """The model with adapters, identical on every rank and every launch (CPU-seeded)."""
    torch.manual_seed(1234)
    model = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)])
    for p in model.parameters():
        p.requires_grad_(False)
    for blk in model:
        for name in TARGETS:
            base = getattr(blk, name)
            if impl == "ours":
                if adapter == "lora":
                    mod = lnn.LoRALinear(base, rank=args.rank, alpha=args.rank)
                else:
                    mod = lnn.LoKrLinear(base, rank=args.rank)
                with torch.no_grad():  # a non-zero "up" factor, so the first steps train every factor
                    for n, p in mod.named_parameters():
                        if not n.startswith("base.") and p.abs().sum() == 0:
                            p.normal_(0, 1e-3)
            else:
                mod = EagerLoRA(base, args.rank) if adapter == "lora" else EagerLoKr(base, args.rank)
            setattr(blk, name, mod)
    return model.to(device, dtype)


def batches(args, step, device, dtype, rank, world):
    """This rank's slice of global batch ``step`` (the same global batch for any world size)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(args.global_batch, args.seq, args.dim, generator=g)
    per = args.global_batch // world
    x = x[rank * per:(rank + 1) * per].to(device, dtype)
    # target: the input itself — the adapters learn to cancel the frozen blocks' residual
    # updates, a loss that falls from the first step (random targets would not)
    return x, x


def wrap(model, parallel, compiled, device, world):
    if compiled:
        for blk in model:
            blk.compile()
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel == "nosync":  # negative control: every rank trains its slice alone; --compare must flag it
        return model
    if parallel == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world,))
        for blk in model:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train(args, adapter, impl, parallel, compiled, device, dtype, rank, world):
    """Losses per step (global-batch mean) and the median step time (ms) after warm-up."""
    torch._dynamo.reset()
    model = wrap(build(args, adapter, impl, device, dtype), parallel, compiled, device, world)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, foreach=True)
    losses, times = [], []
    cuda = device.type == "cuda"
    for step in range(args.steps):
        x, y = batches(args, step, device, dtype, rank, world)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    warm = times[args.warmup:] or times
    del model, opt, params
    return losses, statistics.median(warm), times[0]


def init():
    """(rank, world, device) from torchrun's environment (or a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, **kw)
    return rank, world, device


def compare(ref_path, run_path, rtol, ptol):
    """Curves of ``run_path`` against the single-device curves of ``ref_path`` (same adapter
    and compile flag): the loss per step within ``rtol`` (relative), and the progress
    ``L_t - L_0`` within ``ptol`` of the reference's largest progress (a few steps move the
    loss by a few percent only: the progress is what a missing gradient average changes).
    Prints a table; returns the exit status."""
    ref = {(r["adapter"], r["compiled"]): r for r in json.load(open(ref_path))["runs"]}
    bad = 0
    print(f"{'adapter':7s} {'parallel':8s} {'compiled':8s} {'world':5s} {'loss diff':>9s} {'drift':>9s}  "
          f"first/last loss")
    for r in json.load(open(run_path))["runs"]:
        base = ref.get((r["adapter"], r["compiled"]))
        if base is None or len(r["losses"]) != len(base["losses"]):
            print(f"{r['adapter']:7s} {r['parallel']:8s} {str(r['compiled']):8s} no reference curve of this length")
            bad += 1
            continue
        got, want = r["losses"], base["losses"]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
        total = max(max(abs(b - want[0]) for b in want), 1e-12)  # the reference's largest excursion
        drift = max(abs((a - got[0]) - (b - want[0])) for a, b in zip(got, want)) / total
        ok = worst <= rtol and drift <= ptol and all(map(math.isfinite, got))
        bad += not ok
        print(f"{r['adapter']:7s} {r['parallel']:8s} {str(r['compiled']):8s} {r['world']:5d} {worst:9.2e} "
              f"{drift:9.2e}  {got[0]:.5f}/{got[-1]:.5f} (ref {want[-1]:.5f}) {'ok' if ok else 'DIFFERS'}")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", default="lora,lokr")
    ap.add_argument("--parallel", default=None, help="comma list of ddp,fsdp2,nosync (default: ddp,fsdp2 under "
                                                     "torchrun, single otherwise; nosync = no gradient "
                                                     "averaging, a negative control)")
    ap.add_argument("--impl", default="ours", help="comma list of ours,eager")
    ap.add_argument("--compile", default="both", choices=["no", "yes", "both"])
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--bench", action="store_true",
                    help="step-time run: D=3072, 24 heads, 4 blocks, 4096 tokens per GPU, ours and eager, no compile")
    ap.add_argument("--out", default=None, help="write the runs as JSON (rank 0)")
    ap.add_argument("--compare", nargs=2, metavar=("REF", "RUN"), help="compare two --out files and exit")
    ap.add_argument("--rtol", type=float, default=1e-2, help="--compare: max relative loss difference per step")
    ap.add_argument("--ptol", type=float, default=5e-3,
                    help="--compare: max difference of the progress L_t - L_0, relative to the reference's")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare, args.rtol, args.ptol)

    rank, world, device = init()
    gpu = device.type == "cuda"
    if args.bench:
        dflt = dict(dim=3072, heads=24, layers=4, seq=4096, global_batch=world, steps=12, dtype="bf16")
        args.impl = args.impl if args.impl != "ours" else "ours,eager"
        args.compile = "no" if args.compile == "both" else args.compile
    elif gpu:
        dflt = dict(dim=512, heads=8, layers=2, seq=256, global_batch=8, steps=10, dtype="bf16")
    else:  # CPU: tiny, fp32 (gloo has no bf16 all-reduce on every build)
        dflt = dict(dim=64, heads=4, layers=2, seq=16, global_batch=4, steps=4, dtype="fp32")
    for k, v in dflt.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the world size {world}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    parallels = (args.parallel or ("ddp,fsdp2" if world > 1 else "single")).split(",")
    if world == 1:
        parallels = ["single"]
    compiles = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]

    runs = []
    for adapter in args.adapters.split(","):
        for impl in args.impl.split(","):
            for parallel in parallels:
                for compiled in compiles:
                    losses, ms, first_ms = train(args, adapter, impl, parallel, compiled, device, dtype, rank, world)
                    runs.append(dict(adapter=adapter, impl=impl, parallel=parallel, compiled=compiled, world=world,
                                     losses=losses, step_ms=ms, first_step_ms=first_ms,
                                     tokens_per_s=args.global_batch * args.seq / ms * 1e3))
                    if rank == 0:
                        print(f"{adapter:5s} {impl:5s} {parallel:6s} compiled={str(compiled):5s} world={world} "
                              f"step {ms:8.2f} ms  first {first_ms / 1e3:6.1f} s  "
                              f"loss {losses[0]:.5f} -> {losses[-1]:.5f}", flush=True)
    if rank == 0 and args.out:
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if gpu else "cpu",
                    world=world, **{k: getattr(args, k) for k in
                                    ("dim", "heads", "layers", "seq", "rank", "global_batch", "steps", "dtype", "lr")})
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, runs=runs), f, indent=1)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
