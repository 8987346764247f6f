"""Small helpers shared by the family planners (plans/<family>.py)."""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

import torch

from lycoris_ops.reference.checks import promote_dtypes as compute_dtype  # noqa: F401  (re-exported to the planners)

_HALF = (torch.float16, torch.bfloat16)


def as_dict(cfg) -> Optional[Dict[str, Any]]:
    """A launcher config (NamedTuple, nested ones included) as a plain JSON-able dict."""
    if cfg is None:
        return None
    if hasattr(cfg, "_asdict"):
        return {k: as_dict(v) if hasattr(v, "_asdict") else v for k, v in cfg._asdict().items()}
    return dict(cfg)


_triton_modules: Dict[str, Any] = {}


def triton_module(family: str):
    """``lycoris_ops.backends.triton.<family>`` (imported lazily: the launchers import the planners;
    then kept here: this runs on every launch and import_module costs a microsecond)."""
    module = _triton_modules.get(family)
    if module is None:
        module = _triton_modules[family] = importlib.import_module(f"lycoris_ops.backends.triton.kernels.{family}")
    return module


def reference_module(family: str):
    return importlib.import_module(f"lycoris_ops.reference.{family}")


def rand(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    """Sample data for ``warmup`` from the caller's private generator."""
    return (torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)
