"""The autograd formulas of the forward ops: ``_<op>_setup`` and ``_<op>_backward`` per op.

Each forward op's backward calls its ``*_bwd`` op (``lora_merge_fwd`` in mode ``sum``,
``lora_tucker_fwd`` and ``add_scaled`` differentiate through their own rules, docs/ops.md
§2). What each op saves, which ``*_bwd`` ops it calls and whether the whole backward is one
such call (made by the C++ node without entering Python) are the op table's
(``optable.py``); the registration loop at the end reads it.
"""
from __future__ import annotations

import torch

# torch.library.register_autograd's registration with its per-call overhead removed
from lycoris_ops._library.autograd_kernel import first_order_only, register_autograd
from lycoris_ops._library.optable import BY_NAME, OPS
from lycoris_ops.reference import cast, mm32
from lycoris_ops.reference.lora import tucker_apply, tucker_core, tucker_rows

lycoris = torch.ops.lycoris


def _cast(grad, like):
    """A gradient in its input's dtype, or None when the input is absent/not needed."""
    if grad is None or like is None:
        return None
    return cast(grad, like.dtype)


def _grad_for(grad, *operands):
    """The incoming G as a ``*_bwd`` op takes it. A merge whose ``out_dtype`` is the other 16-bit
    dtype than its operands' gets G widened to fp32 (exact): fp16 and bf16 never meet in one
    call (docs/ops.md §1.3 rule 1), and the op rounds an fp32 G to its compute dtype (rule 7) as the
    wrapper would. ``csrc/autograd.cpp``'s direct backward does the same."""
    if grad.dtype in _HALF and any(t is not None and t.dtype in _HALF and t.dtype != grad.dtype for t in operands):
        return grad.float()
    return grad


_HALF = (torch.float16, torch.bfloat16)


# --- lora ---
from lycoris_ops.reference.checks import compute_dtype as _lora_compute_dtype


def _lora_acc_cast(t, c):
    """t rounded to the compute dtype c, then widened to its accumulation dtype."""
    acc = torch.float64 if c == torch.float64 else torch.float32
    return None if t is None else t.to(c).to(acc)


def _lora_merge_fwd_setup(ctx, inputs, output):
    a1, b1, a2, b2, base, gamma, mode = inputs[:7]
    ctx.gamma, ctx.mode = gamma, mode
    ctx.base_dtype = None if base is None else base.dtype
    if mode == "plain":
        ctx.save_for_backward(a1, b1)
    else:
        ctx.save_for_backward(a1, b1, a2, b2)


def _lora_merge_fwd_backward(ctx, grad):
    need = ctx.needs_input_grad
    g_base = cast(grad, ctx.base_dtype) if need[4] else None
    rest = (None,) * (len(need) - 5)
    if not any(need[:4]):
        return (None, None, None, None, g_base) + rest
    gamma = ctx.gamma
    grad = _grad_for(grad, *ctx.saved_tensors)
    if ctx.mode == "plain":
        a1, b1 = ctx.saved_tensors
        g_a1, g_b1 = lycoris.lora_merge_bwd(grad, a1, b1, gamma)
        grads = (g_a1, g_b1, None, None)
    elif ctx.mode == "hada":
        grads = lycoris.loha_merge_bwd(grad, *ctx.saved_tensors, gamma)
    else:  # sum = γ·a1·b1 + γ·a2·b2: each product's gradient is a plain merge backward
        a1, b1, a2, b2 = ctx.saved_tensors
        c = _lora_compute_dtype("lora_merge_fwd", a1=a1, b1=b1, a2=a2, b2=b2)
        if _lora_compute_dtype("lora_merge_fwd", a1=a1, b1=b1) == c == _lora_compute_dtype(
                "lora_merge_fwd", a2=a2, b2=b2):
            grads = lycoris.lora_merge_bwd(grad, a1, b1, gamma) + lycoris.lora_merge_bwd(grad, a2, b2, gamma)
        else:  # the pairs round to different dtypes alone: eager in the common compute dtype
            gs = _lora_acc_cast(grad, c) * gamma
            A1, B1, A2, B2 = (_lora_acc_cast(t, c) for t in (a1, b1, a2, b2))
            grads = (
                (gs @ B1.t()).to(a1.dtype) if need[0] else None,
                (A1.t() @ gs).to(b1.dtype) if need[1] else None,
                (gs @ B2.t()).to(a2.dtype) if need[2] else None,
                (A2.t() @ gs).to(b2.dtype) if need[3] else None,
            )
    grads = tuple(g if n else None for g, n in zip(grads, need[:4]))
    return grads + (g_base,) + rest


def _lora_bypass_fwd_setup(ctx, inputs, output):
    x, up, down, gamma, base = inputs  # the defaults are filled in: always 5
    ctx.gamma = gamma
    ctx.base_dtype = None if base is None else base.dtype
    ctx.save_for_backward(x, up, down)


def _lora_bypass_fwd_backward(ctx, grad):
    need = ctx.needs_input_grad  # 4 entries when the call left base out
    g_base = None
    if len(need) > 4 and need[4]:  # G in base's dtype
        g_base = cast(grad, ctx.base_dtype)
    gx = g_up = g_down = None
    if need[0] or need[1] or need[2]:
        x, up, down = ctx.saved_tensors
        gx, g_up, g_down = lycoris.lora_bypass_bwd(grad, x, up, down, ctx.gamma)
    out = (gx if need[0] else None, g_up if need[1] else None, g_down if need[2] else None, None)
    return out + ((g_base,) if len(need) > 4 else ())


def _lora_tucker_fwd_setup(ctx, inputs, output):
    a1, t1, b1, a2, t2, b2, gamma = inputs
    ctx.gamma = gamma
    ctx.save_for_backward(a1, t1, b1, a2, t2, b2)


def _lora_tucker_grads(gp, a, t, b, at, gamma, need):
    """Grads of γ·C, C[o,i,κ] = Σ round(a·t)[o,q,κ]·b[q,i], for the incoming gradient in
    rows form ``gp`` (O·Kk, I) (the compute dtype, or fp32 for two chains); a, t, b
    rounded to the compute dtype and in gp's dtype; ``at`` = round(a·t) (O, R', Kk).
    g_at = Gᵀ·b, g_a = g_at·tᵀ, g_t = aᵀ·g_at, g_b = ATᵀ·G: GEMMs with fp32 results."""
    O, Ra, Rb, Kk = a.shape[0], t.shape[0], t.shape[1], t.shape[2]
    g_a = g_t = g_b = None
    if need[0] or need[1]:
        g_at = mm32(gp, b.t()) * gamma  # (O·Kk, Rb) rows (o, κ)
        g_at = g_at.reshape(O, Kk, Rb).transpose(1, 2).reshape(O, Rb * Kk)
        if need[0]:
            g_a = mm32(g_at, cast(t.reshape(Ra, Rb * Kk), g_at.dtype).t())
        if need[1]:
            g_t = mm32(cast(a, g_at.dtype).t(), g_at).reshape(Ra, Rb, Kk)
    if need[2]:
        g_b = mm32(tucker_rows(at).t(), gp) * gamma  # (Rb, O·Kk)·(O·Kk, I)
    return g_a, g_t, g_b


def _lora_tucker_fwd_backward(ctx, grad):
    """No bwd op (docs/ops.md §2.1.5): eager contractions, each a GEMM with fp32 results (one
    permuted copy of G makes them plain GEMMs; no fp32 copy of G for one chain); γ is
    applied to the small results. Two chains: the chain-1 grads use γ·G ⊙ C2 and the
    chain-2 grads γ·G ⊙ C1 (recomputed, fp32). Differentiable again (double backward
    works: mm32 takes its upcast path when autograd records)."""
    need = ctx.needs_input_grad
    saved = ctx.saved_tensors
    if not any(need[:6]):
        return (None,) * 7
    c = _lora_compute_dtype("lora_tucker_fwd", **dict(zip(("a1", "t1", "b1", "a2", "t2", "b2"), saved)))
    acc = torch.float64 if c == torch.float64 else torch.float32
    two = saved[3] is not None
    w = acc if two else c  # the dtype the big GEMMs read G in
    A1, T1, B1, A2, T2, B2 = (None if x is None else cast(cast(x, c), w) for x in saved)
    AT1 = tucker_core(A1, T1, c)
    if not two:
        grads = _lora_tucker_grads(tucker_rows(cast(grad, c)), A1, T1, B1, AT1, ctx.gamma, need[:3])
        grads += (None, None, None)
    else:
        AT2 = tucker_core(A2, T2, c)
        g = cast(cast(grad, c), acc)
        AT1, AT2 = cast(AT1, acc), cast(AT2, acc)
        g1 = tucker_rows(g * tucker_apply(AT2, B2))
        g2 = tucker_rows(g * tucker_apply(AT1, B1))
        grads = (_lora_tucker_grads(g1, A1, T1, B1, AT1, ctx.gamma, need[:3])
                 + _lora_tucker_grads(g2, A2, T2, B2, AT2, ctx.gamma, need[3:6]))
    return tuple(None if g is None else cast(g, t.dtype) for g, t in zip(grads, saved)) + (None,)


# --- end lora ---

# --- loha ---
def _loha_bypass_fwd_setup(ctx, inputs, output):
    x, a1, b1, a2, b2, gamma = inputs[:6]
    base = inputs[6] if len(inputs) > 6 else None
    ctx.gamma = gamma
    ctx.base_dtype = None if base is None else base.dtype
    ctx.save_for_backward(x, a1, b1, a2, b2)


def _loha_bypass_fwd_backward(ctx, grad):
    need = ctx.needs_input_grad
    g_base = cast(grad, ctx.base_dtype) if len(need) > 6 and need[6] else None
    grads = (None,) * 5
    if any(need[:5]):
        grads = lycoris.loha_bypass_bwd(grad, *ctx.saved_tensors, ctx.gamma)
    out = tuple(g if n else None for g, n in zip(grads, need[:5])) + (None,)
    return out + ((g_base,) if len(need) > 6 else ())


# --- end loha ---

# --- lokr ---
def _lokr_full_merge_fwd_setup(ctx, inputs, output):
    w1, w2, base, gamma = inputs[:4]
    ctx.save_for_backward(w1, w2)
    ctx.gamma = gamma
    ctx.base_dtype = None if base is None else base.dtype


def _lokr_full_merge_fwd_backward(ctx, grad):
    w1, w2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    g_w1 = g_w2 = g_base = None
    if need[0] or need[1]:
        g_w1, g_w2 = lycoris.lokr_full_merge_bwd(_grad_for(grad, w1, w2), w1, w2, ctx.gamma)
        g_w1 = g_w1 if need[0] else None
        g_w2 = g_w2 if need[1] else None
    if ctx.base_dtype is not None and need[2]:
        g_base = cast(grad, ctx.base_dtype)
    return g_w1, g_w2, g_base, None, None


def _lokr_merge_fwd_setup(ctx, inputs, output):
    w1a, w1b, w2a, w2b, shape, base, gamma = inputs[:7]
    ctx.save_for_backward(w1a, w1b, w2a, w2b)
    ctx.shape = list(shape)
    ctx.gamma = gamma
    ctx.base_dtype = None if base is None else base.dtype


def _lokr_merge_fwd_backward(ctx, grad):
    w1a, w1b, w2a, w2b = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = [None, None, None, None]
    if any(need[:4]):
        outs = lycoris.lokr_merge_bwd(_grad_for(grad, w1a, w1b, w2a, w2b), w1a, w1b, w2a, w2b, ctx.shape, ctx.gamma)
        for k, (g, w) in enumerate(zip(outs, (w1a, w1b, w2a, w2b))):
            # an absent b factor comes back as an empty tensor: map it to None
            grads[k] = g if (w is not None and need[k]) else None
    g_base = cast(grad, ctx.base_dtype) if ctx.base_dtype is not None and need[5] else None
    return grads[0], grads[1], grads[2], grads[3], None, g_base, None, None


def _lokr_bypass_fwd_setup(ctx, inputs, output):
    x, w1, w2, gamma = inputs[:4]
    base = inputs[4] if len(inputs) > 4 else None
    ctx.save_for_backward(x, w1, w2)
    ctx.gamma = gamma
    ctx.base_dtype = None if base is None else base.dtype


def _lokr_bypass_fwd_backward(ctx, grad):
    x, w1, w2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx = g_w1 = g_w2 = g_base = None
    if need[0] or need[1] or need[2]:
        gx, g_w1, g_w2 = lycoris.lokr_bypass_bwd(grad, x, w1, w2, ctx.gamma)
        gx = gx if need[0] else None
        g_w1 = g_w1 if need[1] else None
        g_w2 = g_w2 if need[2] else None
    if ctx.base_dtype is not None and need[4]:
        g_base = cast(grad, ctx.base_dtype)
    return gx, g_w1, g_w2, None, g_base


# --- end lokr ---

# --- dora ---
def _dora_fwd_setup(ctx, inputs, output):
    w, dscale, mult, row_axis, delta = inputs
    ctx.mark_non_differentiable(output[1])  # norms: saved statistics, not differentiable
    ctx.mult, ctx.row_axis = mult, row_axis
    ctx.save_for_backward(w, dscale, delta, output[1])


def _dora_fwd_backward(ctx, grad_y, grad_norms):
    w, dscale, delta, norms = ctx.saved_tensors
    need = ctx.needs_input_grad
    if grad_y is None or not (need[0] or need[1] or (delta is not None and need[4])):
        return None, None, None, None, None
    g_m, g_d = lycoris.dora_bwd(grad_y, w, dscale, norms, ctx.mult, ctx.row_axis, delta)
    return (
        _cast(g_m, w) if need[0] else None,
        _cast(g_d, dscale).reshape(dscale.shape) if need[1] else None,
        None,
        None,
        _cast(g_m, delta) if delta is not None and need[4] else None,
    )


# --- end dora ---

# --- oft ---
def _oft_fwd_setup(ctx, inputs, output):
    blocks, x, rescale, cscale, shift, weight = inputs
    ctx.save_for_backward(blocks, x, rescale)
    ctx.cscale, ctx.shift, ctx.weight = cscale, shift, weight
    ctx.has_rescale = rescale is not None


def _oft_fwd_backward(ctx, grad):
    # cscale is a constant float: no gradient flows through the constraint norm here
    # (functional.diag_oft folds an active constraint into the blocks instead).
    blocks, x, rescale = ctx.saved_tensors
    need_b, need_x, need_r = ctx.needs_input_grad[:3]
    if not (need_b or need_x or (need_r and ctx.has_rescale)):
        return None, None, None, None, None, None
    gx, g_blocks, g_rescale = lycoris.oft_bwd(grad, blocks, x, rescale if ctx.has_rescale else None,
                                              ctx.cscale, ctx.shift, ctx.weight)
    g_r = None
    if ctx.has_rescale and need_r:
        g_r = _cast(g_rescale.reshape(rescale.shape), rescale)
    return (_cast(g_blocks, blocks) if need_b else None,
            _cast(gx, x) if need_x else None,
            g_r, None, None, None)


# --- end oft ---

# --- boft ---
def _boft_fwd_setup(ctx, inputs, output):
    blocks, x, axis, cscale, scale, rescale, diff = inputs
    ctx.save_for_backward(blocks, x, rescale)
    ctx.axis, ctx.cscale, ctx.scale, ctx.diff = axis, cscale, scale, diff
    ctx.has_rescale = rescale is not None


def _boft_fwd_backward(ctx, grad):
    # docs/ops.md §3.6: boft_bwd differentiates the plain chain; rescale and diff are
    # handled here. cscale and scale are constant floats (no gradient through them).
    blocks, x, rescale = ctx.saved_tensors
    need_b, need_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_r = ctx.has_rescale and ctx.needs_input_grad[5]
    ax = ctx.axis % x.dim()
    g_r = None
    g_chain = grad
    wd = torch.promote_types(grad.dtype, torch.float32)  # fp32 epilogue math (fp64 stays fp64)
    if ctx.has_rescale:
        bshape = [1] * x.dim()
        bshape[ax] = x.shape[ax]
        rho = rescale.reshape(bshape)
        if need_r:
            pre = lycoris.boft_fwd(blocks, x, ctx.axis, ctx.cscale, ctx.scale, None, False)
            dims = [d for d in range(x.dim()) if d != ax]
            g_r = grad.to(wd) * pre.to(wd)
            g_r = g_r.sum(dim=dims) if dims else g_r
            g_r = _cast(g_r.reshape(rescale.shape), rescale)
        if need_b or need_x:
            g_chain = grad.to(wd) * rho.to(wd)
    g_b = g_x = None
    if need_b or need_x:
        g_x, g_b = lycoris.boft_bwd(g_chain, blocks, x, ctx.axis, ctx.cscale, ctx.scale)
        if ctx.diff and need_x:
            g_x = g_x - grad.to(g_x.dtype)
    return (_cast(g_b, blocks) if need_b else None,
            _cast(g_x, x) if need_x else None,
            None, None, None, g_r, None)


# --- end boft ---

# --- ia3 ---
def _ia3_fwd_setup(ctx, inputs, output):
    x, w, channel_axis, alpha, gamma = inputs
    ctx.args = (channel_axis, alpha, gamma)
    ctx.save_for_backward(x, w)


def _ia3_fwd_backward(ctx, grad):
    x, w = ctx.saved_tensors
    need = ctx.needs_input_grad
    if grad is None or not (need[0] or need[1]):
        return None, None, None, None, None
    gx, gw = lycoris.ia3_bwd(grad, x, w, *ctx.args)
    return (_cast(gx, x) if need[0] else None, _cast(gw, w) if need[1] else None, None, None, None)


# --- end ia3 ---

# --- add ---
def _add_scaled_setup(ctx, inputs, output):
    base, delta, gamma = inputs
    ctx.gamma = gamma
    ctx.base_dtype, ctx.delta_dtype, ctx.delta_shape = base.dtype, delta.dtype, delta.shape


def _add_scaled_backward(ctx, grad):
    # g_base = G, g_delta = γ·G (fp32 math for 16-bit G), each in its input's dtype.
    # Plain torch ops: the rule is exact and linear, so double backward works here.
    need = ctx.needs_input_grad
    if grad is None:
        return None, None, None
    g_base = cast(grad, ctx.base_dtype) if need[0] else None
    g_delta = None
    if need[1]:
        if grad.dtype == ctx.delta_dtype:
            # one kernel: torch's elementwise mul of a 16-bit tensor by a Python scalar already
            # computes in fp32 (opmath) and rounds once, as the upcast form below does
            g_delta = (grad * ctx.gamma).reshape(ctx.delta_shape)
        else:
            wide = torch.float64 if torch.float64 in (grad.dtype, ctx.delta_dtype) else torch.float32
            g_delta = (grad.to(wide) * ctx.gamma).to(ctx.delta_dtype).reshape(ctx.delta_shape)
    return g_base, g_delta, None


# --- end add ---


# --- the backward calls of a forward call ---
def backward_calls(op: str, args: dict, outs) -> list:
    """The ``*_bwd`` op calls the backward of one ``op`` call makes when its inputs need
    gradients: ``[(bwd op, positional args)]``, with ``outs`` (the forward's outputs, or
    stand-ins of their shapes and dtypes) giving the incoming gradient. ``args``: the
    forward's arguments by schema name. What ``backends/tilelang/runner.py`` builds kernels for ahead
    of the first backward; [] where the backward calls none (``lora_tucker_fwd``,
    ``add_scaled``: their own rules). The ops with a direct backward take it from its
    op table's row; the others follow their backward above."""
    g = outs[0]
    direct = BY_NAME[op].autograd.direct if BY_NAME[op].autograd else None
    if direct is not None:
        return [(direct.op.split("::")[1], tuple(g if n == "grad" else args[n] for n in direct.args))]
    a = args
    if op == "lora_merge_fwd":
        if a["mode"] == "plain":
            return [("lora_merge_bwd", (g, a["a1"], a["b1"], a["gamma"]))]
        if a["mode"] == "hada":
            return [("loha_merge_bwd", (g, a["a1"], a["b1"], a["a2"], a["b2"], a["gamma"]))]
        return [("lora_merge_bwd", (g, a["a1"], a["b1"], a["gamma"])),
                ("lora_merge_bwd", (g, a["a2"], a["b2"], a["gamma"]))]
    if op == "dora_fwd":
        return [("dora_bwd", (g, a["w"], a["dscale"], outs[1], a["mult"], a["row_axis"], a["delta"]))]
    if op == "oft_fwd":
        return [("oft_bwd", (g, a["blocks"], a["x"], a["rescale"], a["cscale"], a["shift"], a["weight"]))]
    if op == "boft_fwd":  # with a rescale the chain's gradient is G·ρ in fp32 (_boft_fwd_backward)
        if a["rescale"] is not None:
            g = g.new_empty(g.shape, dtype=torch.promote_types(g.dtype, torch.float32))
        return [("boft_bwd", (g, a["blocks"], a["x"], a["axis"], a["cscale"], a["scale"]))]
    return []


# Each forward op registers ``_<op>_setup`` / ``_<op>_backward`` above with what the op table
# says it saves and calls; the ``*_bwd`` ops are first order only (differentiating through
# one raises instead of returning a silent zero).
for _op in OPS:
    if _op.autograd is None:
        first_order_only(_op.qualname)
        continue
    _a = _op.autograd
    register_autograd(_op.qualname, globals()[f"_{_op.name}_backward"], setup_context=globals()[f"_{_op.name}_setup"],
                      save=_a.save, save_outputs=_a.save_outputs, nondiff_outputs=_a.nondiff_outputs, direct=_a.direct)
