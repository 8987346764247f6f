"""The TileLang op set: one function per op of the op table, named and called like the schema.

Each receives arguments the op already validated (``check_<op>``) and that are inside
``lycoris_ops.backends.scope`` for backend ``"tilelang"`` (16-bit compute dtypes: fp32 calls
of the GEMM ops step down); outputs are fresh and contiguous, dtypes as the eager bodies
(``reference/<family>.py``). Each call goes through ``runner.run``: the op's launcher
(``tuning/<family>.py``'s ``LAUNCHERS[op]``, in ``kernels/``) with its timed config, or the
op's step-down body at the shapes where a timing showed it faster.

Importing this module raises ImportError when tilelang is not installed (the backend is
then absent) and compiles nothing: kernels compile on first use. Optional module attributes
read by ``registry``/``select``: ``DEVICE_TYPES`` (default ``("cuda",)``), ``DTYPES``,
``MIN_CAPABILITY``.
"""
import importlib.util as _ilu
import inspect

# whether tilelang is installed, without importing it (its import takes seconds): else the backend is absent
if _ilu.find_spec("tilelang") is None:
    raise ImportError("lycoris_ops.backends.tilelang.ops needs the tilelang package")

from lycoris_ops import reference  # noqa: E402
from lycoris_ops._library.optable import OPS  # noqa: E402
from lycoris_ops.backends.tilelang import common, runner  # noqa: E402
from lycoris_ops.tuner import tune  # noqa: E402


def _op_set_function(op: str):
    def run(*args):
        with common.device_guard(args[0]):  # every op's first argument is a tensor on the call's device
            return runner.run(op, args)

    run.__name__ = run.__qualname__ = op
    run.__signature__ = inspect.signature(reference.step_down(op))  # the schema's argument names
    run.__doc__ = f"lycoris.{op} on TileLang: runner.run({op!r}, args)."
    return run


#: the ops with TileLang kernels: all of them
__all__ = [row.name for row in OPS]
for _row in OPS:
    globals()[_row.name] = _op_set_function(_row.name)


def clear_caches() -> None:
    """Forget this process's built kernels and TileLang's tuning picks (``lycoris_ops.clear_caches``)."""
    common.clear()
    tune.clear()
