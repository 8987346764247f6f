"""What runs fused: one row per adapted layer, from every integration that patches layers.

An integration (``integrations/peft/``, ``integrations/lycoris_lora.py``,
``nn/base.py``) registers a *describer*: ``describe(name, module) -> LayerRoute | None``,
returning the op the layer runs on now, or ``op=None`` with the reason it falls back to
the owner's own forward. ``explain(model)`` asks every describer about every submodule.

A row describes the layer's *current* state: its ``training`` flag, which adapters are
active, merged or disabled, their settings. So ``explain`` after ``model.eval()`` may
differ from ``explain`` in training (e.g. PEFT's OFT module dropout falls back only in
training). Conditions a call brings (PEFT's ``adapter_names=`` mixed batches, extra
forward arguments) are warned about when a call meets them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Set

import torch.nn as nn

__all__ = ["LayerRoute", "Report", "explain", "register_describer", "warn_fallback"]


@dataclass(frozen=True)
class LayerRoute:
    name: str  #: the module's path in the model
    adapter: str  #: "peft.lora", "lycoris.lokr", "lycoris_ops.DoRALinear", ...
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
