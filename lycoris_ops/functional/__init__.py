"""What a LyCORIS module calls: merge and bypass entry points per algorithm.

They flatten leading dims, reshape conv weights, promote dtypes (docs/ops.md §1.3)
and fold the base into the op where it is safe, then call ``torch.ops.lycoris.*``.
"""
from lycoris_ops.functional import boft, diag_oft, dora, full, ia3, locon, loha, lokr  # noqa: F401
