"""Run an existing PEFT model's adapters on ``torch.ops.lycoris.*``.

``patch_peft(model)`` swaps the ``forward`` of each supported PEFT layer
(instance attribute; the class is untouched) for one that calls our ops, and
keeps every parameter, buffer, state-dict key and PEFT feature (merge/unmerge,
``disable_adapters``, adapter switching, saving) as it is. ``unpatch_peft``
restores the original forwards. Supported (fast path):

- ``peft.tuners.lora.Linear``, vanilla LoRA: ``lora_bypass_fwd`` with the base
  output folded in (``y = base(x) + s·B·A·dropout(x)``);
- ``peft.tuners.lora.Linear`` with DoRA (``use_dora=True``):
  ``k = magnitude/‖W + s·B·A‖`` (norm in fp32 from ``‖W‖² + 2s·B·(W·Aᵀ) + s²·B·(A·Aᵀ)·Bᵀ``
  per row, no merged weight built; detached as PEFT does), ``y = base(x) + k⊙(W·x' + s·B·A·x') − W·x'`` with the bracket one
  ``lora_bypass_fwd`` call (x' = dropout(x); W·x' is ``base(x) − bias`` when there
  is no dropout);
- ``peft.tuners.loha.Linear`` (non-tucker): ``loha_bypass_fwd``;
- ``peft.tuners.lokr.Linear`` (non-tucker): ``lokr_bypass_fwd``;
- ``peft.tuners.lora.Conv2d`` (vanilla LoRA): the rank-r conv with lora_A's own
  stride/padding/dilation, then the 1×1 up conv (``functional.locon.bypass``);
- ``peft.tuners.loha.Conv2d`` (non-tucker): ``conv(x, s·ΔW)`` with ΔW from the merge op;
- ``peft.tuners.lokr.Conv2d`` (whole, factored or tucker w2): ``lokr_bypass_conv``
  (x convolved with w2 per group of input channels, contracted with w1; ΔW never built);
- ``peft.tuners.ia3.Linear`` / ``Conv2d``: ``ia3_fwd`` on the output (or the input for
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

Anything else falls back to PEFT's own forward per call: merged or disabled
adapters, ``adapter_names=`` mixed batches, extra forward args, ``fan_in_fan_out``,
non-``nn.Linear``/``nn.Conv2d``/``nn.Embedding`` (e.g. quantized) base layers, grouped or
non-zero-padded convs, LoHa's tucker convs (``use_effective_conv2d``), DoRA on convs,
other LoRA variants, ``lora_bias``, LoHa/LoKr rank or module dropout in
training, tucker factors on linear layers; OFT with the Cayley–Neumann series
(``use_cayley_neumann=True``, **PEFT's default**: a truncated series, not the
exact Cayley transform our ops compute — their outputs differ by far more than
a dtype tolerance once the blocks move from zero — in PEFT 0.21.2 the series
even approximates the transpose of its exact branch's R — so those layers stay
on PEFT's forward and keep the numbers the adapter was trained with), OFT
``module_dropout`` / BOFT ``boft_dropout`` in training (random block masks),
BOFT with several stages but no CUDA block-diagonal extension (PEFT's own
forward raises there), BOFT stages whose channel partition does not match
``boft_fwd``'s, non-square conv kernels, string conv padding, unbatched (3-D)
inputs to an OFT Conv2d.

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

import importlib
import types

import torch
import torch.nn as nn

from .functional import dora as _dora
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


def _common_ok(self, x, args, kwargs, base_cls=nn.Linear) -> bool:
    return (not args and not kwargs and not self.disable_adapters and not self.merged
            and type(self.get_base_layer()) is base_cls and not getattr(self, "fan_in_fan_out", False))


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
            with torch.no_grad():  # ‖W + s·B·A‖ per row in fp32, without building the merged weight
                norm = _dora.lowrank_norm_terms(W.detach(), B.detach(), A.detach(), s)[0].clamp_min(0).sqrt()
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


def _conv_ok(self, x, args, kwargs) -> bool:
    """A plain 2-D conv base (groups 1, zero padding) on a batched (4-D) input."""
    if not _common_ok(self, x, args, kwargs, nn.Conv2d) or x.dim() != 4:
        return False
    base = self.get_base_layer()
    return base.groups == 1 and base.padding_mode == "zeros" and not isinstance(base.padding, str)


def _lora_conv_forward(self, x, *args, **kwargs):
    """PEFT's LoRA Conv2d: ``base(x) + s·B(A(dropout(x)))``, A the rank-r conv with its own
    stride/padding/dilation, B 1×1 (``functional.locon.bypass``'s conv chain)."""
    if not _conv_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.lora_A.keys()]
    for a in active:
        A, B = self.lora_A[a], self.lora_B[a]
        if (a in getattr(self, "lora_variant", {}) or B.bias is not None or A.groups != 1 or B.groups != 1
                or tuple(B.kernel_size) != (1, 1) or isinstance(A.padding, str)):
            return type(self).forward(self, x, *args, **kwargs)
    result = self.get_base_layer()(x)
    out_dtype = result.dtype
    for a in active:
        A, B = self.lora_A[a], self.lora_B[a]
        dropout = self.lora_dropout[a]
        xd = x if isinstance(dropout, nn.Identity) or not self.training else dropout(x)
        result = _locon.bypass(xd, B.weight, A.weight, float(self.scaling[a]), base=result, stride=A.stride,
                               padding=A.padding, dilation=A.dilation)
    return result.to(out_dtype)


def _lyco_ok(self, a) -> bool:
    if self.training and (self.rank_dropout[a] or self.module_dropout[a]):
        return False
    return True


def _loha_run(self, x, args, kwargs, ok: bool, conv: bool):
    """PEFT's LoHa (non-tucker): ``loha_bypass_fwd`` on a linear (ΔW never stored), or
    ``conv(x, s·ΔW)`` with ΔW from the merge op on a conv (w1b/w2b (r, I·kh·kw))."""
    active = [a for a in self.active_adapters if a in self._available_adapters]
    if not ok or any(a in self.hada_t1 or not _lyco_ok(self, a) for a in active):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.get_base_layer()
    geometry = dict(kernel_size=base.kernel_size, stride=base.stride, padding=base.padding,
                    dilation=base.dilation) if conv else {}
    result = base(x)
    dt = x.dtype
    for a in active:
        result = _loha.bypass(x, self.hada_w1_a[a], self.hada_w1_b[a], self.hada_w2_a[a], self.hada_w2_b[a],
                              float(self.scaling[a]), base=result, **geometry)
    return result.to(dt)


def _loha_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, _common_ok(self, x, args, kwargs), False)


def _loha_conv_forward(self, x, *args, **kwargs):
    return _loha_run(self, x, args, kwargs, _conv_ok(self, x, args, kwargs), True)


def _lokr_factors(self, a, kernel=None):
    """PEFT's LoKr tensors of adapter ``a`` as ``functional.lokr`` factors (a conv's flattened
    w2b (r, d·kh·kw) gets its kernel axes back)."""
    f = {}
    if a in self.lokr_w1:
        f["w1"] = self.lokr_w1[a]
    else:
        f["w1a"], f["w1b"] = self.lokr_w1_a[a], self.lokr_w1_b[a]
    if a in self.lokr_w2:
        f["w2"] = self.lokr_w2[a]
    else:
        f["w2a"], f["w2b"] = self.lokr_w2_a[a], self.lokr_w2_b[a]
        if a in self.lokr_t2:
            f["t2"] = self.lokr_t2[a]
        elif kernel is not None:
            f["w2b"] = f["w2b"].reshape(f["w2b"].shape[0], -1, *kernel)
    return f


def _lokr_forward(self, x, *args, **kwargs):
    if not _common_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self._available_adapters]
    if any(a in self.lokr_t2 or not _lyco_ok(self, a) for a in active):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.get_base_layer()(x)
    dt = x.dtype
    for a in active:
        result = _lokr.lokr_bypass(x, **_lokr_factors(self, a), scale=float(self.scaling[a]), base=result)
    return result.to(dt)


def _lokr_conv_forward(self, x, *args, **kwargs):
    """PEFT's LoKr Conv2d (whole, factored or tucker w2): ``lokr_bypass_conv`` (ΔW never built)."""
    if not _conv_ok(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self._available_adapters]
    if any(not _lyco_ok(self, a) for a in active):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.get_base_layer()
    result = base(x)
    dt = x.dtype
    for a in active:
        result = _lokr.lokr_bypass_conv(x, **_lokr_factors(self, a, tuple(base.kernel_size)),
                                        scale=float(self.scaling[a]), base=result, stride=base.stride,
                                        padding=base.padding, dilation=base.dilation)
    return result.to(dt)


def _ia3_run(self, x, args, kwargs, ok: bool, axis: int):
    """PEFT's IA3 with one active adapter: ``base(x)⊙w`` (bias included, as PEFT scales the
    result) or, for a feed-forward layer, ``base(x⊙w)``; w along ``axis`` (``ia3_fwd``)."""
    active = [a for a in self.active_adapters if a in self.ia3_l.keys()] if ok else []
    if len(active) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    w = self.ia3_l[active[0]].reshape(-1)
    base = self.get_base_layer()
    if self.is_feedforward:
        return base(torch.ops.lycoris.ia3_fwd(x, w, axis, 0.0, 1.0).to(x.dtype))
    y = base(x)
    return torch.ops.lycoris.ia3_fwd(y, w, axis, 0.0, 1.0).to(y.dtype)


def _ia3_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, _common_ok(self, x, args, kwargs), -1)


def _ia3_conv_forward(self, x, *args, **kwargs):
    return _ia3_run(self, x, args, kwargs, _conv_ok(self, x, args, kwargs), 1)


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


def _oft_ok(self, a, mod) -> bool:
    if getattr(mod, "use_cayley_neumann", True):
        return False
    drop = self.oft_dropout[a] if a in self.oft_dropout else None
    return not (self.training and drop is not None and not isinstance(drop, nn.Identity))


def _oft_project(mod) -> None:
    if mod.coft:  # PEFT's constrained OFT: in-place per-block projection (as its forward does)
        with torch.no_grad():
            mod.weight.copy_(mod._project_batch(mod.weight, eps=mod.eps))


def _oft_rotate(blocks, h, cscale=1.0):
    """``oft_fwd`` on a 2-D (T, C) tensor: each row v -> v·R' (R' from ``blocks``)."""
    return torch.ops.lycoris.oft_fwd(blocks, h, None, cscale, False, False)


def _oft_mods(self, table, x, args, kwargs, base_cls):
    if not _common_ok(self, x, args, kwargs, base_cls):
        return None
    active = [a for a in self.active_adapters if a in table.keys()]
    mods = [table[a] for a in active]
    if not mods or not all(_oft_ok(self, a, m) for a, m in zip(active, mods)):
        return None
    return mods


def _oft_linear_forward(self, x, *args, **kwargs):
    mods = _oft_mods(self, self.oft_R, x, args, kwargs, nn.Linear)
    if mods is None:
        return type(self).forward(self, x, *args, **kwargs)
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
    return torch.nn.functional.linear(x, w, base.bias).to(prev)


def _oft_conv2d_forward(self, x, *args, **kwargs):
    mods = _oft_mods(self, self.oft_R, x, args, kwargs, nn.Conv2d)
    if mods is None or x.dim() != 4:
        return type(self).forward(self, x, *args, **kwargs)
    prev = x.dtype
    h = x
    for mod in mods:
        _oft_project(mod)
        h = h.to(mod.weight.dtype)
        shape = h.shape
        u = _oft_rotate(_oft_blocks(mod, lower=True), mod._unfold(h))
        h = mod._fold(u, shape)
    return self.get_base_layer()(h.to(prev)).to(prev)


def _oft_embedding_forward(self, x, *args, **kwargs):
    mods = _oft_mods(self, self.oft_embedding_R, x, args, kwargs, nn.Embedding)
    if mods is None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.get_base_layer()(x)
    out_dtype = result.dtype
    h = result.reshape(-1, result.shape[-1])
    for mod in mods:
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
    from .reference.boft import stage_permutation
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
    """None: one stage (``oft_fwd``); a tensor: ``boft_fwd`` gather index; False: unsupported."""
    R = self.boft_R[a]
    N, D, H = R.shape[0], R.shape[1], R.shape[2]
    cache = self.__dict__.setdefault(_BOFT_CACHE, {})
    hit = cache.get(a)
    if hit is not None and hit[0] == (N, D, H, R.device):
        return hit[1]
    P = getattr(self, "boft_P", None)
    C = D * H
    if P is None or P.dim() != 3 or tuple(P.shape) != (N, C, C):
        idx = False
    else:
        with torch.no_grad():
            perm = P.detach().argmax(dim=-1).cpu()
        if N == 1:
            idx = None if torch.equal(perm[0], torch.arange(C)) else False
        elif not getattr(self, "fbd_cuda_available", False):
            idx = False  # PEFT's own forward cannot build several stages without its extension
        else:
            g = _boft_gather_index(perm, N, D, H)
            idx = False if g is None else g.to(R.device)
    cache[a] = ((N, D, H, R.device), idx)
    return idx


def _boft_plans(self, x, args, kwargs, base_cls):
    if not _common_ok(self, x, args, kwargs, base_cls):
        return None
    plans = []
    for a in self.active_adapters:
        if a not in self.boft_R.keys():
            continue
        if self.training and not isinstance(self.boft_dropout[a], nn.Identity):
            return None
        idx = _boft_index(self, a)
        if idx is False:
            return None
        plans.append((a, idx))
    return plans or None


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
    plans = _boft_plans(self, x, args, kwargs, nn.Linear)
    if plans is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.get_base_layer()
    prev = x.dtype
    scale = _boft_scale(self, plans, conv=False)
    C = self.in_features
    if all(idx is None for _, idx in plans) and x.numel() // C <= self.out_features:
        # one stage each: rotate the activations, x·M_last···M_first… in row form
        h = x.reshape(-1, C)
        for a, _ in reversed(plans):
            h = _oft_rotate(self.boft_R[a][0].transpose(-1, -2).contiguous(), h, 0.5)
        y = torch.nn.functional.linear(h.reshape(x.shape), base.weight) * scale.reshape(-1)
        if base.bias is not None:
            y = y + base.bias
        return y.to(prev)
    w = _boft_rotate_weight(self, plans, base.weight)
    w = (w * scale).to(base.weight.dtype)
    return torch.nn.functional.linear(x, w, base.bias).to(prev)


def _boft_conv2d_forward(self, x, *args, **kwargs):
    plans = _boft_plans(self, x, args, kwargs, nn.Conv2d)
    base = self.get_base_layer()
    if (plans is None or not self.cast_input_dtype_enabled or isinstance(base.padding, str)
            or base.kernel_size[0] != base.kernel_size[1]):
        return type(self).forward(self, x, *args, **kwargs)
    prev = x.dtype
    W = base.weight
    w = _boft_rotate_weight(self, plans, W.reshape(W.shape[0], -1))
    w = (w * _boft_scale(self, plans, conv=True)).to(W.dtype).view(W.shape)
    bias = base.bias.to(W.dtype) if base.bias is not None else None
    y = torch.nn.functional.conv2d(x.to(W.dtype), w, bias, padding=base.padding[0], stride=base.stride[0])
    return y.to(prev)


#: PEFT module -> {layer class name: our forward}
_FORWARDS = {
    "peft.tuners.lora": {"Linear": _lora_forward, "Conv2d": _lora_conv_forward},
    "peft.tuners.loha": {"Linear": _loha_forward, "Conv2d": _loha_conv_forward},
    "peft.tuners.lokr": {"Linear": _lokr_forward, "Conv2d": _lokr_conv_forward},
    "peft.tuners.ia3": {"Linear": _ia3_forward, "Conv2d": _ia3_conv_forward},
    "peft.tuners.oft.layer": {"Linear": _oft_linear_forward, "Conv2d": _oft_conv2d_forward,
                              "Embedding": _oft_embedding_forward},
    "peft.tuners.boft.layer": {"Linear": _boft_linear_forward, "Conv2d": _boft_conv2d_forward},
}


def _table():
    table = {}
    for module, forwards in _FORWARDS.items():
        try:  # a PEFT version without a tuner patches the others
            m = importlib.import_module(module)
            for cls, fn in forwards.items():
                table[getattr(m, cls)] = fn
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
        if fn in (_boft_linear_forward, _boft_conv2d_forward):
            for a in m.boft_R.keys():  # build the gather indices now (eager, outside any compile)
                _boft_index(m, a)
        n += 1
    return n


def unpatch_peft(model: nn.Module) -> int:
    """Undo :func:`patch_peft`. Returns the number of layers restored."""
    n = 0
    for m in model.modules():
        if getattr(m, _ORIG, False):
            del m.__dict__["forward"]
            del m.__dict__[_ORIG]
            m.__dict__.pop(_BOFT_CACHE, None)
            n += 1
    return n
