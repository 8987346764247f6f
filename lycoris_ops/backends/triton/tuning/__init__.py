"""The Triton op set's launch configs, one module per family (``<family>.py``):

* ``plan_<op>(dev, ...)``: the shortlist the tuner times (``tuner.keys.Plan``), ranked by
  the family's work model (``lycoris_ops/tuner/models/<family>.py``): the model's best
  tile shapes, the launcher's fixed default, variants the model cannot tell apart (timed,
  never predicted), and ``SENTINEL_EAGER`` where the eager body could win;
* ``<op>_kwargs(<schema args>)``: the launcher keyword arguments for one call (one dict
  lookup once its key is tuned), ``SENTINEL_EAGER`` where eager won, or ``{}`` off CUDA
  (the launcher's defaults, e.g. under the Triton interpreter);
* ``KWARGS`` (op -> its kwargs function) and ``LAUNCHERS`` (op -> the launcher in
  ``backends/triton/kernels/<family>.py`` those kwargs are for).

``backends/triton/ops.py`` calls ``<op>_kwargs`` and then the launcher (or the eager body).
"""
from __future__ import annotations

from lycoris_ops.backends.triton.tuning import add, boft, dora, ia3, loha, lokr, lora, oft, tucker

#: the family modules, in warm-up order
FAMILIES = (lora, tucker, loha, lokr, dora, oft, boft, ia3, add)
#: op -> its family's module (from the families' ``KWARGS``)
MODULE_OF = {op: module for module in FAMILIES for op in module.KWARGS}
