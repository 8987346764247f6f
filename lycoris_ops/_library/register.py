"""CPU and CUDA kernels of the 23 ops.

CPU: the eager body (``reference/<family>.py``), or the compile tier when it is
named. CUDA: the body chosen per call by ``select`` (a fused op set, the
compile tier or the same eager body), behind the C++ kernel that replays a seen
call signature's Triton launches without Python where the build has it
(``csrc/launch.cpp``, ``_launch_record.py``).
"""
from __future__ import annotations

import torch

from lycoris_ops import _C, settings
from lycoris_ops import reference
from lycoris_ops._library.optable import OPS


def replay_enabled() -> bool:
    """Whether the CUDA key gets the C++ kernel that replays recorded launches
    (csrc/launch.cpp): built with CUDA, and ``LYCORIS_KERNEL_REPLAY`` on."""
    return hasattr(_C, "_register_cuda_kernel") and settings.get("LYCORIS_KERNEL_REPLAY")


def _register():
    from lycoris_ops._library.launch_record import recorder
    from lycoris_ops.backends.select import cpu_kernel, cuda_kernel

    replay = replay_enabled()
    if replay:  # a signature that ran a deferred key's first config got no plan: recorded again
        from lycoris_ops.tuner import tune

        tune.on_deferred_final(_C._clear_launch_plans)
    for op in (row.name for row in OPS):
        # CPU: the exact eager body (routed through the choice only when `compile` is named)
        torch.library.impl(f"lycoris::{op}", "CPU")(cpu_kernel(op, reference.eager(op)))
        # CUDA: the per-call choice, whose step-down tiers run the step-down body
        cuda = cuda_kernel(op, reference.step_down(op))
        if replay:  # C++: a seen signature replays its launches; others call `cuda`
            _C._register_cuda_kernel(f"lycoris::{op}", cuda, recorder(op, cuda, cuda._lycoris_state.tier_of))
        else:
            torch.library.impl(f"lycoris::{op}", "CUDA")(cuda)


_register()
