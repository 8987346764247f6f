"""lycoris_ops: the fused LyCORIS adapter ops as ``torch.ops.lycoris.*`` custom ops.

Importing this package loads the prebuilt schema library (``lycoris_ops._C``,
built by ``pip install``; nothing is compiled at import), then registers the CPU
and CUDA kernels, the fakes and the autograd formulas of all 23 ops.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch, which _C links against)

try:
    from lycoris_ops._build_info import TORCH_VERSION as _BUILT_AGAINST  # written by setup.py beside _C
except ImportError as exc:
    raise ImportError(
        "lycoris_ops._C is not built. Install the package first: "
        "pip install torch==2.13.0 && pip install --no-build-isolation -e ."
    ) from exc

from lycoris_ops._library import preflight as _preflight  # noqa: E402

# Both before _C loads: a mismatched _C can crash as it loads, and a clash over the lycoris
# namespace while it loads terminates the process.
_preflight.check_torch_matches_build(_BUILT_AGAINST)
_preflight.check_namespace_free()

from lycoris_ops import _C  # noqa: E402

from lycoris_ops._library import optable as _optable  # noqa: E402

_optable.check_against(_C.schemas())
#: the op names, in schema order (the schemas: csrc/schemas.h; the op table: _library/optable.py)
OP_NAMES = tuple(op.name for op in _optable.OPS)

from lycoris_ops import settings as _settings  # noqa: E402

_settings.check_environment()  # an invalid LYCORIS_* value fails here, before anything runs

from lycoris_ops.backends.registry import available_backends, fused_backends, resolve_backend  # noqa: E402
from lycoris_ops.backends.registry import set_backend, use_backend  # noqa: E402
from lycoris_ops.warmup import warmup  # noqa: E402
from lycoris_ops._library import register as _registry  # noqa: E402  CPU/CUDA kernels
from lycoris_ops._library import fakes as _fakes  # noqa: E402  fake (meta) kernels
from lycoris_ops._library import autograd as _autograd  # noqa: E402  autograd on the ops
from lycoris_ops import functional, ops  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "OP_NAMES", "functional", "ops", "__version__",
    "available_backends", "fused_backends", "resolve_backend", "set_backend", "use_backend",
]
from lycoris_ops.report import explain  # noqa: E402  (what runs fused, per adapted layer)


def clear_caches() -> None:
    """Forget every decision this process cached, as a fresh process would start: the per-call
    backend choices, the tuned configs in memory (the tables on disk stay and are read again),
    the device facts, the validated call signatures, and each loaded op set's own caches."""
    from lycoris_ops.backends import registry, select
    from lycoris_ops.reference import checks
    from lycoris_ops.tuner import device, tune

    select.clear()
    tune.clear()
    device.clear()
    checks.clear_cached_checks()
    for opset in registry.loaded_opsets():
        getattr(opset, "clear_caches", lambda: None)()


from lycoris_ops.integrations.peft import patch_peft, unpatch_peft  # noqa: E402
__all__ += ["explain", "patch_peft", "unpatch_peft", "clear_caches"]

from lycoris_ops.integrations import lycoris_lora as _lycoris_lora  # noqa: E402
_lycoris_lora.install()  # then `import lycoris` (lycoris-lora 4.1) runs on these ops
