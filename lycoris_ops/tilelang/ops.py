"""The TileLang op set: the fused TileLang kernels of the 23 ops, one function per op.

Each function has the op's schema signature and name and receives arguments that
the op already validated (``check_<op>``) and that are inside
``lycoris_ops.scope`` for backend ``"tilelang"``. An op absent from this module
steps down to the next tier (``select``), so the set may grow one op at a time.
Optional module attributes read by ``dispatch``/``select``: ``DEVICE_TYPES``
(default ``("cuda",)``), ``DTYPES``, ``MIN_CAPABILITY``.

No op is implemented yet.
"""
