"""What diag-OFT and BOFT share: lycoris-lora's rotation runs in float32 (its Cayley
transform inverts in float32), so its outputs are float32 whatever the weight's or
activation's dtype; the operand is taken there before the op."""
from __future__ import annotations

import torch


def work_dtype(blocks: torch.Tensor) -> torch.dtype:
    return torch.float64 if blocks.dtype == torch.float64 else torch.float32


def constraint_of(constraint) -> float:
    """lycoris-lora's ``constraint`` (None or a float; > 0 bounds ‖Q‖_F) as a float."""
    return 0.0 if constraint is None else float(constraint)
