"""LoHa case table (docs/ops.md §2.2): valid calls of the three LoHa ops
(the LoHa merge forward is ``lora_merge_fwd`` mode hada, in testing/lora.py)."""
from __future__ import annotations

from typing import List

import torch

from lycoris_ops.testing import Case, make


def cases(dtype=torch.float32, device="cpu", requires_grad: bool = False, gen: torch.Generator = None) -> List[Case]:
    half = dtype in (torch.float16, torch.bfloat16)

    def m(*shape, nc=False, rg=True, dt=None, scale=1.0):
        return make(shape, dt or dtype, device, gen=gen, scale=scale, noncontiguous=nc,
                    requires_grad=rg and requires_grad)

    def g(*shape, nc=False, dt=None):
        return m(*shape, nc=nc, rg=False, dt=dt)

    O, I, r, T = 37, 19, 5, 11
    out: List[Case] = []

    def f(fn, nc=False):  # a1, b1, a2, b2
        return fn(O, r), fn(r, I, nc=nc), fn(O, r, nc=nc), fn(r, I)

    B = "loha_merge_bwd"
    out.append(Case(B, (g(O, I), *f(g), 0.75), "merge_bwd"))
    out.append(Case(B, (g(O, I, nc=True), *f(g, nc=True), -1.5), "merge_bwd-nc"))
    if half:
        out.append(Case(B, (g(O, I, dt=torch.float32), *f(g), 0.5), "merge_bwd-fp32_grad"))

    F = "loha_bypass_fwd"
    out.append(Case(F, (m(T, I), *f(m), 0.75), "bypass"))
    out.append(Case(F, (m(T, I, nc=True), *f(m, nc=True), -1.25, m(T, O)), "bypass-base-nc"))
    if half:
        out.append(Case(F, (m(T, I), m(O, r, dt=torch.float32), m(r, I), m(O, r), m(r, I), 0.5,
                            m(T, O, dt=torch.float32)), "bypass-mixed_fp32"))

    B = "loha_bypass_bwd"
    out.append(Case(B, (g(T, O), g(T, I), *f(g), 0.75), "bypass_bwd"))
    out.append(Case(B, (g(T, O, nc=True), g(T, I, nc=True), *f(g, nc=True), -1.5), "bypass_bwd-nc"))
    return out
