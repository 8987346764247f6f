"""Dump every Triton shortlist (through each op's ``<op>_kwargs``, the tuner's ``pick``
captured instead of timing) and every TileLang shortlist (``TILELANG``) for a grid of
layers, token counts, dtypes and synthetic devices, as JSON: two checkouts' dumps compare
whether a change kept the tuning choices. CPU only (Triton interpreter; nothing runs).

    TRITON_INTERPRET=1 PYTHONPATH=<checkout> python bench/shortlists.py out.json
    cmp a.json b.json
"""
from __future__ import annotations

import importlib
import json
import math
import sys

import torch

FAMILIES = ("lora", "tucker", "loha", "lokr", "dora", "oft", "boft", "ia3", "add")


class _Layer:
    def __init__(self, o, i, r):
        self.out_features, self.in_features, self.rank = o, i, r


def _samples(family):
    try:
        from lycoris_ops.testing.samples import SAMPLES
        return SAMPLES[family]
    except ImportError:  # a checkout from before the samples moved
        return importlib.import_module(f"lycoris_ops.backends.triton.tuning.{family}").samples


def _clean(v):
    if isinstance(v, float):
        return "inf" if math.isinf(v) else round(v, 15)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v if isinstance(v, (int, str, bool, type(None))) else repr(v)


def main(out_path: str) -> int:
    import lycoris_ops  # noqa: F401  (registers the ops)
    from lycoris_ops.backends import select
    from lycoris_ops.tuner import device

    devices = {"h200": device.synthetic(),
               "a100": device.synthetic("NVIDIA A100-SXM4-80GB", capability=(8, 0), sm_count=108, l2_bytes=40 << 20,
                                        smem_per_block=163 << 10, smem_per_sm=164 << 10),
               "small": device.synthetic("x", capability=(7, 5), sm_count=40, l2_bytes=4 << 20,
                                         smem_per_block=64 << 10, smem_per_sm=64 << 10)}
    layers = [_Layer(1024, 1024, 16), _Layer(3072, 768, 32), _Layer(768, 3072, 8), _Layer(4096, 4096, 64)]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for family in FAMILIES:
        pm = importlib.import_module(f"lycoris_ops.backends.triton.tuning.{family}")
        pm.DEVICE_TYPES = ("cpu", "cuda")
        captured = []

        def pick(op, backend, key, plan, run_fused, run_eager, *, resolve, **kw):
            p = plan() if callable(plan) else plan
            cands = list(p)
            first = None if pm.tune.is_eager(cands[0]) else _clean(resolve(cands[0]))
            captured.append((op, _clean(key), _clean(cands), _clean(getattr(p, "predicted", [])), first))
            return cands[0]

        pm.tune.pick = pick
        for name, dev in devices.items():
            pm.facts = lambda d, dev=dev: dev
            for layer in layers:
                for T in (64, 4096):
                    for dtype in (torch.float32, torch.bfloat16):
                        for op, args in _samples(family)(layer, T, dtype, "cpu", gen):
                            captured.clear()
                            full = select._full_args(op, args)
                            pm.KWARGS[op](*full)
                            key = f"{name}|{op}|{layer.out_features}x{layer.in_features}r{layer.rank}|T{T}|{dtype}"
                            out["triton|" + key] = list(captured)
                            tl = getattr(pm, "TILELANG", {}).get(op)
                            if tl is not None:
                                p = tl[0](dev, *full)
                                out["tilelang|" + key] = [_clean(p.candidates), _clean(p.predicted), _clean(tl[1](*full))]
    with open(out_path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"{len(out)} shortlists -> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
