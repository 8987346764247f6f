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

#: the 23 op names, in schema order (the table lives in csrc/schemas.h)
OP_NAMES = tuple(s.split("(", 1)[0] for s in _C.schemas())

from lycoris_ops import settings as _settings  # noqa: E402

_settings.check_environment()  # an invalid LYCORIS_* value fails here, before anything runs

from lycoris_ops.backends.registry import available_backends, fused_backends, resolve_backend  # noqa: E402
from lycoris_ops.backends.registry import set_backend, use_backend  # noqa: E402
from lycoris_ops.warmup import warmup  # noqa: E402
from lycoris_ops._library import register as _registry  # noqa: E402  CPU/CUDA kernels
from lycoris_ops._library import fakes as _fakes  # noqa: E402  fake (meta) kernels
from lycoris_ops._library import autograd as _autograd  # noqa: E402  autograd on the ops
from lycoris_ops import functional  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "OP_NAMES", "functional", "__version__",
    "available_backends", "fused_backends", "resolve_backend", "set_backend", "use_backend",
]
from lycoris_ops.report import explain  # noqa: E402  (what runs fused, per adapted layer)
__all__ += ["explain"]

from lycoris_ops.integrations import lycoris_lora as _lycoris_lora  # noqa: E402
_lycoris_lora.install()  # then `import lycoris` (lycoris-lora 4.1) runs on these ops
