"""Bounds check of Triton kernels under the interpreter (the CPU runs of the kernel tests).

The interpreter reads and writes past a tensor silently, where a GPU faults (an illegal
memory access, which also kills the process's CUDA context). ``checked()`` makes every load
and store of an interpreted launch assert that each address its mask enables lies inside the
storage of one of that launch's tensor arguments. It wraps three internals of
``triton.runtime.interpreter`` (``GridExecutor._init_args_hst``,
``InterpreterBuilder.create_masked_load`` / ``create_masked_store``);
``tests/triton/test_interpreter_bounds.py`` fails if they move.
"""
from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def checked():
    from triton.runtime import interpreter as interp

    ranges = []  # [start, end) of each storage the current launch was given
    real_init = interp.GridExecutor._init_args_hst
    real_load = interp.InterpreterBuilder.create_masked_load
    real_store = interp.InterpreterBuilder.create_masked_store

    def note(a):
        if isinstance(a, (tuple, list)):
            for b in a:
                note(b)
        elif hasattr(a, "untyped_storage"):
            st = a.untyped_storage()
            ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        ranges.clear()
        note(list(args_hst) + list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        addr = np.asarray(ptrs.data).astype(np.uint64)
        live = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        if live.size == 0:
            return
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(live.shape, dtype=bool)
        for lo, hi in ranges:
            ok |= (live >= lo) & (live + size <= hi)
        if not ok.all():
            bad = live[~ok]
            raise AssertionError(f"interpreted {what} outside the launch's tensors: {bad.size} of {live.size} "
                                 f"addresses, e.g. {hex(int(bad[0]))}; tensors at "
                                 f"{[(hex(lo), hi - lo) for lo, hi in ranges]} (start, bytes)")

    def load(self, ptrs, mask, other, *args, **kwargs):
        check(ptrs, mask, "load")
        return real_load(self, ptrs, mask, other, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        check(ptrs, mask, "store")
        return real_store(self, ptrs, value, mask, *args, **kwargs)

    interp.GridExecutor._init_args_hst = init
    interp.InterpreterBuilder.create_masked_load = load
    interp.InterpreterBuilder.create_masked_store = store
    try:
        yield
    finally:
        interp.GridExecutor._init_args_hst = real_init
        interp.InterpreterBuilder.create_masked_load = real_load
        interp.InterpreterBuilder.create_masked_store = real_store
