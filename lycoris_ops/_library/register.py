"""CPU and CUDA kernels of the 23 ops.

CPU: the eager body (``reference/<family>.py``), or the compile tier when it is
named. CUDA: the body chosen per call by ``select`` (a fused op set, the
compile tier or the same eager body), behind the C++ kernel that replays a seen
call signature's Triton launches without Python where the build has it
(``csrc/launch.cpp``, ``_launch_record.py``).
"""
from __future__ import annotations

import torch

from lycoris_ops import OP_NAMES, _C, settings
from lycoris_ops.reference import add, boft, dora, ia3, lokr, lora, loha, oft

#: op name -> family module of reference/ (and of triton/, tilelang/, plans/)
FAMILY = {}
for _module, _ops in (
    (lora, ("lora_merge_fwd", "lora_merge_bwd", "lora_bypass_fwd", "lora_bypass_bwd", "lora_tucker_fwd")),
    (loha, ("loha_merge_bwd", "loha_bypass_fwd", "loha_bypass_bwd")),
    (lokr, ("lokr_full_merge_fwd", "lokr_full_merge_bwd", "lokr_merge_fwd", "lokr_merge_bwd",
            "lokr_bypass_fwd", "lokr_bypass_bwd")),
    (dora, ("dora_fwd", "dora_bwd")),
    (oft, ("oft_fwd", "oft_bwd")),
    (boft, ("boft_fwd", "boft_bwd")),
    (ia3, ("ia3_fwd", "ia3_bwd")),
    (add, ("add_scaled",)),
):
    for _op in _ops:
        FAMILY[_op] = _module
assert tuple(FAMILY) == OP_NAMES, "registry.FAMILY must list the ops in schema order"


def eager(op: str):
    """The eager body of ``op`` (its CPU kernel)."""
    return getattr(FAMILY[op], op)


def replay_enabled() -> bool:
    """Whether the CUDA key gets the C++ kernel that replays recorded launches
    (csrc/launch.cpp): built with CUDA, and ``LYCORIS_KERNEL_REPLAY`` on."""
    return hasattr(_C, "_register_cuda_kernel") and settings.get("LYCORIS_KERNEL_REPLAY")


def _register():
    from lycoris_ops._library.launch_record import recorder
    from lycoris_ops.backends.select import cpu_kernel, cuda_kernel

    replay = replay_enabled()
    for op in OP_NAMES:
        body = eager(op)
        # CPU: the eager body (routed through the choice only when `compile` is named)
        torch.library.impl(f"lycoris::{op}", "CPU")(cpu_kernel(op, body))
        cuda = cuda_kernel(op, body)
        if replay:  # C++: a seen signature replays its launches; others call `cuda`
            _C._register_cuda_kernel(f"lycoris::{op}", cuda, recorder(op, cuda, cuda._lycoris_state.tier_of))
        else:
            torch.library.impl(f"lycoris::{op}", "CUDA")(cuda)


_register()
