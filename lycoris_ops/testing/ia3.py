"""Cases for ``ia3_fwd`` / ``ia3_bwd`` (docs/ops.md §2.7)."""
from __future__ import annotations

import torch

from lycoris_ops.testing import Case, make


def cases(dtype, device, requires_grad, gen):
    rg = requires_grad
    half = dtype in (torch.float16, torch.bfloat16)
    # (id, x shape, w shape, channel_axis, alpha, gamma, noncontiguous x, w dtype)
    table = [
        ("linear_act", (5, 7, 19), (19,), -1, 1.0, 0.8, False, dtype),
        ("conv_act", (2, 6, 5, 3), (1, 6, 1, 1), 1, 1.0, 1.0, False, dtype),
        ("merge_out_diff", (37, 19), (37, 1), 0, 0.0, 0.6, False, dtype),
        ("merge_in_nc", (37, 19), (1, 19), -1, 1.0, 1.3, True, dtype),
        ("conv_weight_in", (6, 5, 3, 3), (5,), 1, 0.0, 1.0, False, dtype),
        ("vector", (37,), (37,), 0, 1.0, 0.5, False, dtype),
    ]
    if half:  # an fp32 IA3 vector on 16-bit activations: output fp32
        table.append(("fp32_w", (5, 19), (19,), -1, 1.0, 1.0, True, torch.float32))
    out = []
    for cid, xs, ws, ax, alpha, gamma, nc, wdt in table:
        x = make(xs, dtype, device, gen=gen, noncontiguous=nc, requires_grad=rg)
        w = make(ws, wdt, device, gen=gen, requires_grad=rg)
        out.append(Case("ia3_fwd", (x, w, ax, alpha, gamma), cid))
        g = make(xs, torch.promote_types(dtype, wdt), device, gen=gen, noncontiguous=nc)
        out.append(Case("ia3_bwd", (g, x.detach(), w.detach(), ax, alpha, gamma), cid))
    return out
