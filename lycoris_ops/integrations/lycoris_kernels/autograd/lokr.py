"""LoKr: ``lokr_full_merge_fwd`` (both sides whole), ``lokr_merge_fwd`` (a factored
side) and ``lokr_bypass_fwd`` (linear bypass, the Kronecker product never built)."""
from lycoris_ops.functional import lokr

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend, split_scale


def rank_scale(w1a, w2a, gamma):
    """lycoris-lora's functional LoKr scale: gamma / rank, rank = the factored side's
    rank (w1a's columns, else w2a's); with both sides whole the rank is gamma itself
    (so 1). A tensor gamma stays a tensor."""
    if w1a is not None:
        return gamma / w1a.shape[1]
    if w2a is not None:
        return gamma / w2a.shape[1]
    return gamma / gamma


def _split(w1, w1a, scale):
    """Fold a tensor scale into side 1 (the small one)."""
    if w1 is not None:
        w1, scale = split_scale(w1, scale)
    else:
        w1a, scale = split_scale(w1a, scale)
    return w1, w1a, scale


def lokr_kron_weight(w1, w1a, w1b, w2, w2a, w2b, t2=None, scale=1.0, backend=None, base=None):
    """ΔW = scale·kron(w1, w2) (a·c, b·d[, *kernel]), w1 = w1a·w1b and w2 = w2a·w2b
    (or the tucker chain with t2) when factored; with ``base``, base + ΔW."""
    check_backend("lokr_kron_weight", backend)
    w1, w1a, scale = _split(w1, w1a, scale)
    return lokr.lokr_weight(w1, w1a, w1b, w2, w2a, w2b, t2, scale=scale, base=base)


def lokr_diff_weight(w1, w1a, w1b, w2, w2a, w2b, t2=None, gamma=1.0, backend=None):
    """``lokr_kron_weight`` with scale = ``rank_scale(w1a, w2a, gamma)``."""
    return lokr_kron_weight(w1, w1a, w1b, w2, w2a, w2b, t2, scale=rank_scale(w1a, w2a, gamma), backend=backend)


def lokr_kron_bypass(x, w1, w1a, w1b, w2, w2a, w2b, t2=None, scale=1.0, backend=None, base=None):
    """scale·x·kron(w1, w2)ᵀ for x (..., b·d) (linear layers; ΔW never built);
    with ``base`` ((..., a·c)), base + that."""
    check_backend("lokr_kron_bypass", backend)
    if t2 is not None:
        raise ValueError("lycoris.kernels.autograd.lokr_kron_bypass is the linear bypass: t2 (a tucker conv "
                         "factor) must be None; conv LoKr bypasses run lycoris-lora's own grouped-conv chain")
    w1, w1a, scale = _split(w1, w1a, scale)
    return lokr.lokr_bypass(x, w1, w1a, w1b, w2, w2a, w2b, scale=scale, base=base)


def lokr_bypass_diff(x, w1, w1a, w1b, w2, w2a, w2b, t2=None, gamma=1.0, backend=None, base=None):
    """``lokr_kron_bypass`` with scale = ``rank_scale(w1a, w2a, gamma)``."""
    return lokr_kron_bypass(x, w1, w1a, w1b, w2, w2a, w2b, t2, scale=rank_scale(w1a, w2a, gamma),
                            backend=backend, base=base)
