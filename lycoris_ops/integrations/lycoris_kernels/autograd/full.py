"""Full: ``add_scaled``."""
import torch

from lycoris_ops.functional import full

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend


def full_diff_weight(org_weight, diff, multiplier=1.0, backend=None):
    """org_weight + multiplier·diff, in the dtype torch's promotion gives the pair."""
    check_backend("full_diff_weight", backend)
    dtype = torch.promote_types(org_weight.dtype, diff.dtype)
    return full.scaled_add(org_weight.to(dtype), diff, multiplier)
