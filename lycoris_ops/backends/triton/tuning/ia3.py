"""Tuned launch configs of the Triton IA3 kernels (``kernels/ia3.py``): ``ia3_fwd`` and
``ia3_bwd``. Work model: ``tuner/models/ia3.py`` (memory-bound tiles of x seen as a matrix).
Key: bucketed M, exact N, the row kind, dtypes.
"""
from __future__ import annotations

import functools

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import ia3 as kernels
from lycoris_ops.reference import ia3 as reference
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import make_plan, p2, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import ia3 as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, reference)


def _tiles(M, N):
    out = []
    for bn in (16, 32, 64, 128, 256):
        if bn > max(16, p2(N)):
            continue
        for elems in (1024, 2048, 4096, 8192):
            bm = max(1, min(p2(M), elems // bn))
            out.append((bm, bn))
    return sorted(set(out))


def plan_ia3_fwd(dev: DeviceFacts, M: int, N: int, C: int, x_dtype, w_dtype, *, default=None, n: int = 5):
    work, eager = models.fwd_model(dev, M, N, C, x_dtype, w_dtype)
    cfgs = [dict(block_m=bm, block_n=bn, split=0, num_warps=w) for bm, bn in _tiles(M, N) for w in (2, 4, 8)]
    return make_plan("ia3_fwd", rank(cfgs, work, dev), tile_axes=("block_m", "block_n"), n=n, default=default,
                     default_s=predict(work, default, dev), eager_s=eager)


def plan_ia3_bwd(dev: DeviceFacts, M: int, N: int, C: int, ch_rows: bool, x_dtype, w_dtype, g_dtype, *,
                 default=None, n: int = 5):
    work, eager = models.bwd_model(dev, M, N, C, ch_rows, x_dtype, w_dtype, g_dtype)
    cfgs = [dict(block_m=bm, block_n=bn, split=0, num_warps=w) for bm, bn in _tiles(M, N) for w in (2, 4, 8)]
    return make_plan("ia3_bwd", rank(cfgs, work, dev), tile_axes=("block_m", "block_n"), n=n, default=default,
                     default_s=predict(work, default, dev), eager_s=eager)


_F_FWD, _F_BWD = tune.Front(), tune.Front()


def ia3_fwd_kwargs(x, w, channel_axis, alpha, gamma):
    """Launcher kwargs for ``kernels.ia3_fwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, x.dtype, w.dtype, channel_axis, dev)
    hit = _F_FWD.get(fk)
    if hit is not None:
        return hit
    M, N, C, ch_rows = models.geometry(x.shape, channel_axis)
    key = tune.shape_key(x.dtype, tokens={"M": M}, exact={"N": N, "C": C}, flags={"w": w.dtype, "rows": ch_rows})
    return tune.pick(
        "ia3_fwd", BACKEND, key,
        lambda: plan_ia3_fwd(facts(dev), M, N, C, x.dtype, w.dtype, default=as_dict(kernels.default_ia3_fwd_cfg(M, N))),
        lambda kw: kernels.ia3_fwd(x, w, channel_axis, alpha, gamma, **kw),
        lambda: reference.ia3_fwd_native(x, w, channel_axis, alpha, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.Ia3Cfg(**c)}, front=(_F_FWD, fk), prepare=precompile.precompile)


def ia3_bwd_kwargs(grad, x, w, channel_axis, alpha, gamma):
    """Launcher kwargs for ``kernels.ia3_bwd`` (or SENTINEL_EAGER)."""
    dev = x.device
    if dev.type not in DEVICE_TYPES:
        return {}
    fk = (x.shape, grad.dtype, x.dtype, w.dtype, channel_axis, dev)
    hit = _F_BWD.get(fk)
    if hit is not None:
        return hit
    M, N, C, ch_rows = models.geometry(x.shape, channel_axis)
    key = tune.shape_key(x.dtype, tokens={"M": M}, exact={"N": N, "C": C},
                         flags={"w": w.dtype, "g": grad.dtype, "rows": ch_rows})
    return tune.pick(
        "ia3_bwd", BACKEND, key,
        lambda: plan_ia3_bwd(facts(dev), M, N, C, ch_rows, x.dtype, w.dtype, grad.dtype,
                             default=as_dict(kernels.default_ia3_bwd_cfg(M, N, ch_rows))),
        lambda kw: kernels.ia3_bwd(grad, x, w, channel_axis, alpha, gamma, **kw),
        lambda: reference.ia3_bwd_native(grad, x, w, channel_axis, alpha, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.Ia3Cfg(**c)}, front=(_F_BWD, fk), prepare=precompile.precompile)


KWARGS = {"ia3_fwd": ia3_fwd_kwargs, "ia3_bwd": ia3_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"ia3_fwd": kernels.ia3_fwd, "ia3_bwd": kernels.ia3_bwd}
