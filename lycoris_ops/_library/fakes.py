"""Fake (meta) kernels of the 23 ops, in schema order.

Each fake runs the op's own argument checks (``reference/<family>.py``,
``check_<op>``) and allocates outputs of the shapes and dtypes they return, so a
traced graph gets exactly the errors and metadata the real kernels produce, with
symbolic token dims kept symbolic.
"""
from __future__ import annotations

from torch.library import register_fake

from lycoris_ops.reference import add, boft, dora, ia3, lokr, lora, loha, oft


def _outputs(ref, spec):
    outs = tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in spec)
    return outs[0] if len(outs) == 1 else outs


# --- lora ---

@register_fake("lycoris::lora_merge_fwd")
def _lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype=None):
    return _outputs(a1, lora.check_lora_merge_fwd(a1, b1, a2, b2, base, gamma, mode, out_dtype))


@register_fake("lycoris::lora_merge_bwd")
def _lora_merge_bwd(grad, up, down, gamma):
    return _outputs(grad, lora.check_lora_merge_bwd(grad, up, down, gamma))


@register_fake("lycoris::lora_bypass_fwd")
def _lora_bypass_fwd(x, up, down, gamma, base=None):
    return _outputs(x, lora.check_lora_bypass_fwd(x, up, down, gamma, base))


@register_fake("lycoris::lora_bypass_bwd")
def _lora_bypass_bwd(grad, x, up, down, gamma):
    return _outputs(grad, lora.check_lora_bypass_bwd(grad, x, up, down, gamma))


@register_fake("lycoris::lora_tucker_fwd")
def _lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma):
    return _outputs(a1, lora.check_lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma))


# --- loha ---

@register_fake("lycoris::loha_merge_bwd")
def _loha_merge_bwd(grad, a1, b1, a2, b2, gamma):
    return _outputs(grad, loha.check_loha_merge_bwd(grad, a1, b1, a2, b2, gamma))


@register_fake("lycoris::loha_bypass_fwd")
def _loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base=None):
    return _outputs(x, loha.check_loha_bypass_fwd(x, a1, b1, a2, b2, gamma, base))


@register_fake("lycoris::loha_bypass_bwd")
def _loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma):
    return _outputs(grad, loha.check_loha_bypass_bwd(grad, x, a1, b1, a2, b2, gamma))


# --- lokr ---

@register_fake("lycoris::lokr_full_merge_fwd")
def _lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype=None):
    return _outputs(w1, lokr.check_lokr_full_merge_fwd(w1, w2, base, gamma, out_dtype))


@register_fake("lycoris::lokr_full_merge_bwd")
def _lokr_full_merge_bwd(grad, w1, w2, gamma):
    return _outputs(grad, lokr.check_lokr_full_merge_bwd(grad, w1, w2, gamma))


@register_fake("lycoris::lokr_merge_fwd")
def _lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype=None):
    return _outputs(w1a, lokr.check_lokr_merge_fwd(w1a, w1b, w2a, w2b, shape, base, gamma, out_dtype))


@register_fake("lycoris::lokr_merge_bwd")
def _lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma):
    return _outputs(grad, lokr.check_lokr_merge_bwd(grad, w1a, w1b, w2a, w2b, shape, gamma))


@register_fake("lycoris::lokr_bypass_fwd")
def _lokr_bypass_fwd(x, w1, w2, gamma, base=None):
    return _outputs(x, lokr.check_lokr_bypass_fwd(x, w1, w2, gamma, base))


@register_fake("lycoris::lokr_bypass_bwd")
def _lokr_bypass_bwd(grad, x, w1, w2, gamma):
    return _outputs(grad, lokr.check_lokr_bypass_bwd(grad, x, w1, w2, gamma))


# --- dora ---

@register_fake("lycoris::dora_fwd")
def _dora_fwd(w, dscale, mult, row_axis, delta=None):
    return _outputs(w, dora.check_dora_fwd(w, dscale, mult, row_axis, delta))


@register_fake("lycoris::dora_bwd")
def _dora_bwd(grad, w, dscale, norms, mult, row_axis, delta=None):
    return _outputs(grad, dora.check_dora_bwd(grad, w, dscale, norms, mult, row_axis, delta))


# --- oft ---

@register_fake("lycoris::oft_fwd")
def _oft_fwd(blocks, x, rescale, cscale, shift, weight):
    return _outputs(blocks, oft.check_oft_fwd(blocks, x, rescale, cscale, shift, weight))


@register_fake("lycoris::oft_bwd")
def _oft_bwd(grad, blocks, x, rescale, cscale, shift, weight):
    return _outputs(grad, oft.check_oft_bwd(grad, blocks, x, rescale, cscale, shift, weight))


# --- boft ---

@register_fake("lycoris::boft_fwd")
def _boft_fwd(blocks, x, axis, cscale, scale, rescale, diff):
    return _outputs(blocks, boft.check_boft_fwd(blocks, x, axis, cscale, scale, rescale, diff))


@register_fake("lycoris::boft_bwd")
def _boft_bwd(grad, blocks, x, axis, cscale, scale):
    return _outputs(grad, boft.check_boft_bwd(grad, blocks, x, axis, cscale, scale))


# --- ia3 ---

@register_fake("lycoris::ia3_fwd")
def _ia3_fwd(x, w, channel_axis, alpha, gamma):
    return _outputs(x, ia3.check_ia3_fwd(x, w, channel_axis, alpha, gamma))


@register_fake("lycoris::ia3_bwd")
def _ia3_bwd(grad, x, w, channel_axis, alpha, gamma):
    return _outputs(grad, ia3.check_ia3_bwd(grad, x, w, channel_axis, alpha, gamma))


# --- add ---

@register_fake("lycoris::add_scaled")
def _add_scaled(base, delta, gamma):
    return _outputs(base, add.check_add_scaled(base, delta, gamma))
