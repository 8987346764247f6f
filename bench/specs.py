"""Benchmark specs: one per forward op (and layout) of torch.ops.lycoris.

Each ``Spec`` says, for a geometry ``Geo(N, D, r)`` and a dtype:

- ``build``: the named inputs (an ordered dict of tensors; fresh random data, never
  zeros). Merge and DoRA ops work on (D, D) weights; bypass ops on (N, D)
  activations with out-features = in-features = D.
- ``eager``: the formula a user writes today without lycoris_ops (plain torch,
  written from the math, not from our eager bodies): ``base + γ·F.linear(F.linear(x,
  down), up)``, ``torch.kron``, a Cayley transform through ``inv``, a stage loop of
  reshapes for BOFT, ... It takes the input tensors positionally (dict order).
- ``op_args``: the ``torch.ops.lycoris.<op>`` argument tuple for those tensors;
  ``ours`` calls the op and returns its first output (the one differentiated).
- ``grads``: the inputs a training step differentiates (fwd+bwd = forward, then
  ``torch.autograd.grad`` of the first output w.r.t. these with a fixed upstream
  grad). Frozen tensors (base weights, the base layer's output) are not in it.
- ``bwd``: the backward op and its arguments, only so ``select.explain`` can report
  which tier the backward takes (None: the backward is eager formulas).

The memory floor is computed by the harness from the actual tensors: bytes of
every input read once plus every output written once (fwd); for fwd+bwd also the
upstream grad read once and one gradient per ``grads`` input written once.

This module must not import lycoris_ops: ``peer_lycoris.py`` (a process in which
lycoris-lora owns the ``lycoris`` op namespace) imports it for ``build``/``eager``.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Geo:
    N: int  # tokens (bypass ops)
    D: int  # features: in = out = D
    r: int  # rank

    @property
    def tag(self) -> str:
        return f"N{self.N}-D{self.D}-r{self.r}"


#: named geometries (--shapes); "tiny" is the host-overhead / smoke size
SHAPES: Dict[str, Geo] = {
    "small": Geo(8192, 3072, 32),
    "large": Geo(32768, 4096, 64),
    "tiny": Geo(16, 64, 8),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# constants of the calls (plain Python floats: γ is a launch constant of the op)
GAMMA = 0.75          # LoRA / LoHa / LoKr / tucker scale
DORA_MULT = 1.0       # DoRA multiplier
OFT_BLOCK = 32        # diag-OFT block size S
CSCALE = 1.0          # Cayley constraint factor (no constraint active)
BOFT_SCALE = 1.0      # BOFT multiplier (folded into every stage)
IA3_ALPHA, IA3_GAMMA = 1.0, 1.0
ADD_GAMMA = 0.5       # add_scaled γ (Full merge multiplier)
TUCKER_KK = 9         # tucker spatial kernel (3x3)


@dataclass
class Spec:
    name: str
    op: str
    build: Callable[[Geo, torch.dtype, torch.device, torch.Generator], "OrderedDict[str, torch.Tensor]"]
    eager: Callable[..., torch.Tensor]
    op_args: Callable[..., tuple]
    grads: Tuple[str, ...]
    bwd: Optional[Callable[..., Tuple[str, tuple]]] = None  # (inputs..., G, outs) -> (bwd op, args)
    note: str = ""

    def packet(self):
        """``torch.ops.lycoris.<op>`` (looked up once: the host-overhead numbers should be the op's)."""
        p = self.__dict__.get("_packet")
        if p is None:
            p = self.__dict__["_packet"] = getattr(torch.ops.lycoris, self.op)
        return p

    def ours(self, *ts):
        out = self.packet()(*self.op_args(*ts))
        return out[0] if isinstance(out, tuple) else out

    def ours_all(self, *ts):
        out = self.packet()(*self.op_args(*ts))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# --------------------------------------------------------------------------- geometry helpers

def kron_near_square(D: int) -> Tuple[int, int]:
    """(a, c) with a·c = D and a the largest divisor ≤ sqrt(D): 3072 -> (48, 64), 4096 -> (64, 64)."""
    a = max(d for d in range(1, int(math.isqrt(D)) + 1) if D % d == 0)
    return a, D // a


def kron_big_side(D: int) -> Tuple[int, int]:
    """(a, c) for a factored LoKr merge: the big side c = 256 (3072 -> (12, 256), 4096 -> (16, 256)),
    D // 4 when 256 does not divide D (tiny sizes)."""
    c = 256 if D % 256 == 0 and D > 256 else D // 4
    return D // c, c


def boft_geometry(D: int, target: int = 32) -> Tuple[int, int, int]:
    """(m, nb, s): nb a power of two, s even, nb·s = D, s closest to ``target``
    (3072 -> s 24, nb 128; 4096 -> s 32, nb 128), m = log2(nb) + 1 (full stage count)."""
    best = None
    nb = 1
    while nb <= D:
        if D % nb == 0 and (D // nb) % 2 == 0:
            s = D // nb
            key = (abs(s - target), -s)
            if best is None or key < best[0]:
                best = (key, nb, s)
        nb *= 2
    if best is None:
        raise ValueError(f"no BOFT geometry for D={D}")
    _, nb, s = best
    return int(math.log2(nb)) + 1, nb, s


def _rand(gen, shape, dtype, device, scale=1.0):
    """fp32 normal samples drawn on ``gen``'s device (a CUDA generator keeps large inputs off
    the host), scaled, then moved to ``device`` in ``dtype``."""
    t = torch.randn(tuple(shape), generator=gen, dtype=torch.float32, device=gen.device) * scale
    return t.to(device=device, dtype=dtype)


def _od(**kw) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(kw)


# --------------------------------------------------------------------------- LoRA / LoCon

def _lora_factors(g, dt, dev, gen):
    up = _rand(gen, (g.D, g.r), dt, dev, 1 / math.sqrt(g.r))
    down = _rand(gen, (g.r, g.D), dt, dev, 1 / math.sqrt(g.D))
    return up, down


def build_merge_plain(g, dt, dev, gen):
    up, down = _lora_factors(g, dt, dev, gen)
    return _od(W=_rand(gen, (g.D, g.D), dt, dev, 0.02), up=up, down=down)


def eager_merge_plain(W, up, down):
    return W + GAMMA * (up @ down)


def build_merge_two(g, dt, dev, gen):
    a1, b1 = _lora_factors(g, dt, dev, gen)
    a2, b2 = _lora_factors(g, dt, dev, gen)
    return _od(W=_rand(gen, (g.D, g.D), dt, dev, 0.02), a1=a1, b1=b1, a2=a2, b2=b2)


def eager_merge_hada(W, a1, b1, a2, b2):
    return W + GAMMA * ((a1 @ b1) * (a2 @ b2))


def eager_merge_sum(W, a1, b1, a2, b2):
    return W + GAMMA * (a1 @ b1 + a2 @ b2)


def build_bypass(g, dt, dev, gen):
    up, down = _lora_factors(g, dt, dev, gen)
    x = _rand(gen, (g.N, g.D), dt, dev)
    base = _rand(gen, (g.N, g.D), dt, dev)  # the base layer's output F.linear(x, W)
    return _od(x=x, up=up, down=down, base=base)


def eager_bypass(x, up, down, base):
    return base + GAMMA * F.linear(F.linear(x, down), up)


def build_tucker(g, dt, dev, gen):
    R = g.r
    return _od(up=_rand(gen, (g.D, R), dt, dev, 1 / math.sqrt(R)),
               mid=_rand(gen, (R, R, TUCKER_KK), dt, dev, 1 / math.sqrt(R)),
               down=_rand(gen, (R, g.D), dt, dev, 1 / math.sqrt(g.D)))


def eager_tucker(up, mid, down):
    return GAMMA * torch.einsum("op,pqk,qi->oik", up, mid, down)


# --------------------------------------------------------------------------- LoHa

def build_loha_bypass(g, dt, dev, gen):
    s = 1 / math.sqrt(math.sqrt(g.r * g.D))  # keeps (a1·b1)⊙(a2·b2) ~ 1/sqrt(D)
    a1, a2 = (_rand(gen, (g.D, g.r), dt, dev, s) for _ in range(2))
    b1, b2 = (_rand(gen, (g.r, g.D), dt, dev, s) for _ in range(2))
    return _od(x=_rand(gen, (g.N, g.D), dt, dev), a1=a1, b1=b1, a2=a2, b2=b2,
               base=_rand(gen, (g.N, g.D), dt, dev))


def eager_loha_bypass(x, a1, b1, a2, b2, base):
    return base + GAMMA * F.linear(x, (a1 @ b1) * (a2 @ b2))


# --------------------------------------------------------------------------- LoKr

def build_lokr_full(g, dt, dev, gen):
    a, c = kron_near_square(g.D)
    return _od(W=_rand(gen, (g.D, g.D), dt, dev, 0.02), w1=_rand(gen, (a, a), dt, dev, 1 / math.sqrt(a)),
               w2=_rand(gen, (c, c), dt, dev, 1 / math.sqrt(c)))


def eager_lokr_full(W, w1, w2):
    return W + GAMMA * torch.kron(w1, w2)


def build_lokr_merge(g, dt, dev, gen):
    a, c = kron_big_side(g.D)
    r = min(g.r, max(1, c // 4))
    return _od(W=_rand(gen, (g.D, g.D), dt, dev, 0.02), w1=_rand(gen, (a, a), dt, dev, 1 / math.sqrt(a)),
               w2a=_rand(gen, (c, r), dt, dev, 1 / math.sqrt(r)), w2b=_rand(gen, (r, c), dt, dev, 1 / math.sqrt(c)))


def eager_lokr_merge(W, w1, w2a, w2b):
    return W + GAMMA * torch.kron(w1, w2a @ w2b)


def _lokr_merge_args(W, w1, w2a, w2b):
    a, b = w1.shape
    c, d = w2a.shape[0], w2b.shape[1]
    return (w1, None, w2a, w2b, [a, b, c, d], W, GAMMA)


def build_lokr_bypass(g, dt, dev, gen):
    a, c = kron_near_square(g.D)
    return _od(x=_rand(gen, (g.N, g.D), dt, dev), w1=_rand(gen, (a, a), dt, dev, 1 / math.sqrt(a)),
               w2=_rand(gen, (c, c), dt, dev, 1 / math.sqrt(c)), base=_rand(gen, (g.N, g.D), dt, dev))


def eager_lokr_bypass(x, w1, w2, base):
    # y_t = γ·vec(w1·X_t·w2ᵀ) with X_t = x_t viewed (b, d): never builds kron(w1, w2)
    b, d = w1.shape[1], w2.shape[1]
    y = torch.einsum("ub,nbd,cd->nuc", w1, x.reshape(-1, b, d), w2)
    return base + GAMMA * y.reshape(x.shape[0], -1)


# --------------------------------------------------------------------------- DoRA

def build_dora(g, dt, dev, gen):
    W = _rand(gen, (g.D, g.D), dt, dev, 0.02)
    m = (W.float().norm(dim=1, keepdim=True) * (1 + 0.1 * _rand(gen, (g.D, 1), torch.float32, dev))).to(dt)
    return _od(W=W, m=m)


def eager_dora(W, m):
    # W' = W · (mult·(m/‖W‖ − 1) + 1), norm per output row (wd_on_out)
    norm = torch.linalg.vector_norm(W, dim=1, keepdim=True) + torch.finfo(m.dtype).eps
    return W * (DORA_MULT * (m / norm - 1) + 1)


# --------------------------------------------------------------------------- diag-OFT / BOFT

def cayley(blocks: torch.Tensor) -> torch.Tensor:
    """R = (I + Q)(I − Q)⁻¹, Q = cscale·(B − Bᵀ), in fp32 (``inv_ex``: the same math as
    ``torch.inverse`` without its error-check host sync)."""
    b = blocks.float()
    q = CSCALE * (b - b.transpose(-1, -2))
    eye = torch.eye(b.shape[-1], dtype=b.dtype, device=b.device)
    return (eye + q) @ torch.linalg.inv_ex(eye - q).inverse


def build_oft_bypass(g, dt, dev, gen):
    K = g.D // OFT_BLOCK
    return _od(blocks=_rand(gen, (K, OFT_BLOCK, OFT_BLOCK), dt, dev, 0.02), y=_rand(gen, (g.N, g.D), dt, dev))


def eager_oft_bypass(blocks, y):
    # Δy = y·(R − I) per block of S channels, R shared by every token
    K, S, _ = blocks.shape
    d = (cayley(blocks) - torch.eye(S, device=y.device)).to(y.dtype)
    return torch.einsum("nks,kst->nkt", y.reshape(-1, K, S), d).reshape(y.shape)


def build_oft_merge(g, dt, dev, gen):
    K = g.D // OFT_BLOCK
    return _od(blocks=_rand(gen, (K, OFT_BLOCK, OFT_BLOCK), dt, dev, 0.02), W=_rand(gen, (g.D, g.D), dt, dev, 0.02))


def eager_oft_merge(blocks, W):
    # ΔW = (R − I)ᵀ·W per block of S rows
    K, S, _ = blocks.shape
    d = (cayley(blocks) - torch.eye(S, device=W.device)).to(W.dtype)
    return torch.einsum("kji,kjl->kil", d, W.reshape(K, S, -1)).reshape(W.shape)


def build_boft(g, dt, dev, gen):
    m, nb, s = boft_geometry(g.D)
    return _od(blocks=_rand(gen, (m, nb, s, s), dt, dev, 0.02), y=_rand(gen, (g.N, g.D), dt, dev))


def eager_boft(blocks, y):
    # Δy = butterfly(y) − y: stage i pairs channel j of each 2κ-group's first half with
    # channel j + κ of its second half (κ = 2^i·s/2), blocks of s permuted positions
    m, nb, s, _ = blocks.shape
    C = nb * s
    R = cayley(blocks)
    if BOFT_SCALE != 1.0:
        R = BOFT_SCALE * R + (1 - BOFT_SCALE) * torch.eye(s, device=R.device)
    R = R.to(y.dtype)
    lead = y.shape[:-1]
    u = y
    for i in range(m):
        k = (2 ** i) * s // 2
        v = u.reshape(*lead, C // (2 * k), 2, k).transpose(-1, -2).reshape(*lead, nb, s)
        v = torch.einsum("...bq,bpq->...bp", v, R[i])
        u = v.reshape(*lead, C // (2 * k), k, 2).transpose(-1, -2).reshape(*lead, C)
    return u - y


# --------------------------------------------------------------------------- IA3, add_scaled

def build_ia3(g, dt, dev, gen):
    return _od(x=_rand(gen, (g.N, g.D), dt, dev), w=_rand(gen, (g.D,), dt, dev, 0.1))


def eager_ia3(x, w):
    return x * (IA3_ALPHA + IA3_GAMMA * w)


def build_add(g, dt, dev, gen):
    return _od(W=_rand(gen, (g.D, g.D), dt, dev, 0.02), delta=_rand(gen, (g.D, g.D), dt, dev, 0.02))


def eager_add(W, delta):
    return W + ADD_GAMMA * delta


# --------------------------------------------------------------------------- the table

SPECS = [
    Spec("lora_merge_plain", "lora_merge_fwd", build_merge_plain, eager_merge_plain,
         lambda W, up, down: (up, down, None, None, W, GAMMA, "plain"), ("up", "down"),
         bwd=lambda W, up, down, G, outs: ("lora_merge_bwd", (G, up, down, GAMMA)),
         note="W + γ·up·down, (D, D)"),
    Spec("lora_merge_hada", "lora_merge_fwd", build_merge_two, eager_merge_hada,
         lambda W, a1, b1, a2, b2: (a1, b1, a2, b2, W, GAMMA, "hada"), ("a1", "b1", "a2", "b2"),
         bwd=lambda W, a1, b1, a2, b2, G, outs: ("loha_merge_bwd", (G, a1, b1, a2, b2, GAMMA)),
         note="W + γ·(a1·b1)⊙(a2·b2) (LoHa merge)"),
    Spec("lora_merge_sum", "lora_merge_fwd", build_merge_two, eager_merge_sum,
         lambda W, a1, b1, a2, b2: (a1, b1, a2, b2, W, GAMMA, "sum"), ("a1", "b1", "a2", "b2"),
         note="W + γ·(a1·b1 + a2·b2) (GLoRA merge); backward eager"),
    Spec("lora_bypass", "lora_bypass_fwd", build_bypass, eager_bypass,
         lambda x, up, down, base: (x, up, down, GAMMA, base), ("x", "up", "down"),
         bwd=lambda x, up, down, base, G, outs: ("lora_bypass_bwd", (G, x, up, down, GAMMA)),
         note="base + γ·(x·downᵀ)·upᵀ, (N, D)"),
    Spec("lora_tucker", "lora_tucker_fwd", build_tucker, eager_tucker,
         lambda up, mid, down: (up, mid, down, None, None, None, GAMMA), ("up", "mid", "down"),
         note=f"γ·einsum(up, mid, down) -> (D, D, {TUCKER_KK}); backward eager"),
    Spec("loha_bypass", "loha_bypass_fwd", build_loha_bypass, eager_loha_bypass,
         lambda x, a1, b1, a2, b2, base: (x, a1, b1, a2, b2, GAMMA, base), ("x", "a1", "b1", "a2", "b2"),
         bwd=lambda x, a1, b1, a2, b2, base, G, outs: ("loha_bypass_bwd", (G, x, a1, b1, a2, b2, GAMMA)),
         note="base + γ·x·((a1·b1)⊙(a2·b2))ᵀ"),
    Spec("lokr_full_merge", "lokr_full_merge_fwd", build_lokr_full, eager_lokr_full,
         lambda W, w1, w2: (w1, w2, W, GAMMA), ("w1", "w2"),
         bwd=lambda W, w1, w2, G, outs: ("lokr_full_merge_bwd", (G, w1, w2, GAMMA)),
         note="W + γ·kron(w1, w2), near-square factors"),
    Spec("lokr_merge", "lokr_merge_fwd", build_lokr_merge, eager_lokr_merge, _lokr_merge_args,
         ("w1", "w2a", "w2b"),
         bwd=lambda W, w1, w2a, w2b, G, outs: ("lokr_merge_bwd", (G,) + _lokr_merge_args(W, w1, w2a, w2b)[:5] + (GAMMA,)),
         note="W + γ·kron(w1, w2a·w2b), big side 256 factored"),
    Spec("lokr_bypass", "lokr_bypass_fwd", build_lokr_bypass, eager_lokr_bypass,
         lambda x, w1, w2, base: (x, w1, w2, GAMMA, base), ("x", "w1", "w2"),
         bwd=lambda x, w1, w2, base, G, outs: ("lokr_bypass_bwd", (G, x, w1, w2, GAMMA)),
         note="base + γ·x·kron(w1, w2)ᵀ; eager = einsum on x viewed (N, b, d)"),
    Spec("dora", "dora_fwd", build_dora, eager_dora,
         lambda W, m: (W, m, DORA_MULT, 0), ("W", "m"),
         bwd=lambda W, m, G, outs: ("dora_bwd", (G, W, m, outs[1], DORA_MULT, 0)),
         note="W·m/(‖W‖row+eps), (D, D), row_axis 0"),
    Spec("oft_bypass", "oft_fwd", build_oft_bypass, eager_oft_bypass,
         lambda blocks, y: (blocks, y, None, CSCALE, True, False), ("blocks", "y"),
         bwd=lambda blocks, y, G, outs: ("oft_bwd", (G, blocks, y, None, CSCALE, True, False)),
         note=f"Δy = y·(R−I) on (N, D), block {OFT_BLOCK}"),
    Spec("oft_merge", "oft_fwd", build_oft_merge, eager_oft_merge,
         lambda blocks, W: (blocks, W, None, CSCALE, True, True), ("blocks",),
         bwd=lambda blocks, W, G, outs: ("oft_bwd", (G, blocks, W, None, CSCALE, True, True)),
         note=f"ΔW = (R−I)ᵀ·W on (D, D), block {OFT_BLOCK}"),
    Spec("boft", "boft_fwd", build_boft, eager_boft,
         lambda blocks, y: (blocks, y, -1, CSCALE, BOFT_SCALE, None, True), ("blocks", "y"),
         bwd=lambda blocks, y, G, outs: ("boft_bwd", (G, blocks, y, -1, CSCALE, BOFT_SCALE)),
         note="Δy = butterfly(y) − y on (N, D), nb·s = D, m = log2(nb)+1"),
    Spec("ia3", "ia3_fwd", build_ia3, eager_ia3,
         lambda x, w: (x, w, -1, IA3_ALPHA, IA3_GAMMA), ("x", "w"),
         bwd=lambda x, w, G, outs: ("ia3_bwd", (G, x, w, -1, IA3_ALPHA, IA3_GAMMA)),
         note="x ⊙ (1 + w) on (N, D)"),
    Spec("add_scaled", "add_scaled", build_add, eager_add,
         lambda W, delta: (W, delta, ADD_GAMMA), ("delta",),
         note="W + γ·delta, (D, D) (Full merge); backward eager"),
]
BY_NAME = {s.name: s for s in SPECS}


def select(names: Optional[Sequence[str]]) -> list:
    """Specs by name (None / 'all': every spec; a name may also be an op name: all its specs)."""
    if not names or list(names) == ["all"]:
        return list(SPECS)
    out = []
    for n in names:
        hit = [s for s in SPECS if s.name == n or s.op == n]
        if not hit:
            raise SystemExit(f"unknown op/spec {n!r}; known: {', '.join(BY_NAME)}")
        out.extend(h for h in hit if h not in out)
    return out


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def floor_bytes(inputs, outputs, G, trained) -> Tuple[int, int]:
    """The memory floor's bytes (fwd, fwd+bwd): every input read once and every output written
    once; fwd+bwd adds the upstream grad ``G`` read once and one gradient per ``trained`` input."""
    fwd = nbytes(inputs) + nbytes(outputs)
    return fwd, fwd + nbytes([G]) + nbytes(trained)
