"""PEFT models on ``torch.ops.lycoris.*``: :func:`patch_peft` swaps the forward of each
supported PEFT adapter layer for one on the ops and returns the report of what runs where;
:func:`unpatch_peft` restores PEFT's forwards (see ``patcher``)."""
from lycoris_ops.integrations.peft.patcher import patch_peft, peft_available, unpatch_peft

__all__ = ["patch_peft", "unpatch_peft", "peft_available"]
