"""Operands on two devices: every op names the argument and the devices, from the
kernel that runs (CPU and fake alike), instead of crashing or mixing memory."""
import pytest
import torch

import lycoris_ops
from lycoris_ops import testing

FIRST_CASE = {}
for _case in testing.cases():
    FIRST_CASE.setdefault(_case.op, _case)


@pytest.mark.parametrize("op", lycoris_ops.OP_NAMES)
def test_two_devices_is_a_clear_error(op):
    case = FIRST_CASE[op]
    slots = [i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor) and a.numel() > 0]
    assert len(slots) >= 2, "every op takes at least two tensors"
    args = list(case.args)
    args[slots[1]] = args[slots[1]].to("meta")  # one operand elsewhere (no second GPU needed)
    with pytest.raises(ValueError, match=r"on meta but .* is on cpu|on cpu but .* is on meta|one device"):
        getattr(torch.ops.lycoris, op)(*args)


def test_every_op_has_a_case():
    assert set(FIRST_CASE) == set(lycoris_ops.OP_NAMES)
