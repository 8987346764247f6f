"""BOFT: ``boft_fwd``, the m-stage butterfly on a weight's rows (merge) or a layer
output's channels (bypass); ``scale`` (the module multiplier) interpolates every
stage toward identity; the constraint scales the blocks on device."""
from lycoris_ops.functional import boft

from lycoris_ops.integrations.lycoris_kernels.autograd._common import check_backend
from lycoris_ops.integrations.lycoris_kernels.autograd._oft import constraint_of, work_dtype


def boft_diff_weight(org_weight, oft_blocks, rescale=None, constraint=None, scale=1, backend=None):
    """ΔW = butterfly(W)·rescale − W on W's rows, float32."""
    check_backend("boft_diff_weight", backend)
    blocks = oft_blocks.to(work_dtype(oft_blocks))
    return boft.merge(blocks, org_weight, rescale, constraint=constraint_of(constraint), multiplier=float(scale))


def boft_bypass_diff(org_out, oft_blocks, rescale=None, constraint=None, scale=1, need_transpose=False, backend=None,
                     diff=True):
    """The butterfly on a layer output's channels (last dim; dim 1 when
    ``need_transpose``): the difference, or with ``diff=False`` the rotated output,
    float32."""
    check_backend("boft_bypass_diff", backend)
    y = org_out.to(work_dtype(oft_blocks))
    return boft.bypass(oft_blocks, y, rescale, constraint=constraint_of(constraint), multiplier=float(scale),
                       conv=need_transpose, diff=diff)
