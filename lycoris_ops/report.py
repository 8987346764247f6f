"""What runs fused: one row per adapted layer, from every integration that patches layers.

An integration (``patch.py`` for PEFT, ``integrations/lycoris_lora.py``, ``nn``)
registers a *describer*: ``describe(name, module) -> LayerRoute | None``, returning the
op the layer runs on now, or ``op=None`` with the reason it falls back to the owner's
own forward. ``explain(model)`` asks every describer about every submodule.

A row describes the layer's *current* state: its ``training`` flag, which adapters are
active, merged or disabled, their settings. So ``explain`` after ``model.eval()`` may
differ from ``explain`` in training (e.g. PEFT's OFT module dropout falls back only in
training). Conditions a call brings (PEFT's ``adapter_names=`` mixed batches, extra
forward arguments) are warned about when a call meets them.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Set

import torch.nn as nn

__all__ = ["LayerRoute", "Report", "explain", "register_describer", "warn_fallback"]


@dataclass(frozen=True)
class LayerRoute:
    name: str  #: the module's path in the model
    adapter: str  #: "peft.lora", "lycoris.lokr", "lycoris_ops.dora", ...
    op: Optional[str]  #: "lycoris.lora_bypass_fwd" (the forward op), or None: a fallback
    reason: Optional[str] = None  #: why it falls back (None when ``op`` is set)

    @property
    def fused(self) -> bool:
        return self.op is not None


class Report(List[LayerRoute]):
    """A list of :class:`LayerRoute`, printable as a table."""

    def fallbacks(self) -> "Report":
        return Report(r for r in self if not r.fused)

    def __str__(self) -> str:
        if not self:
            return "no adapted layers"
        w = max(len(r.name) for r in self)
        a = max(len(r.adapter) for r in self)
        lines = [f"{r.name:<{w}}  {r.adapter:<{a}}  {r.op if r.fused else 'fallback: ' + str(r.reason)}" for r in self]
        n = sum(r.fused for r in self)
        lines.append(f"{n} of {len(self)} layers on lycoris ops")
        return "\n".join(lines)


_describers: List[Callable[[str, nn.Module], Optional[LayerRoute]]] = []
_warned: Set[str] = set()


def register_describer(fn: Callable[[str, nn.Module], Optional[LayerRoute]]) -> Callable:
    if fn not in _describers:
        _describers.append(fn)
    return fn


def explain(model: nn.Module) -> Report:
    """Per adapted layer of ``model``: the lycoris op it runs on, or why it falls back
    (for the layer's current state: see the module docstring)."""
    from lycoris_ops.integrations import peft as patch  # noqa: F401  (registers the PEFT describer; PEFT itself is imported only for its layers)
    report = Report()
    for name, module in model.named_modules():
        for describe in _describers:
            route = describe(name, module)
            if route is not None:
                report.append(route)
                break
    return report


def warn_fallback(reason: str) -> None:
    """One warning per distinct fallback reason per process."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"lycoris_ops: some layers run their own (unfused) forward: {reason}", RuntimeWarning,
                      stacklevel=3)


# ---------------------------------------------------------------- lycoris_ops.nn


@functools.lru_cache(maxsize=None)
def _nn_routes(lnn):
    """{lycoris_ops.nn adapter class: module -> (op, reason)}: the op its forward runs
    (the main one), or None and why none. Kept true by tests/test_report.py, which runs
    every class's forward and checks the op is called (or that none is)."""
    def op(name):
        return lambda m: ("lycoris." + name, None)

    def dora_linear(m):  # a trainable base weight takes the merged path (ΔW, then the rescale op)
        return ("lycoris.dora_fwd", None) if m.base.weight.requires_grad else ("lycoris.lora_bypass_fwd", None)

    def dora_conv(m):  # the column-wise rescale of a conv weight stays eager (functional.dora)
        if m.wd_on_out:
            return "lycoris.dora_fwd", None
        return ("lycoris.lora_tucker_fwd" if m.lora_mid is not None else "lycoris.lora_merge_fwd"), None

    def oft(m):
        if m.multiplier != 1.0:
            return None, "diag-OFT with multiplier != 1 (eager: the op has no multiplier)"
        return "lycoris.oft_fwd", None

    return {
        lnn.LoRALinear: op("lora_bypass_fwd"),
        lnn.LoRAConv2d: lambda m: (None, "LoCon conv: eager conv chain (no conv bypass op)"),
        lnn.LoHaLinear: op("loha_bypass_fwd"),
        lnn.LoHaConv2d: lambda m: ("lycoris.lora_tucker_fwd" if m.hada_t1 is not None else "lycoris.lora_merge_fwd",
                                   None),
        lnn.LoKrLinear: op("lokr_bypass_fwd"),
        lnn.LoKrConv2d: lambda m: (None, "LoKr conv: eager grouped conv chain (no conv bypass op)"),
        lnn.DoRALinear: dora_linear,
        lnn.DoRAConv2d: dora_conv,
        lnn.OFTLinear: oft,
        lnn.OFTConv2d: oft,
        lnn.BOFTLinear: op("boft_fwd"),
        lnn.BOFTConv2d: op("boft_fwd"),
        lnn.IA3Linear: op("ia3_fwd"),
        lnn.IA3Conv2d: op("ia3_fwd"),
        lnn.FullLinear: op("add_scaled"),
        lnn.FullConv2d: op("add_scaled"),
        lnn.NormAdapter: op("add_scaled"),
    }


def _describe_nn(name: str, module: nn.Module) -> Optional[LayerRoute]:
    """``lycoris_ops.nn`` adapters (checked by class, without importing nn for other models)."""
    if not any(c.__module__.startswith("lycoris_ops.nn.") for c in type(module).__mro__):
        return None
    from lycoris_ops import nn as lnn
    if not isinstance(module, lnn.AdapterModule):
        return None
    adapter = "lycoris_ops." + type(module).__name__
    if module.merged:
        return LayerRoute(name, adapter, None, "merged into the base weight")
    routes = _nn_routes(lnn)
    route = next((routes[c] for c in type(module).__mro__ if c in routes), None)
    if route is None:
        return LayerRoute(name, adapter, None, "no route known for this lycoris_ops.nn class")
    op, reason = route(module)
    return LayerRoute(name, adapter, op, reason)


register_describer(_describe_nn)
