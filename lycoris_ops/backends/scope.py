"""The scope of the fused kernels: one table, read by ``select`` and by the op sets.

A call takes a fused backend only when its operands are inside that backend's
scope for the op; otherwise it steps one tier down (the other fused backend in
``auto``, then ``compile`` on CUDA, then eager ``torch``), so no configuration
fails for lack of a kernel. Two kinds of rules live here:

- generic gates (every op): floating operands of one device type the op set
  serves, dtypes in ``FUSED_DTYPES`` (float64 steps down), no float16 mixed with
  bfloat16, no bfloat16 before sm_80, no zero-size operand;
- per-op rules (``SCOPE[op]``): register budgets (``limits``, quantities
  measured from the argument shapes by ``measure``), layouts (``layout`` gives a
  tag such as ``"linear"`` or ``"conv"``; ``layouts`` lists the tags a backend's
  kernel is written for) and extra predicates (``rules``).

Limits are keyed by backend, ``"*"`` being the value for any backend not
listed (docs/ops.md §4.4): the tucker rank and the hadamard rank are checked here,
and diag-OFT and BOFT have a block cap.

An op set reads its caps with ``limit(op, quantity, backend)`` (e.g.
``limit("oft_fwd", "block", "triton")`` -> 64) and may assume every call it
receives passed ``why_not(op, backend, args) is None``. Everything here reads
shapes, dtypes and flags only: never tensor data (no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Mapping, Optional, Sequence

import torch

ANY = "*"

#: dtypes a fused kernel takes (per backend; an op set may override with ``DTYPES``)
FUSED_DTYPES: Dict[str, tuple] = {ANY: (torch.float16, torch.bfloat16, torch.float32)}
#: minimum compute capability of a backend under ``auto`` (a named backend ignores it);
#: Triton's tensor-core dots and bf16 MMA need sm_80. An op set may override with ``MIN_CAPABILITY``.
MIN_CAPABILITY: Dict[str, tuple] = {"triton": (8, 0)}
#: bfloat16 operands go to a fused kernel only from this capability on (every backend)
BF16_CAPABILITY = (8, 0)


def pad(n: int, lo: int = 16) -> int:
    """``n`` padded to a power of two, at least ``lo`` (the kernels' register tiles)."""
    p = lo
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class OpScope:
    """The fused scope of one op (see the module docstring)."""

    #: args -> {quantity: value}; each quantity must be <= its cap in ``limits``
    measure: Optional[Callable[..., Dict[str, int]]] = None
    #: quantity -> {backend or "*": cap}
    limits: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    #: args -> layout tag
    layout: Optional[Callable[..., str]] = None
    #: backend or "*" -> the layout tags its kernel is written for (absent: every layout)
    layouts: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    #: backend or "*" -> args -> None (in scope) or the reason it is not
    rules: Mapping[str, Callable[..., Optional[str]]] = field(default_factory=dict)


def _rank(t: torch.Tensor, dim: int = 1) -> Dict[str, int]:
    return {"rank": pad(int(t.shape[dim]))}


def _oft_layout(x: torch.Tensor, weight: bool) -> str:
    if weight:
        return "weight"
    return "linear" if x.dim() == 2 else "conv"


def _boft_layout(x: torch.Tensor, axis: int) -> str:
    axis = axis % max(x.dim(), 1)
    if axis == x.dim() - 1:
        return "linear"  # channels last: (..., C)
    if axis == 0:
        return "weight"  # (C, rest...)
    return "conv"  # (N, C, *spatial)


def _ia3_layout(x: torch.Tensor, channel_axis: int) -> str:
    return "linear" if channel_axis % max(x.dim(), 1) == x.dim() - 1 else "conv"


def _lokr_factors(w1, w2) -> Dict[str, int]:
    return {"factor": pad(max(int(s) for s in tuple(w1.shape) + tuple(w2.shape)))}


def _lokr_held(w1, w2) -> Dict[str, int]:
    """The LoKr forward's quantities: every factor dim, and the smaller inner dim (b or d)."""
    return {**_lokr_factors(w1, w2), "held": min(pad(int(w1.shape[1])), pad(int(w2.shape[1])))}


def _same_dtype(base, delta, gamma) -> Optional[str]:
    if base.dtype != delta.dtype:
        return f"base is {base.dtype} but delta is {delta.dtype} (the kernel takes one dtype)"
    return None


_RANK_128 = {"rank": {ANY: 128}}


def _tc16(*tensors) -> Optional[str]:
    """TileLang's GEMM kernels (LoRA/LoHa/LoKr/tucker) run on tensor cores, where fp32
    operands lower to TF32: an fp32 compute dtype (no 16-bit matrix operand) steps down."""
    if any(t is not None and t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        return None
    return "fp32 compute dtype (TileLang tensor-core GEMMs would run it as TF32)"


_OFT_LIMITS = {"block": {ANY: 64}}  # the padded block's Cayley solve in registers
_BOFT_LIMITS = {"block": {ANY: 64}}

#: op -> its fused scope. Ops absent from a backend's op set step down regardless.
SCOPE: Dict[str, OpScope] = {
    # LoRA / LoCon (forward merge: the rank loop is tiled, no cap)
    "lora_merge_fwd": OpScope(rules={"tilelang": lambda a1, b1, a2, b2, base, gamma, mode, out_dtype=None: _tc16(
        a1, b1, *((a2, b2) if mode != "plain" else ()))}),
    "lora_merge_bwd": OpScope(measure=lambda grad, up, down, gamma: _rank(up), limits=_RANK_128,
                              rules={"tilelang": lambda grad, up, down, gamma: _tc16(up, down)}),
    "lora_bypass_fwd": OpScope(measure=lambda x, up, down, gamma, base=None: _rank(up), limits=_RANK_128,
                               rules={"tilelang": lambda x, up, down, gamma, base=None: _tc16(x, up, down)}),
    "lora_bypass_bwd": OpScope(measure=lambda grad, x, up, down, gamma: _rank(up), limits=_RANK_128,
                               rules={"tilelang": lambda grad, x, up, down, gamma: _tc16(x, up, down)}),
    "lora_tucker_fwd": OpScope(
        measure=lambda a1, t1, b1, a2, t2, b2, gamma: {
            "tucker_rank": max(int(t1.shape[0]), int(t1.shape[1]),
                               *(() if t2 is None else (int(t2.shape[0]), int(t2.shape[1]))))},
        limits={"tucker_rank": {ANY: 64}},
        rules={"tilelang": lambda a1, t1, b1, a2, t2, b2, gamma: _tc16(a1, t1, b1, a2, t2, b2)},
    ),
    # LoHa (MAX_HADA_RANK: the regenerated P tiles live in registers)
    "loha_merge_bwd": OpScope(measure=lambda grad, a1, b1, a2, b2, gamma: _rank(a1), limits=_RANK_128,
                              rules={"tilelang": lambda grad, a1, b1, a2, b2, gamma: _tc16(a1, b1, a2, b2)}),
    "loha_bypass_fwd": OpScope(measure=lambda x, a1, b1, a2, b2, gamma, base=None: _rank(a1),
                               limits={"rank": {"triton": None, ANY: 128}},  # triton: materializes above 128
                               rules={"tilelang": lambda x, a1, b1, a2, b2, gamma, base=None: _tc16(x, a1, b1, a2, b2)}),
    "loha_bypass_bwd": OpScope(measure=lambda grad, x, a1, b1, a2, b2, gamma: _rank(a1), limits=_RANK_128,
                               rules={"tilelang": lambda grad, x, a1, b1, a2, b2, gamma: _tc16(x, a1, b1, a2, b2)}),
    # LoKr: merges loop over the ranks (no cap, §2.3.3); the bypass keeps whole
    # padded factor dims in registers.
    "lokr_full_merge_fwd": OpScope(),
    "lokr_full_merge_bwd": OpScope(),
    # (TileLang: whole-factor merges are exact fp32 arithmetic; a factored side is a GEMM)
    "lokr_merge_fwd": OpScope(rules={"tilelang": lambda w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None: (
        None if w1b is None and w2b is None else _tc16(w1a, w1b, w2a, w2b))}),
    "lokr_merge_bwd": OpScope(rules={"tilelang": lambda grad, w1a, w1b, w2a, w2b, shape, gamma: (
        None if w1b is None and w2b is None else _tc16(w1a, w1b, w2a, w2b))}),
    "lokr_bypass_fwd": OpScope(measure=lambda x, w1, w2, gamma, base=None: _lokr_held(w1, w2),
                               # triton: holds only the inner dim of one contraction order
                               limits={"factor": {"triton": None, ANY: 128}, "held": {"triton": 128, ANY: None}},
                               rules={"tilelang": lambda x, w1, w2, gamma, base=None: _tc16(x, w1, w2)}),
    "lokr_bypass_bwd": OpScope(measure=lambda grad, x, w1, w2, gamma: _lokr_factors(w1, w2),
                               limits={"factor": {ANY: 128}},
                               rules={"tilelang": lambda grad, x, w1, w2, gamma: _tc16(x, w1, w2)}),
    # DoRA: resident or streamed rows, no cap
    "dora_fwd": OpScope(),
    "dora_bwd": OpScope(),
    # diag-OFT: in-register Cayley solve of each S x S block
    "oft_fwd": OpScope(
        measure=lambda blocks, x, rescale, cscale, shift, weight: {"block": pad(int(blocks.shape[-1]))},
        limits=_OFT_LIMITS,
        layout=lambda blocks, x, rescale, cscale, shift, weight: _oft_layout(x, weight),
    ),
    "oft_bwd": OpScope(
        measure=lambda grad, blocks, x, rescale, cscale, shift, weight: {"block": pad(int(blocks.shape[-1]))},
        limits=_OFT_LIMITS,
        layout=lambda grad, blocks, x, rescale, cscale, shift, weight: _oft_layout(x, weight),
    ),
    # BOFT: in-register Cayley solve of each s x s block (capped here)
    "boft_fwd": OpScope(
        measure=lambda blocks, x, axis, cscale, scale, rescale, diff: {"block": pad(int(blocks.shape[-1]))},
        limits=_BOFT_LIMITS,
        layout=lambda blocks, x, axis, cscale, scale, rescale, diff: _boft_layout(x, axis),
    ),
    "boft_bwd": OpScope(
        measure=lambda grad, blocks, x, axis, cscale, scale: {"block": pad(int(blocks.shape[-1]))},
        limits=_BOFT_LIMITS,
        layout=lambda grad, blocks, x, axis, cscale, scale: _boft_layout(x, axis),
    ),
    # IA3: elementwise, every layout
    "ia3_fwd": OpScope(layout=lambda x, w, channel_axis, alpha, gamma: _ia3_layout(x, channel_axis)),
    "ia3_bwd": OpScope(layout=lambda grad, x, w, channel_axis, alpha, gamma: _ia3_layout(x, channel_axis)),
    # add_scaled: elementwise; both backends read each operand in its own dtype
    "add_scaled": OpScope(),
}


def _pick(table: Mapping, backend: str):
    return table.get(backend, table.get(ANY))


def limit(op: str, quantity: str, backend: str) -> Optional[int]:
    """The cap on ``quantity`` of ``op`` for ``backend`` (None: uncapped)."""
    entry = SCOPE[op].limits.get(quantity)
    return None if entry is None else _pick(entry, backend)


def fused_dtypes(backend: str, module=None) -> tuple:
    own = getattr(module, "DTYPES", None) if module is not None else None
    return tuple(own) if own is not None else _pick(FUSED_DTYPES, backend)


def why_not(op: str, backend: str, args: Sequence) -> Optional[str]:
    """None when a call of ``op`` with ``args`` (full schema order, validated) is
    inside ``backend``'s scope; else the reason. Per-op rules only: the generic
    gates (device, dtypes, ...) are ``select``'s."""
    s = SCOPE.get(op)
    if s is None:
        return None
    if s.measure is not None:
        for quantity, value in s.measure(*args).items():
            cap = limit(op, quantity, backend)
            if cap is not None and value > cap:
                return f"{quantity} {value} > {cap}"
    if s.layout is not None and s.layouts:
        served = _pick(s.layouts, backend)
        if served is not None:
            tag = s.layout(*args)
            if tag not in served:
                return f"{tag} layout (kernel written for {', '.join(sorted(served))})"
    rule = _pick(s.rules, backend) if s.rules else None
    if rule is not None:
        return rule(*args)
    return None


def supported(op: str, backend: str, args: Sequence) -> bool:
    """``why_not(...) is None``."""
    return why_not(op, backend, args) is None


def static_scale(*scales) -> bool:
    """True when no scale is a tensor that carries a gradient (a fused op takes a
    constant γ: a scale with a gradient must go through eager torch)."""
    return not any(isinstance(s, torch.Tensor) and s.requires_grad for s in scales)
