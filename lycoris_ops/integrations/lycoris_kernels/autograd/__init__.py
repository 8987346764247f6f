"""``lycoris.kernels.autograd`` (lycoris-lora 4.1's per-algorithm entry points), on
lycoris_ops' functional layer and ops: same names, signatures and results as
lycoris-lora's (its eager bodies' math and output dtypes); gradients come from the
ops' registered autograd."""
from lycoris_ops.integrations.lycoris_kernels.autograd.boft import boft_bypass_diff, boft_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.diag_oft import diag_oft_bypass_diff, diag_oft_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.dora import apply_dora
from lycoris_ops.integrations.lycoris_kernels.autograd.dylora import dylora_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.full import full_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.glora import glora_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.ia3 import ia3_bypass, ia3_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.locon import locon_bypass_diff, locon_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.loha import loha_bypass_diff, loha_diff_weight
from lycoris_ops.integrations.lycoris_kernels.autograd.lokr import (lokr_bypass_diff, lokr_diff_weight, lokr_kron_bypass,
                                                                   lokr_kron_weight)
from lycoris_ops.integrations.lycoris_kernels.autograd.norms import norm_diff_weights

__all__ = [
    "apply_dora",
    "boft_bypass_diff",
    "boft_diff_weight",
    "diag_oft_bypass_diff",
    "diag_oft_diff_weight",
    "dylora_diff_weight",
    "full_diff_weight",
    "glora_diff_weight",
    "ia3_bypass",
    "ia3_diff_weight",
    "locon_bypass_diff",
    "locon_diff_weight",
    "loha_bypass_diff",
    "loha_diff_weight",
    "lokr_bypass_diff",
    "lokr_diff_weight",
    "lokr_kron_bypass",
    "lokr_kron_weight",
    "norm_diff_weights",
]
