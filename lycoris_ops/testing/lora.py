"""LoRA / LoCon case table (docs/ops.md §2.1): valid calls of the five LoRA ops.

Odd, tiny sizes; each op with and without base / out_dtype, a non-contiguous
operand, every merge mode, one- and two-chain tucker (a transposed a1 as LoHa
tucker passes it), and (16-bit runs) an fp32 operand promoted down.
"""
from __future__ import annotations

from typing import List

import torch

from lycoris_ops.testing import Case, make


def cases(dtype=torch.float32, device="cpu", requires_grad: bool = False, gen: torch.Generator = None) -> List[Case]:
    half = dtype in (torch.float16, torch.bfloat16)

    def m(*shape, nc=False, rg=True, dt=None, scale=1.0):
        return make(shape, dt or dtype, device, gen=gen, scale=scale, noncontiguous=nc,
                    requires_grad=rg and requires_grad)

    def g(*shape, nc=False, dt=None):  # operands of bwd ops never require grad
        return m(*shape, nc=nc, rg=False, dt=dt)

    O, I, r, r2, T = 37, 19, 5, 3, 11
    out: List[Case] = []

    # ---- lora_merge_fwd
    F = "lora_merge_fwd"
    out.append(Case(F, (m(O, r), m(r, I), None, None, None, 0.75, "plain"), "merge-plain"))
    out.append(Case(F, (m(O, r), m(r, I, nc=True), None, None, m(O, I), -1.25, "plain"), "merge-plain-base-nc"))
    out.append(Case(F, (m(O, r, nc=True), m(r, I), None, None, None, 0.5, "plain", torch.float32),
                    "merge-plain-out_fp32-nc"))
    out.append(Case(F, (m(O, r), m(r, I), m(O, r), m(r, I), None, 0.6, "hada"), "merge-hada"))
    out.append(Case(F, (m(O, r), m(r, I), m(O, r, nc=True), m(r, I), m(O, I), 1.5, "hada", torch.float32),
                    "merge-hada-base-out_fp32-nc"))
    out.append(Case(F, (m(O, r), m(r, I), m(O, r2), m(r2, I), None, 0.8, "sum"), "merge-sum"))
    out.append(Case(F, (m(O, r), m(r, I, nc=True), m(O, r2), m(r2, I), m(O, I), -0.4, "sum"), "merge-sum-base-nc"))
    if half:  # an fp32 factor (rounded down to the 16-bit compute dtype) and an fp32 base
        out.append(Case(F, (m(O, r), m(r, I, dt=torch.float32), None, None, m(O, I, dt=torch.float32), 0.9, "plain",
                            torch.float32), "merge-plain-mixed_fp32"))

    # ---- lora_merge_bwd
    B = "lora_merge_bwd"
    out.append(Case(B, (g(O, I), g(O, r), g(r, I), 0.75), "merge_bwd"))
    out.append(Case(B, (g(O, I, nc=True), g(O, r), g(r, I, nc=True), -1.5), "merge_bwd-nc"))
    if half:  # grad in fp32 (an out_dtype=fp32 forward)
        out.append(Case(B, (g(O, I, dt=torch.float32), g(O, r), g(r, I), 0.5), "merge_bwd-fp32_grad"))

    # ---- lora_bypass_fwd
    F = "lora_bypass_fwd"
    out.append(Case(F, (m(T, I), m(O, r), m(r, I), 0.75), "bypass"))
    out.append(Case(F, (m(T, I, nc=True), m(O, r), m(r, I), -1.25, m(T, O)), "bypass-base-nc"))
    if half:
        out.append(Case(F, (m(T, I), m(O, r, dt=torch.float32), m(r, I), 0.5, m(T, O, dt=torch.float32)),
                        "bypass-mixed_fp32"))

    # ---- lora_bypass_bwd
    B = "lora_bypass_bwd"
    out.append(Case(B, (g(T, O), g(T, I), g(O, r), g(r, I), 0.75), "bypass_bwd"))
    out.append(Case(B, (g(T, O, nc=True), g(T, I), g(O, r, nc=True), g(r, I), -1.5), "bypass_bwd-nc"))

    # ---- lora_tucker_fwd: (O, R), (R, R, Kk), (R, I)
    F = "lora_tucker_fwd"
    O, I, R, R2, Kk = 13, 7, 4, 3, 9
    out.append(Case(F, (m(O, R), m(R, R, Kk), m(R, I), None, None, None, 0.7), "tucker-1chain"))
    # LoHa passes w1uᵀ: a transposed (non-contiguous) a1
    a1t = m(R, O, rg=False).t()
    a2t = m(R2, O, rg=False).t()
    if requires_grad:
        a1t.requires_grad_(True)
        a2t.requires_grad_(True)
    out.append(Case(F, (a1t, m(R, R, Kk), m(R, I), a2t, m(R2, R2, Kk), m(R2, I), -1.3), "tucker-2chain-transposed"))
    out.append(Case(F, (m(O, R), m(R, R, 1, nc=True), m(R, I), m(O, R), m(R, R, 1), m(R, I), 0.5),
                    "tucker-2chain-k1-nc"))
    return out
