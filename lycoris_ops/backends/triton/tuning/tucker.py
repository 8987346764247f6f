"""Tuned launch config of the Triton tucker rebuild (``kernels/tucker.py``):
``lora_tucker_fwd``. Work model: ``tuner/models/tucker.py``. Key: exact O, I, Kk and ranks,
dtypes; a call small enough for one program keeps the launcher's one launch, untimed.
"""
from __future__ import annotations

import functools

import torch

from lycoris_ops.backends.triton import precompile
from lycoris_ops.backends.triton.kernels import fusedkit, tucker as kernels
from lycoris_ops.reference import lora as reference
from lycoris_ops.reference.checks import promote_dtypes as compute_dtype
from lycoris_ops.tuner import tune
from lycoris_ops.tuner.keys import as_dict
from lycoris_ops.tuner.cost import esize, make_plan, predict, rank
from lycoris_ops.tuner.device import DeviceFacts, facts
from lycoris_ops.tuner.models import tucker as models

BACKEND = "triton"
#: device types whose calls are tuned (others get the launcher defaults: ``{}``); tests add "cpu"
DEVICE_TYPES = ("cuda",)


@functools.lru_cache(maxsize=None)
def version() -> str:
    return tune.source_version(kernels, fusedkit, reference)


def plan_tucker_fwd(dev: DeviceFacts, O: int, I: int, Kk: int, ranks, compute, out_dtype, *, default=None,
                    n: int = 5):
    tc = compute != torch.float32
    chains = 2 if len(ranks) == 4 else 1
    work = models.fwd_work(dev, O, I, Kk, ranks, compute, out_dtype, pack_width=kernels.pack_width)
    # fp32 (FMA dots): one row per dot or the packed rows; 16-bit (tensor cores, write-bound): one row
    packs = sorted({1, kernels.o_pack_for(Kk, 32)}) if not tc else [1]
    cfgs = [dict(block_o=bo * opk, block_i=bi, group_o=8, num_warps=w, num_stages=s, o_pack=opk)
            for opk in packs for bo in (4, 8, 16, 32) for bi in (32, 64, 128, 256) for w in (4, 8)
            for s in (1, 2, 3)]
    eager = models.fwd_eager(dev, O, I, Kk, max(ranks), chains, esize(compute), esize(out_dtype), tc)
    return make_plan("lora_tucker_fwd", rank(cfgs, work, dev), tile_axes=("block_o", "block_i", "o_pack"), n=n,
                     default=default, default_s=predict(work, default, dev), eager_s=eager)


_FRONT = tune.Front()


def tucker_fwd_kwargs(a1, t1, b1, a2, t2, b2, gamma):
    """Launcher kwargs for ``kernels.tucker_fwd`` (or SENTINEL_EAGER)."""
    dev = a1.device
    if dev.type not in DEVICE_TYPES:
        return {}
    two = a2 is not None
    fk = (a1.shape, t1.shape, b1.shape, None if not two else (t2.shape, a2.dtype, t2.dtype, b2.dtype),
          a1.dtype, t1.dtype, b1.dtype, dev)
    hit = _FRONT.get(fk)
    if hit is not None:
        return hit
    O, I, Kk = int(a1.shape[0]), int(b1.shape[1]), int(t1.shape[2])
    ranks = (int(t1.shape[0]), int(t1.shape[1])) + ((int(t2.shape[0]), int(t2.shape[1])) if two else ())
    compute = compute_dtype(*(t.dtype for t in (a1, t1, b1, a2, t2, b2) if t is not None))
    key = tune.shape_key(compute, exact={"O": O, "I": I, "Kk": Kk, "ranks": ranks}, flags={"out": a1.dtype})
    if kernels.one_launch(O, I, Kk, ranks[1::2], compute):
        # one program building its own AT: launch-bound (a few µs of device time), so no tile is
        # worth the second launch a timed pick may bring (a multi-program tile needs AT first)
        _FRONT[fk] = {}
        return {}
    d = kernels.default_tucker_cfg(O, I, Kk, max(ranks), two, compute)
    default = as_dict(d)
    return tune.pick(
        "lora_tucker_fwd", BACKEND, key,
        lambda: plan_tucker_fwd(facts(dev), O, I, Kk, ranks, compute, a1.dtype, default=default),
        lambda kw: kernels.tucker_fwd(a1, t1, b1, a2, t2, b2, gamma, **kw),
        lambda: reference.lora_tucker_fwd(a1, t1, b1, a2, t2, b2, gamma),
        device=dev, version=version(), resolve=lambda c: {"cfg": kernels.TuckerCfg(**c)}, front=(_FRONT, fk), prepare=precompile.precompile)


KWARGS = {"lora_tucker_fwd": tucker_fwd_kwargs}
#: op -> the launcher those kwargs are for (schema arguments, then the kwargs)
LAUNCHERS = {"lora_tucker_fwd": kernels.tucker_fwd}
