"""DoRA weight decomposition (DoRA / DoHa / DoKr): ``dora_fwd``."""
from lycoris_ops.functional import dora

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend


def apply_dora(weight, dora_scale, multiplier=1.0, wd_on_out=True, backend=None, delta=None):
    """M·s with M = weight (+ delta), one norm per output row (``wd_on_out``) or per
    input column, s = multiplier·(dora_scale/(‖M‖ + ε) − 1) + 1, ε the machine
    epsilon of dora_scale's dtype. M is taken in dora_scale's dtype and so is the
    result (as lycoris-lora's eager weight decompose). A conv weight with
    ``wd_on_out=False`` (no 2-D view) runs eagerly."""
    check_backend("apply_dora", backend)
    dtype = dora_scale.dtype
    weight = weight.to(dtype)
    if delta is not None:
        delta = delta.to(dtype)
    return dora.weight_decompose(weight, dora_scale, multiplier, wd_on_out, delta=delta)
