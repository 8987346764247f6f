"""Cases for ``dora_fwd`` / ``dora_bwd`` (docs/ops.md §2.4)."""
from __future__ import annotations

import torch

from lycoris_ops.testing import Case, make


def _dscale(n, shape, dtype, device, gen, requires_grad=False):
    # magnitudes are positive and of the order of the row norms (DoRA init = ‖W_r‖)
    t = (make((n,), torch.float64, "cpu", gen=gen).abs() + 0.5) * 3.0
    return t.reshape(shape).to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _norms(w, delta, row_axis, dscale_dtype):
    m = w.detach().double() + (0 if delta is None else delta.detach().double())
    n = torch.linalg.vector_norm(m, dim=1 - row_axis) + torch.finfo(dscale_dtype).eps
    return n.to(torch.float64 if all(t.dtype == torch.float64 for t in (w, delta) if t is not None)
                and dscale_dtype == torch.float64 else torch.float32)


def cases(dtype, device, requires_grad, gen):
    rg = requires_grad
    out = []
    half = dtype in (torch.float16, torch.bfloat16)
    # (id, shape, row_axis, dscale shape, mult, with delta, noncontiguous w, dscale dtype)
    table = [
        ("rows", (37, 19), 0, (37, 1), 1.0, False, False, dtype),
        ("cols", (37, 19), 1, (1, 19), 1.0, False, False, dtype),
        ("rows_mult", (19, 37), 0, (19,), 0.7, False, True, dtype),
        ("cols_delta_mult", (5, 37), 1, (37,), 0.4, True, False, dtype),
        ("rows_delta_nc", (37, 5), 0, (37, 1), 1.0, True, True, dtype),
        ("conv_rows_mult0", (6, 3 * 3 * 3), 0, (6, 1, 1, 1), 0.0, True, False, dtype),
    ]
    if half:  # the usual training setup: fp32 magnitude, 16-bit weight
        table.append(("rows_fp32_scale", (19, 37), 0, (19, 1), 1.0, True, False, torch.float32))
    for cid, shape, ax, dshape, mult, with_delta, nc, ddt in table:
        w = make(shape, dtype, device, gen=gen, noncontiguous=nc, requires_grad=rg)
        delta = make(shape, dtype, device, gen=gen, scale=0.1, requires_grad=rg) if with_delta else None
        ds = _dscale(shape[ax], dshape, ddt, device, gen, requires_grad=rg)
        out.append(Case("dora_fwd", (w, ds, mult, ax, delta), cid))
        g = make(shape, dtype, device, gen=gen, noncontiguous=nc)
        norms = _norms(w, delta, ax, ddt).to(device)
        out.append(Case("dora_bwd", (g, w.detach(), ds.detach(), norms, mult, ax,
                                     None if delta is None else delta.detach()), cid))
    return out
