"""Tuned launch configs of the Triton DoRA kernels (``kernels/dora.py``): ``dora_fwd`` and
``dora_bwd``. Work model: ``tuner/models/dora.py`` (resident or streamed norm vectors).

The tuner picks between the two variants through ``resident_max`` (0 forces streaming) and
the streamed tile (br, bc). Key: exact R, NC (weight dims), the orientation, delta present,
dtypes.
"""
from __future__ import annotations

import functools

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import dora as kernels
from lycoris_ops.reference import dora as reference
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import esize, make_plan, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import dora as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, reference)


def _configs(dev: DeviceFacts, r_contig: bool):
    tiles = [(0, 0)] + ([(64, 32), (128, 16), (256, 32), (128, 64)] if r_contig else [(2, 1024), (8, 256), (4, 1024),
                                                                                     (16, 128)])
    out = []
    for rm in (0, 8192, 16384, 32768):
        for br, bc in (tiles if rm == 0 else [(0, 0)]):
            for w in (4, 8):
                for s in (1, 2, 3):
                    out.append(dict(resident_max=rm, br=br, bc=bc, split=0, num_warps=w, num_stages=s))
    return out


def _plan(op, dev, R, NC, r_contig, bwd, ew, ed, ey, eg, default, n):
    seen = {}
    work, eager = models.model(dev, R, NC, r_contig, bwd, ew, ed, ey, eg, max_split=kernels.MAX_SPLIT, seen=seen)
    cfgs = _configs(dev, r_contig)
    ranked = rank(cfgs, work, dev)
    seen.clear()
    return make_plan(op, ranked, tile_axes=("resident_max", "br", "bc"), n=n, default=default,
                     default_s=predict(work, default, dev), eager_s=eager)


def plan_dora_fwd(dev: DeviceFacts, R: int, NC: int, r_contig: bool, w_dtype, delta_dtype, *, default=None,
                  n: int = 5):
    return _plan("dora_fwd", dev, R, NC, r_contig, False, esize(w_dtype), esize(delta_dtype), esize(w_dtype), 0,
                 default, n)


def plan_dora_bwd(dev: DeviceFacts, R: int, NC: int, r_contig: bool, w_dtype, delta_dtype, g_dtype, *,
                  default=None, n: int = 5):
    return _plan("dora_bwd", dev, R, NC, r_contig, True, esize(w_dtype), esize(delta_dtype), esize(w_dtype),
                 esize(g_dtype), default, n)


def _geom(w, row_axis):
    R, NC = (w.shape[0], w.shape[1]) if row_axis == 0 else (w.shape[1], w.shape[0])
    s0, s1 = w.stride()
    sr, sc = (s0, s1) if row_axis == 0 else (s1, s0)
    return int(R), int(NC), sr == 1 and sc != 1


_F_FWD, _F_BWD = tune.Front(), tune.Front()


def dora_fwd_kwargs(w, dscale, mult, row_axis, delta=None):
    """Launcher kwargs for ``kernels.dora_fwd`` (or SENTINEL_EAGER)."""
    dev = w.device
    if dev.type not in DEVICE_TYPES:
        return {}
    R, NC, r_contig = _geom(w, row_axis)
    fk = (w.shape, r_contig, w.dtype, dscale.dtype, None if delta is None else delta.dtype, row_axis, dev)
    hit = _F_FWD.get(fk)
    if hit is not None:
        return hit
    key = tune.shape_key(w.dtype, exact={"R": R, "NC": NC},
                         flags={"r_contig": r_contig, "dscale": dscale.dtype,
                                "delta": None if delta is None else delta.dtype})
    return tune.pick(
        "dora_fwd", BACKEND, key,
        lambda: plan_dora_fwd(facts(dev), R, NC, r_contig, w.dtype, None if delta is None else delta.dtype,
                              default=as_dict(kernels.DoraCfg())),
        lambda kw: kernels.dora_fwd(w, dscale, mult, row_axis, delta, **kw),
        lambda: reference.dora_fwd(w, dscale, mult, row_axis, delta),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.DoraCfg(**c)}, front=(_F_FWD, fk), prepare=precompile.precompile)


def dora_bwd_kwargs(grad, w, dscale, norms, mult, row_axis, delta=None):
    """Launcher kwargs for ``kernels.dora_bwd`` (or SENTINEL_EAGER)."""
    dev = w.device
    if dev.type not in DEVICE_TYPES:
        return {}
    R, NC, r_contig = _geom(w, row_axis)
    fk = (w.shape, r_contig, grad.dtype, w.dtype, dscale.dtype, None if delta is None else delta.dtype, row_axis,
          dev)
    hit = _F_BWD.get(fk)
    if hit is not None:
        return hit
    key = tune.shape_key(w.dtype, exact={"R": R, "NC": NC},
                         flags={"r_contig": r_contig, "dscale": dscale.dtype, "g": grad.dtype,
                                "delta": None if delta is None else delta.dtype})
    return tune.pick(
        "dora_bwd", BACKEND, key,
        lambda: plan_dora_bwd(facts(dev), R, NC, r_contig, w.dtype, None if delta is None else delta.dtype,
                              grad.dtype, default=as_dict(kernels.DoraCfg())),
        lambda kw: kernels.dora_bwd(grad, w, dscale, norms, mult, row_axis, delta, **kw),
        lambda: reference.dora_bwd(grad, w, dscale, norms, mult, row_axis, delta),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.DoraCfg(**c)}, front=(_F_BWD, fk), prepare=precompile.precompile)


KWARGS = {"dora_fwd": dora_fwd_kwargs, "dora_bwd": dora_bwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"dora_fwd": kernels.dora_fwd, "dora_bwd": kernels.dora_bwd}
