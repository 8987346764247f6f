"""Tile selection: per-op analytic cost models, a timed shortlist, and ``tuning.json``.

* ``device.py``: device facts (SM count, L2, shared memory, registers, cp.async ->
  pipeline depths) and the measured DRAM bandwidth / matmul peak (once per device,
  persisted in ``devices.json``).
* ``cost.py``: the shared roofline model (occupancy, bytes in flight, wave
  quantization, pipelining) and the shortlist builder.
* ``tune.py``: keys, bucketing, the table, the timer, the capture / compile guards,
  ``select_config``, ``warmup`` and the CLI (``python -m lycoris_ops.tuner.tune``).
* ``precompile.py``: a cold key's Triton kernels compiled in forked child processes
  before the tuner's first calls (which then load them from Triton's cache).
* ``tilelang.py``: the TileLang op set's step-down: each TileLang kernel (one fixed
  configuration) timed against the op's eager body once per shape bucket; the kernels
  of a first call built in forked children (``precompile.compile_forked``).
* ``<family>.py`` (the families of ``lycoris_ops/backends/triton/``): ``plan_<op>`` (candidates
  + scores -> ``tune.Plan``), ``<op>_kwargs(<schema args>)`` (the tuned launcher
  keyword arguments, or ``SENTINEL_EAGER``), ``launch(op, *args, **kw)``,
  ``samples`` (warm-up calls) and ``KWARGS`` (op -> its kwargs function).

``tuned(op, *args)`` is the whole thing for an op-set function: pick the config for
these (validated, in-scope) arguments and run the launcher with it, or the eager
body where eager won.
"""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

#: op -> planner family (``plans/<family>.py``)
FAMILY_OF: Dict[str, str] = {
    "lora_merge_fwd": "lora", "lora_merge_bwd": "lora", "lora_bypass_fwd": "lora", "lora_bypass_bwd": "lora",
    "lora_tucker_fwd": "tucker",
    "loha_merge_bwd": "loha", "loha_bypass_fwd": "loha", "loha_bypass_bwd": "loha",
    "lokr_full_merge_fwd": "lokr", "lokr_full_merge_bwd": "lokr", "lokr_merge_fwd": "lokr",
    "lokr_merge_bwd": "lokr", "lokr_bypass_fwd": "lokr", "lokr_bypass_bwd": "lokr",
    "dora_fwd": "dora", "dora_bwd": "dora", "oft_fwd": "oft", "oft_bwd": "oft", "boft_fwd": "boft",
    "boft_bwd": "boft", "ia3_fwd": "ia3", "ia3_bwd": "ia3", "add_scaled": "add",
}
#: op -> its eager body's family (``reference/<family>.py``)
_REFERENCE_OF = {op: ("lora" if fam == "tucker" else fam) for op, fam in FAMILY_OF.items()}
_entries: Dict[str, Tuple] = {}


def _entry(op: str):
    e = _entries.get(op)
    if e is None:
        fam = importlib.import_module(f"{__name__}.{FAMILY_OF[op]}")
        ref = importlib.import_module(f"lycoris_ops.reference.{_REFERENCE_OF[op]}")
        e = _entries[op] = (fam.KWARGS[op], fam.launch, getattr(ref, op))
    return e


def tuned(op: str, *args):
    """Run ``op`` (schema arguments, already validated and in scope) with its tuned Triton
    launch config, or its eager body where eager won the timing. Off CUDA (the Triton
    interpreter) the launcher's defaults are used."""
    kwargs_of, launch, eager = _entry(op)
    kw = kwargs_of(*args)
    if isinstance(kw, str):  # SENTINEL_EAGER
        return eager(*args)
    return launch(op, *args, **kw)
