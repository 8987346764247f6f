"""PEFT's OFT and BOFT layers on ``oft_fwd`` / ``boft_fwd``.

- ``oft.Linear`` / ``Conv2d`` / ``Embedding`` with the exact Cayley transform
  (``use_cayley_neumann=False``): ``oft_fwd`` on the tokens' channels (``x·R``, as PEFT
  does) when the call has at most ``out_features`` tokens, else on the weight's input
  channels (``W·Rᵀ``, then one ``linear``). ``coft`` (PEFT's in-place per-block projection
  under ``no_grad``, repeated as its forward does) and ``block_share`` are supported; a
  conv follows the installed PEFT: from 0.22 it rotates the weight's flattened input
  channels (``W·Rᵀ``, any conv geometry), before it rotated the stride-1 unfolded patches
  and folded them back with PEFT's own ``_unfold``/``_fold``; an embedding rotates the
  looked-up rows.
- PEFT's default Cayley-Neumann series (``use_cayley_neumann=True``) falls back: it is a
  truncated series, not the exact transform the ops compute, and the outputs differ by far
  more than a dtype tolerance once the blocks move from zero; PEFT's forward keeps the
  numbers the adapter was trained with.
- ``boft.Linear`` / ``Conv2d``: one butterfly stage (PEFT's default, and all it builds
  without its CUDA block-diagonal extension) is block-diagonal and runs on ``oft_fwd`` with
  ``cscale=0.5`` (PEFT's ``½(B − Bᵀ)``); several stages run on ``boft_fwd`` over the
  weight's input channels, PEFT's blocks gathered into the op's block order (an index
  built once per adapter from ``boft_P``, checked to give the same channel partition in
  every stage, else the layer falls back). ``boft_s`` scales the output channels. A conv
  runs through the base layer's ``_conv_forward`` from PEFT 0.22 (any kernel, padding,
  dilation), before through ``F.conv2d`` with the first padding and stride, as PEFT did.
- Cayley transforms and rotations run in float32 inside the op, rounded once to the rotated
  tensor's dtype (a rotated BOFT weight is then scaled by ``boft_s`` and rounded again).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lycoris_ops.integrations.peft.common import R_NO_ADAPTER, Route, active_in, call_reason, fallback, state_reason
from lycoris_ops.reference.boft import stage_permutation

_R_NEUMANN = "OFT with the Cayley-Neumann series (use_cayley_neumann=True, PEFT's default)"
_R_OFT_DROPOUT = "OFT module dropout in training"
_R_OFT_UNBATCHED = "unbatched (3-D) input to an OFT Conv2d (PEFT before 0.22)"
_R_OFT_BASE = "OFT/BOFT on a base other than nn.Linear/nn.Conv2d/nn.Embedding (Conv1D, quantized)"
_R_BOFT_DROPOUT = "BOFT dropout in training"
_R_BOFT_NO_FBD = "BOFT with several stages and no CUDA block-diagonal extension (PEFT's forward raises too)"
_R_BOFT_PARTITION = "BOFT stage permutation that boft_fwd's butterfly cannot express"
_R_BOFT_CONV = "BOFT conv with input casting disabled, or a non-square kernel or string padding (PEFT before 0.22)"

# PEFT's OFT block k: Q_k = M_k − M_kᵀ with M_k the vector scattered above the
# diagonal, R_k = (I − Q_k)(I + Q_k)⁻¹ (exact branch), and the layer feeds
# ``x·blockdiag(R)`` to the base layer. ``oft_fwd`` (activation layout) maps a
# token's channel row vector v to ``v·R'`` with ``R' = (I + Q')(I − Q')⁻¹``,
# ``Q' = B − Bᵀ``: with B = M_kᵀ (the vector below the diagonal) Q' = −Q_k and
# R' = R_k. Rotating the weight instead (``W' = W·blockdiag(R)ᵀ``, the op applied
# to W's rows) needs R' = R_kᵀ, i.e. B = M_k.


@functools.lru_cache(maxsize=None)
def _peft_conv_weight_path() -> bool:
    """True from PEFT 0.22, whose OFT conv rotates the weight instead of unfolded patches
    and whose BOFT conv calls the base layer's ``_conv_forward``: the patched forwards
    reproduce the installed version's numbers."""
    from packaging.version import Version
    import peft
    return Version(peft.__version__) >= Version("0.22.0.dev0")


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
    reason = state_reason(self)
    if reason is not None:
        return reason
    if type(self.get_base_layer()) is not base_cls or getattr(self, "fan_in_fan_out", False):
        return _R_OFT_BASE
    active = active_in(self, table)
    if not active:
        return R_NO_ADAPTER
    for a in active:
        if getattr(table[a], "use_cayley_neumann", True):
            return _R_NEUMANN
        drop = self.oft_dropout[a] if a in self.oft_dropout else None
        if self.training and drop is not None and not isinstance(drop, nn.Identity):
            return _R_OFT_DROPOUT
    return None


def _oft_linear_forward(self, x, *args, **kwargs):
    reason = call_reason(args, kwargs) or _oft_reason(self, self.oft_R, nn.Linear)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    mods = [self.oft_R[a] for a in active_in(self, self.oft_R)]
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
    new = _peft_conv_weight_path()
    reason = (call_reason(args, kwargs) or _oft_reason(self, self.oft_R, nn.Conv2d)
              or (None if new or x.dim() == 4 else _R_OFT_UNBATCHED))
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    prev = x.dtype
    mods = [self.oft_R[a] for a in active_in(self, self.oft_R)]
    for mod in mods:
        _oft_project(mod)
    base = self.get_base_layer()
    if new:  # W·(R_1·R_2…)ᵀ on the flattened filters, the conv in the base weight's dtype
        W = base.weight
        w = W.reshape(W.shape[0], -1)
        for mod in reversed(mods):
            w = _oft_rotate(_oft_blocks(mod, lower=False), w.to(mod.weight.dtype))
        w = w.reshape(W.shape).to(W.dtype)
        return base._conv_forward(self._cast_input_dtype(x, W.dtype), w, base.bias).to(prev)
    h = x
    for mod in mods:
        h = h.to(mod.weight.dtype)
        shape = h.shape
        u = _oft_rotate(_oft_blocks(mod, lower=True), mod._unfold(h))
        h = mod._fold(u, shape)
    return base(h.to(prev)).to(prev)


def _oft_embedding_forward(self, x, *args, **kwargs):
    reason = call_reason(args, kwargs) or _oft_reason(self, self.oft_embedding_R, nn.Embedding)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    result = self.get_base_layer()(x)
    out_dtype = result.dtype
    h = result.reshape(-1, result.shape[-1])
    for a in active_in(self, self.oft_embedding_R):
        mod = self.oft_embedding_R[a]
        _oft_project(mod)
        h = _oft_rotate(_oft_blocks(mod, lower=True), h)
    return h.reshape(result.shape).to(out_dtype)


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

#: the layer attribute holding its BOFT gather indices (``unpatch_peft`` removes it)
BOFT_CACHE = "_lycoris_ops_boft_index"


def _boft_gather_index(perm: torch.Tensor, N: int, D: int, H: int):
    """Flat gather index (N, D, H, H) into PEFT's R for ``boft_fwd``, or None when a
    stage's channel partition differs from the op's (CPU, int64)."""
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
    cache = self.__dict__.setdefault(BOFT_CACHE, {})
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
    reason = state_reason(self)
    if reason is not None:
        return reason
    base = self.get_base_layer()
    if type(base) is not base_cls or getattr(self, "fan_in_fan_out", False):
        return _R_OFT_BASE
    if base_cls is nn.Conv2d and (not self.cast_input_dtype_enabled or (not _peft_conv_weight_path() and (
            isinstance(base.padding, str) or base.kernel_size[0] != base.kernel_size[1]))):
        return _R_BOFT_CONV
    active = active_in(self, self.boft_R)
    if not active:
        return R_NO_ADAPTER
    for a in active:
        if self.training and not isinstance(self.boft_dropout[a], nn.Identity):
            return _R_BOFT_DROPOUT
        idx = _boft_index(self, a)
        if isinstance(idx, str):
            return idx
    return None


def _boft_op(self) -> str:
    plans = [_boft_index(self, a) for a in active_in(self, self.boft_R)]
    return "lycoris.oft_fwd" if all(idx is None for idx in plans) else "lycoris.boft_fwd"


def _boft_plans(self):
    return [(a, _boft_index(self, a)) for a in active_in(self, self.boft_R)]


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
    reason = call_reason(args, kwargs) or _boft_reason(self, nn.Linear)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
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
    reason = call_reason(args, kwargs) or _boft_reason(self, nn.Conv2d)
    if reason is not None:
        return fallback(self, reason, x, args, kwargs)
    plans = _boft_plans(self)
    base = self.get_base_layer()
    prev = x.dtype
    W = base.weight
    w = _boft_rotate_weight(self, plans, W.reshape(W.shape[0], -1))
    w = (w * _boft_scale(self, plans, conv=True)).to(W.dtype).view(W.shape)
    bias = base.bias.to(W.dtype) if base.bias is not None else None
    if _peft_conv_weight_path():
        y = base._conv_forward(x.to(W.dtype), w, bias)
    else:
        y = F.conv2d(x.to(W.dtype), w, bias, padding=base.padding[0], stride=base.stride[0])
    return y.to(prev)


def _boft_prepare(self) -> None:
    for a in self.boft_R.keys():  # the gather indices, built eagerly (outside any compile)
        _boft_index(self, a)


#: PEFT module -> {layer class name: route}
ROUTES = {
    "peft.tuners.oft.layer": {
        "Linear": Route(_oft_linear_forward, lambda m: _oft_reason(m, m.oft_R, nn.Linear), "lycoris.oft_fwd"),
        "Conv2d": Route(_oft_conv2d_forward, lambda m: _oft_reason(m, m.oft_R, nn.Conv2d), "lycoris.oft_fwd"),
        "Embedding": Route(_oft_embedding_forward, lambda m: _oft_reason(m, m.oft_embedding_R, nn.Embedding),
                           "lycoris.oft_fwd")},
    "peft.tuners.boft.layer": {
        "Linear": Route(_boft_linear_forward, functools.partial(_boft_reason, base_cls=nn.Linear), _boft_op,
                        _boft_prepare),
        "Conv2d": Route(_boft_conv2d_forward, functools.partial(_boft_reason, base_cls=nn.Conv2d), _boft_op,
                        _boft_prepare)},
}
