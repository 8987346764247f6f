"""Cases for ``add_scaled`` (docs/ops.md §2.8)."""
from __future__ import annotations

import torch

from lycoris_ops.testing import Case, make


def cases(dtype, device, requires_grad, gen):
    rg = requires_grad
    half = dtype in (torch.float16, torch.bfloat16)
    # (id, base shape, delta shape, gamma, noncontiguous delta, delta dtype)
    table = [
        ("weight", (37, 19), (37, 19), 0.75, False, dtype),
        ("conv_weight_nc", (6, 5, 3, 3), (6, 5, 3, 3), 1.0, True, dtype),
        ("bias", (37,), (37,), -0.5, False, dtype),
        ("scalar", (), (), 1.5, False, dtype),
    ]
    if half:  # an fp32 delta on a 16-bit base
        table.append(("fp32_delta", (37, 19), (37, 19), 0.3, True, torch.float32))
    out = []
    for cid, bs, ds, gamma, nc, ddt in table:
        base = make(bs, dtype, device, gen=gen, requires_grad=rg)
        delta = make(ds, ddt, device, gen=gen, noncontiguous=nc, requires_grad=rg)
        out.append(Case("add_scaled", (base, delta, gamma), cid))
    return out
