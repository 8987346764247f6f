"""Which backends exist, in which order they are preferred, and the process-wide setting.

Backends, in order of preference (``ORDER``):

1. ``triton``   -- the fused op set ``lycoris_ops/backends/triton/ops.py``;
2. ``tilelang`` -- the same op set, TileLang-authored (``lycoris_ops/backends/tilelang/ops.py``);
3. ``compile``  -- ``torch.compile`` of the op's eager body (once per op per process);
4. ``torch``    -- the eager body itself (always there).

``_PROBE`` maps each backend to the import that must succeed for it to exist; a
backend whose import fails is simply absent (never an import-time error of
lycoris_ops). ``FUSED`` names the tiers that carry an op set: the module
``lycoris_ops.<name>.ops``, exposing any subset of the 23 op functions (same
signatures as the schemas, arguments already validated). Adding a backend is
registering its name in ``_PROBE``, ``ORDER`` and ``FUSED`` plus that module.

The process-wide setting comes from ``LYCORIS_KERNEL_BACKEND`` (``auto`` or a
backend name), read once on first use; ``set_backend`` / ``use_backend`` change
it at run time. A named backend is still narrowed per call by the scope rules
(``select.choose``, ``scope.py``): a named fused backend steps down to
``compile`` (CUDA) and ``torch``; it never jumps to the *other* fused backend.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from lycoris_ops import settings

#: backend name -> module whose import must succeed for the backend to exist
_PROBE: Dict[str, str] = {
    "triton": "triton",
    "tilelang": "tilelang",
    "compile": "torch._dynamo",
    "torch": "torch",
}
#: preference order, first that applies wins (``torch`` is always the last resort)
ORDER: Tuple[str, ...] = ("triton", "tilelang", "compile", "torch")
#: the tiers that carry an op set (``lycoris_ops.<name>.ops``)
FUSED: Tuple[str, ...] = ("triton", "tilelang")

ENV_BACKEND = settings.ENV_BACKEND
ENV_TUNE = "LYCORIS_KERNEL_TUNE"
ENV_CACHE_DIR = "LYCORIS_KERNEL_CACHE_DIR"

# --- process state (all caches; ``refresh()`` drops them) ---
_probes: Dict[str, Optional[str]] = {}  # name -> None (ok) or the import error text
_opsets: Dict[str, object] = {}  # name -> op-set module, or None when it does not import
_opset_errors: Dict[str, str] = {}
_setting: Optional[str] = None  # "auto" or a backend name; None = env not read yet
#: (backend, device) -> the error text that demoted it for the rest of the process
_demoted: Dict[Tuple[str, torch.device], str] = {}
_capability: Dict[torch.device, Tuple[int, int]] = {}


def valid_values() -> Tuple[str, ...]:
    """The values ``LYCORIS_KERNEL_BACKEND`` and ``set_backend`` accept."""
    return ("auto",) + tuple(ORDER)


def _probe(name: str) -> bool:
    """Whether backend ``name``'s probe import succeeds (cached; never raises)."""
    if name not in _probes:
        module = _PROBE.get(name)
        if module is None:
            _probes[name] = "not registered in lycoris_ops.backends.registry._PROBE"
        elif name == "compile" and os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"):
            _probes[name] = "TORCHDYNAMO_DISABLE is set"
        else:
            try:
                importlib.import_module(module)
                _probes[name] = None
            except Exception as exc:  # ImportError, OSError from a broken install, ...
                _probes[name] = f"import {module} failed: {type(exc).__name__}: {exc}"
    return _probes[name] is None


def probe_error(name: str) -> Optional[str]:
    """Why backend ``name`` is absent (None when it is available)."""
    _probe(name)
    return _probes.get(name)


def opset(name: str):
    """The op-set module of fused backend ``name`` (``lycoris_ops.<name>.ops``), or None
    when the backend is absent or its op set does not import."""
    if name in _opsets:
        return _opsets[name]
    module = None
    if name in FUSED and _probe(name):
        path = f"{__package__}.{name}.ops"
        try:
            module = importlib.import_module(path)
        except Exception as exc:
            _opset_errors[name] = f"import {path} failed: {type(exc).__name__}: {exc}"
            module = None
    _opsets[name] = module
    return module


def loaded_opsets() -> Tuple[object, ...]:
    """The op-set modules imported so far (none is imported to answer)."""
    return tuple(m for m in _opsets.values() if m is not None)


def opset_error(name: str) -> Optional[str]:
    opset(name)
    return _opset_errors.get(name) or (None if _opsets.get(name) is not None else probe_error(name))


def device_types(module) -> Tuple[str, ...]:
    """The device types an op set serves (module attribute ``DEVICE_TYPES``, default cuda)."""
    return tuple(getattr(module, "DEVICE_TYPES", ("cuda",)))


def capability(device: torch.device) -> Tuple[int, int]:
    """CUDA compute capability of ``device`` (cached); (0, 0) for a non-CUDA device."""
    cap = _capability.get(device)
    if cap is None:
        cap = (0, 0)
        if device.type == "cuda":
            try:
                cap = tuple(torch.cuda.get_device_capability(device))
            except Exception:
                cap = (0, 0)
        _capability[device] = cap
    return cap


# --- the process-wide setting ---

def _parse(value: str, source: str) -> str:
    name = value.strip().lower()
    if name in ("", "auto", "default"):
        return "auto"
    if name not in ORDER:
        raise ValueError(
            f"lycoris_ops: {source}={value!r} is not a backend; valid values: {', '.join(valid_values())}"
        )
    return name


def _installed() -> str:
    names = [n for n in ORDER if _probe(n)]
    return ", ".join(names) if names else "none"


def backend_setting() -> str:
    """The process-wide setting: ``auto`` or a backend name (``LYCORIS_KERNEL_BACKEND``,
    read once; an invalid value raises ValueError listing the valid ones; a valid
    but absent backend warns once and means ``auto``)."""
    global _setting
    if _setting is None:
        name = settings.get(ENV_BACKEND)
        if name != "auto" and not _probe(name):
            warnings.warn(
                f"lycoris_ops: {ENV_BACKEND}={name} but that backend is not available "
                f"({probe_error(name)}); installed: {_installed()}. Using auto.",
                RuntimeWarning, stacklevel=2,
            )
            name = "auto"
        _setting = name
    return _setting


def set_backend(name: Optional[str] = "auto", *, strict: bool = True) -> Optional[str]:
    """Change the process-wide backend at run time; returns the previous setting
    (None when the environment's was invalid).

    ``name``: ``auto``, ``triton``, ``tilelang``, ``compile`` or ``torch``;
    ``None`` re-reads ``LYCORIS_KERNEL_BACKEND``. A backend that is not available
    raises ValueError naming the installed ones (``strict=False``: warns and uses
    ``auto``). Every cached per-call choice is dropped, so the next call of each
    op chooses again.
    """
    global _setting
    try:
        previous = backend_setting()
    except ValueError:  # an invalid LYCORIS_KERNEL_BACKEND, being overridden
        previous = None
    if name is None:
        _setting = None  # re-read on next use (an invalid value raises then)
    else:
        parsed = _parse(str(name), "backend")
        if parsed != "auto" and not _probe(parsed):
            msg = (f"lycoris_ops: backend {parsed!r} is not available ({probe_error(parsed)}); "
                   f"installed: {_installed()}")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + ". Using auto.", RuntimeWarning, stacklevel=2)
            parsed = "auto"
        _setting = parsed
    _invalidate()
    return previous


@contextlib.contextmanager
def use_backend(name: Optional[str], *, strict: bool = True) -> Iterator[str]:
    """``with use_backend("torch"): ...`` -- set_backend for the block, then restore."""
    previous = set_backend(name, strict=strict)
    try:
        yield backend_setting()
    finally:
        set_backend(previous, strict=False)


# --- availability ---

def is_demoted(name: str, device: torch.device) -> bool:
    return (name, device) in _demoted


def demote(name: str, device: torch.device, error: str) -> None:
    """Take backend ``name`` out of the order for ``device`` for the rest of the process."""
    _demoted[(name, device)] = error
    _invalidate()


def demotions() -> Dict[Tuple[str, torch.device], str]:
    return dict(_demoted)


def serves(name: str, device: torch.device, *, named: Optional[bool] = None) -> bool:
    """Whether backend ``name`` can take calls on ``device`` at all (before the per-op
    scope rules): present, not demoted there, and the device is one it serves
    (fused: its op set's ``DEVICE_TYPES`` and capability; compile: CUDA unless named)."""
    if named is None:
        named = backend_setting() == name
    if not _probe(name) or (name, device) in _demoted:
        return False
    if name in FUSED:
        module = opset(name)
        if module is None or device.type not in device_types(module):
            return False
        if device.type == "cuda":
            from lycoris_ops.backends import scope

            need = getattr(module, "MIN_CAPABILITY", scope.MIN_CAPABILITY.get(name))
            if need is not None and not named and capability(device) < tuple(need):
                return False
        return True
    if name == "compile":
        return device.type == "cuda" or named
    return True


def candidates(device: Optional[torch.device] = None) -> Tuple[str, ...]:
    """The tiers a call may take, in order, before the per-op scope rules.

    auto: ``ORDER``; a named fused backend: itself, then the non-fused tiers; a
    named non-fused tier: itself and what follows it. With ``device``, narrowed to
    the backends that serve it. Always ends with ``torch``.
    """
    return tuple(iter_candidates(device))


def iter_candidates(device: Optional[torch.device] = None) -> Iterator[str]:
    """``candidates(device)`` lazily: a tier is probed only when the walk reaches it, so
    a call the first tier takes never imports the later ones (TileLang, ``torch._dynamo``:
    seconds at a process's first call)."""
    setting = backend_setting()
    if setting == "auto":
        names = tuple(ORDER)
    elif setting in FUSED:
        names = (setting,) + tuple(n for n in ORDER if n not in FUSED)
    else:
        names = tuple(ORDER[ORDER.index(setting):])
    for n in names:
        if n == "torch":
            break
        if (serves(n, device, named=(n == setting)) if device is not None else _probe(n)):
            yield n
    yield "torch"


def available_backends(device=None) -> Tuple[str, ...]:
    """The backends present in this process, in ``ORDER`` (those whose probe import
    succeeds). With ``device``: those that can take calls there (see ``serves``;
    the compile tier counts on CPU only when it is the named backend)."""
    if device is None:
        return tuple(n for n in ORDER if _probe(n))
    device = torch.device(device)
    return tuple(n for n in ORDER if serves(n, device))


def fused_backends(device=None) -> Tuple[str, ...]:
    """The available backends that carry an op set (``FUSED`` whose op-set module
    imports); with ``device``, those serving it."""
    names = tuple(n for n in ORDER if n in FUSED and opset(n) is not None)
    if device is None:
        return names
    device = torch.device(device)
    return tuple(n for n in names if serves(n, device))


def resolve_backend(device=None) -> str:
    """The process-wide preference: the named backend, or under ``auto`` the first
    available one in ``ORDER``. With ``device``: the first tier that serves it
    (the per-call scope rules may still step an individual call further down)."""
    if device is None:
        setting = backend_setting()
        return setting if setting != "auto" else available_backends()[0]
    return candidates(torch.device(device))[0]


def tuning_enabled() -> bool:
    """``LYCORIS_KERNEL_TUNE`` (default on): off turns measured tile picks off (``settings``)."""
    return settings.get(ENV_TUNE)


def cache_dir() -> str:
    return os.path.expanduser(settings.get(ENV_CACHE_DIR))


def tuning_table_path() -> str:
    return os.path.join(cache_dir(), "tuning.json")


# --- cache invalidation ---

#: called after anything a per-call choice depends on changed (the setting, a demotion, the
#: probes): ``select`` registers its ``clear`` here, so this module never imports it
_on_change: List[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever the cached per-call choices become stale."""
    if callback not in _on_change:
        _on_change.append(callback)


def _invalidate() -> None:
    for callback in _on_change:
        callback()


def refresh() -> None:
    """Forget probes, op sets, the setting and the cached choices (not demotions):
    the next call re-probes. For tests and for registering a backend at run time."""
    global _setting
    _probes.clear()
    _opsets.clear()
    _opset_errors.clear()
    _setting = None
    _invalidate()


def reset() -> None:
    """``refresh()`` and forget demotions too."""
    _demoted.clear()
    refresh()
