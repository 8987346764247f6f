"""What the tuner stores and looks up: candidates, shortlists and table keys.

Keys: ``<device name>|<backend>|<op>|v<kernel version>|<k=v,...>`` where the parts are the
op's bucketed shape, dtypes and flags (``shape_key``). Token-like axes (tokens, numel of
elementwise ops, positions streamed by OFT/BOFT/IA3) are bucketed by ``bucket``: up to
4096 -> the next power of two, 4097-8192 -> 6144 or 8192, above -> the next multiple of
4096; weight dimensions are exact. The version (``source_version``) changes when a kernel's
or its family's reference source changes, which invalidates that family's rows only.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

__all__ = ["SENTINEL_EAGER", "Candidate", "Plan", "is_eager", "as_dict", "bucket", "shape_key", "normalize_parts",
           "make_key", "label", "source_version"]

#: the eager body of the op, a candidate like the tiles
SENTINEL_EAGER = "eager"

Candidate = Union[Dict[str, Any], str]


def is_eager(c) -> bool:
    return isinstance(c, str) and c == SENTINEL_EAGER


@dataclass
class Plan:
    """A planner's answer: the shortlist, best predicted first, with the predicted
    seconds of each (``inf`` where the model has no estimate, e.g. eager)."""

    op: str
    candidates: List[Candidate]
    predicted: List[float] = field(default_factory=list)

    def first(self) -> Candidate:
        return self.candidates[0]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self):
        return iter(self.candidates)


def as_dict(cfg) -> Optional[Dict[str, Any]]:
    """A launcher config (NamedTuple, nested ones included) as a plain JSON-able dict: the
    candidate form of a launcher's default."""
    if cfg is None:
        return None
    if hasattr(cfg, "_asdict"):
        return {k: as_dict(v) if hasattr(v, "_asdict") else v for k, v in cfg._asdict().items()}
    return dict(cfg)


def bucket(n: int) -> int:
    """Bucket of a token-like size: <= 4096 -> next power of two (minimum 1); 4097-8192 ->
    6144 or 8192 (one bucket there put Flux's 4608 tokens under the choice timed at 8192);
    larger -> next multiple of 4096."""
    n = int(n)
    if n <= 1:
        return 1
    if n <= 4096:
        return 1 << (n - 1).bit_length()
    if n <= 6144:
        return 6144
    return -(-n // 4096) * 4096


def _value(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return v
    if isinstance(v, torch.Size) or isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    if isinstance(v, torch.device):
        return str(v)
    return str(v)


def shape_key(dtype=None, *, tokens: Optional[Dict[str, int]] = None, exact: Optional[Dict[str, Any]] = None,
              flags: Optional[Dict[str, Any]] = None) -> Tuple[Tuple[str, Any], ...]:
    """The key parts of one call: ``tokens`` are bucketed, ``exact`` and ``flags`` kept,
    dtypes written without ``torch.``; order: dtype, tokens, exact, flags."""
    parts: List[Tuple[str, Any]] = []
    if dtype is not None:
        parts.append(("dtype", _value(dtype)))
    for k, v in (tokens or {}).items():
        parts.append((k, bucket(v)))
    for k, v in (exact or {}).items():
        parts.append((k, _value(v)))
    for k, v in (flags or {}).items():
        parts.append((k, _value(v)))
    return tuple(parts)


def normalize_parts(parts) -> Tuple[Tuple[str, Any], ...]:
    """``parts`` (a dict, or ``shape_key``'s (name, value) pairs, or bare values) as
    normalized (name, value) pairs."""
    if isinstance(parts, dict):
        return tuple((str(k), _value(v)) for k, v in parts.items())
    out = []
    for item in parts:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((item[0], _value(item[1])))
        else:
            out.append(("", _value(item)))
    return tuple(out)


def _fmt(v) -> str:
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt(x) for x in v) + ")"
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def make_key(device_name: str, backend: str, op: str, version, parts) -> str:
    """The table key of one (device, backend, op, kernel version, shape bucket, dtypes)."""
    shape = ",".join(f"{k}={_fmt(v)}" if k else _fmt(v) for k, v in normalize_parts(parts))
    return f"{device_name}|{backend}|{op}|v{version}|{shape}"


def label(c: Candidate) -> str:
    """A candidate as the table and the log write it (``k=v,...`` or ``eager``)."""
    if is_eager(c):
        return SENTINEL_EAGER
    return ",".join(f"{k}={_fmt(_value(v))}" for k, v in c.items()) if isinstance(c, dict) else str(c)


_versions: Dict[tuple, str] = {}


def source_version(*objs, extra: str = "") -> str:
    """A short hash of the source of ``objs`` (modules, functions, Triton JIT functions,
    file paths): the kernel version in the keys, so editing a kernel retunes it only."""
    key = tuple(id(o) if not isinstance(o, str) else o for o in objs) + (extra,)
    v = _versions.get(key)
    if v is None:
        h = hashlib.sha1(extra.encode())
        for o in objs:
            path = o if isinstance(o, str) else getattr(o, "__file__", None)
            if path and os.path.exists(path):
                with open(path, "rb") as f:
                    h.update(f.read())
                continue
            text = getattr(o, "src", None)  # triton.JITFunction
            if text is None:
                try:
                    text = inspect.getsource(o)
                except (OSError, TypeError):
                    text = repr(o)
            h.update(text.encode())
        v = _versions[key] = h.hexdigest()[:10]
    return v
