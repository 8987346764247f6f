"""TileLang kernel of ``add_scaled`` (docs/ops.md §2.8): ``out = base + γ·delta``.

One pass, one kernel: base and delta are read once each in their own dtypes
(fp32 and one 16-bit type may mix: the reference TileLang kernel's one-dtype
restriction, §6.20, is lifted), the sum is fp32, the result is stored once in
base's dtype. The flat element range is viewed as ``(NV, VEC)`` with a static
vector width VEC (the largest of 8/4/2/1 that divides numel and fits 16 bytes),
so every load and store is a 16-byte vector; a tile is ``BV`` vectors, the tail
tile is masked. ``NV`` is a ``T.dynamic`` size: one kernel serves every numel.

Layout: delta is read in row-major order of its own shape (``reshape``);
non-contiguous or misaligned operands are read from a contiguous copy.
"""

import torch

from lycoris_ops.reference import scalar_in
from lycoris_ops.backends.tilelang.common import aligned, arch_of, kernel, launch_config, tl_dtype

__all__ = ["add_kernel", "add_scaled", "vec_width", "compile_specs"]

_THREADS = 128
_BV = 256  # vectors per tile (2 per thread)
_I32_LIMIT = 2**31 - 2**17
#: the fixed launch config (the tuner's ``{}`` candidate); a tuned ``cfg`` (backends/tilelang/tuning/add.py:
#: ``tl_plan_add_scaled``) overrides BV (vectors per tile) and threads
ADD = dict(BV=_BV, threads=_THREADS)


def add_kernel(bd: str, dd: str, od: str, VEC: int, BV: int = _BV, threads_: int = _THREADS, cpu: bool = False):
    """``O = B + γ·D`` over (NV, VEC) views; fp32 math, one rounding."""
    import tilelang.language as T

    NV = T.dynamic("NV")
    par = T.grid if cpu else T.Parallel
    threads = 1 if cpu else threads_

    @T.prim_func
    def add_scaled_kernel(B: T.Tensor((NV, VEC), bd), D: T.Tensor((NV, VEC), dd), O: T.Tensor((NV, VEC), od),
                          gamma: T.float32):
        with T.Kernel(T.ceildiv(NV, BV), threads=threads) as bx:
            j0 = bx * BV
            for j, v in par(BV, VEC):
                if j0 + j < NV:
                    O[j0 + j, v] = T.cast(T.cast(B[j0 + j, v], "float32") + gamma * T.cast(D[j0 + j, v], "float32"), od)

    return add_scaled_kernel


def vec_width(numel: int, *dtypes: torch.dtype) -> int:
    """Largest VEC in 8/4/2/1 dividing ``numel`` with VEC·itemsize <= 16 bytes for every dtype."""
    cap = min(16 // torch.empty((), dtype=d).element_size() for d in dtypes)
    for v in (8, 4, 2, 1):
        if v <= cap and numel % v == 0:
            return v
    return 1


def add_scaled(base: torch.Tensor, delta: torch.Tensor, gamma: float, cfg=None) -> torch.Tensor:
    """``base + γ·delta`` in base's shape and dtype (fresh, contiguous)."""
    p = launch_config(ADD, cfg)
    out = torch.empty(base.shape, device=base.device, dtype=base.dtype)
    n = out.numel()
    if n == 0:
        return out
    vec = vec_width(n, base.dtype, delta.dtype)
    nv = n // vec
    if nv >= _I32_LIMIT:  # beyond 32-bit tile indices: eager (documented limit)
        out.copy_(torch.add(base.float(), delta.reshape(base.shape).float(),
                            alpha=scalar_in(gamma, torch.float32)))
        return out
    b = aligned(base.reshape(-1).contiguous()).view(nv, vec)
    d = aligned(delta.reshape(-1).contiguous()).view(nv, vec)
    k = kernel(add_kernel, arch_of(base.device), tl_dtype(base.dtype), tl_dtype(delta.dtype), tl_dtype(out.dtype), vec,
               p["BV"], p["threads"])
    k(b, d, out.view(nv, vec), float(gamma))
    return out


def compile_specs(dtype: torch.dtype):
    """(builder, args) of every kernel family of this file at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [(add_kernel, (d, d, d, 8)), (add_kernel, (d, "float32", d, 4))]
