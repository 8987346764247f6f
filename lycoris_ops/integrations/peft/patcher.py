"""``patch_peft``: run an existing PEFT model's adapters on ``torch.ops.lycoris.*``.

Each supported PEFT layer gets our forward as an instance attribute (its class is
untouched; ``unpatch_peft`` deletes it). The forwards live beside the PEFT tuner they
serve (``lora``, ``loha_lokr``, ``ia3``, ``oft``), each with its ``ROUTES``: the PEFT
layer classes it handles, the op it runs and ``reason(layer)``, why the layer's current
state keeps PEFT's own forward (adapters merged or disabled, a PEFT feature the ops do
not compute). A forward checks that reason and the call's arguments (``adapter_names=``
mixed batches, extra arguments) on every call; when either says so it runs PEFT's own
forward, so a fallback gives PEFT's numbers. Each reason is one report row and one
warning per process (none for merged, disabled or absent adapters: the base layer alone
runs). PEFT layer
types without a route (LoRA ``Embedding``, ``Conv1d``/``Conv3d``, IA3 on bitsandbytes
bases, other tuners) are rows that say so.

Numbers equal PEFT's within the dtype tolerance: PEFT keeps a bf16 model's adapter
weights in float32 by default and computes the adapter branch in float32; the ops compute
in the 16-bit dtype with float32 accumulation (docs/ops.md §1.3), gradients come back in
each parameter's own dtype.
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Optional

import torch.nn as nn

from lycoris_ops.integrations.peft.common import QUIET
from lycoris_ops.integrations.peft.ia3 import ROUTES as IA3_ROUTES
from lycoris_ops.integrations.peft.loha_lokr import ROUTES as LOHA_LOKR_ROUTES
from lycoris_ops.integrations.peft.lora import ROUTES as LORA_ROUTES
from lycoris_ops.integrations.peft.oft import BOFT_CACHE
from lycoris_ops.integrations.peft.oft import ROUTES as OFT_ROUTES
from lycoris_ops.report import LayerRoute, Report, register_describer, warn_fallback

__all__ = ["patch_peft", "unpatch_peft", "peft_available"]

#: the instance attribute marking a patched layer
_ORIG = "_lycoris_ops_patched"
_R_NOT_PATCHED = "not patched: call patch_peft(model) (again, for layers added after it)"

#: PEFT module -> {layer class name: Route}
_ROUTES = {**LORA_ROUTES, **LOHA_LOKR_ROUTES, **IA3_ROUTES, **OFT_ROUTES}


def peft_available() -> bool:
    """Whether the ``peft`` package imports."""
    try:
        import peft  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _table():
    """{PEFT layer class: Route} for the installed PEFT (imported on first use)."""
    table = {}
    for module, routes in _ROUTES.items():
        # by name: which tuner modules exist depends on the PEFT version and on optional
        # packages (the bitsandbytes layers); the missing ones are skipped
        try:
            m = importlib.import_module(module)
        except Exception:  # pragma: no cover
            continue
        for cls, route in routes.items():
            if hasattr(m, cls):
                table[getattr(m, cls)] = route
    return table


@functools.lru_cache(maxsize=None)
def _tuner_layer_class():
    from peft.tuners.tuners_utils import BaseTunerLayer  # PEFT is optional: imported when a model has its layers
    return BaseTunerLayer


def _is_peft_layer(module: nn.Module) -> bool:
    """A PEFT adapter layer (checked without importing PEFT for models that have none)."""
    if not any(c.__module__.startswith("peft.") for c in type(module).__mro__):
        return False
    return isinstance(module, _tuner_layer_class())


def _describe_peft(name: str, module: nn.Module) -> Optional[LayerRoute]:
    """The route of a PEFT layer in its current state (training flag, active / merged /
    disabled adapters, their settings). Call-time conditions (``adapter_names=``, extra
    arguments, an unbatched OFT conv input) show only when a call meets them (a warning)."""
    if not _is_peft_layer(module):
        return None
    parts = type(module).__module__.split(".")
    adapter = "peft." + (parts[2] if len(parts) > 2 and parts[1] == "tuners" else type(module).__name__)
    route = _table().get(type(module))
    if route is None:
        return LayerRoute(name, adapter, None, f"not supported by patch_peft: {type(module).__qualname__}")
    if not module.__dict__.get(_ORIG, False):
        return LayerRoute(name, adapter, None, _R_NOT_PATCHED)
    reason = route.reason(module)
    if reason is not None:
        return LayerRoute(name, adapter, None, reason)
    return LayerRoute(name, adapter, route.op if isinstance(route.op, str) else route.op(module))


register_describer(_describe_peft)


def patch_peft(model: nn.Module) -> Report:
    """Route the supported PEFT layers of ``model`` through ``torch.ops.lycoris``
    (see the module docstring); their parameters, buffers, state-dict keys and PEFT's
    features (merge/unmerge, ``disable_adapter``, adapter switching, saving) stay PEFT's.
    Idempotent; call it again for layers added after it. Returns the :class:`~lycoris_ops.report.Report`
    of every PEFT layer in ``model`` as patched (the op it runs on, or why it falls back
    in the model's current state), and warns once per fallback reason."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise ImportError("lycoris_ops.integrations.peft.patch_peft needs the `peft` package") from e
    table = _table()
    report = Report()
    for name, m in model.named_modules():
        route = table.get(type(m))
        if route is not None and not m.__dict__.get(_ORIG, False):
            object.__setattr__(m, "forward", types.MethodType(route.forward, m))
            object.__setattr__(m, _ORIG, True)
            if route.prepare is not None:
                route.prepare(m)
        row = _describe_peft(name, m)
        if row is not None:
            report.append(row)
            if not row.fused and row.reason not in QUIET:
                warn_fallback(row.reason)
    return report


def unpatch_peft(model: nn.Module) -> int:
    """Undo :func:`patch_peft`. Returns the number of layers restored."""
    n = 0
    for m in model.modules():
        if m.__dict__.get(_ORIG, False):
            del m.__dict__["forward"]
            del m.__dict__[_ORIG]
            m.__dict__.pop(BOFT_CACHE, None)
            n += 1
    return n
