"""The TileLang op set's tuning spaces: per family (``<family>.py``) the tile spaces of its
kernels' launch configs (``TL_*``), the shortlist of a call (``TILELANG``: op -> (shortlist
f(DeviceFacts, *schema args) -> Plan, the exact sizes its tuning key adds)), and the quick
twins of cold first configs (``TL_QUICK``). ``backends/tilelang/runner.py`` reads them.

A shortlist scores a family's tile configs with the backend-agnostic work models of
``lycoris_ops/tuner/models`` (the Triton kernels' models, the names mapped) and puts the
kernel's fixed config first: the untimed pick is the configuration the parity tests run.
"""

#: tile candidates of a TileLang shortlist besides its fixed config and eager: each is a
#: TileLang build (seconds each, in forked children before the timing), so fewer than Triton's
TL_N = 3
