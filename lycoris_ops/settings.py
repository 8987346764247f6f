"""Every ``LYCORIS_*`` environment variable lycoris_ops reads, declared once (``SETTINGS``).

Each entry names the variable, its value when unset, its valid values, how its
text is parsed and what it means; every reader in the package calls ``get(name)``
(and keeps reading it when it did before: once, at import or first use, or per use).

Rules:

* Unset or empty (only spaces): the default.
* Switches take ``1/0``, ``on/off``, ``true/false``, ``yes/no`` (any case); counts
  are integers >= 0; the budget is a number of seconds >= 0; names are matched
  case-insensitively.
* An invalid value is an error, never a silent default: a ``ValueError`` naming the
  variable, its value and the valid values. ``import lycoris_ops`` checks every
  variable that is set (``check_environment``), so a typo fails at once, before a
  run starts, whether the package reads the variable at import or at its first
  use; a value changed after the import is checked again where it is read.
* ``LYCORIS_KERNEL_CACHE_DIR`` must not name an existing file. A directory that
  cannot be written is allowed (the tables are read from it; what this process
  tunes is kept in memory, with one warning from ``tuner/store.py``).

Build-time variables (``LYCORIS_CUDA_LAUNCH``, read by ``setup.py``) are not here.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

__all__ = ["Setting", "SETTINGS", "ENV_BACKEND", "get", "raw", "check_environment"]

ENV_BACKEND = "LYCORIS_KERNEL_BACKEND"

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")
_SWITCH = "1/0, on/off, true/false, yes/no"


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``parse(text)`` gives its value or raises ValueError."""

    name: str
    default: Any  # the value when unset (None: the reader computes it, see ``shown_default``)
    shown_default: str  # the default in words
    valid: Union[str, Callable[[], str]]  # the valid values in words (a callable: built on demand)
    parse: Callable[[str], Any]
    meaning: str

    def valid_values(self) -> str:
        return self.valid() if callable(self.valid) else self.valid


def _switch(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(text)


def _count(text: str) -> int:
    n = int(text.strip())  # ValueError for anything but an integer
    if n < 0:
        raise ValueError(text)
    return n


def _seconds(text: str) -> float:
    s = float(text.strip())
    if not math.isfinite(s) or s < 0:
        raise ValueError(text)
    return s


def _choice(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower()
        if word not in words:
            raise ValueError(text)
        return word
    return parse


def _backend(text: str) -> str:
    from lycoris_ops.backends import registry as dispatch  # the backend names live there (ORDER)

    return dispatch._parse(text, ENV_BACKEND)


def _backend_names() -> str:
    from lycoris_ops.backends import registry as dispatch

    return ", ".join(dispatch.valid_values())


def _warp_specialize(text: str) -> bool:
    return True if text.strip().lower() == "auto" else _switch(text)


def _directory(text: str) -> str:
    path = os.path.expanduser(text.strip())
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(text)  # a file: no table could ever be read or written there
    return path


SETTINGS: Dict[str, Setting] = {s.name: s for s in (
    Setting(ENV_BACKEND, "auto", "auto", _backend_names, _backend,
            "the process-wide backend; a named one is still narrowed per call"),
    Setting("LYCORIS_KERNEL_TUNE", True, "on", _SWITCH, _switch,
            "off: no measured tile pick (the planner's first candidate, never stored)"),
    Setting("LYCORIS_KERNEL_CACHE_DIR", os.path.join("~", ".cache", "lycoris_kernels"), "~/.cache/lycoris_kernels",
            "a directory, not an existing file", _directory, "where the tuning and device tables live"),
    Setting("LYCORIS_KERNEL_TUNE_BUDGET", 1.5, "1.5", "a number of seconds >= 0 (0: no limit)", _seconds,
            "seconds of first calls (compiles) a cold key spends before lower-ranked candidates are skipped"),
    Setting("LYCORIS_KERNEL_TUNE_THREADS", 8, "8", "an integer >= 0 (0/1: one after the other)", _count,
            "worker threads running a cold key's candidates' first calls on CUDA"),
    Setting("LYCORIS_KERNEL_TUNE_PROCS", None, "min(12, CPUs - 1)", "an integer >= 0 (0/1: none)", _count,
            "forked child processes compiling a cold key's Triton kernels before its first calls"),
    Setting("LYCORIS_KERNEL_TUNE_DEFER", False, "0", _SWITCH, _switch,
            "1: a cold Triton key's first call compiles and runs its first config only, the rest of its "
            "shortlist compiling in the background (timed at a later call)"),
    Setting("LYCORIS_KERNEL_REPLAY", True, "1", _SWITCH, _switch,
            "0: the CUDA key keeps the Python kernel instead of replaying recorded Triton launches from C++"),
    Setting("LYCORIS_CUBLASLT", True, "1", _SWITCH, _switch,
            "0: vendor GEMMs with a base call torch.addmm instead of one cuBLASLt call"),
    Setting("LYCORIS_AUTOGRAD_KERNEL", "cpp", "cpp", "cpp, python", _choice("cpp", "python"),
            "python: every op's autograd goes through the Python kernel (for compiled autograd)"),
    Setting("LYCORIS_TILELANG_DEFER", True, "1", _SWITCH, _switch,
            "0: a TileLang cold key's first call builds and times its whole shortlist before it returns"),
    Setting("LYCORIS_TILELANG_AHEAD", True, "1", _SWITCH, _switch,
            "0: a TileLang forward's cold call does not start building its backward's kernels"),
    Setting("LYCORIS_TILELANG_MACRO_MEMO", True, "1", _SWITCH, _switch,
            "0: no memo of TileLang's macro rewrites (each build parses them again)"),
    Setting("LYCORIS_TILELANG_WS", True, "auto", f"auto or off ({_SWITCH}; on = auto)", _warp_specialize,
            "off: no TileLang kernel is warp-specialized (an A/B switch for benchmarks)"),
)}


def raw(name: str) -> Optional[str]:
    """The variable's text, or None when unset or empty."""
    text = os.environ.get(name)
    return None if text is None or not text.strip() else text


def get(name: str) -> Any:
    """The value of ``name`` now: its default when unset or empty; ValueError when invalid."""
    setting = SETTINGS[name]
    text = raw(name)
    if text is None:
        return setting.default
    try:
        return setting.parse(text)
    except ValueError:
        raise ValueError(f"lycoris_ops: {name}={text!r} is not valid; valid values: {setting.valid_values()} "
                         f"(unset: {setting.shown_default})") from None


def check_environment() -> Tuple[str, ...]:
    """Check every declared variable that is set (``import lycoris_ops`` runs this); returns
    their names. One ValueError lists every invalid one."""
    problems, seen = [], []
    for name in SETTINGS:
        if raw(name) is None:
            continue
        seen.append(name)
        try:
            get(name)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
    return tuple(seen)
