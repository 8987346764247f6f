"""The models, adapter settings and step timing of ``e2e.py``, importable without
lycoris_ops: ``e2e_lyco.py`` builds the same models in a process that runs lycoris-lora
on its own kernels (importing lycoris_ops would install the hook that serves them)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- models


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


class ResBlock(nn.Module):
    """SDXL's ResnetBlock2D without the time embedding: GroupNorm, SiLU, 3x3 conv, twice."""

    def __init__(self, c):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(32, c), nn.GroupNorm(32, c)
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))


class Attention(nn.Module):
    def __init__(self, c, heads, ctx_dim=None):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(c, c, bias=False)
        self.to_k = nn.Linear(ctx_dim or c, c, bias=False)
        self.to_v = nn.Linear(ctx_dim or c, c, bias=False)
        self.to_out = nn.Linear(c, c)

    def forward(self, h, ctx=None):
        ctx = h if ctx is None else ctx
        b, n, c = h.shape
        q = self.to_q(h).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t(ctx).view(b, ctx.shape[1], self.heads, -1).transpose(1, 2) for t in (self.to_k, self.to_v))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class GEGLU(nn.Module):
    def __init__(self, c, mult=4):
        super().__init__()
        self.proj, self.out = nn.Linear(c, 2 * mult * c), nn.Linear(mult * c, c)

    def forward(self, h):
        a, gate = self.proj(h).chunk(2, dim=-1)
        return self.out(a * F.gelu(gate))


class SpatialTransformer(nn.Module):
    """SDXL's Transformer2DModel (linear proj_in/out, one BasicTransformerBlock): self-attention,
    cross-attention to the text context, GEGLU feed-forward over the flattened pixels."""

    def __init__(self, c, heads, ctx_dim):
        super().__init__()
        self.norm = nn.GroupNorm(32, c)
        self.proj_in, self.proj_out = nn.Linear(c, c), nn.Linear(c, c)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(c), nn.LayerNorm(c), nn.LayerNorm(c)
        self.attn1, self.attn2 = Attention(c, heads), Attention(c, heads, ctx_dim)
        self.ff = GEGLU(c)

    def forward(self, x, ctx):
        n, c, hh, ww = x.shape
        h = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        h = h + self.attn1(self.norm1(h))
        h = h + self.attn2(self.norm2(h), ctx)
        h = h + self.ff(self.norm3(h))
        return x + self.proj_out(h).transpose(1, 2).reshape(n, c, hh, ww)


class UNetStage(nn.Module):
    """``layers`` × (ResNet block, spatial transformer); the text context is a buffer so that
    ``model(x)`` is the whole call, as for the transformer stack."""

    def __init__(self, c, heads, ctx_dim, ctx_tokens, batch, layers):
        super().__init__()
        self.res = nn.ModuleList(ResBlock(c) for _ in range(layers))
        self.st = nn.ModuleList(SpatialTransformer(c, heads, ctx_dim) for _ in range(layers))
        self.register_buffer("context", torch.randn(batch, ctx_tokens, ctx_dim), persistent=False)

    def forward(self, x):
        for res, st in zip(self.res, self.st):
            x = st(res(x), self.context)
        return x


#: adapted layers by leaf name
TARGETS = {"transformer": ["qkv", "proj", "fc1", "fc2"],
           "unet": ["conv1", "conv2", "proj_in", "proj_out", "to_q", "to_k", "to_v", "to_out", "proj", "out"]}


def make_model(args, device, dtype):
    torch.manual_seed(0)
    if args.model == "unet":
        m = UNetStage(args.dim, args.heads, args.ctx_dim, args.ctx_tokens, args.batch, args.layers)
    else:
        m = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)])
    m = m.to(device, dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def make_input(args, device, dtype):
    g = torch.Generator().manual_seed(1)
    if args.model == "unet":
        shape = (args.batch, args.dim, args.spatial, args.spatial)
    else:
        shape = (args.batch, args.tokens // args.batch, args.dim)
    return torch.randn(shape, generator=g).to(device, dtype)


def target_names(model, kind):
    """Qualified names of the adapted layers (the same set for every row family)."""
    leaves = set(TARGETS[kind])
    return [n for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] in leaves and isinstance(m, (nn.Linear, nn.Conv2d))]


# ---------------------------------------------------------------- adapter settings (LyCORIS's factorizations)


def factorization(dim, factor=-1):
    """LyCORIS's ``factorization``: (m, n), m·n = dim, m <= n, m = factor when it divides."""
    if factor > 0 and dim % factor == 0:
        m, n = factor, dim // factor
        return (m, n) if m <= n else (n, m)
    factor = dim if factor < 0 else factor
    m, n = 1, dim
    while m < n:
        new_m = m + 1
        while dim % new_m:
            new_m += 1
        new_n = dim // new_m
        if new_m + new_n > m + n or new_m > factor:
            break
        m, n = new_m, new_n
    return (m, n) if m <= n else (n, m)


def butterfly_factor(dim, factor=-1):
    """LyCORIS's BOFT split (``butterfly_factor``): (block size, block count a power of two)."""
    factor = dim if factor == -1 else factor
    m = n = 0
    while m <= factor:
        m += 2
        while dim % m and m < dim:
            m += 2
        if m > factor:
            break
        if bin(dim // m).count("1") == 1:
            n = dim // m
    if n == 0:
        raise ValueError(f"no BOFT split of {dim} with factor {factor}")
    return dim // n, n


#: the ``linear_dim`` LyCORIS's diag-OFT and BOFT get here (block size 32 where it divides)
OFT_DIM = 32


def oft_block(dim):
    """diag-OFT's block size for ``dim`` output channels (LyCORIS: the smaller factor)."""
    return factorization(dim, OFT_DIM)[0]


def boft_shape(dim):
    """(block size, butterfly factors) LyCORIS's BOFT uses for ``dim`` output channels."""
    b, n = butterfly_factor(dim, OFT_DIM)
    return b, bin(n - 1).count("1") + 1


#: adapter name -> (LyCORIS algorithm, create_lycoris keywords beyond the rank)
LYCO = {
    "lora": ("locon", {}),
    "loha": ("loha", {}),
    "lokr": ("lokr", {"factor": -1}),
    "lokr8": ("lokr", {"factor": 8}),
    "dora": ("locon", {"weight_decompose": True}),
    "oft": ("diag-oft", {}),
    "boft": ("boft", {}),
}


# ---------------------------------------------------------------- one training step, timed


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


def time_steps(step, device, warmup, reps):
    from timing import settle_background  # bench/: deferred cold keys' shortlists built, then timed by a warm-up step

    cuda = torch.device(device).type == "cuda"
    settle_background()
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
