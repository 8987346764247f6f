"""Diag-OFT cases (docs/ops.md §2.5): weight and activation layouts (2-D, 3-D, 4-D),
odd K/S/L/T, rescale on/off (including a module-shaped (O, 1) rescale), shift
on/off, a non-contiguous x, and a constraint factor cscale ≠ 1."""
from __future__ import annotations

from typing import List

import torch

from lycoris_ops.testing import Case, make

#: raw blocks are drawn with this std so I − Q stays well conditioned
BLOCK_SCALE = 0.2

# (id, K, S, x shape, weight, rescale shape or None, cscale, shift, noncontiguous x)
LAYOUTS = (
    ("w_k3s5_l7", 3, 5, (15, 7), True, None, 1.0, True, False),
    ("w_k2s4_l19_rs_noshift", 2, 4, (8, 19), True, (8, 1), 0.7, False, False),
    ("w_k3s5_l7_rs_nc", 3, 5, (15, 7), True, (15,), 1.0, True, True),
    ("a2d_t19_k3s5", 3, 5, (19, 15), False, None, 1.0, True, False),
    ("a2d_t19_k3s5_rs_nc", 3, 5, (19, 15), False, (15,), 0.5, True, True),
    ("a3d_n2_k2s3_l5_rs", 2, 3, (2, 6, 5), False, (6,), 1.0, False, False),
    ("a4d_n2_k3s4_hw3x5", 3, 4, (2, 12, 3, 5), False, (12, 1, 1, 1), 1.0, True, False),
    ("a4d_n2_k3s4_hw3x5_nc", 3, 4, (2, 12, 3, 5), False, None, 0.9, False, True),
    ("a2d_t0_k2s3", 2, 3, (0, 6), False, (6,), 1.0, True, False),
)


def layout_args(dtype, device, requires_grad, gen, K, S, xshape, weight, rshape, cscale, shift, nc,
                block_dtype=None):
    block_dtype = dtype if block_dtype is None else block_dtype
    blocks = make((K, S, S), block_dtype, device, gen=gen, scale=BLOCK_SCALE, requires_grad=requires_grad)
    x = make(xshape, dtype, device, gen=gen, noncontiguous=nc, requires_grad=requires_grad)
    rescale = None
    if rshape is not None:
        rescale = (1.0 + make(rshape, torch.float64, device, gen=gen, scale=0.3)).to(block_dtype)
        rescale.requires_grad_(requires_grad)
    return blocks, x, rescale, cscale, shift, weight


def cases(dtype, device, requires_grad, gen) -> List[Case]:
    out = []
    for (cid, K, S, xs, weight, rs, cscale, shift, nc) in LAYOUTS:
        args = layout_args(dtype, device, requires_grad, gen, K, S, xs, weight, rs, cscale, shift, nc)
        out.append(Case("oft_fwd", args, f"oft_fwd-{cid}"))
        blocks, x, rescale = (a.detach() if isinstance(a, torch.Tensor) else a for a in args[:3])
        grad = make(xs, dtype, device, gen=gen, noncontiguous=nc)
        out.append(Case("oft_bwd", (grad, blocks, x, rescale) + args[3:], f"oft_bwd-{cid}"))
    # blocks kept fp32 with a 16-bit activation (the functional path's usual call)
    if dtype in (torch.float16, torch.bfloat16):
        args = layout_args(dtype, device, requires_grad, gen, 3, 5, (19, 15), False, (15,), 1.0, True, False,
                           block_dtype=torch.float32)
        out.append(Case("oft_fwd", args, "oft_fwd-a2d_fp32blocks"))
        grad = make((19, 15), dtype, device, gen=gen)
        out.append(Case("oft_bwd", (grad,) + tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                    for a in args), "oft_bwd-a2d_fp32blocks"))
    return out
