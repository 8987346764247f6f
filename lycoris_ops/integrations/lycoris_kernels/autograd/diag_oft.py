"""Diag-OFT: ``oft_fwd`` on a weight's rows (merge) or a layer output's channels
(bypass); the constraint scales the blocks on device (no host sync, gradient
through the norm as in lycoris-lora's eager body)."""
from lycoris_ops.functional import diag_oft

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend
from lycoris_ops.integrations.lycoris_kernels.autograd._oft import constraint_of, work_dtype


def diag_oft_diff_weight(org_weight, oft_blocks, rescale=None, constraint=None, backend=None, diff=True):
    """ΔW = diag(rescale)·Rᵀ·W − W blockwise on W's rows (``diff=False``: the merged
    weight diag(rescale)·Rᵀ·W), float32."""
    check_backend("diag_oft_diff_weight", backend)
    w = org_weight.to(work_dtype(oft_blocks))
    return diag_oft.merge(oft_blocks, w, rescale, constraint=constraint_of(constraint), diff=diff)


def diag_oft_bypass_diff(org_out, oft_blocks, rescale=None, constraint=None, need_transpose=False, backend=None,
                         diff=True):
    """The same rotation on the channels of a layer output (last dim; dim 1 when
    ``need_transpose``, as for convs): the difference, or with ``diff=False`` the
    rotated output itself, float32."""
    check_backend("diag_oft_bypass_diff", backend)
    y = org_out.to(work_dtype(oft_blocks))
    return diag_oft.bypass(oft_blocks, y, rescale, constraint=constraint_of(constraint), conv=need_transpose,
                           diff=diff)
