"""The shape matrix (issue #60): the layer shapes of real models crossed with the adapter
settings users pick; in every cell our functional entry point against the eager formula a
user writes, its ``torch.compile``, lycoris-lora 4.1.3 and the memory floor.

    python bench/matrix.py                                  # the default matrix (--seconds 450)
    python bench/matrix.py --algo lokr --model sdxl --dtype bf16 --limit 20 --seconds 120
    python bench/matrix.py --skip-done bench/out/matrix/matrix.json   # resume: its cells are kept
    python bench/matrix.py --list                           # the cells, in run order, and stop
    python bench/matrix.py --report FILE.json [--results bench/RESULTS.md]  # summary from a JSON
    python bench/matrix.py --plot FILE.json                 # heat map -> bench/matrix_heatmap.png
    python bench/matrix.py --smoke                          # CPU, tiny shapes: ours agrees (CI)

Cells: model layer (``LAYERS``: SD 1.5 / SDXL UNet attention, feed-forward and 3×3 resnet
convs, a Flux block, Llama-3-8B projections, bench.py's two shapes) × algorithm
(``SETTINGS``: LoRA, LoHa, LoKr bypass and merge, DoRA, diag-OFT and BOFT on activations
and weights, IA3, conv LoCon / LoHa / LoKr) × setting (ranks, LoKr factor and whole or
factored w2, DoRA axis, OFT/BOFT ``lora_dim`` turned into block sizes by LyCORIS's own
factorizations) × dtype. The default run, in this order (``plan``): the cells issue #60
names as bad (``KNOWN_BAD``); every algorithm's default setting on the sweep layer
(``SWEEP``); on one layer per model (``HEADLINE``); every other setting on the sweep layer;
fp16 and fp32 of the defaults on the sweep layer. ``--full`` adds every layer at the default
and then every setting on every layer. Within a pass the algorithms take turns, so a run cut
by its time budget still covers every algorithm.

Per cell (one process; bench/timing.py's device timer: L2 flushed, launch gaps hidden):

- ``ours``: ``lycoris_ops.functional`` (DoRA: ``nn.DoRALinear``) under the default backend
  setting (``--backend`` pins one), forward and forward+backward; its first call of each
  phase is the cell's cold call: the run starts with empty tuning, Triton and TileLang caches
  (fresh temporary directories), so a cell's cold call pays the tuning of its new keys and the
  builds of kernels no earlier cell of the run built (a key an earlier cell tuned, e.g. the
  same weights at tokens of one bucket, is warm: the cells run in a fixed order). Its result is compared with the eager
  formula's (output and gradients) before it is timed: a cell that disagrees is not timed.
- ``eager``: the formula a user writes, in the input dtype (intermediates rounded there):
  ``x @ down.T @ up.T * s + base``; LoKr ``x @ kron(w1, w2).T`` as PEFT builds it; DoRA as
  PEFT writes it (the out axis; the in axis as LyCORIS merges it); OFT/BOFT through a Cayley
  transform in fp32 rounded to the input dtype; ``F.conv2d`` chains for convs.
- ``compile``: ``torch.compile(eager, dynamic=False)``; its compile costs seconds per shape,
  so by default only the known-bad cells and each algorithm's first cell get it
  (``--compile all|none``); elsewhere the ratio is against eager alone (the JSON says which).
- ``peer``: lycoris-lora's functional API in one subprocess for the cells this run did, in
  their order while its share lasts (bench/peer_lycoris.py --cells; its own fresh tuning
  table), next to the eager formula timed there.
- floor: bytes of every input read once and every output written once (+ the upstream grad
  and one gradient per trained input for fwd+bwd) / the copy bandwidth measured in this run.
- peak: device memory one fwd+bwd call allocates above what was allocated before it.

Time budget (``--seconds``): our pass (eager + ours) until ``1 - compile_share - peer_share``
of it, the compile pass until ``1 - peer_share``, the peer with what is left; unused time
passes on. The JSON (``--json``, default <out>/matrix.json) is rewritten as cells finish (every
few seconds), so a killed run keeps its cells (``--report`` makes the summary from it); ``--skip-done`` keeps
a JSON's measured cells and runs the rest. Outputs: the JSON, <out>/matrix-summary.md,
<out>/matrix-RESULTS-entry.md (also appended to ``--results``) and, with matplotlib,
<out>/matrix_heatmap.png.

Contract (issue #60): ours >= 1.0x the faster of eager and compile in every cell, forward and
forward+backward (aim 1.5x where memory-bound); cold first call (fwd + fwd+bwd) <= 2 s.
"""

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench as B  # noqa: E402
import peer_lycoris as PL  # noqa: E402
import specs as S  # noqa: E402
import timing as T  # noqa: E402

GAMMA = S.GAMMA
CONV_PAD = 1  # every conv cell is a 3x3 "same" conv (the UNet resnet convs)


# --------------------------------------------------------------------------- the tables

@dataclass(frozen=True)
class Layer:
    model: str
    name: str
    T: int                                  # tokens (linear: sequence x batch) or batch (conv)
    I: int                                  # in-features / in-channels
    O: int                                  # out-features / out-channels
    hw: Optional[Tuple[int, int]] = None    # conv: the spatial size (3x3 kernel, padding 1)

    @property
    def kind(self) -> str:
        return "conv" if self.hw else "linear"


#: the layer shapes of real models (batch 2 for the UNets: classifier-free guidance / training)
LAYERS = (
    Layer("sd15", "attn1.to_q 320", 8192, 320, 320),        # 64x64 latent (512 px)
    Layer("sd15", "ff.proj 320", 8192, 320, 2560),          # GEGLU: 2 x 4 x 320
    Layer("sd15", "attn1.to_q 640", 2048, 640, 640),
    Layer("sd15", "attn1.to_q 1280", 512, 1280, 1280),
    Layer("sd15", "attn2.to_k 320", 154, 768, 320),         # the text context: 77 tokens x 2
    Layer("sdxl", "attn1.to_q 640", 8192, 640, 640),        # 64x64 (1024 px: 128x128 latent / 2)
    Layer("sdxl", "attn1.to_q 1280", 2048, 1280, 1280),
    Layer("sdxl", "ff.proj 1280", 2048, 1280, 10240),
    Layer("sdxl", "ff.net.2 1280", 2048, 5120, 1280),
    Layer("sdxl", "attn2.to_k 1280", 154, 2048, 1280),
    Layer("flux", "attn.to_q", 4608, 3072, 3072),           # 4096 image + 512 text tokens
    Layer("flux", "mlp.0", 4608, 3072, 12288),
    Layer("flux", "mlp.2", 4608, 12288, 3072),
    Layer("llama3-8b", "q_proj", 8192, 4096, 4096),
    Layer("llama3-8b", "k_proj", 4096, 4096, 1024),
    Layer("llama3-8b", "up_proj", 8192, 4096, 14336),
    Layer("llama3-8b", "down_proj", 8192, 14336, 4096),
    Layer("llama3-8b", "q_proj 16k", 16384, 4096, 4096),
    Layer("bench", "small", 8192, 3072, 3072),              # bench.py's shapes
    Layer("bench", "large", 32768, 4096, 4096),
    Layer("sd15", "resnet 320", 2, 320, 320, (64, 64)),
    Layer("sd15", "resnet 640", 2, 640, 640, (32, 32)),
    Layer("sd15", "resnet 1280", 2, 1280, 1280, (16, 16)),
    Layer("sdxl", "resnet 320", 2, 320, 320, (128, 128)),
    Layer("sdxl", "resnet 640", 2, 640, 640, (64, 64)),
    Layer("sdxl", "resnet 1280", 2, 1280, 1280, (32, 32)),
)
#: the settings sweep runs on these layers; the other layers get each algorithm's default
SWEEP = {"linear": ("flux", "attn.to_q"), "conv": ("sdxl", "resnet 640")}
#: one layer per model and kind: the default run's second pass
HEADLINE = (("sd15", "ff.proj 320"), ("sdxl", "attn1.to_q 640"), ("flux", "mlp.0"), ("llama3-8b", "up_proj"),
            ("sd15", "resnet 320"), ("sdxl", "resnet 1280"))
#: --smoke: tiny stand-ins (CPU) where every setting still applies
SMOKE_LAYERS = (
    Layer("smoke", "square", 16, 256, 256),
    Layer("smoke", "wide", 8, 128, 384),
    Layer("smoke", "conv", 1, 16, 32, (6, 6)),
)
SMOKE_SWEEP = {"linear": ("smoke", "square"), "conv": ("smoke", "conv")}
SMOKE_HEADLINE = (("smoke", "wide"),)

_LORA_RANKS = tuple({"r": r} for r in (32, 4, 8, 16, 64, 128))
_LOHA_RANKS = tuple({"r": r} for r in (16, 4, 8, 32, 64))
_CONV_RANKS = tuple({"r": r} for r in (16, 4, 8, 32, 64))
#: LoKr: factor (-1: near square) x w2 whole (LyCORIS's full_matrix) or factored at rank w2r
_LOKR = tuple(dict({"factor": f}, **w2) for f in (-1, 4, 8, 16) for w2 in ({}, {"w2r": 16}))
#: OFT / BOFT: LyCORIS's lora_dim, turned into block sizes by its factorizations
_OFT_DIMS = tuple({"dim": d} for d in (32, 4, 8, 16, 64))
#: algorithm -> the settings users pick, the default first (a "-conv" algorithm runs on conv layers)
SETTINGS = {
    "lora": _LORA_RANKS,
    "loha": _LOHA_RANKS,
    "lokr": _LOKR,
    "dora": ({"r": 32, "axis": "out"}, {"r": 32, "axis": "in"}),
    "oft": _OFT_DIMS,
    "boft": _OFT_DIMS,
    "ia3": ({},),
    "lora-merge": _LORA_RANKS,
    "loha-merge": _LOHA_RANKS,
    "lokr-merge": _LOKR,
    "oft-merge": _OFT_DIMS,
    "boft-merge": _OFT_DIMS,
    "locon-conv": _CONV_RANKS,
    "loha-conv": _CONV_RANKS,
    "lokr-conv": tuple(s for s in _LOKR if "w2r" not in s),
}
#: the cells issue #60 names as bad (H100, bf16): run first, always compiled
KNOWN_BAD = (
    ("lokr", "bench", "small", {"factor": 8}, "bf16"),            # w1 8x8, w2 384x384, 8192 tokens
    ("lokr", "bench", "large", {"factor": 8}, "bf16"),            # w2 512x512, 32768 tokens
    ("boft", "bench", "small", {"dim": 64}, "bf16"),              # block 48, 64 blocks, 7 stages
    ("boft-merge", "bench", "small", {"dim": 64}, "bf16"),        # the same on the 3072² weight
    ("loha", "bench", "small", {"r": 32}, "bf16"),                # f+b
)
#: the dtype of every cell and the ones a subset gets (the defaults on the sweep layer)
MAIN_DTYPE, SUBSET_DTYPES = "bf16", ("fp16", "fp32")
SMOKE_MAIN_DTYPE, SMOKE_SUBSET_DTYPES = "fp32", ("bf16",)
#: contract thresholds (issue #60)
MIN_RATIO, AIM_RATIO, COLD_MAX_S = 1.0, 1.5, 2.0
#: the peer subprocess: its process start-up (torch, lycoris-lora, CUDA: not in its own budget), and
#: the least budget left worth starting it for; REPORT_S is kept after it for the summary, so a
#: run ends within --seconds (a caller's own time limit a little above it does not cut the peer)
PEER_START_S, PEER_MIN_S, REPORT_S = 15.0, 45.0, 10.0
#: how long the peer may run past its budget (start-up, its last cell) before it is killed
PEER_GRACE_S = PEER_START_S + 10
#: the JSON is rewritten after a cell at most this often (a killed run loses less than this)
DUMP_EVERY_S = 5.0


def butterfly_blocks(dim: int, factor: int) -> Optional[Tuple[int, int]]:
    """LyCORIS's BOFT rule (``power2factorization``): (block size s, block count nb) with s the
    largest even divisor of ``dim`` not above ``factor`` whose nb = dim / s is a power of two;
    None when there is none (LyCORIS refuses such a layer)."""
    best = None
    for s in range(2, min(factor, dim) + 1, 2):
        nb, rest = divmod(dim, s)
        if rest == 0 and nb & (nb - 1) == 0:
            best = (s, nb)
    return best


#: how each key of a setting reads in the cell ids and tables (f8 w2r16, out r32, dim32, r16)
SETTING_FORMAT = (("factor", "f{}"), ("w2r", "w2r{}"), ("axis", "{}"), ("dim", "dim{}"), ("r", "r{}"))


def setting_label(s: dict) -> str:
    return " ".join(fmt.format(s[k]) for k, fmt in SETTING_FORMAT if k in s) or "-"


def cell_dims(algo: str, s: dict, layer: Layer) -> Optional[dict]:
    """The sizes of one cell's tensors; None where LyCORIS would not build the setting on the
    layer (no BOFT factorization; a factored w2 at a rank that makes it whole)."""
    from lycoris_ops.nn import factorization  # LyCORIS's own (main process only: the peer gets dims)

    d = {"I": layer.I, "O": layer.O}
    if layer.hw:
        d.update(N=layer.T, H=layer.hw[0], W=layer.hw[1])
    elif not algo.endswith("-merge"):
        d["T"] = layer.T
    family = algo.split("-")[0]
    if "r" in s:
        d["r"] = s["r"]
    if family == "dora":
        d["axis"] = s["axis"]
    elif family == "lokr":
        (a, c), (b, dd) = factorization(layer.O, s["factor"]), factorization(layer.I, s["factor"])
        d.update(a=a, b=b, c=c, d=dd)
        if "w2r" in s:
            if s["w2r"] >= max(c, dd) / 2:
                return None
            d["r"] = s["w2r"]
    elif family == "oft":
        d["S"], d["K"] = factorization(layer.O, s["dim"])  # (block size, block count), LyCORIS's order
    elif family == "boft":
        blocks = butterfly_blocks(layer.O, s["dim"])
        if blocks is None:
            return None
        d["s"], d["nb"] = blocks
        d["m"] = bin(d["nb"] - 1).count("1") + 1  # LyCORIS's stage count
    return d


def dims_label(d: dict) -> str:
    """The sizes a setting turned into (LoKr's factors, OFT/BOFT blocks), for the tables."""
    if "a" in d:
        return f"w1 {d['a']}x{d['b']} w2 {d['c']}x{d['d']}" + (f" r{d['r']}" if "r" in d else "")
    if "K" in d:
        return f"S{d['S']} K{d['K']}"
    if "nb" in d:
        return f"s{d['s']} nb{d['nb']} m{d['m']}"
    return ""


def form_of(algo: str, d: dict) -> str:
    return algo + "-factored" if algo.startswith("lokr") and "r" in d else algo


def make_cell(algo, layer, s, dtype, prio) -> Optional[dict]:
    d = cell_dims(algo, s, layer)
    if d is None:
        return None
    label = setting_label(s)
    return {"id": f"{algo}|{layer.model}|{layer.name}|{label}|{dtype}", "algo": algo, "form": form_of(algo, d),
            "model": layer.model, "layer": layer.name, "setting": label, "sizes": dims_label(d), "dtype": dtype,
            "prio": prio, "dims": d}


def plan(layers, sweep, headline, main_dtype, subset_dtypes, full: bool) -> List[dict]:
    """The cells in run order: by pass (see the module docstring), the algorithms taking turns
    within a pass; a merge cell whose weight shape an earlier cell had is dropped."""
    by_name = {(l.model, l.name): l for l in layers}
    passes: List[Dict[str, List[tuple]]] = [{} for _ in range(7)]

    def add(p, algo, layer, s, dtype):
        passes[p].setdefault(algo, []).append((algo, layer, s, dtype))

    for algo, model, name, s, dtype in KNOWN_BAD:
        if (model, name) in by_name:
            add(0, algo, by_name[(model, name)], s, dtype)
    for algo, settings in SETTINGS.items():
        kind = "conv" if algo.endswith("-conv") else "linear"
        rep = by_name[sweep[kind]]
        mine = [l for l in layers if l.kind == kind]
        add(1, algo, rep, settings[0], main_dtype)
        for key in headline:
            if key in by_name and by_name[key].kind == kind:
                add(2, algo, by_name[key], settings[0], main_dtype)
        for s in settings[1:]:
            add(3, algo, rep, s, main_dtype)
        for dtype in subset_dtypes:
            add(4, algo, rep, settings[0], dtype)
        if full:
            for layer in mine:
                add(5, algo, layer, settings[0], main_dtype)
                for s in settings[1:]:
                    add(6, algo, layer, s, main_dtype)
    cells, seen = [], set()
    for p, groups in enumerate(passes):
        queues = [list(q) for q in groups.values()]
        while any(queues):
            for q in queues:
                if not q:
                    continue
                cell = make_cell(*q.pop(0), prio=p)
                if cell is None:
                    continue
                shape_key = (cell["algo"], json.dumps(cell["dims"], sort_keys=True), cell["dtype"])
                if cell["id"] in seen or shape_key in seen:
                    continue
                seen.update((cell["id"], shape_key))
                cells.append(cell)
    return cells


# --------------------------------------------------------------------------- the forms

def _rand(gen, shape, dt, dev, scale=1.0):
    return S._rand(gen, shape, dt, dev, scale)


def _act(d, width, dt, dev, gen):
    """An activation: (T, width) tokens, or (N, width, H, W) for a conv cell."""
    shape = (d["N"], width, d["H"], d["W"]) if "N" in d else (d["T"], width)
    return _rand(gen, shape, dt, dev)


def _lora_factors(d, dt, dev, gen, kernel=()):
    """up (O, r[, 1, 1]), down (r, I[, *kernel])."""
    r, I = d["r"], d["I"]
    return OrderedDict(up=_rand(gen, (d["O"], r) + (1,) * len(kernel), dt, dev, r ** -0.5),
                       down=_rand(gen, (r, I) + kernel, dt, dev, (I * math.prod(kernel)) ** -0.5))


def _hada_factors(d, dt, dev, gen, kernel=()):
    """a1, a2 (O, r); b1, b2 (r, I[, *kernel]); (a1·b1)⊙(a2·b2) ~ 1/sqrt(fan-in)."""
    r, O, fan = d["r"], d["O"], d["I"] * math.prod(kernel)
    a = [_rand(gen, (O, r), dt, dev, r ** -0.5) for _ in range(2)]
    b = [_rand(gen, (r, d["I"]) + kernel, dt, dev, fan ** -0.25) for _ in range(2)]
    return OrderedDict(a1=a[0], b1=b[0], a2=a[1], b2=b[1])


def _kron_factors(d, dt, dev, gen, kernel=()):
    """w1 (a, b) and w2 (c, d[, *kernel]) whole, or w2a (c, r)·w2b (r, d) where the cell has a rank."""
    a, b, c, dd = d["a"], d["b"], d["c"], d["d"]
    out = OrderedDict(w1=_rand(gen, (a, b), dt, dev, b ** -0.5))
    if "r" in d:
        r = d["r"]
        out.update(w2a=_rand(gen, (c, r), dt, dev, r ** -0.5), w2b=_rand(gen, (r, dd), dt, dev, dd ** -0.5))
    else:
        out["w2"] = _rand(gen, (c, dd) + kernel, dt, dev, (dd * math.prod(kernel)) ** -0.5)
    return out


def _oft_blocks(d, dt, dev, gen):
    return OrderedDict(blocks=_rand(gen, (d["K"], d["S"], d["S"]), dt, dev, 0.02))


def _boft_blocks(d, dt, dev, gen):
    return OrderedDict(blocks=_rand(gen, (d["m"], d["nb"], d["s"], d["s"]), dt, dev, 0.02))


def _weight(d, dt, dev, gen):
    return _rand(gen, (d["O"], d["I"]), dt, dev, 0.02)


def bypass_builder(factors, kernel=()):
    """A bypass form's inputs: x, the adapter's factors, the base layer's output."""
    def build(d, dt, dev, gen):
        x = _act(d, d["I"], dt, dev, gen)
        return OrderedDict(x=x, **factors(d, dt, dev, gen, kernel), base=_act(d, d["O"], dt, dev, gen))
    return build


def merge_builder(factors):
    """A merge form's inputs: the frozen weight W (O, I), then the adapter's factors."""
    def build(d, dt, dev, gen):
        return OrderedDict(W=_weight(d, dt, dev, gen), **factors(d, dt, dev, gen))
    return build


def rotation_builder(blocks, merge: bool):
    """OFT / BOFT inputs: the blocks, then the weight W (O, I) (merge) or the layer's output y."""
    def build(d, dt, dev, gen):
        out = blocks(d, dt, dev, gen)
        if merge:
            out["W"] = _weight(d, dt, dev, gen)
        else:
            out["y"] = _act(d, d["O"], dt, dev, gen)
        return out
    return build


def build_dora(d, dt, dev, gen):
    """x, the frozen weight W, the LoRA factors and the magnitude m (one per output row, or
    per input column on the "in" axis) near the norms of W + ΔW."""
    x, W = _act(d, d["I"], dt, dev, gen), _weight(d, dt, dev, gen)
    f = _lora_factors(d, dt, dev, gen)
    M = W.float() + GAMMA * (f["up"].float() @ f["down"].float())
    norm = torch.linalg.vector_norm(M, dim=1 if d["axis"] == "out" else 0, keepdim=True)
    m = (norm * (1 + 0.1 * _rand(gen, norm.shape, torch.float32, dev))).to(dt)
    return OrderedDict(x=x, W=W, **f, m=m)


def build_ia3(d, dt, dev, gen):
    return OrderedDict(x=_act(d, d["O"], dt, dev, gen), w=_rand(gen, (d["O"],), dt, dev, 0.1))


def eager_lokr(x, w1, w2, base):
    # as PEFT's LoKr layer: build ΔW = kron(w1, w2), then the layer's GEMM
    return base + GAMMA * F.linear(x, torch.kron(w1, w2))


def eager_lokr_factored(x, w1, w2a, w2b, base):
    return base + GAMMA * F.linear(x, torch.kron(w1, w2a @ w2b))


def eager_dora(x, W, up, down, m):
    delta = GAMMA * (up @ down)
    if m.shape[0] == 1:  # one magnitude per input column: LyCORIS's form, W' = M·m/‖M‖ (columns)
        M = W + delta
        return F.linear(x, M * (m / torch.linalg.vector_norm(M, dim=0, keepdim=True)))
    # per output row, as PEFT writes it: its DoRA term added to the base layer's output (the
    # norm not detached: LyCORIS's gradient)
    scale = m.reshape(1, -1) / torch.linalg.vector_norm(W + delta, dim=1).reshape(1, -1)
    base = F.linear(x, W)
    return base + ((scale - 1) * base + scale * (GAMMA * F.linear(F.linear(x, down), up)))


def eager_boft_merge(blocks, W):
    # the butterfly along W's output axis: each column of W is one vector of O channels
    return S.eager_boft(blocks, W.t()).t()


def eager_locon_conv(x, up, down, base):
    return base + GAMMA * F.conv2d(F.conv2d(x, down, padding=CONV_PAD), up)


def eager_loha_conv(x, a1, b1, a2, b2, base):
    dw = ((a1 @ b1.flatten(1)) * (a2 @ b2.flatten(1))).reshape(a1.shape[0], *b1.shape[1:])
    return base + F.conv2d(x, GAMMA * dw, padding=CONV_PAD)


def eager_lokr_conv(x, w1, w2, base):
    return base + F.conv2d(x, GAMMA * torch.kron(w1[:, :, None, None], w2), padding=CONV_PAD)


def _functional():
    """lycoris_ops.functional, imported at the first call (the peer's process imports this module)."""
    from lycoris_ops import functional
    return functional


@functools.lru_cache(maxsize=None)
def _dora_module(O, I, r, on_out, dtype):
    """A meta-device ``nn.DoRALinear`` of these sizes: every tensor its forward reads is passed in."""
    from lycoris_ops.nn import DoRALinear

    base = torch.nn.Linear(I, O, bias=False, device="meta", dtype=dtype)
    return DoRALinear(base, rank=r, alpha=GAMMA * r, wd_on_out=on_out)


def ours_dora(x, W, up, down, m):
    """``nn.DoRALinear`` (bias-free base, W frozen) over the cell's tensors (functional_call)."""
    mod = _dora_module(W.shape[0], W.shape[1], up.shape[1], m.shape[0] != 1, W.dtype)
    return torch.func.functional_call(mod, {"base.weight": W, "lora_up": up, "lora_down": down, "dora_scale": m},
                                      (x,))


def _spec_peer(name):
    """The peer readings bench/peer_lycoris.py makes for the bench spec ``name`` (same inputs)."""
    return lambda mods: PL.peer_candidates(mods)[name]


def _peer_dora(mods):
    locon, general = mods[0], mods[5]
    return [lambda x, W, up, down, m: F.linear(x, general.weight_decompose(
        W + locon.diff_weight(down, up, None, gamma=GAMMA), m, 1.0, wd_on_out=m.shape[0] != 1))]


def _peer_boft_merge(mods):
    boft = mods[4]
    return [lambda blocks, W: boft.diff_weight(W, blocks, None, constraint=None, scale=S.BOFT_SCALE),
            lambda blocks, W: boft.diff_weight(W, blocks, None, constraint=None, scale=S.BOFT_SCALE) - W]


_PAD = {"padding": CONV_PAD}


def _peer_loha_conv(mods):
    # its backward wants a tensor gamma on some tiers (as bench/peer_lycoris.py's loha_bypass)
    return [r for gamma in (lambda x: GAMMA, lambda x: PL._scalar(GAMMA, x)) for r in PL.both(
        lambda x, a1, b1, a2, b2, base, gamma=gamma: mods[1].bypass_forward_diff(
            x, base, b1, a1, b2, a2, None, None, gamma=gamma(x), extra_args=_PAD), 5)]


@dataclass(frozen=True)
class Form:
    build: Callable     # (dims, dtype, device, generator) -> the named inputs (OrderedDict)
    eager: Callable     # the formula a user writes, over the inputs in order
    ours: Callable      # our entry point, over the inputs in order
    grads: Tuple[str, ...]  # the inputs a training step differentiates
    peer: Optional[Callable] = None  # (lycoris-lora's functional modules) -> candidate readings


#: form -> how to build, run and check it; a form is an algorithm, LoKr's with a factored w2 apart
FORMS = {
    "lora": Form(bypass_builder(_lora_factors), S.eager_bypass,
                 lambda x, up, down, base: _functional().locon.bypass(x, up, down, GAMMA, base=base),
                 ("x", "up", "down"), _spec_peer("lora_bypass")),
    "loha": Form(bypass_builder(_hada_factors), S.eager_loha_bypass,
                 lambda x, a1, b1, a2, b2, base: _functional().loha.bypass(x, a1, b1, a2, b2, GAMMA, base=base),
                 ("x", "a1", "b1", "a2", "b2"), _spec_peer("loha_bypass")),
    "lokr": Form(bypass_builder(_kron_factors), eager_lokr,
                 lambda x, w1, w2, base: _functional().lokr.lokr_bypass(x, w1=w1, w2=w2, scale=GAMMA, base=base),
                 ("x", "w1", "w2"), _spec_peer("lokr_bypass")),
    "lokr-factored": Form(
        bypass_builder(_kron_factors), eager_lokr_factored,
        lambda x, w1, w2a, w2b, base: _functional().lokr.lokr_bypass(x, w1=w1, w2a=w2a, w2b=w2b, scale=GAMMA,
                                                                     base=base),
        ("x", "w1", "w2a", "w2b"),
        lambda mods: PL.both(lambda x, w1, w2a, w2b, base: mods[2].kron_bypass(x, w1, None, None, None, w2a, w2b,
                                                                               None, scale=GAMMA), 4)),
    "dora": Form(build_dora, eager_dora, ours_dora, ("x", "up", "down", "m"), _peer_dora),
    "oft": Form(rotation_builder(_oft_blocks, False), S.eager_oft_bypass,
                lambda blocks, y: _functional().diag_oft.bypass(blocks, y, diff=True),
                ("blocks", "y"), _spec_peer("oft_bypass")),
    "boft": Form(rotation_builder(_boft_blocks, False), S.eager_boft,
                 lambda blocks, y: _functional().boft.bypass(blocks, y, diff=True),
                 ("blocks", "y"), _spec_peer("boft")),
    "ia3": Form(build_ia3, S.eager_ia3,
                lambda x, w: _functional().ia3.ia3_scale(x, w, -1, S.IA3_GAMMA), ("x", "w")),
    "lora-merge": Form(merge_builder(_lora_factors), S.eager_merge_plain,
                       lambda W, up, down: _functional().locon.merge(up, down, GAMMA, base=W),
                       ("up", "down"), _spec_peer("lora_merge_plain")),
    "loha-merge": Form(merge_builder(_hada_factors), S.eager_merge_hada,
                       lambda W, a1, b1, a2, b2: _functional().loha.merge(a1, b1, a2, b2, GAMMA, base=W),
                       ("a1", "b1", "a2", "b2"), _spec_peer("lora_merge_hada")),
    "lokr-merge": Form(merge_builder(_kron_factors), S.eager_lokr_full,
                       lambda W, w1, w2: _functional().lokr.lokr_weight(w1=w1, w2=w2, scale=GAMMA, base=W),
                       ("w1", "w2"), _spec_peer("lokr_full_merge")),
    "lokr-merge-factored": Form(
        merge_builder(_kron_factors), S.eager_lokr_merge,
        lambda W, w1, w2a, w2b: _functional().lokr.lokr_weight(w1=w1, w2a=w2a, w2b=w2b, scale=GAMMA, base=W),
        ("w1", "w2a", "w2b"), _spec_peer("lokr_merge")),
    "oft-merge": Form(rotation_builder(_oft_blocks, True), S.eager_oft_merge,
                      lambda blocks, W: _functional().diag_oft.merge(blocks, W, diff=True),
                      ("blocks",), _spec_peer("oft_merge")),
    "boft-merge": Form(rotation_builder(_boft_blocks, True), eager_boft_merge,
                       lambda blocks, W: _functional().boft.merge(blocks, W, diff=True),
                       ("blocks",), _peer_boft_merge),
    "locon-conv": Form(
        bypass_builder(_lora_factors, (3, 3)), eager_locon_conv,
        lambda x, up, down, base: _functional().locon.bypass(x, up, down, GAMMA, base=base, padding=CONV_PAD),
        ("x", "up", "down"),
        lambda mods: PL.both(lambda x, up, down, base: mods[0].bypass_forward_diff(
            x, base, down, up, None, gamma=GAMMA, extra_args=_PAD), 3)),
    "loha-conv": Form(
        bypass_builder(_hada_factors, (3, 3)), eager_loha_conv,
        lambda x, a1, b1, a2, b2, base: _functional().loha.bypass(x, a1, b1, a2, b2, GAMMA, base=base,
                                                                  padding=CONV_PAD),
        ("x", "a1", "b1", "a2", "b2"),
        _peer_loha_conv),
    "lokr-conv": Form(
        bypass_builder(_kron_factors, (3, 3)), eager_lokr_conv,
        lambda x, w1, w2, base: _functional().lokr.lokr_bypass_conv(x, w1=w1, w2=w2, scale=GAMMA, base=base,
                                                                    padding=CONV_PAD),
        ("x", "w1", "w2"),
        lambda mods: PL.both(lambda x, w1, w2, base: mods[2].kron_bypass(
            x, w1, None, None, w2, None, None, None, scale=GAMMA, extra_args=_PAD), 3)),
}


# --------------------------------------------------------------------------- running

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="", help=f"comma list of {','.join(SETTINGS)} (a family name, e.g. lokr, "
                                               "takes its merge and conv forms too)")
    ap.add_argument("--model", default="", help="comma list of sd15,sdxl,flux,llama3-8b,bench")
    ap.add_argument("--layer", default="", help="only layers whose name contains this")
    ap.add_argument("--dtype", default="", help="comma list of bf16,fp16,fp32")
    ap.add_argument("--setting", default="", help="comma list of setting labels, e.g. dim64,f8,r16")
    ap.add_argument("--full", action="store_true", help="every layer at the default, then every setting everywhere")
    ap.add_argument("--limit", type=int, default=0, help="the first N cells (after the filters and --skip-done)")
    ap.add_argument("--seconds", type=float, default=None, help="time budget of the run (default 450; smoke 120)")
    ap.add_argument("--skip-done", default=None, help="a matrix JSON: its measured cells are kept, not rerun")
    ap.add_argument("--compile", default=None, choices=("subset", "all", "none"),
                    help="cells that get the compile column (default subset: the known-bad cells and each "
                         "algorithm's first; smoke: none)")
    ap.add_argument("--compile-share", type=float, default=0.2, help="share of --seconds kept for the compile pass")
    ap.add_argument("--no-peer", action="store_true", help="no lycoris-lora subprocess")
    ap.add_argument("--peer-share", type=float, default=0.2, help="share of --seconds kept for the peer")
    ap.add_argument("--peer-path", default=os.environ.get("LYCORIS_PEER_PATH", ""),
                    help="a directory put on the peer's PYTHONPATH (where lycoris-lora is installed)")
    ap.add_argument("--backend", default=None, help="pin our backend (lycoris_ops.use_backend), e.g. triton")
    ap.add_argument("--target-ms", type=float, default=None, help="device time per measurement (default 5)")
    ap.add_argument("--max-reps", type=int, default=None, help="reps per measurement at most (default 15)")
    ap.add_argument("--out", default=None, help="output directory (default bench/out/matrix)")
    ap.add_argument("--json", default=None, help="the cells' JSON (default <out>/matrix.json)")
    ap.add_argument("--results", default=None, help="file the dated summary is appended to (default bench/RESULTS.md)")
    ap.add_argument("--commit", default=os.environ.get("LYCORIS_BENCH_COMMIT", ""))
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32 + bf16: ours agrees with eager")
    ap.add_argument("--list", action="store_true", help="print the cells in run order and exit")
    ap.add_argument("--report", default=None, metavar="JSON", help="only the summary of a saved JSON")
    ap.add_argument("--profile", action="store_true",
                    help="profile the selected cells instead of timing them: ours and the eager formula, "
                         "fwd+bwd under torch.profiler, the top --top kernels of each by device time")
    ap.add_argument("--top", type=int, default=12, help="--profile: rows per table")
    ap.add_argument("--flagged", default=None, metavar="JSON",
                    help="only the cells a saved run flagged (ours < 1.0x the faster reference, fwd or f+b)")
    ap.add_argument("--plot", default=None, metavar="JSON", help="only the heat map of a saved JSON")
    ap.add_argument("--peer-only", default=None, metavar="JSON",
                    help="only the lycoris-lora column, for a saved JSON's measured cells that lack it (same "
                         "GPU model as the saved run: ours is not re-timed), in --seconds; writes --json")
    ap.add_argument("--plot-out", default=os.path.join(HERE, "matrix_heatmap.png"))
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke else ("cuda" if torch.cuda.is_available() else "cpu"))
    args.seconds = args.seconds if args.seconds is not None else (120.0 if smoke else 450.0)
    args.compile = args.compile or ("none" if smoke else "subset")
    args.target_ms = args.target_ms or (1.0 if smoke else 5.0)
    args.max_reps = args.max_reps or (1 if smoke else 15)
    args.min_reps = 1 if smoke else 3
    args.out = args.out or os.path.join(HERE, "out", "matrix")
    args.json = args.json or os.path.join(args.out, "matrix.json")
    if args.results is None:
        args.results = os.path.join(args.out, "RESULTS.md") if smoke else os.path.join(HERE, "RESULTS.md")
    return args


def select_cells(args, done=()) -> List[dict]:
    """The planned cells after the filters, without the ids in ``done`` (--skip-done), the
    first --limit of them."""
    if args.smoke:
        cells = plan(SMOKE_LAYERS, SMOKE_SWEEP, SMOKE_HEADLINE, SMOKE_MAIN_DTYPE, SMOKE_SUBSET_DTYPES, args.full)
    else:
        cells = plan(LAYERS, SWEEP, HEADLINE, MAIN_DTYPE, SUBSET_DTYPES, args.full)
    algos = [a for a in args.algo.split(",") if a]
    for a in algos:
        if a not in SETTINGS and not any(k.split("-")[0] == a for k in SETTINGS):
            raise SystemExit(f"unknown algorithm {a!r}; known: {', '.join(SETTINGS)}")
    if algos:
        cells = [c for c in cells if c["algo"] in algos or c["algo"].split("-")[0] in algos]
    if args.model:
        cells = [c for c in cells if c["model"] in args.model.split(",")]
    if args.layer:
        cells = [c for c in cells if args.layer in c["layer"]]
    if args.dtype:
        cells = [c for c in cells if c["dtype"] in args.dtype.split(",")]
    if args.setting:
        cells = [c for c in cells if c["setting"] in args.setting.split(",")]
    if args.flagged:  # worst first: --limit / a time limit keeps the cells furthest under the contract
        worst = {c["id"]: worst_ratio(r) for c in load_json(args.flagged)["cells"]
                 for r in [cell_ratios(c)] if below_contract(r)}
        cells = sorted((c for c in cells if c["id"] in worst), key=lambda c: worst[c["id"]])
    cells = [c for c in cells if c["id"] not in done]
    return cells[:args.limit] if args.limit else cells


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _col(res: dict, peak=None) -> dict:
    """The JSON part of a measure_column result: medians (ms), cold calls (s), errors, peak (MiB)."""
    out = {p: (res.get(p) or {}).get("median_ms") for p in PHASES}
    for k in ("cold_fwd_s", "cold_fwdbwd_s", "background_fwd_s", "background_fwdbwd_s", "rel_err", "grad_err",
              "error"):
        if res.get(k) is not None:
            out[k] = res[k]
    if peak is not None:
        out["peak_mib"] = peak / 2 ** 20
    return out


PHASES = ("fwd", "fwdbwd")


@contextlib.contextmanager
def fresh_caches():
    """Empty tuning, Triton and TileLang caches for this process and its children (the cold
    calls are cold), removed afterwards; the environment is restored."""
    root = tempfile.mkdtemp(prefix="lycoris-matrix-")
    names = {"LYCORIS_KERNEL_CACHE_DIR": "tuning", "TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang"}
    saved = {k: os.environ.get(k) for k in names}
    try:
        for k, sub in names.items():
            os.environ[k] = os.path.join(root, sub)
        yield root
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


class Matrix:
    def __init__(self, args, cells: List[dict], kept: List[dict], root: str):
        import lycoris_ops  # registers torch.ops.lycoris.* (after fresh_caches set the cache paths)

        self.lo, self.args, self.cells, self.kept, self.root = lycoris_ops, args, cells, kept, root
        self.dev = torch.device(args.device)
        self.gen = torch.Generator(device=self.dev).manual_seed(args.seed)
        torch.manual_seed(args.seed)
        self.tol = (B.SMOKE_TOL if args.smoke else B.CHECK_TOL)
        self.compiled: Dict[str, Callable] = {}
        self.context_lost = False
        self.bw = None
        self.timer = None
        self.notes: List[str] = []
        self.peer_version = "off" if args.no_peer else "n/a"
        self.dumped = 0.0
        if kept:
            self.notes.append(f"{len(kept)} cells measured by an earlier run, kept from {args.skip_done}")

    def backend(self):
        return self.lo.use_backend(self.args.backend) if self.args.backend else contextlib.nullcontext()

    def all_cells(self) -> List[dict]:
        return self.kept + self.cells

    def dump(self, every_s: float = 0.0) -> None:
        """Rewrite the JSON (atomically); with ``every_s``, only if the last write is older."""
        if time.perf_counter() - self.dumped < every_s:
            return
        self.dumped = time.perf_counter()
        os.makedirs(os.path.dirname(os.path.abspath(self.args.json)), exist_ok=True)
        doc = {"env": self.env, "bandwidth_Bps": self.bw, "peer_version": self.peer_version, "notes": self.notes,
               "argv": self.args.argv, "cells": self.all_cells()}
        tmp = self.args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, default=str)
        os.replace(tmp, self.args.json)

    def inputs(self, cell):
        """(form, named inputs, tensors in order with requires_grad set, grad indices, upstream grad)."""
        form = FORMS[cell["form"]]
        inp = form.build(cell["dims"], S.DTYPES[cell["dtype"]], self.dev, self.gen)
        names = list(inp)
        ts = [t.requires_grad_(k in form.grads) for k, t in inp.items()]
        grad_idx = [names.index(k) for k in form.grads]
        with torch.no_grad():
            probe = form.eager(*ts)
        G = _rand(self.gen, probe.shape, probe.dtype, self.dev)
        return form, inp, ts, grad_idx, G, probe

    def peak(self, fn, ts, grad_idx, G):
        targets = [ts[i] for i in grad_idx]
        try:
            return T.peak_bytes(lambda: torch.autograd.grad(fn(*ts), targets, G), self.dev)
        except Exception:  # the column's own error says why
            return None

    def run_cell(self, cell) -> None:
        """Pass 1: the eager formula, then ours (checked against it before it is timed)."""
        t0 = time.perf_counter()
        form, inp, ts, grad_idx, G, probe = self.inputs(cell)
        fl_f, fl_b = S.floor_bytes(ts, [probe], G, [ts[i] for i in grad_idx])
        del probe
        cell["floor_fwd_ms"], cell["floor_fwdbwd_ms"] = fl_f / self.bw * 1e3, fl_b / self.bw * 1e3
        e = T.measure_column(form.eager, ts, grad_idx, G, self.timer, self.dev)
        ref = (e.pop("out", None), e.pop("grads", None))
        cell["eager"] = _col(e, self.peak(form.eager, ts, grad_idx, G))
        if e.get("error"):  # nothing to check ours against, nothing to compare it with
            return
        ours = form.ours
        tol = self.tol[S.DTYPES[cell["dtype"]]]
        with self.backend():
            o = T.measure_column(ours, ts, grad_idx, G, self.timer, self.dev, ref=ref, tol=tol)
            o.pop("out", None), o.pop("grads", None)
            cell["ours"] = _col(o, None if o.get("error") else self.peak(ours, ts, grad_idx, G))
        cell["wall_s"] = time.perf_counter() - t0

    def run_compile(self, cell) -> None:
        """Pass 2: ``torch.compile(eager formula, dynamic=False)``, checked against eager."""
        t0 = time.perf_counter()
        form, inp, ts, grad_idx, G, probe = self.inputs(cell)
        del probe
        out = form.eager(*ts)
        ref = (out.detach(), torch.autograd.grad(out, [ts[i] for i in grad_idx], G))
        del out
        if cell["form"] not in self.compiled:
            self.compiled[cell["form"]] = torch.compile(form.eager, dynamic=False)
        fn = self.compiled[cell["form"]]
        # one compiled function serves every shape of its form: each shape is one more cache entry
        with torch._dynamo.config.patch(recompile_limit=4096, accumulated_recompile_limit=1 << 16):
            c = T.measure_column(fn, ts, grad_idx, G, self.timer, self.dev, ref=ref,
                                 tol=self.tol[S.DTYPES[cell["dtype"]]])
            c.pop("out", None), c.pop("grads", None)
            cell["compile"] = _col(c, None if c.get("error") else self.peak(fn, ts, grad_idx, G))
        cell["compile_wall_s"] = time.perf_counter() - t0

    def step(self, cell, what, fn, stop) -> bool:
        """One pass of one cell (``fn``) unless past ``stop`` or the context is lost; False = not run."""
        if time.perf_counter() > stop or self.context_lost:
            return False
        print(f"-- {what} {cell['id']} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)
        try:
            fn(cell)
        except Exception as exc:  # a cell that cannot even build is reported, the run goes on
            cell.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
            # a device fault (illegal address, ...) poisons the CUDA context: stop with what there is
            self.context_lost = "CUDA error" in str(exc)
        if self.dev.type == "cuda" and not self.context_lost:
            torch.cuda.empty_cache()
        self.dump(DUMP_EVERY_S)
        return True

    def compile_wanted(self) -> List[dict]:
        mode = self.args.compile
        done = [c for c in self.cells if c.get("ours")]
        if mode == "none":
            return []
        if mode == "all":
            return done
        first: Dict[str, dict] = {}
        for c in done:
            first.setdefault(c["algo"], c)
        return [c for c in done if c["prio"] == 0] + [c for c in first.values() if c["prio"] != 0]

    def run(self, env) -> None:
        a = self.args
        self.env = env
        self.t0 = time.perf_counter()
        end = self.t0 + a.seconds
        peer_share = 0.0 if a.no_peer else a.peer_share
        compile_share = 0.0 if a.compile == "none" else a.compile_share
        self.bw = T.copy_bandwidth(self.dev)
        self.timer = T.DeviceTimer(self.dev, target_ms=a.target_ms, min_reps=a.min_reps, max_reps=a.max_reps,
                                   warmup=0 if a.smoke else 1)
        self.dump()
        stop = end - (peer_share + compile_share) * a.seconds
        for cell in self.cells:
            if not self.step(cell, "ours", self.run_cell, stop):
                cell["skipped"] = "context lost" if self.context_lost else "time budget"
        self.dump()
        stop = end - peer_share * a.seconds
        for cell in self.compile_wanted():
            if not self.step(cell, "compile", self.run_compile, stop):
                self.notes.append(f"compile not run on {cell['id']} (time budget)")
        done = [c for c in self.cells if c.get("ours")]
        left = end - time.perf_counter()
        if not a.no_peer and done and not self.context_lost:
            if left >= PEER_MIN_S:
                self.run_peer(done, left - REPORT_S - PEER_GRACE_S)
            else:
                self.notes.append(f"peer not run: {left:.0f} s left of the budget")
        self.dump()

    def run_peer(self, cells, budget) -> None:
        """lycoris-lora over ``cells`` in one subprocess (bench/peer_lycoris.py --cells)."""
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        cells_path, path = os.path.join(a.out, "peer-cells.json"), os.path.join(a.out, "peer.json")
        with open(cells_path, "w") as f:
            json.dump([{k: c[k] for k in ("id", "form", "dims", "dtype")} for c in cells], f)
        cmd = [sys.executable, os.path.join(HERE, "peer_lycoris.py"), "--cells", cells_path, "--configs", "",
               "--device", a.device, "--json", path, "--max-seconds", str(budget), "--target-ms", str(a.target_ms),
               "--max-reps", str(a.max_reps), "--min-reps", str(a.min_reps), "--seed", str(a.seed)]
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()  # the peer shares the GPU
        print(f"-- peer: {len(cells)} cells, {budget:.0f} s", file=sys.stderr, flush=True)
        # killed at its budget + PEER_GRACE_S, REPORT_S before the end of the run (run())
        report = B.peer_subprocess(cmd, path, budget, a.peer_path, os.path.join(self.root, "peer-tuning"),
                                   grace=PEER_GRACE_S)
        self.peer_version = report.get("version", "n/a")
        if report.get("error"):
            self.notes.append(f"peer: {report['error']}")
        rows = {r.get("id"): r for r in report.get("results", [])}
        for c in cells:
            r = rows.get(c["id"])
            if r is None:
                continue
            if r.get("error"):
                c["peer"] = {"error": r["error"]}
                continue
            c["peer"] = _col(r.get("peer") or {})
            c["peer"].update(match=r.get("match"), rel_err=r.get("rel_err"), note=r.get("match_note"))
            c["peer_eager"] = _col(r.get("eager") or {})


# --------------------------------------------------------------------------- summary

def cell_ratios(c: dict) -> dict:
    """{phase: (best reference ms / ours ms, which reference)} against the faster of the eager
    formula and its compiled form (where compiled), and {peer_<phase>: peer ms / ours ms}."""
    o = c.get("ours") or {}
    out = {}
    if not o or o.get("error"):
        return out
    for ph in PHASES:
        if not o.get(ph):
            continue
        refs = [(c[k][ph], k) for k in ("eager", "compile") if (c.get(k) or {}).get(ph) and not c[k].get("error")]
        if refs:
            ms, name = min(refs)
            out[ph] = (ms / o[ph], name)
        p = c.get("peer") or {}
        if p.get(ph) and p.get("match"):
            out["peer_" + ph] = p[ph] / o[ph]
    return out


def below_contract(ratios: dict) -> bool:
    """Whether a cell's ``cell_ratios`` fall under MIN_RATIO, forward or forward+backward."""
    return any(ratios.get(p, (MIN_RATIO,))[0] < MIN_RATIO for p in PHASES)


def worst_ratio(ratios: dict) -> float:
    """The lower of a cell's forward and forward+backward ratios (inf where neither is measured)."""
    return min((ratios[p][0] for p in PHASES if p in ratios), default=float("inf"))


def failure(c: dict) -> str:
    """Why a cell has no valid result: ours or eager failed (or disagreed), or it did not build."""
    for col in ("ours", "eager"):
        err = (c.get(col) or {}).get("error")
        if err:
            return f"{col}: {err}"
    return "; ".join(c.get("errors", []))


def cold_s(c: dict) -> Optional[float]:
    """The cell's cold cost of ours: first forward + first forward+backward call."""
    o = c.get("ours") or {}
    parts = [o.get("cold_fwd_s"), o.get("cold_fwdbwd_s")]
    return sum(parts) if all(p is not None for p in parts) else None


def cell_label(c: dict) -> str:
    return f"{c['algo']} {c['model']} {c['layer']} {c['setting']}" + (f" [{c['sizes']}]" if c.get("sizes") else "") \
        + f" {c['dtype']}"


def _geomean(xs) -> Optional[float]:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _x(v, w=6) -> str:
    return f"{'-':>{w}}" if v is None else f"{v:>{w - 1}.2f}x"


def _worst(pairs) -> Optional[float]:
    return min(x for x, _ in pairs) if pairs else None


def algo_row(algo: str, cells: List[dict]) -> Tuple[str, List[tuple], List[dict], List[dict]]:
    """One algorithm's line of the summary table, and its (flagged (cell, ratios), cold > 2 s,
    wrong or failed) cells."""
    mine = [c for c in cells if c["algo"] == algo]
    measured = [c for c in mine if c.get("ours")]
    rs = [(c, cell_ratios(c)) for c in measured]
    f = [(r["fwd"][0], c) for c, r in rs if "fwd" in r]
    b = [(r["fwdbwd"][0], c) for c, r in rs if "fwdbwd" in r]
    both = [min(r["fwd"][0], r["fwdbwd"][0]) for c, r in rs if "fwd" in r and "fwdbwd" in r]
    colds = [(cold_s(c), c) for c in measured if cold_s(c) is not None]
    wrong = [c for c in measured if str(c["ours"].get("error", "")).startswith("disagrees")]
    failed = [c for c in mine if c not in wrong and failure(c)]
    flagged = [(c, r) for c, r in rs if below_contract(r)]
    line = (f"{algo:<20}{len(measured):>6} | {_x(_geomean(x for x, _ in f), 8)} {_x(_worst(f), 7)} | "
            f"{_x(_geomean(x for x, _ in b), 8)} {_x(_worst(b), 7)} | "
            f"{sum(x < MIN_RATIO for x in both):>5} {sum(x >= AIM_RATIO for x in both):>6} | "
            f"{_x(_geomean(r.get('peer_fwd') for _, r in rs), 8)} {_x(_geomean(r.get('peer_fwdbwd') for _, r in rs), 7)}"
            f" | {max((t for t, _ in colds), default=float('nan')):>8.2f} {sum(t > COLD_MAX_S for t, _ in colds):>4} | "
            f"{len(wrong):>5} {len(failed):>3}")
    return line, flagged, [c for t, c in colds if t > COLD_MAX_S], wrong + failed


def summary_lines(doc: dict) -> List[str]:
    cells = doc["cells"]
    env = doc.get("env") or {}
    bw = doc.get("bandwidth_Bps")
    measured = [c for c in cells if c.get("ours")]
    compiled = sum(1 for c in measured if (c.get("compile") or {}).get("fwd"))
    copy = f"{bw / 1e12:.2f} TB/s" if bw and env.get("gpu") != "cpu" else "n/a (cpu)"
    lines = [f"{env.get('date', '?')} | {env.get('gpu', '?')} | torch {env.get('torch', '?')}, triton "
             f"{env.get('triton', '?')}, tilelang {env.get('tilelang', '?')}, lycoris-lora {doc.get('peer_version')} | "
             f"commit {env.get('commit', '?')} | copy {copy} | backend {env.get('backend') or 'auto'}", "",
             f"cells: {len(measured)} measured of {len(cells)} ({compiled} with the compile column; the others "
             f"against eager alone); ratio = the faster of eager/compile ÷ ours (> 1: ours faster); peer = "
             f"lycoris-lora ÷ ours; cold = ours' first fwd + first fwd+bwd call (s)", ""]
    hdr = (f"{'algorithm':<20}{'cells':>6} | {'fwd geo':>8} {'worst':>7} | {'f+b geo':>8} {'worst':>7} | "
           f"{'<1.0x':>5} {'>=1.5x':>6} | {'peer fwd':>8} {'f+b':>7} | {'cold max':>8} {'>2s':>4} | wrong err")
    lines += [hdr, "-" * len(hdr)]
    flagged, slow, bad = [], [], []
    for algo in dict.fromkeys(c["algo"] for c in cells):
        line, fl, sl, bd = algo_row(algo, cells)
        lines.append(line)
        flagged, slow, bad = flagged + fl, slow + sl, bad + bd
    allr = [cell_ratios(c) for c in measured]
    lines.append(f"{'all':<20}{len(measured):>6} | {_x(_geomean(r['fwd'][0] for r in allr if 'fwd' in r), 8)} "
                 f"{'':>7} | {_x(_geomean(r['fwdbwd'][0] for r in allr if 'fwdbwd' in r), 8)}")
    lines += ["", f"flagged (ours < {MIN_RATIO:.1f}x the faster reference, fwd or f+b): {len(flagged)}"]
    for c, r in sorted(flagged, key=lambda t: worst_ratio(t[1])):
        parts = [f"{name} {r[p][0]:.2f}x: ours {c['ours'][p]:.3g} ms, {r[p][1]} {c[r[p][1]][p]:.3g}, floor "
                 f"{c.get('floor_' + p + '_ms', float('nan')):.3g}" for p, name in (("fwd", "fwd"), ("fwdbwd", "f+b"))
                 if p in r]
        lines.append(f"  {cell_label(c)}: " + "; ".join(parts))
    lines += ["", f"cold first call > {COLD_MAX_S:.0f} s (fwd + f+b): {len(slow)}"]
    lines += [f"  {cell_label(c)}: {c['ours']['cold_fwd_s']:.2f} + {c['ours']['cold_fwdbwd_s']:.2f} s" for c in slow]
    lines += ["", f"wrong or failed: {len(bad)}"]
    lines += [f"  {cell_label(c)}: {failure(c)}"[:300] for c in bad]
    why: Dict[str, List[dict]] = {}
    for c in cells:
        if not c.get("ours") and not failure(c):
            why.setdefault(c.get("skipped") or "not run", []).append(c)
    lines += [f"not measured ({k}): {len(v)} cells, e.g. {', '.join(x['id'] for x in v[:3])}"[:300]
              for k, v in why.items()]
    lines += [f"note: {n}"[:300] for n in doc.get("notes", [])]
    return lines


def write_report(doc: dict, args, json_path: str) -> List[str]:
    lines = summary_lines(doc)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "matrix-summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    env = doc.get("env") or {}
    entry = (f"\n## {env.get('date', '?')} — {env.get('gpu', '?')} — commit {env.get('commit', '?')} — shape matrix\n\n"
             f"`matrix.py {' '.join(doc.get('argv') or []) or '(defaults)'}`; JSON {os.path.basename(json_path)}\n\n"
             "```text\n" + "\n".join(lines) + "\n```\n")
    with open(os.path.join(args.out, "matrix-RESULTS-entry.md"), "w") as f:
        f.write(entry)
    if args.results:
        with open(args.results, "a") as f:
            f.write(entry)
    return lines


# --------------------------------------------------------------------------- heat map

HEAT_COLUMNS = (("fwd", "fwd ÷ best"), ("fwdbwd", "f+b ÷ best"), ("peer_fwd", "fwd ÷ peer"),
                ("peer_fwdbwd", "f+b ÷ peer"))


def heatmap(doc: dict, path: str) -> str:
    """Rows = the measured cells grouped by algorithm; columns = ours' ratios (reference ÷ ours,
    > 1 green) against the faster of eager/compile and against lycoris-lora; log2 colour scale
    clipped at 1/4x..4x, grey = not measured. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = [c for c in doc["cells"] if c.get("ours")]
    order = list(dict.fromkeys(c["algo"] for c in cells))
    cells.sort(key=lambda c: order.index(c["algo"]))
    grid = np.full((len(cells), len(HEAT_COLUMNS)), np.nan)
    for i, c in enumerate(cells):
        r = cell_ratios(c)
        for j, (key, _) in enumerate(HEAT_COLUMNS):
            v = r.get(key)
            v = v[0] if isinstance(v, tuple) else v
            if v:
                grid[i, j] = v
    height = max(3.0, 0.16 * len(cells) + 1.5)
    fig, ax = plt.subplots(figsize=(9, height))
    # fixed margins (tight_layout renders the figure once more: seconds for a few hundred rows)
    fig.subplots_adjust(left=0.34, right=0.84, top=1 - 0.9 / height, bottom=0.2 / height)
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#d0d0d0")
    im = ax.imshow(np.log2(grid), cmap=cmap, vmin=-2, vmax=2, aspect="auto", interpolation="nearest")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=5)
    ax.set_xticks(range(len(HEAT_COLUMNS)), [t for _, t in HEAT_COLUMNS], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(cells)), [cell_label(c).split(" ", 1)[1] for c in cells], fontsize=5)
    start = 0
    for algo in order:
        n = sum(c["algo"] == algo for c in cells)
        if start:
            ax.axhline(start - 0.5, color="k", lw=0.8)
        ax.text(len(HEAT_COLUMNS) - 0.4, start + n / 2 - 0.5, algo, fontsize=7, va="center")
        start += n
    cb = fig.colorbar(im, cax=fig.add_axes((0.93, 0.5 - 1.0 / height, 0.015, 2.0 / height)), ticks=[-2, -1, 0, 1, 2])
    cb.ax.set_yticklabels(["1/4x", "1/2x", "1x", "2x", "4x"], fontsize=6)
    env = doc.get("env") or {}
    ax.set_title(f"shape matrix: reference ÷ ours ({env.get('gpu', '?')}, commit {env.get('commit', '?')})",
                 fontsize=8, pad=18)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def try_heatmap(doc, path) -> str:
    try:
        return f"heat map: {heatmap(doc, path)}"
    except ImportError:
        return "heat map: skipped (no matplotlib; run --plot FILE.json where it is installed)"


# --------------------------------------------------------------------------- main

def smoke_failures(doc: dict, every_algo: bool) -> List[str]:
    """--smoke: every cell measured, ours agreeing with eager; with ``every_algo`` (no filter)
    every algorithm among them."""
    bad = []
    for c in doc["cells"]:
        o = c.get("ours") or {}
        if not o or o.get("error") or c.get("errors"):
            bad.append(f"{c['id']}: {o.get('error') or c.get('errors') or c.get('skipped') or 'not run'}")
    if every_algo:
        bad += [f"no cell of {a}" for a in sorted(set(SETTINGS) - {c["algo"] for c in doc["cells"]})]
    return bad


def profile_cells(args, cells) -> List[str]:
    """``--profile``: where a cell's time goes. Per cell, ours, the eager formula and its
    ``torch.compile`` (not on CPU runs) run three fwd+bwd steps (after two warm-up steps, which
    also tune and compile) under torch.profiler; each prints its kernels by self device time
    (CPU time on a CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    lines = []
    for cell in cells:
        form = FORMS[cell["form"]]
        inp = form.build(cell["dims"], S.DTYPES[cell["dtype"]], dev, gen)
        ts = [t.requires_grad_(k in form.grads) for k, t in inp.items()]
        targets = [t for k, t in zip(inp, ts) if k in form.grads]
        fns = [("ours", form.ours), ("eager", form.eager)]
        if cuda:
            fns.append(("compile", torch.compile(form.eager, dynamic=False)))
        for name, fn in fns:
            def step():
                out = fn(*ts)
                torch.autograd.grad(out, targets, torch.ones_like(out))
            try:
                for _ in range(2):
                    step()
                if cuda:
                    torch.cuda.synchronize(dev)
                with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                    for _ in range(3):
                        step()
                    if cuda:
                        torch.cuda.synchronize(dev)
                key = "self_device_time_total" if cuda else "self_cpu_time_total"
                table = prof.key_averages().table(sort_by=key, row_limit=args.top)
            except Exception as exc:  # one cell's failure should not hide the others' profiles
                table = f"failed: {type(exc).__name__}: {exc}"[:500]
            lines += [f"== {cell['id']} {cell['sizes']}: {name}, 3 steps fwd+bwd", table]
    return lines


def peer_only(args) -> int:
    """``--peer-only``: the lycoris-lora column of a saved run, added in a later process. The
    peer's ratio divides its time by ours from the saved run, so the GPU model must be the same."""
    doc = load_json(args.peer_only)
    env = B.environment(args)
    saved_gpu, gpu = (doc.get("env") or {}).get("gpu"), env.get("gpu")
    if saved_gpu != gpu:
        print(f"--peer-only: {args.peer_only} was measured on {saved_gpu!r}, this process runs on {gpu!r}: "
              "the peer's times would be divided by another GPU's; run the matrix here instead", file=sys.stderr)
        return 2
    todo = [c for c in doc["cells"] if c.get("ours") and not c.get("peer")]
    with fresh_caches() as root:
        m = Matrix(args, [], doc["cells"], root)
        m.env, m.bw = doc.get("env"), doc.get("bandwidth_Bps")
        m.notes = list(doc.get("notes") or []) + [
            f"lycoris-lora column added by --peer-only on {env.get('date')} (commit {env.get('commit')}, "
            f"{len(todo)} cells asked)"]
        m.args.argv = list(doc.get("argv") or []) + ["+ --peer-only"]
        t0 = time.perf_counter()
        if todo:
            m.run_peer(todo, args.seconds - REPORT_S - PEER_GRACE_S)
        m.dump()
        print(f"-- peer-only: {sum(bool(c.get('peer')) for c in todo)} of {len(todo)} cells in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = load_json(args.json)
    print("\n".join(write_report(out, args, args.json)), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        print(try_heatmap(load_json(args.plot), args.plot_out))
        return 0
    if args.report:
        lines = write_report(load_json(args.report), args, args.report)
        print("\n".join(lines))
        return 0
    if args.peer_only:
        return peer_only(args)
    with fresh_caches() as root:
        kept = [c for c in load_json(args.skip_done)["cells"] if c.get("ours")] if args.skip_done else []
        cells = select_cells(args, {c["id"] for c in kept})
        if args.list:
            for c in cells:
                print(f"{c['prio']} {c['id']} {c['sizes']}")
            print(f"{len(cells)} cells")
            return 0
        if args.profile:
            print("\n".join(profile_cells(args, cells)), flush=True)
            return 0
        env = B.environment(args)
        env["backend"] = args.backend or "auto"
        threads = torch.get_num_threads()
        if args.device == "cpu":
            torch.set_num_threads(1)  # CPU runs make no timing claims
        try:
            m = Matrix(args, cells, kept, root)
            m.run(env)
        finally:
            torch.set_num_threads(threads)
    doc = load_json(args.json)
    lines = write_report(doc, args, args.json)
    lines.append(try_heatmap(doc, os.path.join(args.out, "matrix_heatmap.png")))
    lines.append(f"json: {args.json}; summary appended to {args.results}")
    rc = 0
    if args.smoke:
        bad = smoke_failures(doc, not (args.algo or args.model or args.layer or args.dtype or args.setting
                                       or args.limit))
        lines.append("smoke: " + ("OK, every cell agrees with its eager formula" if not bad else
                                  f"{len(bad)} problem(s):\n  " + "\n  ".join(bad)))
        rc = 1 if bad else 0
    print("\n".join(lines), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
