"""DyLoRA: the plain LoCon merge (``lora_merge_fwd``) of the rank-sliced factors."""
from lycoris_ops.functional import locon

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend, split_scale


def dylora_diff_weight(down, up, rank=None, gamma=1.0, backend=None):
    """ΔW = gamma·up[:, :rank]·down[:rank] (every rank when ``rank`` is None)."""
    check_backend("dylora_diff_weight", backend)
    down, gamma = split_scale(down, gamma)
    if rank is None:
        return locon.merge(up, down, gamma)
    return locon.dylora_merge(up, down, rank, gamma)
