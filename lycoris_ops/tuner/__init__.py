"""The backend-agnostic tuner: picks each op's launch config once per (device, op, shape
bucket, dtypes) by timing a short list the op's cost model ranks, and stores the pick.

* ``keys.py``: candidates, ``Plan`` (a shortlist), shape buckets, table keys, kernel versions;
* ``timing.py``: the CUDA-event timer (L2 flush, GPU held busy), the output check against
  eager, the warm-up and timing of a shortlist;
* ``tune.py``: ``select_config`` / ``pick`` (memo -> ``tuning.json`` -> timing), the
  settings (``LYCORIS_KERNEL_TUNE*``), ``Front`` caches, ``clear``;
* ``build_pool.py``: cold keys' kernel builds in forked children (both backends' jobs);
* ``store.py``: the JSON tables shared by processes; ``device.py``: device facts and the
  measured bandwidth / matmul peak; ``cost.py``: the roofline model and shortlist builders;
* ``models/<family>.py``: each family's work models (a config's ``cost.Work``, the eager
  body's time), shared by the backends' tuning spaces.

Backends call into this package (their ``tuning/`` modules); it imports no backend.
"""
