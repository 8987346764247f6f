"""GLoRA (linear): ``lora_merge_fwd`` in mode sum after one torch GEMM (W·a1)."""
from lycoris_ops.functional import locon

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend, split_scale


def glora_diff_weight(w, a1, a2, b1, b2, gamma=1.0, backend=None):
    """ΔW = gamma·(W·a1·a2 + b1·b2); w (O, I), a1 (I, r), a2 (r, I), b1 (O, r'),
    b2 (r', I) (GLoRAModule's Linear weights)."""
    check_backend("glora_diff_weight", backend)
    a2, _ = split_scale(a2, gamma)
    b2, gamma = split_scale(b2, gamma)
    return locon.glora_merge(w, a1, a2, b1, b2, gamma)
