"""Pre-tune the ops for given layer shapes, so no key is timed on first use.

``warmup(layers, ...)`` runs each op once per (layer, token count) with the sample calls
of ``lycoris_ops.testing.samples`` (through ``torch.ops.lycoris``: whatever backend the
dispatcher picks tunes its key now and stores it in ``tuning.json``). From the command
line::

    python -m lycoris_ops.warmup --shapes 4096x4096,11008x4096:r32 --tokens 1024,4096
    python -m lycoris_ops.warmup --show        # the table's rows
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Dict, Iterable, Optional, Sequence

import torch

from lycoris_ops.backends import scope, select
from lycoris_ops.testing.samples import SAMPLES, Layer, parse_layer
from lycoris_ops.tuner import store, tune

__all__ = ["warmup", "Layer", "parse_layer", "main"]

log = logging.getLogger("lycoris_ops.tune")


def warmup(layers: Iterable, *, tokens: Sequence[int] = (1024,), dtype=torch.bfloat16, device=None,
           ops: Optional[Sequence[str]] = None, rank: int = 16, backward: bool = True,
           budget: Optional[float] = None, direct: bool = False) -> Dict[str, Any]:
    """Pre-tune the ops for the given layer shapes: runs each op once per (layer, token
    count) through ``torch.ops.lycoris`` on ``device`` (default the current CUDA device),
    so every key they meet is tuned now (and stored) instead of on first use.

    ``layers``: ``Layer``s, ``(out, in)`` / ``(out, in, rank)`` tuples or strings
    ``"OxI[:rR]"``. ``ops``: only these op names (default: every op with a sample;
    ``backward=False`` skips the ``*_bwd`` ops). ``budget``: per-key warm-up budget while
    pre-tuning (default None = no limit: the whole shortlist is timed). ``direct``: tune
    the Triton configs through the Triton tuning's ``KWARGS`` instead of calling the ops
    (which tune whatever backend the dispatcher picks). Keys that deferred their shortlists
    (Triton's and TileLang's) are waited for and called once more, so they are timed too. Returns a
    summary (calls made, keys tuned, table hits, seconds). Without CUDA it does nothing."""
    summary: Dict[str, Any] = {"calls": 0, "tuned": 0, "table_hits": 0, "seconds": 0.0, "errors": []}
    if not torch.cuda.is_available():
        summary["skipped"] = "no CUDA device"
        return summary
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    parsed = []
    for item in layers:
        if isinstance(item, Layer):
            parsed.append(item)
        elif isinstance(item, str):
            parsed.append(parse_layer(item, rank))
        else:
            vals = tuple(int(v) for v in item)
            parsed.append(Layer(vals[0], vals[1], vals[2] if len(vals) > 2 else rank))
    before = tune.stats()
    t0 = time.perf_counter()
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    previous_budget = tune.set_budget(0.0 if budget is None else budget)
    try:
        _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, summary, direct)
        # keys that deferred their shortlists (the tuner's, Triton's; the TileLang runner's, looked
        # up, not imported: only a process that loaded it can hold them) are timed by a second pass
        runner = sys.modules.get("lycoris_ops.backends.tilelang.runner")
        if tune.settle() + (runner.settle() if runner is not None else 0):
            again: Dict[str, Any] = {"calls": 0, "errors": []}
            _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, again, direct)  # they time them now
            summary["errors"] += again["errors"]
    finally:
        tune.set_budget(previous_budget)
    torch.cuda.synchronize(dev)
    after = tune.stats()
    summary["tuned"] = after["tuned"] - before["tuned"]
    summary["table_hits"] = after["table_hits"] - before["table_hits"]
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _warm_all(parsed, tokens, dtype, dev, gen, ops, backward, summary, direct) -> None:
    kwargs_of = _triton_kwargs() if direct else {}
    with torch.no_grad():
        for samples in SAMPLES.values():
            for layer in parsed:
                for T in tokens:
                    for op, args in samples(layer, int(T), dtype, dev, gen):
                        if ops is not None and op not in ops:
                            continue
                        if not backward and op.endswith("_bwd"):
                            continue
                        try:
                            if direct:
                                full = select._full_args(op, args)
                                if op not in kwargs_of or scope.why_not(op, "triton", full) is not None:
                                    continue
                                kwargs_of[op](*full)
                            else:
                                getattr(torch.ops.lycoris, op)(*args)
                            summary["calls"] += 1
                        except Exception as exc:
                            summary["errors"].append(f"{op} {layer} T={T}: {type(exc).__name__}: {exc}")


def _triton_kwargs() -> Dict[str, Any]:
    """op -> the Triton tuning's launcher-kwargs function (``direct`` warm-ups only)."""
    # imported here: Triton is an optional dependency the ops-driven warm-up does not need
    from lycoris_ops.backends.triton.tuning import MODULE_OF

    return {op: module.KWARGS[op] for op, module in MODULE_OF.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lycoris_ops.warmup",
        description="Pre-tune the lycoris ops for a list of layer shapes (fills tuning.json).")
    p.add_argument("--shapes", default="", help="comma-separated layer shapes OxI[:rR] (e.g. 4096x4096,11008x4096:r32)")
    p.add_argument("--rank", type=int, default=16, help="adapter rank when a shape gives none (default 16)")
    p.add_argument("--tokens", default="1024", help="comma-separated token counts (default 1024)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--ops", default="", help="comma-separated op names (default: all with samples)")
    p.add_argument("--no-backward", action="store_true", help="skip the *_bwd ops")
    p.add_argument("--cache-dir", default=None, help="table directory (default LYCORIS_KERNEL_CACHE_DIR)")
    p.add_argument("--device", default=None, help="CUDA device (default the current one)")
    p.add_argument("--show", action="store_true", help="print the table's rows and exit")
    p.add_argument("--direct", action="store_true",
                   help="tune the Triton configs through the Triton tuning directly, not through torch.ops.lycoris")
    a = p.parse_args(argv)
    if a.cache_dir:
        os.environ[store.ENV_CACHE_DIR] = a.cache_dir
    if a.show:
        rows = tune.table().rows
        print(f"{tune.table().path}: {len(rows)} rows")  # the sibling file where another program's table sits
        for k, row in sorted(rows.items()):
            print(f"  {k} -> {tune.label(row.get('config'))} {row.get('ms')} ms")
        return 0
    if not torch.cuda.is_available():
        print("lycoris_ops.warmup: no CUDA device here; nothing to tune (the table is filled on a GPU machine).")
        return 0
    layers = [parse_layer(s, a.rank) for s in a.shapes.split(",") if s.strip()]
    if not layers:
        print("lycoris_ops.warmup: no --shapes given; nothing to tune.")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tune.set_tuning(True)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    ops = [o.strip() for o in a.ops.split(",") if o.strip()] or None
    s = warmup(layers, tokens=tokens, dtype=getattr(torch, a.dtype), device=a.device, ops=ops, rank=a.rank,
               backward=not a.no_backward, direct=a.direct)
    print(f"lycoris_ops.warmup: {s['calls']} calls, {s['tuned']} keys tuned, {s['table_hits']} from the table, "
          f"{s['seconds']} s -> {tune.table_path()}")
    for e in s["errors"]:
        print("  error:", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
