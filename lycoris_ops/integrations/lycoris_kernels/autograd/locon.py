"""LoCon / LoRA: ``lora_merge_fwd`` (plain), ``lora_tucker_fwd`` (conv with a tucker
mid) and ``lora_bypass_fwd`` (linear bypass)."""
from lycoris_ops.functional import locon

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend, split_scale


def locon_diff_weight(down, up, mid=None, gamma=1.0, backend=None, base=None):
    """ΔW = gamma·up·down, (O, I[, *kernel]) (with ``mid``: the tucker chain
    ``mid ×₁ up ×₂ down``); with ``base`` (the original weight), base + ΔW."""
    check_backend("locon_diff_weight", backend)
    up, gamma = split_scale(up, gamma)
    return locon.merge(up, down, gamma, mid=mid, base=base)


def locon_bypass_diff(x, down, up, gamma=1.0, backend=None, base=None):
    """gamma·(x·downᵀ)·upᵀ for x (..., I); with ``base`` ((..., O)), base + that."""
    check_backend("locon_bypass_diff", backend)
    up, gamma = split_scale(up, gamma)
    return locon.bypass(x, up, down, gamma, base=base)
