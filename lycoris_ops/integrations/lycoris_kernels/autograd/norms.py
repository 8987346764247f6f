"""Norms: ``add_scaled`` on a norm layer's weight and bias."""
from lycoris_ops.integrations.lycoris_kernels.autograd.full import full_diff_weight


def norm_diff_weights(org_w, org_b, w_norm, b_norm, multiplier=1.0, backend=None):
    """(org_w + multiplier·w_norm, org_b + multiplier·b_norm); the bias is None
    unless both org_b and b_norm are given."""
    w = full_diff_weight(org_w, w_norm, multiplier, backend)
    b = None
    if org_b is not None and b_norm is not None:
        b = full_diff_weight(org_b, b_norm, multiplier, backend)
    return w, b
