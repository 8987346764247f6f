"""Sample calls of the ops at a model layer's shape: what ``lycoris_ops.warmup`` runs to
pre-tune those shapes, and what ``backends/triton/compiles.py`` counts the compilations of.

``SAMPLES[family](layer, T, dtype, device, gen)`` gives ``(op, schema args)`` pairs for one
layer (``out_features`` x ``in_features``, adapter ``rank``) at ``T`` tokens; the data comes
from the caller's generator (None: the default one, e.g. on the ``meta`` device).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lycoris_ops.reference import dora as dora_reference

__all__ = ["Layer", "parse_layer", "SAMPLES"]


@dataclass(frozen=True)
class Layer:
    """A layer shape to pre-tune: ``out_features`` x ``in_features``, adapter ``rank``."""

    out_features: int
    in_features: int
    rank: int = 16


def parse_layer(text: str, rank: int = 16) -> Layer:
    """``"OxI"``, ``"OxI:rR"`` or ``"OxIxR"`` -> Layer."""
    t = text.strip().lower()
    if ":r" in t:
        t, r = t.split(":r", 1)
        rank = int(r)
    dims = [int(v) for v in t.replace("*", "x").split("x") if v]
    if len(dims) == 3:
        dims, rank = dims[:2], dims[2]
    if len(dims) != 2:
        raise ValueError(f"lycoris_ops.warmup: bad layer shape {text!r} (expected OxI, OxI:rR or OxIxR)")
    return Layer(dims[0], dims[1], rank)


def rand(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    """Sample data from the caller's private generator."""
    return (torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def lora(layer, T: int, dtype, device, gen):
    """One LoRA layer (out x in, rank) at T tokens."""
    O, I, r = layer.out_features, layer.in_features, layer.rank
    x = rand((T, I), dtype, device, gen)
    up = rand((O, r), dtype, device, gen, 0.02)
    down = rand((r, I), dtype, device, gen, 0.02)
    g = rand((T, O), dtype, device, gen)
    w = rand((O, I), dtype, device, gen, 0.02)
    gw = rand((O, I), dtype, device, gen)
    return [
        ("lora_bypass_fwd", (x, up, down, 1.0, None)),
        ("lora_bypass_bwd", (g, x, up, down, 1.0)),
        ("lora_merge_fwd", (up, down, None, None, w, 1.0, "plain", None)),
        ("lora_merge_bwd", (gw, up, down, 1.0)),
    ]


def tucker(layer, T: int, dtype, device, gen):
    """A 3x3 conv LoCon tucker rebuild (out x in, rank)."""
    O, I, r = layer.out_features, layer.in_features, min(layer.rank, 64)
    return [("lora_tucker_fwd", (rand((O, r), dtype, device, gen, 0.1), rand((r, r, 9), dtype, device, gen, 0.1),
                                 rand((r, I), dtype, device, gen, 0.1), None, None, None, 1.0))]


def loha(layer, T: int, dtype, device, gen):
    """One LoHa layer at T tokens."""
    O, I, r = layer.out_features, layer.in_features, layer.rank
    a1, a2 = rand((O, r), dtype, device, gen, 0.1), rand((O, r), dtype, device, gen, 0.1)
    b1, b2 = rand((r, I), dtype, device, gen, 0.1), rand((r, I), dtype, device, gen, 0.1)
    x = rand((T, I), dtype, device, gen)
    return [("loha_bypass_fwd", (x, a1, b1, a2, b2, 1.0, None)),
            ("loha_bypass_bwd", (rand((T, O), dtype, device, gen), x, a1, b1, a2, b2, 1.0)),
            ("loha_merge_bwd", (rand((O, I), dtype, device, gen), a1, b1, a2, b2, 1.0))]


def lokr(layer, T: int, dtype, device, gen):
    """One LoKr layer (factors near the square root of each dim) at T tokens."""
    O, I, r = layer.out_features, layer.in_features, layer.rank

    def split(n):
        f = max(1, int(n ** 0.5))
        while n % f:
            f -= 1
        return f, n // f

    a, c = split(O)
    b, d = split(I)
    w1 = rand((a, b), dtype, device, gen, 0.1)
    w2 = rand((c, d), dtype, device, gen, 0.1)
    w2a, w2b = rand((c, r), dtype, device, gen, 0.1), rand((r, d), dtype, device, gen, 0.1)
    out = [("lokr_full_merge_fwd", (w1, w2, None, 1.0, None)),
           ("lokr_full_merge_bwd", (rand((O, I), dtype, device, gen), w1, w2, 1.0)),
           ("lokr_merge_fwd", (w1, None, w2a, w2b, [a, b, c, d], None, 1.0, None)),
           ("lokr_merge_bwd", (rand((O, I), dtype, device, gen), w1, None, w2a, w2b, [a, b, c, d], 1.0))]
    if max(max(16, 1 << (v - 1).bit_length()) for v in (a, b, c, d)) <= 128:  # the bypass ops' scope
        x = rand((T, I), dtype, device, gen)
        out += [("lokr_bypass_fwd", (x, w1, w2, 1.0, None)),
                ("lokr_bypass_bwd", (rand((T, O), dtype, device, gen), x, w1, w2, 1.0))]
    return out


def dora(layer, T: int, dtype, device, gen):
    """DoRA of a merged weight (out x in, norms over rows)."""
    O, I = layer.out_features, layer.in_features
    w = rand((O, I), dtype, device, gen, 0.02)
    d = rand((O, I), dtype, device, gen, 0.002)
    ds = rand((O,), torch.float32, device, gen).abs_() + 0.5
    _, norms = dora_reference.dora_fwd(w, ds, 1.0, 0, d)
    return [("dora_fwd", (w, ds, 1.0, 0, d)),
            ("dora_bwd", (rand((O, I), dtype, device, gen), w, ds, norms, 1.0, 0, d))]


def oft(layer, T: int, dtype, device, gen):
    """Diag-OFT (block size 16 when it divides the features, else 8/4/2) on a linear layer's
    input (T x in)."""
    I = layer.in_features
    S = next((s for s in (16, 8, 4, 2) if I % s == 0), None)
    if S is None:
        return []
    blocks = rand((I // S, S, S), dtype, device, gen, 0.01)
    x = rand((T, I), dtype, device, gen)
    return [("oft_fwd", (blocks, x, None, 1.0, False, False)),
            ("oft_bwd", (rand((T, I), dtype, device, gen), blocks, x, None, 1.0, False, False))]


def boft(layer, T: int, dtype, device, gen):
    """BOFT (block 8, as many stages as fit, at most 4) on a linear layer's input."""
    I = layer.in_features
    s = 8
    if I % s:
        return []
    nb = I // s
    m = 1
    while m < 4 and nb % (1 << m) == 0:
        m += 1
    blocks = rand((m, nb, s, s), dtype, device, gen, 0.01)
    x = rand((T, I), dtype, device, gen)
    return [("boft_fwd", (blocks, x, -1, 1.0, 1.0, None, False)),
            ("boft_bwd", (rand((T, I), dtype, device, gen), blocks, x, -1, 1.0, 1.0))]


def ia3(layer, T: int, dtype, device, gen):
    """IA3 on a linear layer's activations (T x out)."""
    O = layer.out_features
    x = rand((T, O), dtype, device, gen)
    w = rand((O,), dtype, device, gen, 0.1)
    return [("ia3_fwd", (x, w, -1, 1.0, 1.0)), ("ia3_bwd", (rand((T, O), dtype, device, gen), x, w, -1, 1.0, 1.0))]


def add(layer, T: int, dtype, device, gen):
    """add_scaled of a merged weight (out x in)."""
    O, I = layer.out_features, layer.in_features
    return [("add_scaled", (rand((O, I), dtype, device, gen), rand((O, I), dtype, device, gen), 1.0))]


#: family -> its sample calls, in warm-up order
SAMPLES = {"lora": lora, "tucker": tucker, "loha": loha, "lokr": lokr, "dora": dora, "oft": oft, "boft": boft,
           "ia3": ia3, "add": add}
