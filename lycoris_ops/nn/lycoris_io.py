"""LyCORIS (lycoris-lora) networks as ``lycoris_ops.nn`` adapters and back:
:func:`load_lycoris_state_dict` builds the adapters from a network's state dict or file,
:func:`lycoris_state_dict` writes them in LyCORIS's format. The format's tensor names
and layouts per algorithm live here, in the loader's builders and the saver's inverse."""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lycoris_ops.nn.base import AdapterModule, RankAdapter, check_conv, out_in
from lycoris_ops.nn.dora import DoHaConv2d, DoHaLinear, DoKrConv2d, DoKrLinear, DoRAConv2d, DoRALinear, WeightDecomposed
from lycoris_ops.nn.full import FullConv2d, FullLinear, NormAdapter
from lycoris_ops.nn.ia3 import IA3Conv2d, IA3Linear
from lycoris_ops.nn.loha import LoHaConv2d, LoHaLinear
from lycoris_ops.nn.lokr import LOKR_FACTORS, LoKrConv2d, LoKrLinear
from lycoris_ops.nn.lora import DyLoRAConv2d, DyLoRALinear, GLoRAConv2d, GLoRALinear, LoRAConv2d, LoRALinear
from lycoris_ops.nn.model import adapters
from lycoris_ops.nn.oft import BOFTConv2d, BOFTLinear, OFTConv2d, OFTLinear


#: LyCORIS algorithm -> (the tensor names that identify a module of it, every tensor name it holds);
#: "oft" is diag-OFT (3-D oft_blocks) or BOFT (4-D)
_LYCORIS_ALGOS: Dict[str, Tuple[frozenset, frozenset]] = {
    "locon": (frozenset({"lora_up.weight"}),
              frozenset({"lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha", "dora_scale"})),
    "loha": (frozenset({"hada_w1_a"}),
             frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "alpha",
                        "dora_scale"})),
    "lokr": (frozenset({"lokr_w1", "lokr_w1_a"}),
             frozenset({"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "alpha",
                        "dora_scale"})),
    "oft": (frozenset({"oft_blocks"}), frozenset({"oft_blocks", "rescale", "alpha"})),
    "ia3": (frozenset({"on_input"}), frozenset({"weight", "on_input"})),
    "full": (frozenset({"diff"}), frozenset({"diff", "diff_b"})),
    "norm": (frozenset({"w_norm"}), frozenset({"w_norm", "b_norm"})),
    "glora": (frozenset({"a1.weight"}), frozenset({"a1.weight", "a2.weight", "b1.weight", "b2.weight", "bm.weight",
                                                   "alpha"})),
    "tlora": (frozenset({"lambda_layer"}), frozenset({"lambda_layer", "q_layer.weight", "p_layer.weight", "alpha"})),
}

#: ``algo=`` hint (lycoris-lora's algorithm names) -> the algorithm its tensors show
_ALGO_HINTS = {"lora": "locon", "locon": "locon", "dylora": "locon", "loha": "loha", "lokr": "lokr",
               "diag-oft": "diag-oft", "boft": "boft", "ia3": "ia3", "full": "full", "glora": "glora"}

#: lycoris-lora's DyLoRA block size when the network was made without one
_DYLORA_BLOCK_SIZE = 4


class LycorisLoadResult(NamedTuple):
    """What ``load_lycoris_state_dict(..., strict=False)`` returns."""

    model: nn.Module
    #: how many layers got an adapter
    adapters: int
    #: keys whose module name is no layer of the model
    unmatched_keys: List[str]
    #: keys of an adapted (or unidentifiable) module that no adapter reads
    unused_keys: List[str]


def _fail(msg: str) -> ValueError:
    return ValueError(f"lycoris_ops.nn.load_lycoris_state_dict: {msg}")


def _listing(keys: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:most])
    return f"[{shown}{f', ... ({len(keys) - most} more)' if len(keys) > most else ''}]"


def _read_lycoris_file(path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(tensors, metadata) of a ``.safetensors`` file, or of a ``torch.save``'d dict (no metadata)."""
    if str(path).endswith(".safetensors"):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ImportError("lycoris_ops.nn.load_lycoris_state_dict: reading a .safetensors file needs the "
                              "safetensors package (pip install safetensors)") from e
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise _fail(f"{path} holds a {type(sd).__name__}, not a state dict")
    return sd, {}


def _dylora_marker(metadata: Dict[str, str]) -> Optional[int]:
    """The DyLoRA block size when the metadata says a lycoris-lora DyLoRA network made the file
    (kohya's trainer writes ``ss_network_module`` and the network's arguments as the JSON
    ``ss_network_args``), else None."""
    if "lycoris" not in str(metadata.get("ss_network_module", "")):
        return None
    try:
        args = json.loads(metadata.get("ss_network_args") or "{}")
    except ValueError as e:
        raise _fail(f"the metadata's ss_network_args is not JSON: {e}") from e
    if not isinstance(args, dict) or str(args.get("algo", "")).lower() != "dylora":
        return None
    try:
        return int(args.get("block_size") or _DYLORA_BLOCK_SIZE)
    except (TypeError, ValueError) as e:
        raise _fail(f"the metadata's DyLoRA block_size {args.get('block_size')!r} is not an integer") from e


def _identify(tensors: Iterable[str]) -> List[str]:
    """The LyCORIS algorithms whose identifying tensors a module's tensors hold."""
    names = set(tensors)
    return [algo for algo, (ids, _) in _LYCORIS_ALGOS.items() if names & ids]


def load_lycoris_state_dict(model: nn.Module, state_dict, prefixes: Sequence[str] = (
        "lycoris_", "lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", ""), multiplier: float = 1.0, *,
        strict: bool = True, algo: Optional[str] = None, block_size: Optional[int] = None,
        metadata: Optional[Dict[str, str]] = None):
    """Build our adapters from a LyCORIS (lycoris-lora) network's state dict, without importing
    LyCORIS; the adapters compute what lycoris-lora's modules compute (fp32 rounding aside).

    ``state_dict``: a dict of tensors, or the path of a ``.safetensors`` file (tensors and
    metadata) or of a ``torch.save``'d dict. LyCORIS names a module's tensors
    ``<prefix><module path with '.'→'_'>.<tensor>``; each such module of ``model`` (``prefixes``
    tried in order) gets the adapter its tensors name:

    - LoCon (``lora_down.weight``/``lora_up.weight``/``alpha``, ``lora_mid.weight`` for a conv's
      tucker core), DoRA with ``dora_scale`` (per output or input channel, by its shape);
    - LoHa (``hada_w1_a`` ..., ``hada_t1``/``hada_t2``), LoKr (``lokr_w1``/``lokr_w1_a``/
      ``lokr_w1_b``/``lokr_w2``/``lokr_w2_a``/``lokr_w2_b``/``lokr_t2``), each with ``dora_scale``
      too (``DoHa*`` / ``DoKr*``);
    - diag-OFT (3-D ``oft_blocks``) and BOFT (4-D), ``rescale``, ``alpha`` the constraint
      (lycoris-lora bounds ‖Q‖ by ``alpha × out_features``);
    - IA3 (``weight``/``on_input``; the bias is not scaled: ``scale_bias=False``), Full
      (``diff``/``diff_b``), GLoRA (``a1.weight``/``a2.weight``/``b1.weight``/``b2.weight``/
      ``alpha``), and for an affine ``LayerNorm`` / ``GroupNorm`` Norms (``w_norm``/``b_norm``);
    - DyLoRA: its files hold LoCon's tensors, its scale is ``alpha / (rank / block_size)``
      (LoCon's is ``alpha / rank``). A file is DyLoRA when its metadata says so (kohya's trainer
      records ``ss_network_args`` ``{"algo": "dylora", "block_size": ...}``) or when the caller
      passes ``algo="dylora"``; else LoCon tensors load as LoCon. ``block_size``: the argument,
      else the metadata's, else lycoris-lora's default 4.

    ``algo``: the network's algorithm (lycoris-lora's name: ``"lora"``/``"locon"``, ``"loha"``,
    ``"lokr"``, ``"dylora"``, ``"glora"``, ``"diag-oft"``, ``"boft"``, ``"ia3"``, ``"full"``) when
    the caller knows it; every module's tensors must agree (norms excepted, lycoris-lora adds them
    to any network), else ValueError. ``metadata``: the file's metadata when ``state_dict`` is a dict.

    Every key must be used: with ``strict`` (default) keys naming no layer of the model and
    tensors no adapter reads raise a ValueError listing them, and nothing changes; with
    ``strict=False`` the rest loads and a :class:`LycorisLoadResult` (the model, the number of
    adapters, those keys) is returned. What cannot be built exactly raises in both modes, naming
    the layer: a layer type without an adapter here (Conv1d, Conv3d, grouped convs, ...), T-LoRA
    (its rank mask depends on the diffusion timestep), GLoRA's tucker core ``bm.weight``
    (lycoris-lora cannot build it either), tensors of another layer's shape, a missing tensor.

    Returns the model (a new object only if the model itself is adapted), or with
    ``strict=False`` a :class:`LycorisLoadResult`.
    """
    if isinstance(state_dict, (str, os.PathLike)):
        state_dict, file_metadata = _read_lycoris_file(state_dict)
        metadata = file_metadata if metadata is None else metadata
    dylora_block = _dylora_marker(metadata or {})
    if algo is not None:
        algo = str(algo).lower()
        if algo not in _ALGO_HINTS:
            raise _fail(f"algo must be one of {sorted(_ALGO_HINTS)}, got {algo!r}")
        if dylora_block is not None and algo != "dylora":
            raise _fail(f"algo={algo!r}, but the file's metadata says a DyLoRA network made it")
        if algo == "dylora" and dylora_block is None:
            dylora_block = _DYLORA_BLOCK_SIZE
    if block_size is not None:
        if dylora_block is None:
            raise _fail("block_size applies to DyLoRA files only (pass algo='dylora')")
        dylora_block = int(block_size)

    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    keys: Dict[str, List[str]] = {}  # the file's keys per module key, for the lists below
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            raise _fail(f"{k!r} is a {type(v).__name__}, not a tensor")
        mod_key, _, t = k.partition(".")
        groups.setdefault(mod_key, {})[t] = v
        keys.setdefault(mod_key, []).append(k)
    layers = {}
    for name, mod in model.named_modules():
        layers.setdefault(name.replace(".", "_"), (name, mod))
    unmatched: List[str] = []
    unused: List[str] = []
    built: Dict[str, AdapterModule] = {}
    owner: Dict[str, str] = {}  # layer -> the module key its tensors came under
    for mod_key, sd in groups.items():
        hit = next((layers[mod_key[len(p):]] for p in prefixes
                    if mod_key.startswith(p) and mod_key[len(p):] in layers), None)
        if hit is None:
            unmatched += keys[mod_key]
            continue
        name, mod = hit
        if name in owner:
            raise _fail(f"{name or 'the model'} has tensors under two module keys: {owner[name]!r} and {mod_key!r}")
        owner[name] = mod_key
        found = _identify(sd)
        if not found:
            unused += keys[mod_key]
            continue
        if len(found) > 1:
            raise _fail(f"{name or 'the model'}: tensors of several LyCORIS algorithms {found} ({sorted(sd)})")
        lyco = found[0]
        if lyco == "oft":
            blocks = sd["oft_blocks"]
            lyco = {3: "diag-oft", 4: "boft"}.get(blocks.dim())
            if lyco is None:
                raise _fail(f"{name}: oft_blocks must be 3-D (diag-OFT) or 4-D (BOFT), got {tuple(blocks.shape)}")
        if algo is not None and lyco != "norm" and _ALGO_HINTS[algo] != lyco:
            raise _fail(f"algo={algo!r}, but {name}'s tensors are LyCORIS' {lyco!r} ({sorted(sd)})")
        used = {t: v for t, v in sd.items() if t in _LYCORIS_ALGOS[found[0]][1]}
        unused += [f"{mod_key}.{t}" for t in sd if t not in used]
        built[name] = _build_adapter(name, mod, lyco, used, multiplier, dylora_block if lyco == "locon" else None)
    if strict and (unmatched or unused):
        parts = []
        if unmatched:
            parts.append(f"{len(unmatched)} key(s) name no layer of the model (prefixes {list(prefixes)}): "
                         f"{_listing(sorted(unmatched))}")
        if unused:
            parts.append(f"{len(unused)} tensor(s) no adapter reads: {_listing(sorted(unused))}")
        raise _fail("; ".join(parts) + " (strict=False loads the rest and returns these keys)")
    for name, ad in built.items():
        if name == "":
            model = ad
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, ad)
    if strict:
        return model
    return LycorisLoadResult(model, len(built), sorted(unmatched), sorted(unused))


def _build_adapter(name, mod, lyco, sd, multiplier, dylora_block) -> AdapterModule:
    """The adapter for one layer from its LyCORIS tensors, checked to make that layer's weight;
    it records each tensor's shape and dtype (``lycoris_state_dict`` writes them back so)."""
    where = f"{name or 'the model'} ({type(mod).__name__}"
    if isinstance(mod, AdapterModule):
        raise _fail(f"{where}) already has an adapter: load into the plain model")
    norm = isinstance(mod, (nn.LayerNorm, nn.GroupNorm))
    if not (norm or isinstance(mod, (nn.Linear, nn.Conv2d))):
        raise _fail(f"{where}) has LyCORIS' {lyco!r} tensors, but lycoris_ops.nn adapts only Linear, Conv2d, "
                    f"LayerNorm and GroupNorm layers")
    if norm != (lyco == "norm"):
        raise _fail(f"{where}): a {type(mod).__name__} with the tensors of LyCORIS' {lyco!r} algorithm "
                    f"({sorted(sd)})")
    if lyco == "tlora":
        raise _fail(f"{where}): T-LoRA is not supported (its rank mask depends on the diffusion timestep, and "
                    f"its base factors are not in the file)")
    where += f" with weight {tuple(mod.weight.shape)})"
    try:
        ad = _BUILDERS[lyco](mod, sd, multiplier, dylora_block)
        with torch.no_grad():  # the tensors must make this layer's weight (not another model's)
            merged = ad.merged_weight()[0]
        if merged.shape != mod.weight.shape:
            raise RuntimeError(f"they make a weight of shape {tuple(merged.shape)}")
    except (RuntimeError, KeyError, TypeError, ValueError) as e:  # shapes of another model, a missing tensor
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        raise _fail(f"{where} cannot take the LyCORIS tensors {shapes}: {type(e).__name__}: {e}") from e
    ad._lyco_layout = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    return ad


def _alpha(sd) -> Optional[float]:
    return float(sd["alpha"]) if "alpha" in sd else None


def _set(ad: AdapterModule, attr: str, t: torch.Tensor) -> None:
    """``ad.attr`` = the stored tensor in the parameter's own shape (same leading size and element
    count: LyCORIS keeps conv factors flat or 4-D), dtype and device."""
    like = getattr(ad, attr)
    if t.dim() == 0 or t.shape[0] != like.shape[0] or t.numel() != like.numel():
        raise ValueError(f"{attr} must have shape {tuple(like.shape)} here (or the same leading size and element "
                         f"count), got {tuple(t.shape)}")
    setattr(ad, attr, nn.Parameter(t.detach().reshape(like.shape).to(device=like.device, dtype=like.dtype).clone()))


def _dora_on_out(mod, ds: torch.Tensor) -> bool:
    """dora_scale holds one norm per output channel ((O, 1, …)) or per input channel ((1, I, …))."""
    O, I = out_in(mod)
    if ds.dim() >= 1 and ds.shape[0] == O and ds.numel() == O:
        return True
    if ds.dim() >= 2 and ds.shape[1] == I and ds.numel() == I:
        return False
    raise ValueError(f"dora_scale must be (O, 1, ...) = ({O}, 1, ...) or (1, I, ...) = (1, {I}, ...), "
                     f"got {tuple(ds.shape)}")


def _from_locon(mod, sd, multiplier, dylora_block):
    down = sd["lora_down.weight"]
    r, alpha = down.shape[0], _alpha(sd)
    conv = isinstance(mod, nn.Conv2d)
    tucker = "lora_mid.weight" in sd
    if tucker and not conv:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    if dylora_block is not None:
        if {"dora_scale", "lora_mid.weight"} & set(sd):
            raise ValueError("a DyLoRA module has neither dora_scale nor lora_mid.weight")
        ad = (DyLoRAConv2d if conv else DyLoRALinear)(mod, r, alpha, multiplier, block_size=dylora_block)
    elif "dora_scale" in sd:
        on_out = _dora_on_out(mod, sd["dora_scale"])
        ad = (DoRAConv2d(mod, r, alpha, multiplier, wd_on_out=on_out, use_tucker=tucker) if conv
              else DoRALinear(mod, r, alpha, multiplier, wd_on_out=on_out))
        _set(ad, "dora_scale", sd["dora_scale"])
    else:
        ad = (LoRAConv2d(mod, r, alpha, multiplier, use_tucker=tucker) if conv
              else LoRALinear(mod, r, alpha, multiplier))
    if tucker:
        if ad.lora_mid is None:
            raise ValueError("lora_mid.weight on a 1x1 conv (LyCORIS makes tucker cores for larger kernels only)")
        _set(ad, "lora_mid", sd["lora_mid.weight"])
    _set(ad, "lora_down", down)
    _set(ad, "lora_up", sd["lora_up.weight"])
    return ad


def _from_loha(mod, sd, multiplier, _):
    r, alpha = sd["hada_w1_b"].shape[0], _alpha(sd)
    conv = isinstance(mod, nn.Conv2d)
    tucker = "hada_t1" in sd or "hada_t2" in sd
    if tucker and not conv:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    on_out = _dora_on_out(mod, sd["dora_scale"]) if "dora_scale" in sd else None
    if conv:
        ad = (LoHaConv2d(mod, r, alpha, multiplier, use_tucker=tucker) if on_out is None
              else DoHaConv2d(mod, r, alpha, multiplier, wd_on_out=on_out, use_tucker=tucker))
        if tucker and ad.hada_t1 is None:
            raise ValueError("hada_t1/hada_t2 on a 1x1 conv (LyCORIS makes tucker cores for larger kernels only)")
    else:
        ad = LoHaLinear(mod, r, alpha, multiplier) if on_out is None else DoHaLinear(mod, r, alpha, multiplier, on_out)
    names = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") + (("hada_t1", "hada_t2") if tucker else ())
    for k in names + (("dora_scale",) if on_out is not None else ()):
        _set(ad, k, sd[k])
    return ad


def _from_lokr(mod, sd, multiplier, _):
    conv = isinstance(mod, nn.Conv2d)
    if conv:
        check_conv(mod, "load_lycoris_state_dict")
    elif "lokr_t2" in sd:
        raise ValueError(f"tucker factors on a {type(mod).__name__} (LyCORIS builds them for convolutions only)")
    on_out = _dora_on_out(mod, sd["dora_scale"]) if "dora_scale" in sd else None
    cls = (LoKrConv2d if conv else LoKrLinear) if on_out is None else (DoKrConv2d if conv else DoKrLinear)
    ad = cls.__new__(cls)  # the factors' shapes come from the file, not from a factorization
    rank = next((sd[k].shape[0] for k in ("lokr_w1_b", "lokr_w2_b") if k in sd), 1)
    RankAdapter.__init__(ad, mod, rank, _alpha(sd), multiplier)  # (the scale ignores alpha when no side is factored)
    names = []
    for n, k in LOKR_FACTORS.items():
        if k in sd:
            t = sd[k]
            if conv and k == "lokr_w2_b" and "lokr_t2" not in sd:  # LyCORIS stores it (r, d·kh·kw)
                t = t.reshape(t.shape[0], -1, *mod.kernel_size)
            setattr(ad, k, nn.Parameter(t.detach().to(device=mod.weight.device, dtype=mod.weight.dtype).clone()))
            names.append(n)
    ad._names = tuple(names)
    if on_out is not None:
        ad._init_decompose(on_out)
        _set(ad, "dora_scale", sd["dora_scale"])
    return ad


def _from_oft(mod, sd, multiplier, _):
    blocks = sd["oft_blocks"]
    out = out_in(mod)[0]
    constraint = float(sd["alpha"]) * out if "alpha" in sd else 0.0  # lycoris-lora: constraint × out_dim
    rescaled = "rescale" in sd
    conv = isinstance(mod, nn.Conv2d)
    if blocks.dim() == 3:
        ad = (OFTConv2d if conv else OFTLinear)(mod, blocks.shape[1], multiplier, constraint, rescaled)
    else:
        ad = (BOFTConv2d if conv else BOFTLinear)(mod, blocks.shape[2], blocks.shape[0], multiplier, constraint,
                                                  rescaled)
    _set(ad, "oft_blocks", blocks)
    if rescaled:
        _set(ad, "rescale", sd["rescale"])
    return ad


def _from_ia3(mod, sd, multiplier, _):
    cls = IA3Conv2d if isinstance(mod, nn.Conv2d) else IA3Linear
    ad = cls(mod, multiplier, bool(sd["on_input"]), scale_bias=False)  # LyCORIS's IA3 leaves the bias unscaled
    _set(ad, "ia3_weight", sd["weight"].reshape(-1))
    return ad


def _from_full(mod, sd, multiplier, _):
    ad = (FullConv2d if isinstance(mod, nn.Conv2d) else FullLinear)(mod, multiplier)
    _set(ad, "diff", sd["diff"])
    if "diff_b" in sd:
        if ad.diff_b is None:
            raise ValueError("diff_b for a layer without a bias")
        _set(ad, "diff_b", sd["diff_b"])
    return ad


def _from_norm(mod, sd, multiplier, _):
    ad = NormAdapter(mod, multiplier)
    _set(ad, "w_norm", sd["w_norm"])
    if "b_norm" in sd:
        if ad.b_norm is None:
            raise ValueError("b_norm for a norm without a bias")
        _set(ad, "b_norm", sd["b_norm"])
    return ad


def _from_glora(mod, sd, multiplier, _):
    if "bm.weight" in sd:
        raise ValueError("GLoRA with a tucker core (bm.weight) is not supported (lycoris-lora cannot build it either)")
    cls = GLoRAConv2d if isinstance(mod, nn.Conv2d) else GLoRALinear
    ad = cls(mod, sd["a2.weight"].shape[0], _alpha(sd), multiplier)
    for k in ("a1", "a2", "b1", "b2"):
        _set(ad, k, sd[f"{k}.weight"])
    return ad


#: LyCORIS algorithm -> builder(layer, its tensors, multiplier, DyLoRA block size or None)
_BUILDERS = {"locon": _from_locon, "loha": _from_loha, "lokr": _from_lokr, "diag-oft": _from_oft,
             "boft": _from_oft, "ia3": _from_ia3, "full": _from_full, "norm": _from_norm, "glora": _from_glora}


def lycoris_state_dict(model: nn.Module, prefix: str = "lycoris_") -> Dict[str, torch.Tensor]:
    """The adapters of ``model`` as a LyCORIS network state dict: the inverse of
    :func:`load_lycoris_state_dict` (load a network, train or edit it on the ops, save it for
    lycoris-lora or any LyCORIS tool). Keys ``<prefix><module path with '.'→'_'>.<tensor>``
    with lycoris-lora's tensor names, shapes and dtypes (a tensor read by the loader keeps the
    shape and dtype it had in the file); lycoris-lora loads them into the same network and
    computes the same outputs. Detached copies.

    An adapter LyCORIS has no form for raises a ValueError naming it: IA3 with
    ``scale_bias=True`` on a layer with a bias (LyCORIS's IA3 leaves the bias unscaled; build it
    with ``scale_bias=False``)."""
    out: Dict[str, torch.Tensor] = {}
    for name, ad in adapters(model):
        head = prefix + name.replace(".", "_") + "."
        layout = getattr(ad, "_lyco_layout", {})
        shapes = _lycoris_shapes(ad)
        for k, t in _lycoris_tensors(ad).items():
            t = t.detach().clone()
            if k in layout:
                shape, dtype = layout[k]
                t = t.reshape(shape).to(dtype)
            elif k in shapes:
                t = t.reshape(shapes[k])
            out[head + k] = t
    return out


def _lycoris_tensors(ad: AdapterModule) -> Dict[str, torch.Tensor]:
    """LyCORIS tensor name -> tensor (the parameters themselves, in the module's shapes), for one adapter."""
    if isinstance(ad, (LoRALinear, LoRAConv2d)):
        t = {"lora_down.weight": ad.lora_down, "lora_up.weight": ad.lora_up, "alpha": ad.alpha}
        if getattr(ad, "lora_mid", None) is not None:
            t["lora_mid.weight"] = ad.lora_mid
    elif isinstance(ad, LoHaLinear):
        t = {k: getattr(ad, k) for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
        if getattr(ad, "hada_t1", None) is not None:
            t.update(hada_t1=ad.hada_t1, hada_t2=ad.hada_t2)
        t["alpha"] = ad.alpha
    elif isinstance(ad, LoKrLinear):
        t = dict({LOKR_FACTORS[n]: getattr(ad, LOKR_FACTORS[n]) for n in ad._names}, alpha=ad.alpha)
    elif isinstance(ad, GLoRALinear):
        t = {"a1.weight": ad.a1, "a2.weight": ad.a2, "b1.weight": ad.b1, "b2.weight": ad.b2, "alpha": ad.alpha}
    elif isinstance(ad, OFTLinear):
        t = {"oft_blocks": ad.oft_blocks}
        if ad.rescale is not None:
            t["rescale"] = ad.rescale
        # lycoris-lora saves the constraint over out_features, 0 for none (a file read without it stays so)
        if ad.constraint or "alpha" in getattr(ad, "_lyco_layout", {"alpha": None}):
            t["alpha"] = torch.tensor(ad.constraint / out_in(ad.base)[0], dtype=torch.float32)
    elif isinstance(ad, IA3Linear):
        if ad.scale_bias and not ad.train_on_input and ad.base.bias is not None:
            raise ValueError("lycoris_ops.nn.lycoris_state_dict: an IA3 adapter with scale_bias=True on a layer "
                             "with a bias has no LyCORIS form (LyCORIS's IA3 leaves the bias unscaled; build the "
                             "adapter with scale_bias=False)")
        t = {"weight": ad.ia3_weight, "on_input": torch.tensor(int(ad.train_on_input))}
    elif isinstance(ad, FullLinear):
        t = {"diff": ad.diff} if ad.diff_b is None else {"diff": ad.diff, "diff_b": ad.diff_b}
    elif isinstance(ad, NormAdapter):
        t = {"w_norm": ad.w_norm} if ad.b_norm is None else {"w_norm": ad.w_norm, "b_norm": ad.b_norm}
    else:
        raise TypeError(f"lycoris_ops.nn.lycoris_state_dict: no LyCORIS form for {type(ad).__name__}")
    if isinstance(ad, (DoRALinear, WeightDecomposed)):
        t["dora_scale"] = ad.dora_scale
    return t


def _lycoris_shapes(ad: AdapterModule) -> Dict[str, Tuple[int, ...]]:
    """The tensors lycoris-lora shapes otherwise than the module: a conv LoKr's w2_b flattened
    (r, d·kh·kw), a conv's per-channel OFT rescale and IA3 weight with the weight's rank."""
    w = ad.base.weight
    if isinstance(ad, LoKrConv2d) and "w2b" in ad._names and "t2" not in ad._names:
        return {"lokr_w2_b": (ad.lokr_w2_b.shape[0], -1)}
    if isinstance(ad, (OFTConv2d, BOFTConv2d)) and ad.rescale is not None:
        return {"rescale": (w.shape[0],) + (1,) * (w.dim() - 1)}
    if isinstance(ad, IA3Conv2d):
        return {"weight": (1, -1) + (1,) * (w.dim() - 2)}
    return {}
