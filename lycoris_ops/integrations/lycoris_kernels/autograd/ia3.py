"""IA3: ``ia3_fwd`` on a weight (merge) or an activation (bypass)."""
from lycoris_ops.functional import ia3

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend


def ia3_diff_weight(org_weight, weight, on_input, multiplier=1.0, diff=True, backend=None):
    """W·(weight·multiplier + (0 if diff else 1)) along W's in-channel axis
    (``on_input``) or out-channel axis."""
    check_backend("ia3_diff_weight", backend)
    return ia3.ia3_merge(org_weight, weight, multiplier, train_on_input=bool(on_input), diff=diff)


def ia3_bypass(x, weight, channel_axis, multiplier=1.0, diff=False, backend=None):
    """x·(weight·multiplier + (0 if diff else 1)) along ``channel_axis``."""
    check_backend("ia3_bypass", backend)
    return ia3.ia3_scale(x, weight, channel_axis, multiplier, diff)
