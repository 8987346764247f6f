"""Run an existing PEFT model's adapters on ``torch.ops.lycoris.*``.

``patch_peft(model)`` swaps the ``forward`` of each supported PEFT layer
(instance attribute; the class is untouched) for one that calls our ops, and
keeps every parameter, buffer, state-dict key and PEFT feature (merge/unmerge,
``disable_adapters``, adapter switching, saving) as it is. ``unpatch_peft``
restores the original forwards. Supported (fast path):

- ``peft.tuners.lora.Linear``, vanilla LoRA: ``lora_bypass_fwd`` with the base
  output folded in (``y = base(x) + s·B·A·dropout(x)``);
- ``peft.tuners.lora.Linear`` with DoRA (``use_dora=True``):
  ``k = magnitude/‖W + s·B·A‖`` (norm through ``lora_merge_fwd``, detached as
  PEFT does), ``y = base(x) + k⊙(W·x' + s·B·A·x') − W·x'`` with the bracket one
  ``lora_bypass_fwd`` call (x' = dropout(x); W·x' is ``base(x) − bias`` when there
  is no dropout);
- ``peft.tuners.loha.Linear`` (non-tucker): ``loha_bypass_fwd``;
- ``peft.tuners.lokr.Linear`` (non-tucker): ``lokr_bypass_fwd``;
- ``peft.tuners.ia3.Linear``: ``ia3_fwd`` on the output (or the input for
  feed-forward layers).

Anything else falls back to PEFT's own forward per call: merged or disabled
adapters, ``adapter_names=`` mixed batches, extra forward args, ``fan_in_fan_out``,
non-``nn.Linear`` (e.g. quantized) base layers, other LoRA variants, ``lora_bias``,
LoHa/LoKr rank or module dropout in training, tucker factors. PEFT's OFT/BOFT
layers are not patched (their parametrisation differs from LyCORIS's diag-OFT/BOFT).

Numbers: equal to PEFT's within the dtype tolerance. PEFT keeps adapter weights
in float32 for a bf16 base by default and computes the adapter branch in float32;
our ops compute in the 16-bit dtype with float32 accumulation (OPS.md §1.3),
gradients come back in each parameter's own dtype.

LyCORIS (lycoris-lora) networks: lycoris-lora registers its own ops in the same
``torch.ops.lycoris`` namespace as this package (``TORCH_LIBRARY(lycoris, ...)``
may only be defined once per process), so lycoris-lora and ``lycoris_ops``
cannot be imported in one process: whichever is imported second fails to
register its library. Patching live LyCORIS modules is therefore not offered;
instead, save the LyCORIS network's state dict (``network.state_dict()`` /
a ``.safetensors`` file) and build our modules from it with
:func:`lycoris_ops.nn.load_lycoris_state_dict` (LoCon, LoHa, LoKr, DoRA-LoCon,
diag-OFT, BOFT, IA3, Full; same parameter values and names' tensors).
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn as nn

from .functional import locon as _locon
from .functional import loha as _loha
from .functional import lokr as _lokr

__all__ = ["patch_peft", "unpatch_peft", "peft_available"]

_ORIG = "_lycoris_ops_patched"


def peft_available() -> bool:
    try:
        import peft  # noqa: F401
    except Exception:
        return False
    return True


def _common_ok(self, x, args, kwargs) -> bool:
    return (not args and not kwargs and not self.disable_adapters and not self.merged
            and type(self.get_base_layer()) is nn.Linear and not getattr(self, "fan_in_fan_out", False))


def _lora_forward(self, x, *args, **kwargs):
    if not _common_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.lora_A.keys()]
    for a in active:
        v = self.lora_variant.get(a) if hasattr(self, "lora_variant") else None
        if (v is not None and type(v).__name__ != "DoraLinearVariant") or self.lora_B[a].bias is not None:
            return type(self).forward(self, x, *args, **kwargs)
    base = self.get_base_layer()
    result = base(x)
    out_dtype = result.dtype
    for a in active:
        A, B = self.lora_A[a].weight, self.lora_B[a].weight
        s = float(self.scaling[a])
        dropout = self.lora_dropout[a]
        plain_dropout = isinstance(dropout, nn.Identity) or not self.training
        xd = x if plain_dropout else dropout(x)
        if hasattr(self, "lora_variant") and a in self.lora_variant:  # DoRA
            mag = self.lora_magnitude_vector[a].weight
            W = base.weight
            with torch.no_grad():
                wide = torch.float64 if W.dtype == torch.float64 else torch.float32
                merged = _locon.merge(B.detach().to(wide), A.detach().to(wide), s, base=W.detach().to(wide))
                norm = torch.linalg.vector_norm(merged, dim=1)
            k = (mag / norm.to(mag.dtype)).view(1, -1)
            if plain_dropout:  # PEFT uses the running result
                bw = result if base.bias is None else result - base.bias
            else:
                bw = torch.nn.functional.linear(xd, W)
            z = _locon.bypass(xd, B, A, s, base=bw)
            result = (result + k * z - bw).to(out_dtype)
        else:
            result = _locon.bypass(xd, B, A, s, base=result)
    return result.to(out_dtype)


def _lyco_ok(self, a) -> bool:
    if self.training and (self.rank_dropout[a] or self.module_dropout[a]):
        return False
    return True


def _loha_forward(self, x, *args, **kwargs):
    if not _common_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self._available_adapters]
    if any(a in self.hada_t1 or not _lyco_ok(self, a) for a in active):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.get_base_layer()(x)
    dt = x.dtype
    for a in active:
        result = _loha.bypass(x, self.hada_w1_a[a], self.hada_w1_b[a], self.hada_w2_a[a], self.hada_w2_b[a],
                              float(self.scaling[a]), base=result)
    return result.to(dt)


def _lokr_forward(self, x, *args, **kwargs):
    if not _common_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self._available_adapters]
    if any(a in self.lokr_t2 or not _lyco_ok(self, a) for a in active):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.get_base_layer()(x)
    dt = x.dtype
    for a in active:
        f = {}
        if a in self.lokr_w1:
            f["w1"] = self.lokr_w1[a]
        else:
            f["w1a"], f["w1b"] = self.lokr_w1_a[a], self.lokr_w1_b[a]
        if a in self.lokr_w2:
            f["w2"] = self.lokr_w2[a]
        else:
            f["w2a"], f["w2b"] = self.lokr_w2_a[a], self.lokr_w2_b[a]
        result = _lokr.lokr_bypass(x, **f, scale=float(self.scaling[a]), base=result)
    return result.to(dt)


def _ia3_forward(self, x, *args, **kwargs):
    if not _common_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.ia3_l.keys()]
    if len(active) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    w = self.ia3_l[active[0]]
    base = self.get_base_layer()
    if self.is_feedforward:
        return base(torch.ops.lycoris.ia3_fwd(x, w.reshape(-1), -1, 0.0, 1.0).to(x.dtype))
    y = base(x)
    return torch.ops.lycoris.ia3_fwd(y, w.reshape(-1), -1, 0.0, 1.0).to(y.dtype)


def _table():
    table = {}
    try:
        from peft.tuners import lora
        table[lora.Linear] = _lora_forward
    except Exception:  # pragma: no cover
        pass
    for mod, fn in (("loha", _loha_forward), ("lokr", _lokr_forward), ("ia3", _ia3_forward)):
        try:
            m = __import__(f"peft.tuners.{mod}", fromlist=["Linear"])
            table[m.Linear] = fn
        except Exception:  # pragma: no cover
            pass
    return table


def patch_peft(model: nn.Module) -> int:
    """Route the supported PEFT layers of ``model`` through ``torch.ops.lycoris``
    (see the module docstring). Idempotent. Returns the number of layers patched."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise ImportError("lycoris_ops.patch.patch_peft needs the `peft` package") from e
    table = _table()
    n = 0
    for m in model.modules():
        fn = table.get(type(m))
        if fn is None or getattr(m, _ORIG, False):
            continue
        object.__setattr__(m, "forward", types.MethodType(fn, m))
        object.__setattr__(m, _ORIG, True)
        n += 1
    return n


def unpatch_peft(model: nn.Module) -> int:
    """Undo :func:`patch_peft`. Returns the number of layers restored."""
    n = 0
    for m in model.modules():
        if getattr(m, _ORIG, False):
            del m.__dict__["forward"]
            del m.__dict__[_ORIG]
            n += 1
    return n
