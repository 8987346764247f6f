"""LoKr case table (docs/ops.md §2.3): valid calls of the six LoKr ops.

Sizes are odd and tiny (a few thousand elements); each op has cases with and
without base / out_dtype, a non-contiguous operand, every factored/whole
combination of ``lokr_merge_fwd`` and a conv w2 flattened to (c, d·Kk).
"""
from __future__ import annotations

from typing import List

import torch

from lycoris_ops.testing import Case, make


def cases(dtype=torch.float32, device="cpu", requires_grad: bool = False, gen: torch.Generator = None) -> List[Case]:
    def m(*shape, nc=False, rg=False, scale=1.0):
        return make(shape, dtype, device, gen=gen, scale=scale, noncontiguous=nc,
                    requires_grad=rg and requires_grad)

    out: List[Case] = []

    # ---- lokr_full_merge_fwd: w1 (a, b), w2 (c, d); output (a*c, b*d)
    a, b, c, d = 5, 3, 7, 19
    out.append(Case("lokr_full_merge_fwd", (m(a, b, rg=True), m(c, d, rg=True), None, 0.75), "full_fwd-plain"))
    out.append(Case("lokr_full_merge_fwd",
                    (m(a, b, rg=True), m(c, d, nc=True, rg=True), m(a * c, b * d, rg=True), -1.25),
                    "full_fwd-base-noncontig_w2"))
    out.append(Case("lokr_full_merge_fwd",
                    (m(a, b, nc=True, rg=True), m(c, d, rg=True), None, 0.5, torch.float32),
                    "full_fwd-out_dtype-noncontig_w1"))
    # conv w2 (c=4, d=5, 3x3) flattened to (4, 45)
    out.append(Case("lokr_full_merge_fwd",
                    (m(3, 2, rg=True), m(4, 5 * 9, rg=True), m(12, 2 * 45, rg=True), 1.5),
                    "full_fwd-conv_w2-base"))

    # ---- lokr_full_merge_bwd
    out.append(Case("lokr_full_merge_bwd", (m(a * c, b * d), m(a, b), m(c, d), 0.75), "full_bwd-plain"))
    out.append(Case("lokr_full_merge_bwd", (m(12, 2 * 45, nc=True), m(3, 2), m(4, 45), -1.5),
                    "full_bwd-conv_w2-noncontig_grad"))

    # ---- lokr_merge_fwd / lokr_merge_bwd: every factored/whole combination
    a, b, c, d, r1, r2 = 5, 7, 3, 11, 2, 4

    def sides(f1, f2, nc=False, rg=False, d_cols=d):
        w1a = m(a, r1 if f1 else b, rg=rg)
        w1b = m(r1, b, rg=rg) if f1 else None
        w2a = m(c, r2 if f2 else d_cols, nc=nc, rg=rg)
        w2b = m(r2, d_cols, rg=rg) if f2 else None
        return w1a, w1b, w2a, w2b

    for f1, f2, tag in ((True, True, "both"), (True, False, "side1"), (False, True, "side2"), (False, False, "whole")):
        w = sides(f1, f2, rg=True)
        out.append(Case("lokr_merge_fwd", (*w, [a, b, c, d], None, 0.5), f"merge_fwd-{tag}"))
        w = sides(f1, f2, nc=True, rg=True)
        out.append(Case("lokr_merge_fwd", (*w, [a, b, c, d], m(a * c, b * d, rg=True), -0.75),
                        f"merge_fwd-{tag}-base-noncontig"))
        w = sides(f1, f2)
        out.append(Case("lokr_merge_bwd", (m(a * c, b * d), *w, [a, b, c, d], 1.25), f"merge_bwd-{tag}"))
    out.append(Case("lokr_merge_fwd", (*sides(True, True, rg=True), [a, b, c, d], None, 2.0, torch.float32),
                    "merge_fwd-out_dtype"))
    # conv w2b (r2, d=2, 3x3) flattened to (r2, 18): shape[3] is the column count 18
    kd = 2 * 9
    w = sides(True, True, rg=True, d_cols=kd)
    out.append(Case("lokr_merge_fwd", (*w, [a, b, c, kd], m(a * c, b * kd, rg=True), 0.5), "merge_fwd-conv_w2b-base"))
    w = sides(False, True, d_cols=kd)
    out.append(Case("lokr_merge_bwd", (m(a * c, b * kd, nc=True), *w, [a, b, c, kd], 0.5),
                    "merge_bwd-conv_w2b-noncontig_grad"))

    # ---- lokr_bypass_fwd / lokr_bypass_bwd: x (T, b*d) -> (T, a*c)
    T, a, b, c, d = 19, 3, 5, 7, 4
    out.append(Case("lokr_bypass_fwd", (m(T, b * d, rg=True), m(a, b, rg=True), m(c, d, rg=True), 0.75),
                    "bypass_fwd-plain"))
    out.append(Case("lokr_bypass_fwd",
                    (m(T, b * d, nc=True, rg=True), m(a, b, rg=True), m(c, d, nc=True, rg=True), -1.5,
                     m(T, a * c, rg=True)),
                    "bypass_fwd-base-noncontig"))
    out.append(Case("lokr_bypass_fwd", (m(T, 37 * 1, rg=True), m(2, 37, rg=True), m(5, 1, rg=True), 0.5),
                    "bypass_fwd-d1"))
    out.append(Case("lokr_bypass_bwd", (m(T, a * c), m(T, b * d), m(a, b), m(c, d), 0.75), "bypass_bwd-plain"))
    out.append(Case("lokr_bypass_bwd", (m(T, a * c, nc=True), m(T, b * d, nc=True), m(a, b), m(c, d, nc=True), -1.5),
                    "bypass_bwd-noncontig"))
    return out
