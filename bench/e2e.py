"""End-to-end training step: a model with an adapter on every targeted layer.

One step = forward + backward + AdamW step over the adapter parameters. Models (``--model``):

- ``transformer`` (default): a stack of pre-norm blocks, D=3072, 24 heads, 4096 tokens
  (batch 1 × seq 4096), bf16, 4 blocks; adapters on qkv, proj, fc1, fc2.
- ``unet``: an SDXL-like stage at 640 channels on (2, 640, 64, 64) latents (``--spatial``):
  a ResNet block (GroupNorm, SiLU, two 3x3 convs) and a transformer block (linear
  proj_in/out, self-attention, cross-attention to a (77, 2048) context, GEGLU FF) over the
  flattened pixels, ``--layers`` pairs (1); adapters on both convs and every attention/FF linear.

Adapters (``--adapters``; rank ``--rank`` 32, alpha = rank): ``lora`` (LoRA, LoCon on convs),
``loha``, ``lokr`` (LoKr factor -1), ``lokr8`` (LoKr factor 8), ``dora``, ``oft`` (diag-OFT,
LyCORIS's block size for each layer's output width at linear_dim 32: 32 where it divides,
20 for 640), ``boft`` (BOFT, LyCORIS's butterfly split at linear_dim 32, e.g. 24x8 for 3072).
Ours and lycoris-lora's get the same shapes per layer; PEFT's equivalents: LoraConfig
(use_dora), LoHaConfig, LoKrConfig(decompose_factor), OFTConfig (exact Cayley),
BOFTConfig. PEFT's OFT/BOFT rotate the input side with one block size for every layer (the
split of the model width): where that does not divide a layer's input the row is n/a with
the reason (the unet's 2048-wide to_k/to_v), and PEFT's BOFT is n/a where it drops to one
butterfly factor (it does when its fbd_cuda extension fails to build, always on CPU).
The plain-* adapters cover LoRA, LoKr, DoRA on the transformer only.

Rows per adapter (when available):

- ``peft-eager``           PEFT's layers, eager (plain-torch baseline)
- ``peft-compiled``        torch.compile(PEFT model) — PEFT's adapters compiled by Inductor
- ``peft-ops-eager``       PEFT model after ``lycoris_ops.integrations.peft.patch_peft``, eager
- ``peft-ops-compiled``    the same, torch.compile'd (our ops stay opaque nodes)
- ``plain-eager`` / ``plain-compiled``   this script's plain-torch adapters (used when PEFT is absent)
- ``ours-eager`` / ``ours-compiled``     ``lycoris_ops.nn`` adapters
- ``lyco-eager`` / ``lyco-compiled``     lycoris-lora's own ``LycorisNetwork`` on the same layers,
                           run by ``e2e_lyco.py`` in a process that never imports lycoris_ops,
                           ``LYCORIS_KERNEL_BACKEND=torch`` (lycoris-lora from this environment or
                           ``LYCORIS_PEER_PATH``; n/a when neither has it)
- ``ours-graphs`` / ``peft-graphs``   ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) of ``ours`` /
                           PEFT's model, CUDA only: the rows to compare where a step is host-bound
- ``base-eager``           no adapters: the frozen blocks' forward and input-gradient backward, the
                           floor under every row (what adapter fusion cannot remove)
- ``base-compiled``        ``torch.compile`` of ``base-eager``: the floor under the compiled rows

Reports median step time (ms), speed-up vs the row's eager baseline, and peak
memory (``torch.cuda.max_memory_allocated`` over the measured steps), and a note: layers on
our ops, or why a row is n/a; ``--profile``
adds one profiled step per row of this process (not the ``lyco-*`` rows), its time split into GEMMs, attention, our ops,
optimizer, norms/activations and the rest. Writes
``<out>/e2e.json`` and ``<out>/e2e.md``; ``--plot`` draws ``bench/e2e_ratios.png``
(end-to-end ratios, plus per-op x_eager from a ``bench.py`` CSV given by ``--per-op-csv``;
needs matplotlib).

    python bench/e2e.py                       # transformer, every adapter
    python bench/e2e.py --model unet          # the SDXL-like stage
    python bench/e2e.py --quick --layers 2 --adapters lora,lokr8
    python bench/e2e.py --smoke [--model unet]   # CPU, tiny dims (CI)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import lycoris_ops  # noqa: E402,F401
from lycoris_ops import nn as lnn  # noqa: E402
from timing import sync  # noqa: E402  (bench/, this script's folder)
from e2e_models import boft_shape, make_input, make_model, oft_block, step_fn, target_names, time_steps  # noqa: E402


#: adapter name -> what it is (ours, PEFT's and lycoris-lora's at the same setting; see the docstring)
ADAPTERS = {"lora": "LoRA/LoCon r", "loha": "LoHa r", "lokr": "LoKr factor -1, r", "lokr8": "LoKr factor 8, r",
            "dora": "DoRA r", "oft": "diag-OFT", "boft": "BOFT"}
DEFAULT_ADAPTERS = "lora,lokr8,lokr,dora,oft,boft"


class NA(Exception):
    """A row this setting cannot have (the family lacks the exact adapter): reported, not measured."""


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


def _replace(model, names, fn):
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, fn(getattr(owner, leaf)))
    return model


def _ours(adapter, layer, r):
    """Our adapter for one layer, at LyCORIS's settings for its shape (OFT/BOFT: per output width)."""
    O = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
    kind, kw = {"lora": ("lora", dict(rank=r, alpha=r)), "loha": ("loha", dict(rank=r, alpha=r)),
                "dora": ("dora", dict(rank=r, alpha=r)), "lokr": ("lokr", dict(rank=r, factor=-1)),
                "lokr8": ("lokr", dict(rank=r, factor=8)), "oft": ("diag-oft", dict(block_size=oft_block(O))),
                "boft": ("boft", dict(zip(("block_size", "n_butterfly"), boft_shape(O))))}[adapter]
    return lnn.ADAPTERS[kind][type(layer)](layer, **kw)


def _rotated_dims(model, names):
    """What PEFT's OFT/BOFT rotate: each layer's input side (a conv's in·kh·kw)."""
    out = {}
    for n in names:
        m = model.get_submodule(n)
        out[n] = m.in_channels * math.prod(m.kernel_size) if isinstance(m, nn.Conv2d) else m.in_features
    return out


def _peft_config(adapter, model, names, args):
    import peft
    r = args.rank
    if adapter in ("lora", "dora"):
        return peft.LoraConfig(r=r, lora_alpha=r, target_modules=names, use_dora=adapter == "dora")
    if adapter == "loha":
        return peft.LoHaConfig(r=r, alpha=r, target_modules=names)
    if adapter in ("lokr", "lokr8"):
        return peft.LoKrConfig(r=r, alpha=r, decompose_factor=8 if adapter == "lokr8" else -1, target_modules=names)
    # PEFT's OFT/BOFT take one block size for every layer and rotate the input side; ours (LyCORIS's)
    # rotate the output side at each width's own split: PEFT gets the split of the model width, where
    # it fits every layer it rotates
    dims = _rotated_dims(model, names)
    if adapter == "oft":
        S = oft_block(args.dim)
        bad = sorted({f"{n.rsplit('.', 1)[-1]} ({d})" for n, d in dims.items() if d % S})
        if bad:
            raise NA(f"PEFT's OFT takes one block size; LyCORIS's {S} for width {args.dim} does not divide "
                     f"the inputs of {', '.join(bad)}")
        # exact Cayley (linalg.solve) as LyCORIS, not PEFT's default Neumann series
        return peft.OFTConfig(r=0, oft_block_size=S, use_cayley_neumann=False, target_modules=names)
    if adapter == "boft":
        b, m = boft_shape(args.dim)
        bad = sorted({f"{n.rsplit('.', 1)[-1]} ({d})" for n, d in dims.items() if d % (b << (m - 1))})
        if bad:
            raise NA(f"PEFT's BOFT takes one split; LyCORIS's {b}x{m} for width {args.dim} does not divide "
                     f"the inputs of {', '.join(bad)}")
        return peft.BOFTConfig(boft_block_size=b, boft_n_butterfly_factor=m, target_modules=names)
    raise NA(f"PEFT has no {adapter}")


def _route_note(rep):
    """"k/n layers on our ops", and why the others are not (e.g. the conv paths' eager chains)."""
    why = sorted({str(x.reason) for x in rep if not x.fused})
    return f"{sum(x.fused for x in rep)}/{len(rep)} layers on our ops" + (f" (rest: {'; '.join(why)})" if why else "")


def build(variant, adapter, args, device, dtype):
    """(model, trainable params, note) for a row; raises NA for a row the family cannot have."""
    m = make_model(args, device, dtype)
    names = target_names(m, args.model)
    fam = variant.split("-")[0]
    r = args.rank
    note = ""
    if fam == "base":  # no adapters: the frozen model's own forward + input-gradient backward
        return m, [], note
    if fam == "plain":
        if adapter not in ("lora", "lokr", "dora") or args.model != "transformer":
            raise NA("plain adapters: LoRA, LoKr, DoRA on linears only")
        _replace(m, names, (lambda l: PlainLoKr(l, r)) if adapter == "lokr"
                 else (lambda l: PlainLoRA(l, r, adapter == "dora")))
    elif fam == "ours":
        _replace(m, names, lambda l: _ours(adapter, l, r))
        # non-zero "up" so the adapter does real work in the backward
        with torch.no_grad():
            for _, a in lnn.adapters(m):
                for n, p in a.named_parameters():
                    if not n.startswith("base.") and p.abs().sum() == 0:
                        p.normal_(0, 1e-3)
        note = _route_note(lycoris_ops.explain(m))
    else:
        import peft
        m = peft.get_peft_model(m, _peft_config(adapter, m, names, args),
                                autocast_adapter_dtype=False).base_model.model
        if adapter == "boft":  # PEFT quietly drops to one butterfly factor when its CUDA extension fails
            got = {p.shape[0] for n, p in m.named_parameters() if "boft_R" in n}
            if got != {boft_shape(args.dim)[1]}:
                raise NA(f"PEFT's BOFT built {sorted(got)} butterfly factors, not {boft_shape(args.dim)[1]} "
                         "(its fbd_cuda extension did not load)")
        if "ops" in variant:
            from lycoris_ops.integrations.peft import patch_peft
            rep = patch_peft(m)
            fused = sum(x.fused for x in rep)
            if not fused:
                raise NA(f"patch_peft routes none of PEFT's {adapter} layers "
                         f"({rep[0].reason if len(rep) else 'no PEFT layers'})")
            note = _route_note(rep)
    params = [p for p in m.parameters() if p.requires_grad]
    return m, params, note


#: profile categories, first match wins; an event inside a matched one is not counted again
CATEGORIES = (
    ("lycoris ops", lambda n: n.startswith("lycoris::")),
    ("attention", lambda n: "scaled_dot_product" in n or "flash_attention" in n or "efficient_attention" in n),
    ("GEMM", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                             "aten::linear", "aten::_scaled_mm", "aten::kron", "aten::convolution")),
    ("optimizer", lambda n: n.startswith("Optimizer.") or "_foreach_" in n or "_fused_adam" in n),
    ("norm/activation", lambda n: "layer_norm" in n or "group_norm" in n or "gelu" in n or "silu" in n),
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
    every = {}  # kernel -> [launches, us]: the whole step's, peers' rows included (what a miss is made of)

    for e in prof.events():
        own = sum(k.duration for k in e.kernels) if cuda else e.self_cpu_time_total  # us
        if not own:
            continue
        total += own
        cat, op = category(e)
        if cat is not None:
            out[cat] += own
        for k in e.kernels if cuda else ():
            slot = every.setdefault(k.name[:90], [0, 0.0])
            slot[0] += 1
            slot[1] += k.duration
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
    out["launches"] = sum(n for n, _ in every.values())
    out["top"] = [(k, n, us / 1e3) for k, (n, us) in sorted(every.items(), key=lambda kv: -kv[1][1])[:16]]
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
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    print(f"host profile, {label}:\n" + "\n".join(buf.getvalue().splitlines()[4:]), flush=True)
    # our ops' calls that reached Python (a call replayed by the C++ kernel never does): the
    # selecting kernels and the op sets' functions carry the op's name
    from lycoris_ops._library.optable import OPS
    names = {row.name for row in OPS}
    hits = sorted(((nc, tt, f"{fn} ({os.path.basename(path)}:{line})")
                   for (path, line, fn), (cc, nc, tt, ct, callers) in stats.stats.items()
                   if fn in names), reverse=True)
    print(f"  our ops' calls in Python this step: {sum(n for n, _, _ in hits)}"
          + "".join(f"\n    x{n} {where} own {tt * 1e3:.2f} ms" for n, tt, where in hits[:12]), flush=True)
    from lycoris_ops._library import launch_record  # why a signature got no replay plan (last one per op)
    for op, why in sorted(launch_record.refusals.items()):
        print(f"  no replay plan, {op}: {why}"[:240], flush=True)


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


def variants(args, device):
    try:
        import peft  # noqa: F401
        have_peft = True
    except Exception:
        have_peft = False
    v = (["peft-eager", "peft-compiled", "peft-ops-eager", "peft-ops-compiled"] if have_peft
         else ["plain-eager", "plain-compiled"])
    v += ["ours-eager", "ours-compiled", "lyco-eager", "lyco-compiled"]
    v[:0] = ["base-eager", "base-compiled"]  # the floor every row shares: no adapters
    named = set(args.variants.split(",")) if args.variants else set()
    if torch.device(device).type == "cuda":  # --quick leaves them out unless named
        v += [g for g in (["peft-graphs"] if have_peft else []) + ["ours-graphs"]
              if not args.quick or g in named]
    if args.no_compile:
        v = [x for x in v if "compiled" not in x and "graphs" not in x]
    if args.variants:
        v = [x for x in v if x in args.variants.split(",")]
    return v


def lyco_rows(args, adapters, wanted):
    """{(adapter, variant): row} of lycoris-lora's own network, measured by ``e2e_lyco.py`` in a
    process that never imports lycoris_ops, on lycoris-lora's torch backend."""
    def stub(a, v, **kw):
        return dict(dict(adapter=a, variant=v, ms=float("nan"), peak_gib=float("nan"), cold_s=float("nan"),
                         x_eager=float("nan"), error="", baseline="lyco-eager", profile=None, note=""), **kw)
    if not wanted:
        return {}
    # lycoris-lora from this environment, or from LYCORIS_PEER_PATH (a --target install, as matrix.py's)
    peer = os.environ.get("LYCORIS_PEER_PATH", "")
    if importlib.util.find_spec("lycoris") is None and not (peer and os.path.isdir(os.path.join(peer, "lycoris"))):
        return {(a, v): stub(a, v, note="n/a: lycoris-lora is not importable") for a in adapters for v in wanted}
    cfg = dict(args=dict(model=args.model, dim=args.dim, heads=args.heads, tokens=args.tokens, batch=args.batch,
                         layers=args.layers, rank=args.rank, spatial=args.spatial, ctx_dim=args.ctx_dim,
                         ctx_tokens=args.ctx_tokens, dtype=args.dtype, device=args.device, reps=args.reps,
                         warmup=args.warmup), adapters=adapters, variants=wanted)
    env = dict(os.environ, LYCORIS_KERNEL_BACKEND="torch", PYTHONUNBUFFERED="1")
    if peer:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (peer, env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, os.path.join(HERE, "e2e_lyco.py"), json.dumps(cfg)], env=env,
                       capture_output=True, text=True)
    got = {}
    for line in p.stdout.splitlines():
        if line.startswith("ROW "):
            r = json.loads(line[4:])
            got[(r["adapter"], r["variant"])] = stub(r["adapter"], r["variant"], **r)
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {(a, v): got.get((a, v)) or stub(a, v, error=f"lycoris-lora process exit {p.returncode}: {tail}")
            for a in adapters for v in wanted}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=["transformer", "unet"])
    ap.add_argument("--dim", type=int, default=None, help="width (transformer 3072, unet channels 640)")
    ap.add_argument("--heads", type=int, default=None, help="transformer 24, unet 10")
    ap.add_argument("--tokens", type=int, default=4096, help="transformer: batch x seq")
    ap.add_argument("--spatial", type=int, default=64, help="unet: the latent's height and width")
    ap.add_argument("--ctx-dim", type=int, default=2048, help="unet: the text context's width")
    ap.add_argument("--ctx-tokens", type=int, default=77)
    ap.add_argument("--batch", type=int, default=None, help="transformer 1, unet 2")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (4); unet (ResNet, transformer) pairs (1)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapters", default=DEFAULT_ADAPTERS, help=f"comma list of {', '.join(ADAPTERS)}")
    ap.add_argument("--variants", default=None, help="comma list of row names (default: all available)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer reps, no CUDA-graph rows unless named in --variants")
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
    unet = args.model == "unet"
    for k, t, u in (("dim", 3072, 640), ("heads", 24, 10), ("batch", 1, 2), ("layers", 4, 1)):
        if getattr(args, k) is None:
            setattr(args, k, u if unet else t)
    if args.smoke:
        args.dim, args.heads, args.tokens, args.rank, args.layers = 64, 4, 32, 4, min(args.layers, 2)
        args.spatial, args.ctx_dim, args.ctx_tokens = 8, 32, 7
        args.reps, args.warmup, args.no_compile, args.dtype = 2, 1, True, "fp32"
        args.device = args.device or "cpu"
    if args.quick:
        args.reps, args.warmup = min(args.reps, 8), min(args.warmup, 3)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    args.device = device
    adapters = args.adapters.split(",")
    unknown = [a for a in adapters if a not in ADAPTERS]
    if unknown:
        ap.error(f"unknown adapters {unknown}; known: {', '.join(ADAPTERS)}")
    # lycoris-lora's rows first, in their own process, before this one holds device memory
    lyco = lyco_rows(args, adapters, [v for v in variants(args, device) if v.startswith("lyco")])
    x = make_input(args, device, dtype)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    meta = dict(model=args.model, dim=args.dim, heads=args.heads, layers=args.layers, rank=args.rank,
                dtype=args.dtype, device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                torch=torch.__version__)
    meta.update(dict(spatial=args.spatial, batch=args.batch, ctx=(args.ctx_tokens, args.ctx_dim)) if unet
                else dict(tokens=args.tokens))

    def save():  # after every row, so a run cut by its time limit keeps the rows it measured
        with open(os.path.join(args.out, "e2e.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    for adapter in adapters:
        base_ms = {}
        for v in variants(args, device):
            if v.startswith("base-") and any(r["variant"] == v for r in rows):
                continue  # adapter-independent: measured once
            if v.startswith("lyco"):
                rows.append(lyco[(adapter, v)])
                r = rows[-1]
                r["x_eager"] = (base_ms.get("peft", base_ms.get("plain", float("nan"))) / r["ms"]
                                if r["ms"] == r["ms"] and r["ms"] > 0 else float("nan"))
                print(f"{adapter:5s} {v:18s} {r['ms']:9.2f} ms  x{r['x_eager']:.2f}  peak {r['peak_gib']:.2f} GiB  "
                      f"cold {r['cold_s']:.1f}s {r['note']}{r['error']}", flush=True)
                continue
            torch._dynamo.reset()
            model = params = None
            note = ""
            try:
                model, params, note = build(v, adapter, args, device, dtype)
                if v.endswith("compiled"):
                    model = torch.compile(model, fullgraph=v.startswith("ours") or "ops" in v)
                elif v.endswith("graphs"):
                    model = torch.compile(model, mode="reduce-overhead", fullgraph=v.startswith("ours"))
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
            except NA as e:  # the family lacks this exact setting: say so, measure nothing else
                ms, peak, cold, err, prof, note = float("nan"), float("nan"), float("nan"), "", None, f"n/a: {e}"
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
                             baseline=eager_key, profile=prof, note=note))
            print(f"{adapter:5s} {v:18s} {ms:9.2f} ms  x{rows[-1]['x_eager']:.2f}  peak {peak:.2f} GiB  "
                  f"cold {cold:.1f}s {note} {err}", flush=True)
            del model, params
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            save()
    save()
    md = [f"E2E training step ({meta}); x = eager PEFT (or plain) / row\n",
          "| adapter | variant | ms | x | peak GiB | note |", "| --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['adapter']} | {r['variant']} | {r['ms']:.2f} | {r['x_eager']:.2f} | {r['peak_gib']:.2f} | "
           f"{(r.get('note') or '') + (' error: ' + r['error'] if r['error'] else '')} |" for r in rows]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        cats = [c for c in profiled[0]["profile"] if c not in ("kernels", "top", "launches")]
        unit = "device ms" if device.startswith("cuda") else "CPU ms"
        md += ["", f"One profiled step per row ({unit}; GEMM = every matmul and conv, the frozen base's and unfused "
                   "adapters'; `other` = the rest: adds, casts, copies, Inductor's fused kernels):", "",
               "| adapter | variant | " + " | ".join(cats) + " |", "| --- | --- | " + " | ".join("---" for _ in cats) + " |"]
        md += [f"| {r['adapter']} | {r['variant']} | " + " | ".join(f"{r['profile'][c]:.2f}" for c in cats) + " |"
               for r in profiled]
        for r in profiled:
            if r["profile"].get("kernels"):
                md += ["", f"Our ops' kernels, {r['adapter']} {r['variant']} (op, kernel, launches, device ms):", ""]
                md += [f"    {op:28s} {k:70s} {n:4d} {ms:7.3f}" for op, k, n, ms in r["profile"]["kernels"]]
            if r["profile"].get("top"):
                md += ["", f"Top kernels of the step, {r['adapter']} {r['variant']} ({r['profile']['launches']} "
                           "launches; kernel, launches, device ms):", ""]
                md += [f"    {k:90s} {n:4d} {ms:7.3f}" for k, n, ms in r["profile"]["top"]]
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
