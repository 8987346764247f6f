"""The op table: one row per op of the ``lycoris`` namespace, in schema order.

The schemas are written once, in C++ (``csrc/schemas.h``); this table adds what Python
needs to know about each op and is checked against the schema list when the package
loads (``check_against``). Everything else reads it: the CPU/CUDA registration
(``register.py``), the fakes (``fakes.py``), the autograd registrations (``autograd.py``),
the fused op sets (``backends/<name>/ops.py``), the tuner's family lookup and the test
case tables (``testing/``). Adding an op: its schema in ``csrc/schemas.h``, a row here,
``check_<op>`` and the eager body in ``reference/<family>.py``, its autograd formula (forward
ops), kernels in the backends that fuse it, and its cases in ``testing/<family>.py``.

A leaf module: it imports nothing from the package.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple


class BwdCall(NamedTuple):
    """A backward that is one call of ``op``: ``args`` names, per argument of ``op``, the
    forward argument passed (``"grad"``: the incoming gradient); ``grads`` names, per output
    of ``op``, the forward argument it is the gradient of (None: dropped); ``passthrough``
    names the forward argument whose gradient is the incoming one, in its own dtype (a
    bypass op's ``base``). The C++ autograd node makes this call without entering Python."""

    op: str
    args: Sequence[str]
    grads: Sequence[Optional[str]]
    passthrough: Optional[str] = None


class Autograd(NamedTuple):
    """How a forward op differentiates (its formula is ``autograd.py``'s ``_<op>_backward``)."""

    save: Tuple[str, ...]  #: tensor arguments the graph node keeps for the backward
    calls: Tuple[str, ...] = ()  #: the ``*_bwd`` ops the backward calls
    direct: Optional[BwdCall] = None  #: the whole backward as one ``*_bwd`` call
    save_outputs: Tuple[int, ...] = ()  #: outputs kept for the backward (non-differentiable)
    nondiff_outputs: Tuple[int, ...] = ()


class Op(NamedTuple):
    name: str
    #: ``reference/<family>.py`` (``check_<name>``, the eager body) and ``testing/<family>.py``
    family: str
    #: the fused backends' ``kernels/<kernels>.py`` and ``tuning/<kernels>.py`` (tucker has its own)
    kernels: str
    #: forward ops: how they differentiate; None for the ``*_bwd`` ops (first order only)
    autograd: Optional[Autograd] = None

    @property
    def qualname(self) -> str:
        return f"lycoris::{self.name}"


def _bypass(bwd: str, args: Sequence[str]) -> Autograd:
    """A bypass/merge forward whose backward is its ``*_bwd`` op on (grad, *args, gamma)."""
    tensors = tuple(a for a in args if a != "shape")
    return Autograd(save=tensors, calls=(bwd,),
                    direct=BwdCall(f"lycoris::{bwd}", ("grad", *args, "gamma"), tensors, "base"))


OPS: Tuple[Op, ...] = (
    Op("lora_merge_fwd", "lora", "lora",
       Autograd(save=("a1", "b1", "a2", "b2"), calls=("lora_merge_bwd", "loha_merge_bwd"))),
    Op("lora_merge_bwd", "lora", "lora"),
    Op("lora_bypass_fwd", "lora", "lora", _bypass("lora_bypass_bwd", ("x", "up", "down"))),
    Op("lora_bypass_bwd", "lora", "lora"),
    Op("lora_tucker_fwd", "lora", "tucker", Autograd(save=("a1", "t1", "b1", "a2", "t2", "b2"))),
    Op("loha_merge_bwd", "loha", "loha"),
    Op("loha_bypass_fwd", "loha", "loha", _bypass("loha_bypass_bwd", ("x", "a1", "b1", "a2", "b2"))),
    Op("loha_bypass_bwd", "loha", "loha"),
    Op("lokr_full_merge_fwd", "lokr", "lokr", _bypass("lokr_full_merge_bwd", ("w1", "w2"))),
    Op("lokr_full_merge_bwd", "lokr", "lokr"),
    Op("lokr_merge_fwd", "lokr", "lokr", _bypass("lokr_merge_bwd", ("w1a", "w1b", "w2a", "w2b", "shape"))),
    Op("lokr_merge_bwd", "lokr", "lokr"),
    Op("lokr_bypass_fwd", "lokr", "lokr", _bypass("lokr_bypass_bwd", ("x", "w1", "w2"))),
    Op("lokr_bypass_bwd", "lokr", "lokr"),
    Op("dora_fwd", "dora", "dora",
       Autograd(save=("w", "dscale", "delta"), calls=("dora_bwd",), save_outputs=(1,), nondiff_outputs=(1,))),
    Op("dora_bwd", "dora", "dora"),
    Op("oft_fwd", "oft", "oft", Autograd(save=("blocks", "x", "rescale"), calls=("oft_bwd",))),
    Op("oft_bwd", "oft", "oft"),
    Op("boft_fwd", "boft", "boft", Autograd(save=("blocks", "x", "rescale"), calls=("boft_bwd",))),
    Op("boft_bwd", "boft", "boft"),
    Op("ia3_fwd", "ia3", "ia3",
       Autograd(save=("x", "w"), calls=("ia3_bwd",),
                direct=BwdCall("lycoris::ia3_bwd", ("grad", "x", "w", "channel_axis", "alpha", "gamma"), ("x", "w")))),
    Op("ia3_bwd", "ia3", "ia3"),
    Op("add_scaled", "add", "add", Autograd(save=())),
)

#: op name -> row
BY_NAME: Dict[str, Op] = {op.name: op for op in OPS}
#: the reference/testing families, in table order
FAMILIES: Tuple[str, ...] = tuple(dict.fromkeys(op.family for op in OPS))
#: the backends' kernel/tuning families, in table order
KERNEL_FAMILIES: Tuple[str, ...] = tuple(dict.fromkeys(op.kernels for op in OPS))


def check_against(schemas: Sequence[str]) -> None:
    """The table lists exactly the registered schemas' ops, in their order; every op a
    forward's backward calls is a row without autograd of its own."""
    names = tuple(s.split("(", 1)[0] for s in schemas)
    if names != tuple(op.name for op in OPS):
        raise RuntimeError(f"lycoris_ops: the op table {tuple(BY_NAME)} does not match csrc/schemas.h {names}")
    for op in OPS:
        for bwd in op.autograd.calls if op.autograd else ():
            if bwd not in BY_NAME or BY_NAME[bwd].autograd is not None:
                raise RuntimeError(f"lycoris_ops: {op.name}'s backward calls {bwd}, not a first-order *_bwd op")
