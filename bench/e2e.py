"""End-to-end training step: a stack of transformer blocks with an adapter on every linear.

One step = forward + backward + AdamW step over the adapter parameters. Defaults:
D=3072, 24 heads, 4096 tokens (batch 1 × seq 4096), bf16, 4 blocks, adapters
LoRA r=32, LoKr, DoRA. Rows per adapter (when available):

- ``peft-eager``           PEFT's layers, eager (plain-torch baseline)
- ``peft-compiled``        torch.compile(PEFT model) — PEFT's adapters compiled by Inductor
- ``peft-ops-eager``       PEFT model after ``lycoris_ops.integrations.peft.patch_peft``, eager
- ``peft-ops-compiled``    the same, torch.compile'd (our ops stay opaque nodes)
- ``plain-eager`` / ``plain-compiled``   this script's plain-torch adapters (used when PEFT is absent)
- ``ours-eager`` / ``ours-compiled``     ``lycoris_ops.nn`` adapters
- ``ours-graphs``          ``torch.compile(mode="reduce-overhead")`` of ``ours`` (CUDA graphs), CUDA only
- ``base-eager``           no adapters: the frozen blocks' forward and input-gradient backward, the
                           floor under every row (what adapter fusion cannot remove)

Reports median step time (ms), speed-up vs the row's eager baseline, and peak
memory (``torch.cuda.max_memory_allocated`` over the measured steps); ``--profile``
adds one profiled step per row, its time split into GEMMs, attention, our ops,
optimizer, norms/activations and the rest. Writes
``<out>/e2e.json`` and ``<out>/e2e.md``; ``--plot`` draws ``bench/e2e_ratios.png``
(end-to-end ratios, plus per-op x_eager from a ``bench.py`` CSV given by ``--per-op-csv``;
needs matplotlib).

    python bench/e2e.py                       # H200 full run
    python bench/e2e.py --quick --layers 2    # fewer reps / variants
    python bench/e2e.py --smoke               # CPU, tiny dims (CI)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import lycoris_ops  # noqa: E402,F401
from lycoris_ops import nn as lnn  # noqa: E402
from timing import sync  # noqa: E402  (bench/, this script's folder)


class Block(nn.Module):
    def __init__(self, D, heads, mlp=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, mlp * D)
        self.fc2 = nn.Linear(mlp * D, D)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def make_model(args, device, dtype):
    torch.manual_seed(0)
    m = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)]).to(device, dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


TARGETS = ["qkv", "proj", "fc1", "fc2"]


# ---------------------------------------------------------------- plain-torch adapters (baseline without PEFT)


class PlainLoRA(nn.Module):
    def __init__(self, base, r, dora=False):
        super().__init__()
        self.base, self.s = base, 1.0
        self.A = nn.Parameter(torch.randn(r, base.in_features, device=base.weight.device, dtype=base.weight.dtype)
                              / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device, dtype=base.weight.dtype))
        self.dora = dora
        if dora:
            self.m = nn.Parameter(base.weight.float().norm(dim=1).to(base.weight.dtype))

    def forward(self, x):
        if not self.dora:
            return self.base(x) + (x @ self.A.t()) @ self.B.t() * self.s
        W = self.base.weight + self.s * self.B @ self.A
        n = W.float().norm(dim=1).to(W.dtype)
        return F.linear(x, W * (self.m / n)[:, None], self.base.bias)


class PlainLoKr(nn.Module):
    def __init__(self, base, r):
        super().__init__()
        self.base = base
        a, c = lnn.factorization(base.out_features)
        b, d = lnn.factorization(base.in_features)
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.w1 = nn.Parameter(torch.randn(a, b, **kw) * 0.02)
        self.w2 = nn.Parameter(torch.zeros(c, d, **kw))

    def forward(self, x):
        return self.base(x) + F.linear(x, torch.kron(self.w1, self.w2))


def _replace(model, fn):
    for blk in model:
        for t in TARGETS:
            setattr(blk, t, fn(getattr(blk, t)))
    return model


def build(variant, adapter, args, device, dtype):
    """(model, trainable params) for a row."""
    m = make_model(args, device, dtype)
    fam = variant.split("-")[0]
    r = args.rank
    if fam == "base":  # no adapters: the frozen model's own forward + input-gradient backward
        return m, []
    if fam == "plain":
        _replace(m, (lambda l: PlainLoKr(l, r)) if adapter == "lokr" else (lambda l: PlainLoRA(l, r, adapter == "dora")))
    elif fam == "ours":
        kind = {"lora": "lora", "lokr": "lokr", "dora": "dora"}[adapter]
        kw = {"rank": r, "alpha": r} if adapter != "lokr" else {"rank": r}
        lnn.add_adapters(m, kind, include=TARGETS, **{k: v for k, v in kw.items() if k != "rank"}, rank=kw["rank"])
        # non-zero "up" so the adapter does real work in the backward
        with torch.no_grad():
            for _, a in lnn.adapters(m):
                for n, p in a.named_parameters():
                    if not n.startswith("base.") and p.abs().sum() == 0:
                        p.normal_(0, 1e-3)
    else:
        import peft
        if adapter == "lokr":
            cfg = peft.LoKrConfig(r=r, alpha=r, target_modules=TARGETS)
        else:
            cfg = peft.LoraConfig(r=r, lora_alpha=r, target_modules=TARGETS, use_dora=adapter == "dora")
        m = peft.get_peft_model(m, cfg, autocast_adapter_dtype=False).base_model.model
        if "ops" in variant:
            from lycoris_ops.integrations.peft import patch_peft
            patch_peft(m)
    params = [p for p in m.parameters() if p.requires_grad]
    return m, params


def step_fn(model, params, x):
    if not params:  # the "base" row: backward through the frozen blocks to the input, no optimizer
        x = x.detach().requires_grad_()

        def base_step():
            model(x).float().square().mean().backward()
            x.grad = None
        return base_step
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step():
        y = model(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


#: profile categories, first match wins; an event inside a matched one is not counted again
CATEGORIES = (
    ("lycoris ops", lambda n: n.startswith("lycoris::")),
    ("attention", lambda n: "scaled_dot_product" in n or "flash_attention" in n or "efficient_attention" in n),
    ("GEMM", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                             "aten::linear", "aten::_scaled_mm", "aten::kron")),
    ("optimizer", lambda n: n.startswith("Optimizer.") or "_foreach_" in n or "_fused_adam" in n),
    ("norm/activation", lambda n: "layer_norm" in n or "gelu" in n),
)


def profile_step(step, device) -> dict:
    """One profiled step: device time (ms; CPU time without CUDA) per category of
    ``CATEGORIES`` and ``other`` (the rest: adds, casts, copies, reductions, Inductor's
    fused kernels). Each kernel is counted once, under the op that launched it, and
    goes to the category of that op's outermost matching ancestor (an ``aten::mm``
    inside ``lycoris::lora_bypass_fwd`` is the op's time, not a GEMM)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step()  # not the first call of anything
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    out = {name: 0.0 for name, _ in CATEGORIES}
    total = 0.0

    def category(e):
        found, op = None, None
        while e is not None:  # the outermost match wins
            for name, match in CATEGORIES:
                if match(e.name):
                    found, op = name, e.name
                    break
            e = e.cpu_parent
        return found, op

    ours = {}  # (lycoris op, kernel) -> [launches, us]: where our ops' time goes

    for e in prof.events():
        own = sum(k.duration for k in e.kernels) if cuda else e.self_cpu_time_total  # us
        if not own:
            continue
        total += own
        cat, op = category(e)
        if cat is not None:
            out[cat] += own
        if cat == "lycoris ops" and cuda:
            for k in e.kernels:
                slot = ours.setdefault((op, k.name[:70]), [0, 0.0])
                slot[0] += 1
                slot[1] += k.duration
    out = {k: v / 1e3 for k, v in out.items()}
    out["other"] = max(total / 1e3 - sum(out.values()), 0.0)
    out["total"] = total / 1e3
    top = sorted(ours.items(), key=lambda kv: -kv[1][1])[:14]
    out["kernels"] = [(op, k, n, us / 1e3) for (op, k), (n, us) in top]
    return out


def host_profile(step, device, label, top=15):
    """cProfile of one step (after a warm one): where the host time goes."""
    import cProfile
    import io
    import pstats
    step()
    sync(device)
    pr = cProfile.Profile()
    pr.enable()
    step()
    sync(device)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"host profile, {label}:\n" + "\n".join(buf.getvalue().splitlines()[4:]), flush=True)


def sync_report(step, device, label, top=8):
    """The synchronizing CUDA calls one step makes (``torch.cuda.set_sync_debug_mode``):
    a host-bound step whose host time is not its Python work waits somewhere."""
    import warnings
    if torch.device(device).type != "cuda":
        return
    step()
    sync(device)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        where = f"{w.filename}:{w.lineno}: {str(w.message)[:120]}"
        seen[where] = seen.get(where, 0) + 1
    print(f"sync report, {label}: {sum(seen.values())} synchronizing calls", flush=True)
    for where, n in sorted(seen.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  x{n} {where}")


def time_steps(step, device, warmup, reps):
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ts = []
    for _ in range(reps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            step()
            ts.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return statistics.median(ts), peak


def variants(args, device):
    try:
        import peft  # noqa: F401
        have_peft = True
    except Exception:
        have_peft = False
    v = (["peft-eager", "peft-compiled", "peft-ops-eager", "peft-ops-compiled"] if have_peft
         else ["plain-eager", "plain-compiled"])
    v += ["ours-eager", "ours-compiled"]
    v.insert(0, "base-eager")  # the floor every row shares: no adapters
    if torch.device(device).type == "cuda" and not args.quick:
        v.append("ours-graphs")
    if args.no_compile:
        v = [x for x in v if "compiled" not in x and "graphs" not in x]
    if args.variants:
        v = [x for x in v if x in args.variants.split(",")]
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapters", default="lora,lokr,dora")
    ap.add_argument("--variants", default=None, help="comma list of row names (default: all available)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer reps, no CUDA-graph row")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny dims, 2 reps, no compile")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one step per row: time per category (GEMMs, attention, our ops, ...)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="one step of each ours-* row under torch.cuda.set_sync_debug_mode('warn'): where the host waits")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile one step of each ours-* row: the top host functions by own time")
    ap.add_argument("--per-op-csv", default=None, help="bench.py CSV for the per-op panel of the plot")
    args = ap.parse_args(argv)
    if args.smoke:
        args.dim, args.heads, args.tokens, args.rank, args.layers = 64, 4, 32, 4, min(args.layers, 2)
        args.reps, args.warmup, args.no_compile, args.dtype = 2, 1, True, "fp32"
        args.device = args.device or "cpu"
    if args.quick:
        args.reps, args.warmup = min(args.reps, 8), min(args.warmup, 3)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    x = torch.randn(args.batch, args.tokens // args.batch, args.dim, device=device, dtype=dtype)
    rows = []
    for adapter in args.adapters.split(","):
        base_ms = {}
        for v in variants(args, device):
            if v == "base-eager" and any(r["variant"] == v for r in rows):
                continue  # adapter-independent: measured once
            torch._dynamo.reset()
            try:
                model, params = build(v, adapter, args, device, dtype)
                if v.endswith("compiled"):
                    model = torch.compile(model, fullgraph=v.startswith("ours") or "ops" in v)
                elif v.endswith("graphs"):
                    model = torch.compile(model, mode="reduce-overhead", fullgraph=True)
                t0 = time.perf_counter()
                step = step_fn(model, params, x)
                step()
                cold = time.perf_counter() - t0
                ms, peak = time_steps(step, device, args.warmup, args.reps)
                prof = profile_step(step, device) if args.profile else None
                if args.host_profile and v.startswith("ours"):
                    host_profile(step, device, f"{adapter} {v}")
                if args.sync_debug and v.startswith("ours"):
                    sync_report(step, device, f"{adapter} {v}")
                err = ""
            except Exception as e:  # keep the other rows
                ms, peak, cold, err = float("nan"), float("nan"), float("nan"), f"{type(e).__name__}: {e}"[:300]
                prof = None
            fam = v.split("-")[0]
            eager_key = "peft-eager" if fam == "peft" else f"{fam}-eager"
            if v.endswith("eager") and v.count("-") == 1:
                base_ms[fam] = ms
            ref = base_ms.get("peft", base_ms.get("plain", float("nan")))
            rows.append(dict(adapter=adapter, variant=v, ms=ms, peak_gib=peak, cold_s=cold,
                             x_eager=ref / ms if ms == ms and ms > 0 else float("nan"), error=err,
                             baseline=eager_key, profile=prof))
            print(f"{adapter:5s} {v:18s} {ms:9.2f} ms  x{rows[-1]['x_eager']:.2f}  peak {peak:.2f} GiB  "
                  f"cold {cold:.1f}s {err}", flush=True)
            del model, params
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(dim=args.dim, heads=args.heads, tokens=args.tokens, layers=args.layers, rank=args.rank,
                dtype=args.dtype, device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                torch=torch.__version__)
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = [f"E2E training step ({meta}); x = eager PEFT (or plain) / row\n", "| adapter | variant | ms | x | peak GiB |",
          "| --- | --- | --- | --- | --- |"]
    md += [f"| {r['adapter']} | {r['variant']} | {r['ms']:.2f} | {r['x_eager']:.2f} | {r['peak_gib']:.2f} |"
           for r in rows]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        cats = [c for c in profiled[0]["profile"] if c != "kernels"]
        unit = "device ms" if device.startswith("cuda") else "CPU ms"
        md += ["", f"One profiled step per row ({unit}; GEMM = every matmul, the frozen base's and unfused "
                   "adapters'; `other` = the rest: adds, casts, copies, Inductor's fused kernels):", "",
               "| adapter | variant | " + " | ".join(cats) + " |", "| --- | --- | " + " | ".join("---" for _ in cats) + " |"]
        md += [f"| {r['adapter']} | {r['variant']} | " + " | ".join(f"{r['profile'][c]:.2f}" for c in cats) + " |"
               for r in profiled]
        for r in profiled:
            if r["profile"].get("kernels"):
                md += ["", f"Our ops' kernels, {r['adapter']} {r['variant']} (op, kernel, launches, device ms):", ""]
                md += [f"    {op:28s} {k:70s} {n:4d} {ms:7.3f}" for op, k, n, ms in r["profile"]["kernels"]]
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    if args.profile:  # which candidate the tuner picked at this run's shapes
        from lycoris_ops.tuner import tune
        table = dict(tune.table().rows)  # this process's view (another program may own the file)
        print(f"\ntuning table {tune.table_path()}: {len(table)} rows")
        for k, row in sorted(table.items()):
            times = row.get("times") or {}
            best = sorted((t, c) for c, t in times.items() if isinstance(t, (int, float)) and c != "eager")[:2]
            print(f"  {k.split('|', 2)[-1]}: {row.get('ms')} ms, eager {times.get('eager')} ms, "
                  f"best fused {best}, picked {json.dumps(row.get('config'), sort_keys=True)}")
    if args.plot:
        import plot as ratio_plot  # bench/plot.py
        ratio_plot.plot([r for r in rows if r["x_eager"] == r["x_eager"]],
                        ratio_plot.per_op_rows([args.per_op_csv]) if args.per_op_csv else None,
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_ratios.png"))
    return rows


if __name__ == "__main__":
    main()
