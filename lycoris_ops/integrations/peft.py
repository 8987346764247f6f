"""Run an existing PEFT model's adapters on ``torch.ops.lycoris.*``.

``patch_peft(model)`` swaps the ``forward`` of each supported PEFT layer
(instance attribute; the class is untouched) for one that calls our ops, and
keeps every parameter, buffer, state-dict key and PEFT feature (merge/unmerge,
``disable_adapters``, adapter switching, saving) as it is. It returns a
:class:`~lycoris_ops.report.Report`: one row per PEFT layer of the model, the op
it runs on or why it falls back (``print(patch_peft(model))``; later,
``lycoris_ops.explain(model)`` gives the same rows for the model's state then).
``unpatch_peft`` restores the original forwards. Supported (fast path):

- ``peft.tuners.lora.Linear``, vanilla LoRA on any base layer — ``nn.Linear``,
  transformers' GPT-2 ``Conv1D`` (``fan_in_fan_out``), bitsandbytes
  ``Linear8bitLt``/``Linear4bit`` (PEFT's ``lora.bnb`` layers) or torchao-quantized
  linears (``TorchaoLoraLinear``): the base layer runs its own forward and the
  adapter runs ``lora_bypass_fwd`` with that output folded in as ``base``
  (``y = base(x) + s·B·A·dropout(x)``, dropout in training included: PEFT drops
  only the adapter's input); ``lora_bias`` adds ``s·b_B`` to the base output first;
- ``peft.tuners.lora.Linear`` with DoRA (``use_dora=True``) on an ``nn.Linear``:
  ``k = magnitude/‖W + s·B·A‖`` (norm in fp32 from ``‖W‖² + 2s·B·(W·Aᵀ) + s²·B·(A·Aᵀ)·Bᵀ``
  per row, no merged weight built; detached as PEFT does), ``y = base(x) + k⊙(W·x' + s·B·A·x') − W·x'`` with the bracket one
  ``lora_bypass_fwd`` call (x' = dropout(x); W·x' is ``base(x) − bias`` when there
  is no dropout);
- ``peft.tuners.lora.Conv2d`` (vanilla LoRA, any base conv): the input is unfolded
  (im2col, lora_A's own kernel/stride/padding/dilation; a 1×1 kernel without
  padding is a strided view) to rows of (C·kh·kw) and ``lora_bypass_fwd`` runs on
  them with lora_A flattened as ``down`` and lora_B as ``up``; the rows come back
  as a channels-last view added to the base output. The rows cost kh·kw times
  the adapter input's memory (and the op saves them for the backward);
- ``peft.tuners.loha.Linear`` (non-tucker): ``loha_bypass_fwd``;
- ``peft.tuners.loha.Conv2d`` (non-tucker): ``conv(x, s·ΔW)`` with ΔW from the
  merge op (``lora_merge_fwd``, mode hada);
- ``peft.tuners.lokr.Linear``: ``lokr_bypass_fwd``;
- ``peft.tuners.lokr.Conv2d`` (whole, factored or tucker w2): im2col as for LoRA,
  then ``lokr_bypass_fwd`` with w2 flattened to (c, d·kh·kw) — ΔW's flattened
  columns are ``kron(w1, w2_flat)``'s, so the Kronecker product is never built;
- LoHa/LoKr ``rank_dropout`` and ``module_dropout`` in training, drawn as PEFT draws
  them (one ``torch.rand(1)`` per adapter, then ``torch.rand(out)`` for the rank
  mask, on the CPU generator; PEFT also draws the first when both are 0, this
  forward does not): a dropped adapter is skipped, the rank mask scales the op's
  output rows;
- ``peft.tuners.ia3.Linear`` / ``Conv2d`` (any base layer, one or several active
  adapters: their vectors multiplied): ``ia3_fwd`` on the output (or the input for
  feed-forward layers) along the feature / channel axis;
- ``peft.tuners.oft.Linear`` / ``Conv2d`` / ``Embedding`` with the exact Cayley
  transform (``use_cayley_neumann=False``): ``oft_fwd``. PEFT stores each block
  as the S(S−1)/2 entries above the diagonal; the op's raw block is that vector
  scattered into an S×S matrix (``index_copy``, differentiable), below the
  diagonal to rotate the tokens' channels (``x·R``, as PEFT does) when the call
  has at most ``out_features`` tokens, else above it to rotate the weight's
  input channels instead (``W·Rᵀ``, then one ``linear``). ``coft`` (PEFT's
  per-block in-place projection of the parameter under ``no_grad``, repeated
  as PEFT's forward does) and ``block_share`` are supported; Conv2d rotates the
  stride-1 unfolded patches and folds them back with PEFT's own
  ``_unfold``/``_fold`` (as its forward does; note PEFT's merge of a k>1 conv
  is not that map); Embedding rotates the looked-up rows;
- ``peft.tuners.boft.Linear`` / ``Conv2d``: one butterfly stage (the default,
  and the only one PEFT builds without its CUDA block-diagonal extension) is a
  block-diagonal rotation and runs on ``oft_fwd`` with ``cscale=0.5`` (PEFT's
  ``½(B − Bᵀ)``), any block size; several stages run on ``boft_fwd`` rotating
  the weight's input channels (PEFT's stage 0 acts first, like the op's): each
  PEFT block is gathered into the op's block order (an index gather built once
  per adapter from PEFT's ``boft_P`` permutations and checked to give the same
  channel partition in every stage, else the layer falls back). ``boft_s``
  scales the output channels (folded into the rotated weight, or applied to
  the output when the activations are rotated).

Anything else runs PEFT's own forward, per call; each row of the report says
why (the ``_R_*`` strings below), and each reason is warned about once per
process (``report.warn_fallback``: at patch time for what the layers' state
shows then, at call time for the rest) — except merged, disabled or absent
adapters, where the base layer alone runs and there is nothing to fuse.
Fallbacks: merged or disabled adapters; ``adapter_names=`` mixed-adapter batches
and other extra forward arguments (seen at call time); LoRA variants other than
DoRA (aLoRA, Arrow, …); DoRA on a base other than ``nn.Linear`` (Conv1D,
quantized) or with ``lora_bias``; DoRA on convs; LoRA convs on a grouped base
(grouped lora_B) or with string padding; LoHa/LoKr convs on a grouped,
string-padded or non-zero-padded base; LoHa's tucker convs
(``use_effective_conv2d``); OFT with the Cayley–Neumann series
(``use_cayley_neumann=True``, **PEFT's default**: a truncated series, not the
exact Cayley transform our ops compute — their outputs differ by far more than
a dtype tolerance once the blocks move from zero — in PEFT 0.21.2 the series
even approximates the transpose of its exact branch's R — so those layers stay
on PEFT's forward and keep the numbers the adapter was trained with), OFT
``module_dropout`` / BOFT ``boft_dropout`` in training (random block masks),
OFT/BOFT on a base other than ``nn.Linear``/``nn.Conv2d``/``nn.Embedding``;
BOFT with several stages but no CUDA block-diagonal extension (PEFT's own
forward raises there), BOFT stages whose channel partition does not match
``boft_fwd``'s, BOFT convs with a non-square kernel, string padding or input
casting disabled; unbatched (3-D) inputs to an OFT Conv2d; PEFT layer types
this module has no forward for (e.g. LoRA ``Embedding``, ``Conv1d``/``Conv3d``,
``MultiheadAttention``, IA3 on bitsandbytes bases, other tuners); and PEFT
layers created after ``patch_peft`` ran (call it again: it is idempotent).

Numbers: equal to PEFT's within the dtype tolerance. PEFT keeps adapter weights
in float32 for a bf16 base by default and computes the adapter branch in float32;
our ops compute in the 16-bit dtype with float32 accumulation (OPS.md §1.3),
gradients come back in each parameter's own dtype. OFT/BOFT: Cayley transforms
and rotations in float32 inside the op, rounded once to the rotated tensor's
dtype (the activations, or the base weight; a rotated BOFT weight is then
multiplied by ``boft_s`` and rounded to the base weight's dtype again).

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

import functools
import importlib
import types
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.functional import dora as _dora
from lycoris_ops.functional import locon as _locon
from lycoris_ops.functional import loha as _loha
from lycoris_ops.functional import lokr as _lokr
from lycoris_ops.report import LayerRoute, Report, register_describer, warn_fallback

__all__ = ["patch_peft", "unpatch_peft", "peft_available"]

_ORIG = "_lycoris_ops_patched"

# Fallback reasons (a report row's ``reason``; one warning each). No per-layer
# numbers in them: a reason is warned about once however many layers share it.
_R_DISABLED = "adapters disabled (disable_adapter)"
_R_MERGED = "adapter merged into the base weight"
_R_NO_ADAPTER = "no active adapter on this layer"
#: the base layer alone runs: nothing to fuse, reported but not warned about
_QUIET = frozenset({_R_DISABLED, _R_MERGED, _R_NO_ADAPTER})
_R_MIXED = "mixed-adapter batch (adapter_names=)"
_R_EXTRA_ARGS = "extra forward arguments"
_R_NOT_PATCHED = "not patched: call patch_peft(model) (again, for layers added after it)"
_R_DORA_BASE = "DoRA on a base other than nn.Linear (Conv1D, quantized)"
_R_DORA_BIAS = "DoRA with lora_bias"
_R_CONV_VARIANT = "LoRA variant (DoRA, ...) on a conv"
_R_LORA_CONV_GROUPED = "LoRA conv on a grouped base or with string padding"
_R_CONV_BASE = "grouped, string-padded or non-zero-padded conv base"
_R_LOHA_TUCKER = "LoHa tucker conv (use_effective_conv2d)"
_R_LOKR_TUCKER_LINEAR = "LoKr tucker factors on a linear layer"
_R_NEUMANN = "OFT with the Cayley-Neumann series (use_cayley_neumann=True, PEFT's default)"
_R_OFT_DROPOUT = "OFT module dropout in training"
_R_OFT_UNBATCHED = "unbatched (3-D) input to an OFT Conv2d"
_R_BOFT_DROPOUT = "BOFT dropout in training"
_R_BOFT_NO_FBD = "BOFT with several stages and no CUDA block-diagonal extension (PEFT's forward raises too)"
_R_BOFT_PARTITION = "BOFT stage permutation that boft_fwd's butterfly cannot express"
_R_BOFT_CONV = "BOFT conv with a non-square kernel, string padding or input casting disabled"
_R_OFT_BASE = "OFT/BOFT on a base other than nn.Linear/nn.Conv2d/nn.Embedding (Conv1D, quantized)"


def peft_available() -> bool:
    try:
        import peft  # noqa: F401
    except Exception:
        return False
    return True


def _fallback(self, reason: str, x, args, kwargs):
    """PEFT's own forward, warning once per reason (not while Dynamo traces)."""
    if reason not in _QUIET and not torch.compiler.is_compiling():
        warn_fallback(reason)
    return type(self).forward(self, x, *args, **kwargs)


def _call_reason(args, kwargs) -> Optional[str]:
    """Why this call's arguments keep PEFT's forward (None: they don't)."""
    if kwargs.get("adapter_names") is not None:
        return _R_MIXED
    if args or any(k != "adapter_names" for k in kwargs):
        return _R_EXTRA_ARGS
    return None


def _state_reason(self) -> Optional[str]:
    if self.disable_adapters:
        return _R_DISABLED
    if self.merged:
        return _R_MERGED
    return None


def _active(self, table):
    return [a for a in self.active_adapters if a in table]


def _dropped(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x if isinstance(dropout, nn.Identity) else dropout(x)


def _batched(x: torch.Tensor) -> torch.Tensor:
    """A conv input as (N, C, H, W) (an unbatched (C, H, W) one gets N = 1)."""
    return x if x.dim() == 4 else x.unsqueeze(0)


def _rows(x: torch.Tensor, kernel, stride, padding, dilation):
    """im2col: x (N, C, H, W) -> (N·H'·W', C·kh·kw), row n·H'·W' + p the receptive field
    of output position p in the flattened conv weight's (c, kh, kw) column order; and
    (N, H', W'). A 1×1 kernel without padding is a strided view of the pixels (no unfold)."""
    N, C, H, W = x.shape
    if tuple(kernel) == (1, 1) and tuple(padding) == (0, 0):
        xs = x[:, :, ::stride[0], ::stride[1]]
        return xs.permute(0, 2, 3, 1).reshape(-1, C), (N, xs.shape[2], xs.shape[3])
    Ho, Wo = ((size + 2 * p - d * (k - 1) - 1) // s + 1
              for size, k, s, p, d in zip((H, W), kernel, stride, padding, dilation))
    cols = F.unfold(x, tuple(kernel), tuple(dilation), tuple(padding), tuple(stride))  # (N, C·kh·kw, H'·W')
    return cols.transpose(1, 2).reshape(N * Ho * Wo, cols.shape[1]), (N, Ho, Wo)


def _unrows(y: torch.Tensor, nhw) -> torch.Tensor:
    """Rows (N·H'·W', O) -> (N, O, H', W'), a channels-last view."""
    N, Ho, Wo = nhw
    return y.view(N, Ho, Wo, y.shape[-1]).permute(0, 3, 1, 2)


# -------------------------------------------------------------------------- LoRA


def _lora_reason(self, dora_ok: bool = True) -> Optional[str]:
    """Why PEFT's LoRA Linear (any base) keeps its forward in its current state (None: it doesn't).
    ``dora_ok``: the layer class reads a plain base weight (not the quantized ones)."""
    reason = _state_reason(self)
    if reason is not None:
        return reason
    active = _active(self, self.lora_A)
    if not active:
        return _R_NO_ADAPTER
    for a in active:
        v = self.lora_variant.get(a)
        if v is None:
            continue
        if type(v).__name__ != "DoraLinearVariant":
            return f"LoRA variant {type(v).__name__}"
        if not dora_ok or type(self.get_base_layer()) is not nn.Linear or self.base_layer is not self.get_base_layer():
            return _R_DORA_BASE
        if self.lora_B[a].bias is not None:
            return _R_DORA_BIAS
    return None


def _lora_run(self, x, args, kwargs, dora_ok: bool):
    reason = _call_reason(args, kwargs) or _lora_reason(self, dora_ok)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    out_dtype = result.dtype
    for a in _active(self, self.lora_A):
        A, B = self.lora_A[a].weight, self.lora_B[a].weight
        s = float(self.scaling[a])
        dropout = self.lora_dropout[a]
        if a in self.lora_variant:  # DoRA
            base = self.get_base_layer()
            plain_dropout = isinstance(dropout, nn.Identity) or not self.training
            xd = x if plain_dropout else dropout(x)
            mag = self.lora_magnitude_vector[a].weight
            W = base.weight
            with torch.no_grad():  # ‖W + s·B·A‖ per row in fp32, without building the merged weight
                norm = _dora.lowrank_norm_terms(W.detach(), B.detach(), A.detach(), s)[0].clamp_min(0).sqrt()
            k = (mag / norm.to(mag.dtype)).view(1, -1)
            if plain_dropout:  # PEFT uses the running result
                bw = result if base.bias is None else result - base.bias
            else:
                bw = F.linear(xd, W)
            z = _locon.bypass(xd, B, A, s, base=bw)
            result = (result + k * z - bw).to(out_dtype)
        else:
            bias = self.lora_B[a].bias  # lora_bias: s·b_B on every token
            base = result if bias is None else result + (bias * s).to(result.dtype)
            result = _locon.bypass(_dropped(dropout, x), B, A, s, base=base)
    return result.to(out_dtype)


def _lora_forward(self, x, *args, **kwargs):
    return _lora_run(self, x, args, kwargs, dora_ok=True)


def _lora_quant_forward(self, x, *args, **kwargs):
    """PEFT's LoRA on a quantized base (bitsandbytes, torchao): its own base forward, our bypass."""
    return _lora_run(self, x, args, kwargs, dora_ok=False)


def _lora_conv_reason(self) -> Optional[str]:
    reason = _state_reason(self)
    if reason is not None:
        return reason
    active = _active(self, self.lora_A)
    if not active:
        return _R_NO_ADAPTER
    for a in active:
        if a in self.lora_variant:
            return _R_CONV_VARIANT
        A, B = self.lora_A[a], self.lora_B[a]
        if A.groups != 1 or B.groups != 1 or tuple(B.kernel_size) != (1, 1) or isinstance(A.padding, str):
            return _R_LORA_CONV_GROUPED
    return None


def _lora_conv_forward(self, x, *args, **kwargs):
    """PEFT's LoRA Conv2d: ``base(x) + s·B(A(dropout(x)))`` as ``lora_bypass_fwd`` on the
    im2col rows of dropout(x) (A's own geometry), B the 1×1 up projection."""
    reason = _call_reason(args, kwargs) or _lora_conv_reason(self)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    out_dtype = result.dtype
    x4 = _batched(x)
    for a in _active(self, self.lora_A):
        A, B = self.lora_A[a], self.lora_B[a]
        s = float(self.scaling[a])
        rows, nhw = _rows(_dropped(self.lora_dropout[a], x4), A.kernel_size, A.stride, A.padding, A.dilation)
        delta = _locon.bypass(rows, B.weight, A.weight.flatten(1), s)
        if B.bias is not None:
            delta = delta + (B.bias * s).to(delta.dtype)
        delta = _unrows(delta, nhw)
        result = result + (delta if x.dim() == 4 else delta.squeeze(0))
    return result.to(out_dtype)


# -------------------------------------------------------------------- LoHa / LoKr


def _lyco_draws(self, a, rescale: bool):
    """PEFT's LoHa/LoKr dropouts of adapter ``a`` for this call, drawn in PEFT's order from
    the CPU generator: (kept, rank mask (out,) or None). Module dropout skips the whole
    adapter; rank dropout masks ΔW's output rows (``rescale``: divided by its mean)."""
    p_module, p_rank = self.module_dropout[a], self.rank_dropout[a]
    if not self.training or not (p_module or p_rank):
        return True, None
    if not bool(torch.rand(1) > p_module):
        return False, None
    if not p_rank:
        return True, None
    mask = (torch.rand(self.get_base_layer().weight.shape[0]) > p_rank).float()
    return True, (mask / mask.mean() if rescale else mask)


def _masked(delta: torch.Tensor, mask: torch.Tensor, channel_axis: int) -> torch.Tensor:
    shape = [1] * delta.dim()
    shape[channel_axis] = -1
    return delta * mask.to(device=delta.device, dtype=delta.dtype).view(shape)


def _conv_base_reason(self) -> Optional[str]:
    """LoHa/LoKr convs use the base's geometry: a plain 2-D conv (groups 1, zero padding)."""
    base = self.get_base_layer()
    if (type(base) is not nn.Conv2d or base.groups != 1 or base.padding_mode != "zeros"
            or isinstance(base.padding, str)):
        return _R_CONV_BASE
    return None


def _loha_reason(self, conv: bool = False) -> Optional[str]:
    reason = _state_reason(self) or (_conv_base_reason(self) if conv else None)
    if reason is not None:
        return reason
    active = _active(self, self._available_adapters)
    if not active:
        return _R_NO_ADAPTER
    if any(a in self.hada_t1 for a in active):
        return _R_LOHA_TUCKER
    return None


def _loha_run(self, x, args, kwargs, conv: bool):
    """PEFT's LoHa (non-tucker): ``loha_bypass_fwd`` on a linear (ΔW never stored), or
    ``conv(x, s·ΔW)`` with ΔW from the merge op on a conv (w1b/w2b (r, I·kh·kw))."""
    reason = _call_reason(args, kwargs) or _loha_reason(self, conv)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    base = self.get_base_layer()
    geometry = dict(kernel_size=base.kernel_size, stride=base.stride, padding=base.padding,
                    dilation=base.dilation) if conv else {}
    result = self.base_layer(x)
    dt = x.dtype
    xin = _batched(x) if conv else x
    for a in _active(self, self._available_adapters):
        kept, mask = _lyco_draws(self, a, rescale=True)  # PEFT's LoHa always rescales the rank mask
        if not kept:
            continue
        factors = (self.hada_w1_a[a], self.hada_w1_b[a], self.hada_w2_a[a], self.hada_w2_b[a])
        s = float(self.scaling[a])
        if mask is None and not conv:
            result = _loha.bypass(x, *factors, s, base=result)
            continue
        delta = _loha.bypass(xin, *factors, s, **geometry)
        delta = delta if mask is None else _masked(delta, mask, 1 if conv else -1)
        result = result + (delta if delta.dim() == x.dim() else delta.squeeze(0))
    return result.to(dt)


def _loha_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, False)


def _loha_conv_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, True)


def _lokr_reason(self, conv: bool = False) -> Optional[str]:
    reason = _state_reason(self) or (_conv_base_reason(self) if conv else None)
    if reason is not None:
        return reason
    active = _active(self, self._available_adapters)
    if not active:
        return _R_NO_ADAPTER
    if not conv and any(a in self.lokr_t2 for a in active):
        return _R_LOKR_TUCKER_LINEAR
    return None


def _lokr_factors(self, a, conv: bool = False):
    """PEFT's LoKr tensors of adapter ``a`` as ``functional.lokr`` factors; for a conv,
    side 2 as a (c, d·kh·kw) matrix (PEFT stores a factored w2b flattened already)."""
    f = {}
    if a in self.lokr_w1:
        f["w1"] = self.lokr_w1[a]
    else:
        f["w1a"], f["w1b"] = self.lokr_w1_a[a], self.lokr_w1_b[a]
    if a in self.lokr_w2:
        f["w2"] = self.lokr_w2[a].flatten(1) if conv else self.lokr_w2[a]
    elif a in self.lokr_t2:  # conv only (the reason above keeps linears with t2 on PEFT's forward)
        t2, w2a, w2b = self.lokr_t2[a], self.lokr_w2_a[a], self.lokr_w2_b[a]
        f["w2"] = _lokr._tucker_w2(t2, w2a, w2b, torch.promote_types(t2.dtype, w2a.dtype)).flatten(1)
    else:
        f["w2a"], f["w2b"] = self.lokr_w2_a[a], self.lokr_w2_b[a]
    return f


def _lokr_run(self, x, args, kwargs, conv: bool):
    """PEFT's LoKr: ``lokr_bypass_fwd`` on x (linear) or on x's im2col rows (conv, the
    base's geometry; ΔW's flattened columns are kron(w1, w2_flat)'s)."""
    reason = _call_reason(args, kwargs) or _lokr_reason(self, conv)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    result = self.base_layer(x)
    dt = x.dtype
    rows = None
    for a in _active(self, self._available_adapters):
        kept, mask = _lyco_draws(self, a, rescale=bool(self.rank_dropout_scale[a]))
        if not kept:
            continue
        s = float(self.scaling[a])
        if not conv:
            if mask is None:
                result = _lokr.lokr_bypass(x, **_lokr_factors(self, a), scale=s, base=result)
            else:
                result = result + _masked(_lokr.lokr_bypass(x, **_lokr_factors(self, a), scale=s), mask, -1)
            continue
        if rows is None:
            base = self.get_base_layer()
            rows, nhw = _rows(_batched(x), base.kernel_size, base.stride, base.padding, base.dilation)
        delta = _lokr.lokr_bypass(rows, **_lokr_factors(self, a, conv=True), scale=s)
        delta = _unrows(delta if mask is None else _masked(delta, mask, -1), nhw)
        result = result + (delta if x.dim() == 4 else delta.squeeze(0))
    return result.to(dt)


def _lokr_forward(self, x, *args, **kwargs):
    return _lokr_run(self, x, args, kwargs, False)


def _lokr_conv_forward(self, x, *args, **kwargs):
    return _lokr_run(self, x, args, kwargs, True)


# --------------------------------------------------------------------------- IA3


def _ia3_reason(self) -> Optional[str]:
    return _state_reason(self) or (None if _active(self, self.ia3_l) else _R_NO_ADAPTER)


def _ia3_run(self, x, args, kwargs, axis: int):
    """PEFT's IA3: ``base(x)⊙w`` (bias included, as PEFT scales the result) or, for a
    feed-forward layer, ``base(x⊙w)``; w the product of the active adapters' vectors,
    along ``axis`` (``ia3_fwd``)."""
    reason = _call_reason(args, kwargs) or _ia3_reason(self)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    w = None
    for a in _active(self, self.ia3_l):
        v = self.ia3_l[a].reshape(-1)
        w = v if w is None else w * v
    if self.is_feedforward:
        return self.base_layer(torch.ops.lycoris.ia3_fwd(x, w, axis, 0.0, 1.0).to(x.dtype))
    y = self.base_layer(x)
    return torch.ops.lycoris.ia3_fwd(y, w, axis, 0.0, 1.0).to(y.dtype)


def _ia3_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, -1)


def _ia3_conv_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, -3)  # the channel axis of (N, C, H, W) and of unbatched (C, H, W)

# --------------------------------------------------------------------------- OFT
#
# PEFT's OFT block k: Q_k = M_k − M_kᵀ with M_k the vector scattered above the
# diagonal, R_k = (I − Q_k)(I + Q_k)⁻¹ (exact branch), and the layer feeds
# ``x·blockdiag(R)`` to the base layer. ``oft_fwd`` (activation layout) maps a
# token's channel row vector v to ``v·R'`` with ``R' = (I + Q')(I − Q')⁻¹``,
# ``Q' = B − Bᵀ``: with B = M_kᵀ (the vector below the diagonal) Q' = −Q_k and
# R' = R_k. Rotating the weight instead (``W' = W·blockdiag(R)ᵀ``, the op applied
# to W's rows) needs R' = R_kᵀ, i.e. B = M_k.


def _oft_blocks(mod, lower: bool) -> torch.Tensor:
    """PEFT's ``OFTRotationModule.weight`` (n, S(S−1)/2) -> raw blocks (K, S, S)."""
    w = mod.weight
    S = mod.block_size
    lin = mod.cols * S + mod.rows if lower else mod.rows * S + mod.cols
    b = w.new_zeros(w.shape[0], S * S).index_copy(1, lin, w).view(w.shape[0], S, S)
    K = mod.in_features // S
    if b.shape[0] != K:  # block_share: one block for every channel group
        b = b.expand(K, S, S).contiguous()
    return b


def _oft_project(mod) -> None:
    if mod.coft:  # PEFT's constrained OFT: in-place per-block projection (as its forward does)
        with torch.no_grad():
            mod.weight.copy_(mod._project_batch(mod.weight, eps=mod.eps))


def _oft_rotate(blocks, h, cscale=1.0):
    """``oft_fwd`` on a 2-D (T, C) tensor: each row v -> v·R' (R' from ``blocks``)."""
    return torch.ops.lycoris.oft_fwd(blocks, h, None, cscale, False, False)


def _oft_reason(self, table, base_cls) -> Optional[str]:
    reason = _state_reason(self)
    if reason is not None:
        return reason
    if type(self.get_base_layer()) is not base_cls or getattr(self, "fan_in_fan_out", False):
        return _R_OFT_BASE
    active = _active(self, table)
    if not active:
        return _R_NO_ADAPTER
    for a in active:
        if getattr(table[a], "use_cayley_neumann", True):
            return _R_NEUMANN
        drop = self.oft_dropout[a] if a in self.oft_dropout else None
        if self.training and drop is not None and not isinstance(drop, nn.Identity):
            return _R_OFT_DROPOUT
    return None


def _oft_linear_forward(self, x, *args, **kwargs):
    reason = _call_reason(args, kwargs) or _oft_reason(self, self.oft_R, nn.Linear)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    mods = [self.oft_R[a] for a in _active(self, self.oft_R)]
    base = self.get_base_layer()
    prev = x.dtype
    for mod in mods:
        _oft_project(mod)
    C = self.in_features
    if x.numel() // C <= self.out_features:  # rotate the activations (x·R_1·R_2…)
        h = x.reshape(-1, C)
        for mod in mods:
            h = _oft_rotate(_oft_blocks(mod, lower=True), h)
        return base(h.reshape(x.shape).to(prev)).to(prev)
    w = base.weight  # rotate the weight's input channels: W·(R_1·R_2…)ᵀ = W·…·R_2ᵀ·R_1ᵀ
    for mod in reversed(mods):
        w = _oft_rotate(_oft_blocks(mod, lower=False), w)
    return F.linear(x, w, base.bias).to(prev)


def _oft_conv2d_forward(self, x, *args, **kwargs):
    reason = (_call_reason(args, kwargs) or _oft_reason(self, self.oft_R, nn.Conv2d)
              or (None if x.dim() == 4 else _R_OFT_UNBATCHED))
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    prev = x.dtype
    h = x
    for a in _active(self, self.oft_R):
        mod = self.oft_R[a]
        _oft_project(mod)
        h = h.to(mod.weight.dtype)
        shape = h.shape
        u = _oft_rotate(_oft_blocks(mod, lower=True), mod._unfold(h))
        h = mod._fold(u, shape)
    return self.get_base_layer()(h.to(prev)).to(prev)


def _oft_embedding_forward(self, x, *args, **kwargs):
    reason = _call_reason(args, kwargs) or _oft_reason(self, self.oft_embedding_R, nn.Embedding)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    result = self.get_base_layer()(x)
    out_dtype = result.dtype
    h = result.reshape(-1, result.shape[-1])
    for a in _active(self, self.oft_embedding_R):
        mod = self.oft_embedding_R[a]
        _oft_project(mod)
        h = _oft_rotate(_oft_blocks(mod, lower=True), h)
    return h.reshape(result.shape).to(out_dtype)


# -------------------------------------------------------------------------- BOFT
#
# PEFT's BOFT adapter: R (N, D, H, H) raw blocks, R_t,b = (I − S)(I + S)⁻¹ with
# S = ½(B − Bᵀ) (= the op's Cayley transform with cscale = ½ of Bᵀ), stage
# matrices M_t = P_t·blockdiag(R_t)·P_tᵀ (P_t = ``boft_P[t]``, P_t[r, perm_t[r]] = 1),
# M = M_{N−1}···M_0, and the layer computes ``base(x·M)·boft_s`` (Linear) or a
# conv with the weight ``(W·Mᵀ)·boft_s`` (Conv2d). Rotating the weight's rows by M
# applies stage 0 first, like ``boft_fwd`` (axis −1 of W), whose stage t must then
# reproduce M_t: the op's block β, slot p holds channel π_t(β·s + p); PEFT holds
# channel c at block-diagonal position perm_t[c] = b·H + j. When every op block's
# channels lie in one PEFT block b, F_t,β[p, q] = R_t,b[j_p, j_q], which is the
# op's Cayley transform (cscale ½) of the gathered G[p, q] = B_t,b[j_q, j_p].

_BOFT_CACHE = "_lycoris_ops_boft_index"


def _boft_gather_index(perm: torch.Tensor, N: int, D: int, H: int):
    """Flat gather index (N, D, H, H) into PEFT's R for ``boft_fwd``, or None when a
    stage's channel partition differs from the op's (CPU, int64)."""
    from lycoris_ops.reference.boft import stage_permutation
    C = D * H
    out = torch.empty(N, D, H, H, dtype=torch.long)
    for t in range(N):
        pos = perm[t]
        if not torch.equal(torch.sort(pos).values, torch.arange(C)):
            return None
        ch = stage_permutation(t, H, C)[0].view(D, H)
        b, j = (pos // H)[ch], (pos % H)[ch]
        if not bool((b == b[:, :1]).all()):
            return None
        out[t] = ((t * D + b[:, :1, None]) * H + j[:, None, :]) * H + j[:, :, None]
    return out


def _boft_index(self, a):
    """None: one stage (``oft_fwd``); a tensor: ``boft_fwd`` gather index; a str: why not."""
    R = self.boft_R[a]
    N, D, H = R.shape[0], R.shape[1], R.shape[2]
    cache = self.__dict__.setdefault(_BOFT_CACHE, {})
    hit = cache.get(a)
    if hit is not None and hit[0] == (N, D, H, R.device):
        return hit[1]
    P = getattr(self, "boft_P", None)
    C = D * H
    if P is None or P.dim() != 3 or tuple(P.shape) != (N, C, C):
        idx = _R_BOFT_PARTITION
    else:
        with torch.no_grad():
            perm = P.detach().argmax(dim=-1).cpu()
        if N == 1:
            idx = None if torch.equal(perm[0], torch.arange(C)) else _R_BOFT_PARTITION
        elif not getattr(self, "fbd_cuda_available", False):
            idx = _R_BOFT_NO_FBD
        else:
            g = _boft_gather_index(perm, N, D, H)
            idx = _R_BOFT_PARTITION if g is None else g.to(R.device)
    cache[a] = ((N, D, H, R.device), idx)
    return idx


def _boft_reason(self, base_cls) -> Optional[str]:
    reason = _state_reason(self)
    if reason is not None:
        return reason
    base = self.get_base_layer()
    if type(base) is not base_cls or getattr(self, "fan_in_fan_out", False):
        return _R_OFT_BASE
    if base_cls is nn.Conv2d and (not self.cast_input_dtype_enabled or isinstance(base.padding, str)
                                  or base.kernel_size[0] != base.kernel_size[1]):
        return _R_BOFT_CONV
    active = _active(self, self.boft_R)
    if not active:
        return _R_NO_ADAPTER
    for a in active:
        if self.training and not isinstance(self.boft_dropout[a], nn.Identity):
            return _R_BOFT_DROPOUT
        idx = _boft_index(self, a)
        if isinstance(idx, str):
            return idx
    return None


def _boft_op(self) -> str:
    plans = [_boft_index(self, a) for a in _active(self, self.boft_R)]
    return "lycoris.oft_fwd" if all(idx is None for idx in plans) else "lycoris.boft_fwd"


def _boft_plans(self):
    return [(a, _boft_index(self, a)) for a in _active(self, self.boft_R)]


def _boft_rotate_weight(self, plans, w2):
    """Rows of w2 (O, C) -> M·row for M = M_last···M_first (PEFT's adapter order)."""
    for a, idx in plans:
        R = self.boft_R[a]
        if idx is None:
            w2 = _oft_rotate(R[0], w2, 0.5)
        else:
            w2 = torch.ops.lycoris.boft_fwd(R.reshape(-1)[idx], w2, -1, 0.5, 1.0, None, False)
    return w2


def _boft_scale(self, plans, conv: bool):
    s = None
    for a, _ in plans:
        sa = self.boft_s[a]
        sa = sa.transpose(0, 1) if conv else sa
        s = sa if s is None else sa * s
    return s  # (O, 1)


def _boft_linear_forward(self, x, *args, **kwargs):
    reason = _call_reason(args, kwargs) or _boft_reason(self, nn.Linear)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    plans = _boft_plans(self)
    base = self.get_base_layer()
    prev = x.dtype
    scale = _boft_scale(self, plans, conv=False)
    C = self.in_features
    if all(idx is None for _, idx in plans) and x.numel() // C <= self.out_features:
        # one stage each: rotate the activations, x·M_last···M_first… in row form
        h = x.reshape(-1, C)
        for a, _ in reversed(plans):
            h = _oft_rotate(self.boft_R[a][0].transpose(-1, -2).contiguous(), h, 0.5)
        y = F.linear(h.reshape(x.shape), base.weight) * scale.reshape(-1)
        if base.bias is not None:
            y = y + base.bias
        return y.to(prev)
    w = _boft_rotate_weight(self, plans, base.weight)
    w = (w * scale).to(base.weight.dtype)
    return F.linear(x, w, base.bias).to(prev)


def _boft_conv2d_forward(self, x, *args, **kwargs):
    reason = _call_reason(args, kwargs) or _boft_reason(self, nn.Conv2d)
    if reason is not None:
        return _fallback(self, reason, x, args, kwargs)
    plans = _boft_plans(self)
    base = self.get_base_layer()
    prev = x.dtype
    W = base.weight
    w = _boft_rotate_weight(self, plans, W.reshape(W.shape[0], -1))
    w = (w * _boft_scale(self, plans, conv=True)).to(W.dtype).view(W.shape)
    bias = base.bias.to(W.dtype) if base.bias is not None else None
    y = F.conv2d(x.to(W.dtype), w, bias, padding=base.padding[0], stride=base.stride[0])
    return y.to(prev)


# --------------------------------------------------------------- table, report


class _Route(NamedTuple):
    forward: Callable  #: our forward for the layer
    reason: Callable[[nn.Module], Optional[str]]  #: why the layer's current state falls back (None: it doesn't)
    op: Union[str, Callable[[nn.Module], str]]  #: the lycoris op its fast path runs (the main one)


_LORA = _Route(_lora_forward, _lora_reason, "lycoris.lora_bypass_fwd")
_LORA_QUANT = _Route(_lora_quant_forward, functools.partial(_lora_reason, dora_ok=False), "lycoris.lora_bypass_fwd")

#: PEFT module -> {layer class name: route}; a class missing from the installed PEFT (or
#: needing a missing package, e.g. the bitsandbytes layers) is skipped
_ROUTES = {
    "peft.tuners.lora": {"Linear": _LORA,
                         "Conv2d": _Route(_lora_conv_forward, _lora_conv_reason, "lycoris.lora_bypass_fwd")},
    "peft.tuners.lora.bnb": {"Linear8bitLt": _LORA_QUANT, "Linear4bit": _LORA_QUANT},
    "peft.tuners.lora.torchao": {"TorchaoLoraLinear": _LORA_QUANT},
    "peft.tuners.loha": {"Linear": _Route(_loha_forward, _loha_reason, "lycoris.loha_bypass_fwd"),
                         "Conv2d": _Route(_loha_conv_forward, functools.partial(_loha_reason, conv=True),
                                          "lycoris.lora_merge_fwd")},
    "peft.tuners.lokr": {"Linear": _Route(_lokr_forward, _lokr_reason, "lycoris.lokr_bypass_fwd"),
                         "Conv2d": _Route(_lokr_conv_forward, functools.partial(_lokr_reason, conv=True),
                                          "lycoris.lokr_bypass_fwd")},
    "peft.tuners.ia3": {"Linear": _Route(_ia3_forward, _ia3_reason, "lycoris.ia3_fwd"),
                        "Conv2d": _Route(_ia3_conv_forward, _ia3_reason, "lycoris.ia3_fwd")},
    "peft.tuners.oft.layer": {
        "Linear": _Route(_oft_linear_forward, lambda m: _oft_reason(m, m.oft_R, nn.Linear), "lycoris.oft_fwd"),
        "Conv2d": _Route(_oft_conv2d_forward, lambda m: _oft_reason(m, m.oft_R, nn.Conv2d), "lycoris.oft_fwd"),
        "Embedding": _Route(_oft_embedding_forward, lambda m: _oft_reason(m, m.oft_embedding_R, nn.Embedding),
                            "lycoris.oft_fwd")},
    "peft.tuners.boft.layer": {
        "Linear": _Route(_boft_linear_forward, functools.partial(_boft_reason, base_cls=nn.Linear), _boft_op),
        "Conv2d": _Route(_boft_conv2d_forward, functools.partial(_boft_reason, base_cls=nn.Conv2d), _boft_op)},
}


@functools.lru_cache(maxsize=None)
def _table():
    """{PEFT layer class: _Route} for the installed PEFT (imported on first use)."""
    table = {}
    for module, routes in _ROUTES.items():
        try:  # a PEFT version without a tuner (or its quantization package) patches the others
            m = importlib.import_module(module)
        except Exception:  # pragma: no cover
            continue
        for cls, route in routes.items():
            if hasattr(m, cls):
                table[getattr(m, cls)] = route
    return table


@functools.lru_cache(maxsize=None)
def _tuner_layer_class():
    from peft.tuners.tuners_utils import BaseTunerLayer
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
    (see the module docstring). Idempotent. Returns the :class:`~lycoris_ops.report.Report`
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
            if route.forward in (_boft_linear_forward, _boft_conv2d_forward):
                for a in m.boft_R.keys():  # build the gather indices now (eager, outside any compile)
                    _boft_index(m, a)
        row = _describe_peft(name, m)
        if row is not None:
            report.append(row)
            if not row.fused and row.reason not in _QUIET:
                warn_fallback(row.reason)
    return report


def unpatch_peft(model: nn.Module) -> int:
    """Undo :func:`patch_peft`. Returns the number of layers restored."""
    n = 0
    for m in model.modules():
        if m.__dict__.get(_ORIG, False):
            del m.__dict__["forward"]
            del m.__dict__[_ORIG]
            m.__dict__.pop(_BOFT_CACHE, None)
            n += 1
    return n
