"""Adapters on a whole model: :data:`ADAPTERS` (the adapter class per kind and layer type),
:func:`add_adapters`, :func:`adapters`, :func:`merge_adapters`, :func:`unmerge_adapters`,
:func:`remove_adapters`, :func:`mark_only_adapters_trainable`."""
from __future__ import annotations

import fnmatch
from typing import Dict, Iterator, Sequence, Tuple, Type

import torch.nn as nn

from lycoris_ops.nn.base import AdapterModule
from lycoris_ops.nn.dora import DoRAConv2d, DoRALinear
from lycoris_ops.nn.full import FullConv2d, FullLinear, NormAdapter
from lycoris_ops.nn.ia3 import IA3Conv2d, IA3Linear
from lycoris_ops.nn.loha import LoHaConv2d, LoHaLinear
from lycoris_ops.nn.lokr import LoKrConv2d, LoKrLinear
from lycoris_ops.nn.lora import GLoRAConv2d, GLoRALinear, LoRAConv2d, LoRALinear
from lycoris_ops.nn.oft import BOFTConv2d, BOFTLinear, OFTConv2d, OFTLinear


#: kind -> {base layer type: adapter class}
ADAPTERS: Dict[str, Dict[Type[nn.Module], Type[AdapterModule]]] = {
    "lora": {nn.Linear: LoRALinear, nn.Conv2d: LoRAConv2d},
    "locon": {nn.Linear: LoRALinear, nn.Conv2d: LoRAConv2d},
    "loha": {nn.Linear: LoHaLinear, nn.Conv2d: LoHaConv2d},
    "lokr": {nn.Linear: LoKrLinear, nn.Conv2d: LoKrConv2d},
    "dora": {nn.Linear: DoRALinear, nn.Conv2d: DoRAConv2d},
    "glora": {nn.Linear: GLoRALinear, nn.Conv2d: GLoRAConv2d},
    "oft": {nn.Linear: OFTLinear, nn.Conv2d: OFTConv2d},
    "diag-oft": {nn.Linear: OFTLinear, nn.Conv2d: OFTConv2d},
    "boft": {nn.Linear: BOFTLinear, nn.Conv2d: BOFTConv2d},
    "ia3": {nn.Linear: IA3Linear, nn.Conv2d: IA3Conv2d},
    "full": {nn.Linear: FullLinear, nn.Conv2d: FullConv2d},
    "norm": {nn.LayerNorm: NormAdapter, nn.GroupNorm: NormAdapter},
}


def _match(name: str, patterns) -> bool:
    if patterns is None:
        return False
    if isinstance(patterns, str):
        patterns = (patterns,)
    return any(fnmatch.fnmatchcase(name, p) or name.split(".")[-1] == p for p in patterns)


def add_adapters(model: nn.Module, kind: str, rank: int = 4, target: Sequence[Type[nn.Module]] = (nn.Linear,), *,
                 include=None, exclude=None, **kw) -> nn.Module:
    """Replace every submodule whose type is exactly one of ``target`` (and, if given, whose
    qualified name matches ``include`` — fnmatch patterns or a last-name-component — and not
    ``exclude``) by the ``kind`` adapter wrapping it, in place. ``kind``: one of :data:`ADAPTERS`.
    ``rank`` goes to the rank-based adapters; ``**kw`` (alpha, multiplier, block_size, ...) to every
    adapter. Returns the model (a new object only if the model itself is a target)."""
    if kind not in ADAPTERS:
        raise ValueError(f"lycoris_ops.nn.add_adapters: kind must be one of {sorted(ADAPTERS)}, got {kind!r}")
    table = ADAPTERS[kind]
    target = tuple(target)
    for t in target:
        if t not in table:
            raise ValueError(f"lycoris_ops.nn.add_adapters: {kind!r} has no adapter for {t.__name__} "
                             f"(supported: {[b.__name__ for b in table]})")

    def make(name, mod):
        cls = table[type(mod)]
        args = dict(kw)
        if cls.uses_rank:
            args["rank"] = rank
        return cls(mod, **args)

    def wanted(name, mod):
        if type(mod) not in target:
            return False
        if include is not None and not _match(name, include):
            return False
        return not _match(name, exclude)

    if wanted("", model):
        return make("", model)
    todo = [(name, mod) for name, mod in model.named_modules()
            if wanted(name, mod) and not any(isinstance(p, AdapterModule) for p in _parents(model, name))]
    for name, mod in todo:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, make(name, mod))
    return model


def _parents(model, name) -> Iterator[nn.Module]:
    parts = name.split(".")[:-1]
    m = model
    for p in parts:
        m = getattr(m, p)
        yield m


def adapters(model: nn.Module) -> Iterator[Tuple[str, AdapterModule]]:
    """(name, adapter) for every adapter module of the model."""
    for name, m in model.named_modules():
        if isinstance(m, AdapterModule):
            yield name, m


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (merge ops); forward then runs the plain layers."""
    for _, m in adapters(model):
        m.merge()
    return model


def unmerge_adapters(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_adapters`."""
    for _, m in adapters(model):
        m.unmerge()
    return model


def remove_adapters(model: nn.Module, merge: bool = True) -> nn.Module:
    """Replace each adapter by its base layer (merged into it first when ``merge``)."""
    if isinstance(model, AdapterModule):
        if merge:
            model.merge()
        return model.base
    for name, m in list(adapters(model)):
        if merge:
            m.merge()
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, m.base)
    return model


def mark_only_adapters_trainable(model: nn.Module) -> nn.Module:
    """requires_grad = True on adapter parameters only (base layers and the rest frozen)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for _, m in adapters(model):
        for n, p in m.named_parameters():
            if not n.startswith("base."):
                p.requires_grad_(True)
    return model
