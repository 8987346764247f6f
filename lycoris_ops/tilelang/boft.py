"""TileLang kernels of BOFT (OPS.md §2.6): ``boft_fwd`` and ``boft_bwd``.

Written from the math (``reference/boft.py`` is the oracle): everything fp32,
one rounding at the store. Stage i (κ_i = 2^i·s/2) applies
``F_{i,β} = scale·R_{i,β} + (1 − scale)·I`` (R, not Rᵀ) to the blocks of the
π_i-permuted channels, ``π_i(p) = ⌊p/2κ_i⌋·2κ_i + (p mod 2)·κ_i + ⌊(p mod 2κ_i)/2⌋``;
``y = u^m ⊙ rescale − diff·x``.

The kernel families are diag-OFT's (``oft.py``), with the channel map of each
stage computed in-kernel from κ_i (a launch argument) and the GEMM dtype fixed
to fp32 (TF32 hi + lo split, ~fp32 accuracy):

``boft_fwd``: ONE Cayley launch for all m·nb blocks (groups of NB blocks, NB a
    power of two dividing nb, so a group never straddles two stages; the
    rescale is folded into the rows of the last stage), then one apply launch
    per stage: stage 0 reads x, stages write fp32 ping-pong scratch, the last
    stage stores y in x's dtype and subtracts x when ``diff``.
``boft_bwd`` (the plain chain, OPS.md §2.6.2): F and Fᵀ Cayley launches, m − 1
    apply launches to keep the stage inputs u^1 … u^{m−1} (fp32 scratch), then
    per stage from the last one streaming launch (``gx = g·F``, fp32 partials
    ``P = Σ g_βᵀ·u_β`` in the permuted block basis) and ONE chain launch over
    all groups (``gR = scale·P``, ``gQ = 2Mᵀ·gR·Mᵀ``, ``gB = cscale·(gQ − gQᵀ)``).

Layouts: channels last (axis −1), weight (axis 0, (C, rest…)) and channels
first ((N, C, *spatial)) all run (x read as (pre, C, post), contiguous).
Tile configs: the streaming kernels' positions per tile and threads come from oft.py's
``APPLY`` / ``STREAM``, or a tuned ``cfg`` over them (plans/boft.py: ``TILELANG``).

Scope: s <= 64 (``scope.py``), fp16 / bf16 / fp32.
"""
import torch

from ._common import aligned, arch_of, kernel, launch_config, tl_dtype
from .oft import (_BT_BWD, _BT_FWD, APPLY, STREAM, apply_kernel, bwd_stream_kernel, cayley_kernel, chain_kernel,
                  position_view, tiling)
from .oft import _cayley as _oft_cayley

__all__ = ["boft_fwd", "boft_bwd", "boft_groups", "compile_specs"]

_F32 = "float32"


def boft_groups(s: int, nb: int):
    """(GP, NB, GC): group width, blocks per group (a power of two dividing nb), used channels."""
    gp = 32 if s <= 32 else 64
    n = 1
    while 2 * n * s <= gp and nb % (2 * n) == 0:
        n *= 2
    return gp, n, n * s


def _setup(blocks, x, axis):
    m, nb, s = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    ax = axis % x.dim()
    GP, NB, GC = boft_groups(s, nb)
    gps = nb // NB
    xc, cf, xv = position_view(x, ax)
    pre, post = (xv.shape[0], xv.shape[2]) if cf else (xv.shape[0], 1)
    return m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post


def _cayley(bc, rs, m, nb, s, NB, GP, gps, trans, cscale, scale, arch):
    """All stages' (hi, lo) fp32 group matrices; rescale ``rs`` folded into the last stage's rows."""
    return _oft_cayley(bc.view(m * nb, s, s), rs, torch.float32, s, NB, GP, True, True, trans, cscale, scale,
                       (m - 1) * gps, (s // 2) << (m - 1), m * gps, arch)


def boft_fwd(blocks, x, axis, cscale, scale, rescale, diff, cfg=None):
    """BOFT forward (OPS.md §2.6.1, see ``reference.boft.boft_fwd``): 1 + m launches; ``cfg``:
    the apply kernels' tuned {BT, threads} over oft's ``APPLY`` (every stage the same)."""
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post = _setup(blocks, x, axis)
    arch = arch_of(x.device)
    bc = aligned(blocks.contiguous())
    rs = None if rescale is None else aligned(rescale.reshape(-1).contiguous())
    fh, fl = _cayley(bc, rs, m, nb, s, NB, GP, gps, False, cscale, scale, arch)
    p = launch_config(APPLY, cfg)
    nsplit, tps = tiling(cf, pre, post, p["BT"], gps, x.device)
    xd = tl_dtype(x.dtype)
    scratch = [torch.empty(xv.shape, device=x.device, dtype=torch.float32) for _ in range(min(m - 1, 2))]
    src = xv
    for i in range(m):
        last = i == m - 1
        dst = y.view(xv.shape) if last else scratch[i % 2]
        k = kernel(apply_kernel, arch, tl_dtype(src.dtype), tl_dtype(dst.dtype), xd, _F32, GP, GC, p["BT"], cf, True,
                   bool(diff) and last, p["threads"])
        k(src, xv, fh, fl, dst, i * gps, (s // 2) << i, nsplit, tps)
        src = dst
    return y


def boft_bwd(grad, blocks, x, axis, cscale, scale, cfg=None):
    """BOFT backward of the plain chain (OPS.md §2.6.2): returns gx (x's shape and dtype)
    and g_blocks (blocks' shape and dtype). ``cfg``: the stream kernels' tuned {BT, threads}
    over oft's ``STREAM``; the forward replay keeps ``APPLY`` (its kernels are the forward's
    fixed ones, so a tuned key builds one kernel per candidate)."""
    gx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    g_blocks = torch.empty(blocks.shape, device=x.device, dtype=blocks.dtype)
    if x.numel() == 0:
        g_blocks.zero_()
        return gx, g_blocks
    m, nb, s, ax, GP, NB, GC, gps, xc, cf, xv, pre, post = _setup(blocks, x, axis)
    _, _, gv = position_view(grad, ax)
    dev = x.device
    arch = arch_of(dev)
    bc = aligned(blocks.contiguous())
    ng = m * gps
    xd = tl_dtype(x.dtype)
    # forward replay: stage inputs u^0 = x, u^1 … u^{m-1} (fp32)
    fh, fl = _cayley(bc, None, m, nb, s, NB, GP, gps, False, cscale, scale, arch)
    nsplit_f, tps_f = tiling(cf, pre, post, APPLY["BT"], gps, dev)
    us = [xv]
    for i in range(m - 1):
        dst = torch.empty(xv.shape, device=dev, dtype=torch.float32)
        k = kernel(apply_kernel, arch, tl_dtype(us[-1].dtype), _F32, xd, _F32, GP, GC, APPLY["BT"], cf, True, False,
                   APPLY["threads"])
        k(us[-1], xv, fh, fl, dst, i * gps, (s // 2) << i, nsplit_f, tps_f)
        us.append(dst)
    # backward through the stages
    th, tl_ = _cayley(bc, None, m, nb, s, NB, GP, gps, True, cscale, scale, arch)
    p = launch_config(STREAM, cfg)
    nsplit, tps = tiling(cf, pre, post, p["BT"], gps, dev)
    part = torch.empty((nsplit, ng, GP, GP), device=dev, dtype=torch.float32)
    g = gv
    for i in reversed(range(m)):
        dst = gx.view(xv.shape) if i == 0 else torch.empty(xv.shape, device=dev, dtype=torch.float32)
        k = kernel(bwd_stream_kernel, arch, tl_dtype(g.dtype), tl_dtype(us[i].dtype), tl_dtype(dst.dtype), _F32,
                   GP, GC, p["BT"], cf, True, p["threads"])
        k(g, us[i], th, tl_, dst, part, i * gps, (s // 2) << i, tps)
        g = dst
    kc = kernel(chain_kernel, arch, tl_dtype(blocks.dtype), tl_dtype(blocks.dtype), s, NB, GP, True, False)
    kc(part, bc.view(m * nb, s, s), bc.view(-1), g_blocks.view(m * nb, s, s),
       torch.empty((1,), device=dev, dtype=blocks.dtype), float(cscale), float(scale))
    return gx, g_blocks


def compile_specs(dtype: torch.dtype):
    """(builder, args) of the BOFT-specific configurations (permuted channel map, fp32
    GEMMs, diff) at a small config (CI compile check)."""
    d = tl_dtype(dtype)
    return [
        (cayley_kernel, (d, d, _F32, 4, 8, 32, True, True, True, False)),
        (apply_kernel, (d, _F32, d, _F32, 32, 32, _BT_FWD, False, True, False)),
        (apply_kernel, (_F32, d, d, _F32, 32, 32, _BT_FWD, True, True, True)),
        (bwd_stream_kernel, (d, d, d, _F32, 32, 32, _BT_BWD, False, True)),
        (chain_kernel, (d, d, 4, 8, 32, True, False)),
    ]
