"""BOFT cases (docs/ops.md §2.6): m = 1 … log2(nb)+1, odd block counts of channels
(s = 6), every axis (0, −1, 1 on 3-D/4-D, a positive last axis), scale ≠ 1,
rescale, diff, a non-contiguous x and an empty token dim."""
from __future__ import annotations

from typing import List

import torch

from lycoris_ops.testing import Case, make

BLOCK_SCALE = 0.2

# (id, m, nb, s, x shape, axis, cscale, scale, rescale shape or None, diff, noncontiguous x)
LAYOUTS = (
    ("w_m1_nb4_s2_ax0", 1, 4, 2, (8, 5), 0, 1.0, 1.0, None, True, False),
    ("w_m3_nb4_s4_ax0_rs", 3, 4, 4, (16, 7), 0, 0.8, 1.0, (16, 1), True, False),
    ("w_m2_nb2_s6_ax0_conv", 2, 2, 6, (12, 3, 3, 1), 0, 1.0, 0.6, (12,), False, False),
    ("a2d_m2_nb4_s4_last", 2, 4, 4, (19, 16), -1, 1.0, 1.0, (16,), True, False),
    ("a3d_m4_nb8_s2_last_nc", 4, 8, 2, (2, 5, 16), -1, 1.0, 0.5, None, True, True),
    ("a2d_m1_nb3_s6_ax1pos", 1, 3, 6, (5, 18), 1, 1.0, 1.0, (18,), False, False),
    ("a4d_m3_nb4_s2_ax1_rs", 3, 4, 2, (2, 8, 3, 5), 1, 1.0, 1.5, (8,), True, False),
    ("a3d_m2_nb2_s4_ax1_nc", 2, 2, 4, (3, 8, 5), 1, 0.7, 1.0, None, False, True),
    ("a2d_t0_m2_nb2_s2", 2, 2, 2, (0, 4), -1, 1.0, 1.0, (4,), True, False),
)


def layout_args(dtype, device, requires_grad, gen, m, nb, s, xshape, axis, cscale, scale, rshape, diff, nc,
                block_dtype=None):
    block_dtype = dtype if block_dtype is None else block_dtype
    blocks = make((m, nb, s, s), block_dtype, device, gen=gen, scale=BLOCK_SCALE, requires_grad=requires_grad)
    x = make(xshape, dtype, device, gen=gen, noncontiguous=nc, requires_grad=requires_grad)
    rescale = None
    if rshape is not None:
        rescale = (1.0 + make(rshape, torch.float64, device, gen=gen, scale=0.3)).to(block_dtype)
        rescale.requires_grad_(requires_grad)
    return blocks, x, axis, cscale, scale, rescale, diff


def cases(dtype, device, requires_grad, gen) -> List[Case]:
    out = []
    for (cid, m, nb, s, xs, axis, cscale, scale, rs, diff, nc) in LAYOUTS:
        args = layout_args(dtype, device, requires_grad, gen, m, nb, s, xs, axis, cscale, scale, rs, diff, nc)
        out.append(Case("boft_fwd", args, f"boft_fwd-{cid}"))
        blocks, x = args[0].detach(), args[1].detach()
        grad = make(xs, dtype, device, gen=gen, noncontiguous=nc)
        out.append(Case("boft_bwd", (grad, blocks, x, axis, cscale, scale), f"boft_bwd-{cid}"))
    if dtype in (torch.float16, torch.bfloat16):
        args = layout_args(dtype, device, requires_grad, gen, 2, 4, 4, (19, 16), -1, 1.0, 1.0, (16,), True, False,
                           block_dtype=torch.float32)
        out.append(Case("boft_fwd", args, "boft_fwd-a2d_fp32blocks"))
        grad = make((19, 16), dtype, device, gen=gen)
        out.append(Case("boft_bwd", (grad, args[0].detach(), args[1].detach(), -1, 1.0, 1.0),
                        "boft_bwd-a2d_fp32blocks"))
    return out
