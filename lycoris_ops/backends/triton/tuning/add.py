"""Tuned launch config of the Triton ``add_scaled`` kernel (``kernels/add.py``): one program
per ``block`` elements. Work model: ``tuner/models/add.py``. Key: bucketed numel, the two
dtypes and whether each operand is one contiguous run (strided views read slower).
"""
from __future__ import annotations

import functools

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import add as kernels
from lycoris_ops.reference import add as reference
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import make_plan, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import add as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, reference)


def plan_add_scaled(dev: DeviceFacts, numel: int, base_dtype, delta_dtype, *, default=None, n: int = 5):
    work, eager = models.model(dev, numel, base_dtype, delta_dtype)
    cfgs = [dict(block=b, num_warps=w) for b in (256, 512, 1024, 2048, 4096, 8192) for w in (2, 4, 8, 16)]
    return make_plan("add_scaled", rank(cfgs, work, dev), tile_axes=("block",), n=n, default=default,
                     default_s=predict(work, default, dev), eager_s=eager)


_FRONT = tune.Front()


def add_scaled_kwargs(base, delta, gamma):
    """Launcher kwargs for ``kernels.add_scaled`` (or SENTINEL_EAGER)."""
    dev = base.device
    if dev.type not in DEVICE_TYPES:
        return {}
    bc, dc = base.is_contiguous(), delta.is_contiguous()
    fk = (base.numel(), base.dtype, delta.dtype, bc, dc, dev)
    hit = _FRONT.get(fk)
    if hit is not None:
        return hit
    numel = base.numel()
    key = tune.shape_key(base.dtype, tokens={"numel": numel}, flags={"delta": delta.dtype, "contig": (bc, dc)})
    return tune.pick(
        "add_scaled", BACKEND, key,
        lambda: plan_add_scaled(facts(dev), numel, base.dtype, delta.dtype,
                                default=as_dict(kernels.default_add_cfg(numel))),
        lambda kw: kernels.add_scaled(base, delta, gamma, **kw),
        lambda: reference.add_scaled(base, delta, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.AddCfg(**c)}, front=(_FRONT, fk), prepare=precompile.precompile)


KWARGS = {"add_scaled": add_scaled_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"add_scaled": kernels.add_scaled}
