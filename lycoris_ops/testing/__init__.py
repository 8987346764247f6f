"""Shared test-case tables: one per family (``testing/<family>.py``).

The same cases drive the reference parity tests, opcheck, the Triton interpreter
tests, the GPU parity script and ``python -m lycoris_ops``' sample calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lycoris_ops._library.optable import FAMILIES  # the op table's families

#: relative Frobenius distance allowed against an fp64 oracle (docs/ops.md §8)
REL_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass
class Case:
    """One valid call: ``torch.ops.lycoris.<op>(*args)``."""

    op: str
    args: tuple
    id: str

    def __call__(self):
        return getattr(torch.ops.lycoris, self.op)(*self.args)

    def tensors(self) -> List[torch.Tensor]:
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def to(self, device=None, dtype=None, requires_grad: Optional[bool] = None) -> "Case":
        """The same call with every tensor moved/cast (layout kept: non-contiguous stays so)."""
        def conv(a):
            if not isinstance(a, torch.Tensor):
                return a
            b = _same_layout_copy(a, device, dtype)
            if requires_grad is not None:
                b.requires_grad_(requires_grad and b.is_floating_point())
            return b
        return Case(self.op, tuple(conv(a) for a in self.args), self.id)


def _same_layout_copy(a: torch.Tensor, device, dtype) -> torch.Tensor:
    device = a.device if device is None else device
    dtype = a.dtype if dtype is None else dtype
    if a.is_contiguous() or a.dim() == 0:
        return a.detach().to(device=device, dtype=dtype).clone()
    # keep the strides: copy into an empty_strided buffer of the same geometry
    out = torch.empty_strided(a.shape, a.stride(), device=device, dtype=dtype)
    out.copy_(a.detach())
    return out


def make(shape: Sequence[int], dtype=torch.float32, device="cpu", *, gen: torch.Generator,
         scale: float = 1.0, requires_grad: bool = False, noncontiguous: bool = False) -> torch.Tensor:
    """Fresh random normal data; ``noncontiguous`` gives a strided view (every other column)."""
    shape = tuple(shape)
    if noncontiguous and len(shape) >= 1:
        big = torch.randn(shape[:-1] + (2 * shape[-1],), generator=gen, dtype=torch.float64)
        t = (big * scale).to(device=device, dtype=dtype)[..., ::2]  # slice last: the view stays strided
    else:
        t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def check_bf16_against_eager(run: "Case") -> None:
    """Refill ``run``'s floating tensors (normal), call the op and its eager body on them
    and compare every non-empty output, loosely (bf16 against bf16: garbage fails)."""
    from lycoris_ops._library.register import eager

    for a in run.tensors():
        if a.is_floating_point():
            a.normal_()
    want, got = eager(run.op)(*run.args), run()
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for w, g in zip(want, got):
        if isinstance(w, torch.Tensor) and w.numel():
            assert g.shape == w.shape and g.dtype == w.dtype, f"{run.op}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
            err = rel_err(g, w)
            assert err <= 4 * REL_TOL[torch.bfloat16] or (g.double() - w.double()).abs().max() <= 1e-2, \
                f"{run.op}: rel err {err:.3e}"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius distance ||a - e|| / max(||e||, tiny), computed in fp64."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def cases(family: Optional[str] = None, dtype=torch.float32, device="cpu", requires_grad: bool = False,
          seed: int = 0) -> List[Case]:
    """Valid calls of every op of ``family`` (all families when None)."""
    out = []
    for fam in FAMILIES if family is None else (family,):
        mod = globals()[fam]
        gen = torch.Generator().manual_seed(seed)
        out.extend(mod.cases(dtype=dtype, device=device, requires_grad=requires_grad, gen=gen))
    return out


# The family case tables, after the helpers they import from this package.
from lycoris_ops.testing import add, boft, dora, ia3, lokr, lora, loha, oft  # noqa: E402,F401
