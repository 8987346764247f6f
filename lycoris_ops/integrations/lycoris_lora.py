"""The live bridge to lycoris-lora: its networks run on lycoris_ops' ops.

lycoris-lora 4.1 ships a kernel layer (``lycoris.kernels``) that registers its own
``torch.ops.lycoris`` namespace, which lycoris_ops registers too: the two cannot
both load. So ``import lycoris_ops`` installs an import hook (``install``): when
``lycoris`` is imported afterwards,

- lycoris-lora 4.1.x: ``lycoris.kernels`` and its submodules are served from
  ``lycoris_ops/integrations/lycoris_kernels/`` (same names and signatures as 4.1's,
  implemented on our functional layer), lycoris-lora's own kernel package never
  runs, and its functional / module / wrapper layers (``create_lycoris``,
  ``LycorisNetwork``, the kohya network) run on ``torch.ops.lycoris.*``, inside
  ``torch.compile(fullgraph=True)`` too;
- another lycoris-lora version: ``import lycoris`` raises ImportError saying which
  versions the bridge serves;
- lycoris-lora not installed: nothing happens (``import lycoris`` fails or not as
  it would without us).

``lycoris_ops.report.explain(network)`` then says, per adapted layer, which of our
ops its forward runs on, or why it runs lycoris-lora's own eager body (one
warning per reason): ``describe`` below is that table. Two limits sit in
lycoris-lora's own code, not in the kernel layer: under ``torch.compile`` its LoKr
scope test refuses the fused linear bypass (``bypass_mode`` LoKr then traces its
eager chain), and DyLoRA draws its rank with Python's ``random`` per call, which
Dynamo cannot keep in one graph (``fullgraph=True`` fails there).
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
from typing import Optional, Tuple

import torch.nn as nn

from lycoris_ops import report

__all__ = ["SUPPORTED_SERIES", "DISTRIBUTION", "install", "describe", "route"]

#: the lycoris-lora release series whose kernel-layer API the shim serves
SUPPORTED_SERIES = "4.1"
DISTRIBUTION = "lycoris-lora"
#: the folder holding the shim: ``lycoris.kernels[.x[.y]]`` is its file ``x/y.py`` (or ``x/y/__init__.py``)
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lycoris_kernels")
KERNELS = "lycoris.kernels"


def installed_version() -> Optional[str]:
    """lycoris-lora's installed version (from its distribution metadata, without
    importing it), or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(version: str) -> bool:
    return version == SUPPORTED_SERIES or version.startswith(SUPPORTED_SERIES + ".")


def _shim_file(fullname: str) -> Optional[Tuple[str, bool]]:
    """(path, is_package) of the shim file serving ``fullname`` (a ``lycoris.kernels``
    module), or None when the shim has no such module."""
    parts = fullname.split(".")[2:]
    base = os.path.join(SHIM_DIR, *parts)
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    if parts and os.path.isfile(base + ".py"):
        return base + ".py", False
    return None


class KernelLayerFinder(importlib.abc.MetaPathFinder):
    """Gates ``lycoris`` on lycoris-lora's version and serves ``lycoris.kernels`` from the shim."""

    def __init__(self):
        #: the lycoris-lora version admitted at the last ``import lycoris`` (None: not installed)
        self.admitted: Optional[str] = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "lycoris":
            version = installed_version()
            if version is not None and not supported(version):
                raise ImportError(
                    f"lycoris_ops is loaded and serves lycoris-lora's kernel layer (torch.ops.lycoris) for "
                    f"lycoris-lora {SUPPORTED_SERIES}.x only, but lycoris-lora {version} is installed. Install "
                    f"lycoris-lora=={SUPPORTED_SERIES}.3 (pip install 'lycoris-lora=={SUPPORTED_SERIES}.3'), "
                    f"or import lycoris in a process without lycoris_ops: both packages register the "
                    f"torch.ops.lycoris namespace, so they cannot share a process otherwise.",
                    name=fullname)
            self.admitted = version
            return None  # lycoris-lora's own package imports normally (or is absent: a no-op)
        if fullname != KERNELS and not fullname.startswith(KERNELS + "."):
            return None
        if self.admitted is None:
            raise ImportError(
                "lycoris_ops is loaded and a 'lycoris' package without lycoris-lora's distribution metadata is "
                "importing its kernel layer, which would register the torch.ops.lycoris namespace a second "
                f"time. Install lycoris-lora {SUPPORTED_SERIES}.x with pip (the bridge serves its kernel layer), "
                "or import that package in a process without lycoris_ops.", name=fullname)
        found = _shim_file(fullname)
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: with lycoris_ops loaded, lycoris-lora's kernel layer is served by "
                f"lycoris_ops, which provides lycoris.kernels, lycoris.kernels.select, lycoris.kernels.dispatch "
                f"and lycoris.kernels.autograd.<family> (lycoris-lora {SUPPORTED_SERIES}'s public kernel API)",
                name=fullname)
        file, package = found
        if fullname == KERNELS:
            report.register_describer(describe)
        return importlib.util.spec_from_file_location(
            fullname, file, submodule_search_locations=[os.path.dirname(file)] if package else None)


_finder = KernelLayerFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). ``import lycoris_ops`` calls it."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


# --------------------------------------------------------------------------- report
#
# Which op each lycoris-lora module's forward reaches, read off its configuration:
# lycoris-lora's modules and functional layer decide (their layout tests), our shim
# serves what they hand to the kernel layer. tests/integration/test_lycoris_bridge.py checks
# every row against the ops a forward really runs.

FALLBACK_RANK_DROPOUT = "rank dropout in training: lycoris-lora's module applies its mask in its own eager chain"
FALLBACK_CONV_BYPASS = ("bypass on a conv layer: lycoris-lora's functional layer runs its own conv chain "
                        "(its kernel layer's bypass is linear-only)")
FALLBACK_LOKR_CONV_BYPASS = "LoKr bypass on a conv layer: lycoris-lora's module runs its own grouped-conv chain"
FALLBACK_LOKR_CONV_W2 = ("LoKr with a whole conv w2 (c, d, *kernel) or a tucker w2: lycoris-lora's functional "
                         "layer builds this Kronecker product eagerly")
FALLBACK_DORA_CONV_IN = ("DoRA with wd_on_output=False on a conv layer (a norm per input channel has no 2-D "
                         "view): lycoris-lora's eager weight decompose")
FALLBACK_OFT_MULTIPLIER = "diag-OFT with multiplier != 1: lycoris-lora's module rotates eagerly"
FALLBACK_OFT_DROPOUT = "diag-OFT bypass with dropout in training: lycoris-lora's module rotates eagerly"
FALLBACK_OFT_BLOCK = "diag-OFT block size above lycoris-lora's MAX_BLOCK: its functional layer rotates eagerly"
FALLBACK_GLORA_CONV = "GLoRA on a conv layer (W·a1 keeps spatial axes): lycoris-lora's eager rebuild"
FALLBACK_OWN_BYPASS = "bypass_mode: lycoris-lora's module runs its own eager chains (no kernel-layer call)"
FALLBACK_FULL_LIVE = ("Full after apply_to holds the whole weight: lycoris-lora's module uses it directly "
                      "(no kernel-layer call)")
FALLBACK_NO_KERNELS = "lycoris-lora's module never calls its kernel layer"

_ALGO = {
    "LoConModule": "locon", "LohaModule": "loha", "LokrModule": "lokr", "DiagOFTModule": "diag-oft",
    "ButterflyOFTModule": "boft", "IA3Module": "ia3", "GLoRAModule": "glora", "DyLoraModule": "dylora",
    "FullModule": "full", "NormModule": "norms", "TLoraModule": "tlora",
}


def _dora(m, merge_op: str) -> Tuple[Tuple[str, ...], Optional[str]]:
    if not m.wd:
        return (merge_op,), None
    if not m.wd_on_out and m.module_type.startswith("conv"):
        return (merge_op,), FALLBACK_DORA_CONV_IN
    return (merge_op, "dora_fwd"), None


def route(m: nn.Module) -> Tuple[Tuple[str, ...], Optional[str]]:
    """(the ops a lycoris-lora module's forward runs, the reason part of it runs
    lycoris-lora's own eager body, or None) in its current configuration (training
    flag, multiplier, bypass_mode)."""
    kind = type(m).__name__
    training = m.training
    conv = m.module_type.startswith("conv")
    if kind == "LoConModule":
        if m.bypass_mode:
            if training and m.rank_dropout:
                return (), FALLBACK_RANK_DROPOUT
            return ((), FALLBACK_CONV_BYPASS) if conv else (("lora_bypass_fwd",), None)
        return _dora(m, "lora_tucker_fwd" if m.tucker else "lora_merge_fwd")
    if kind == "LohaModule":
        merge_op = "lora_tucker_fwd" if m.tucker else "lora_merge_fwd"
        if m.bypass_mode:
            if conv or m.tucker or (training and m.rank_dropout):
                return (merge_op,), None  # ΔW through the kernel layer, then the layer's own op
            return ("loha_bypass_fwd",), None
        return _dora(m, merge_op)
    if kind == "LokrModule":
        if m.bypass_mode:
            return ((), FALLBACK_LOKR_CONV_BYPASS) if conv else (("lokr_bypass_fwd",), None)
        if (m.use_w2 and m.lokr_w2.dim() > 2) or (m.tucker and not m.use_w2):
            return (), FALLBACK_LOKR_CONV_W2
        return _dora(m, "lokr_full_merge_fwd" if m.use_w1 and m.use_w2 else "lokr_merge_fwd")
    if kind == "DiagOFTModule":
        from lycoris.functional.diag_oft import MAX_BLOCK  # lycoris-lora is optional: imported once its modules exist

        if m.multiplier != 1:
            return (), FALLBACK_OFT_MULTIPLIER
        if m.bypass_mode and training and m.dropout:
            return (), FALLBACK_OFT_DROPOUT
        if not m.bypass_mode and training and m.rank_dropout:
            return (), FALLBACK_RANK_DROPOUT
        if m.block_size > MAX_BLOCK:
            return (), FALLBACK_OFT_BLOCK
        return ("oft_fwd",), None
    if kind == "ButterflyOFTModule":
        return ("boft_fwd",), None
    if kind == "IA3Module":
        return ("ia3_fwd",), None
    if kind == "GLoRAModule":
        if m.bypass_mode:
            return (), FALLBACK_OWN_BYPASS
        if m.tucker or conv:
            return (), FALLBACK_GLORA_CONV
        return ("lora_merge_fwd",), None
    if kind == "DyLoraModule":
        return ((), FALLBACK_OWN_BYPASS) if m.bypass_mode else (("lora_merge_fwd",), None)
    if kind == "FullModule":
        if not m.is_diff:
            return (), FALLBACK_FULL_LIVE
        return ((), FALLBACK_RANK_DROPOUT) if training and m.rank_dropout else (("add_scaled",), None)
    if kind == "NormModule":
        return ((), FALLBACK_RANK_DROPOUT) if training and m.rank_dropout else (("add_scaled",), None)
    return (), FALLBACK_NO_KERNELS


def describe(name: str, module: nn.Module) -> Optional[report.LayerRoute]:
    """The report row of a lycoris-lora module (None for any other module)."""
    if not type(module).__module__.startswith("lycoris.modules."):
        return None
    from lycoris.modules.base import LycorisBaseModule  # lycoris-lora is optional: imported once its modules exist

    if not isinstance(module, LycorisBaseModule) or module.not_supported:
        return None
    adapter = "lycoris." + _ALGO.get(type(module).__name__, type(module).__name__)
    ops, reason = route(module)
    if reason is not None:
        report.warn_fallback(reason)
        if ops:
            reason += f" (the rest runs on {' + '.join('lycoris.' + op for op in ops)})"
        return report.LayerRoute(name, adapter, None, reason)
    return report.LayerRoute(name, adapter, " + ".join("lycoris." + op for op in ops))
