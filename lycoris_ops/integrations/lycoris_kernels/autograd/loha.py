"""LoHa: ``lora_merge_fwd`` (hada), ``lora_tucker_fwd`` (two tucker chains) and
``loha_bypass_fwd`` (linear bypass).

lycoris-lora's order is (w1d, w1u, w2d, w2u): the "down" factors (r, I) first,
the "up" factors (O, r) — (r, O) with tucker cores — second.
"""
from lycoris_ops.functional import loha

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend, split_scale


def loha_diff_weight(w1d, w1u, w2d, w2u, t1=None, t2=None, gamma=1.0, backend=None, base=None):
    """ΔW = gamma·(w1u·w1d)⊙(w2u·w2d), (O, I[, *kernel]); with tucker cores t1, t2
    each half is the chain ``t ×₁ wu ×₂ wd``. With ``base``, base + ΔW."""
    check_backend("loha_diff_weight", backend)
    w1u, gamma = split_scale(w1u, gamma)
    return loha.merge(w1u, w1d, w2u, w2d, gamma, t1=t1, t2=t2, base=base)


def loha_bypass_diff(x, w1d, w1u, w2d, w2u, gamma=1.0, backend=None, base=None):
    """gamma·x·ΔWᵀ for x (..., I), ΔW never stored; with ``base`` ((..., O)), base + that."""
    check_backend("loha_bypass_diff", backend)
    w1u, gamma = split_scale(w1u, gamma)
    return loha.bypass(x, w1u, w1d, w2u, w2d, gamma, base=base)
