"""A small JSON table on disk shared by processes: the tuning table and the device table.

File format: ``{"version": N, "<section>": {key: row}}``. The file is read once
per process (``rows``); a row this process stores is written through at once:
the rows on disk are re-read just before the write, this process's own rows are
merged over them (a same-key conflict goes to the last writer), and the result
is written to a temporary file named with the pid and thread id, then moved
over the table with ``os.replace`` (atomic: readers never see a partial file).
An advisory ``fcntl`` lock on ``<path>.lock`` serializes the read-merge-replace
of concurrent writers where ``fcntl`` exists, so no writer drops another's rows.

A corrupt file (not UTF-8, not JSON, nested too deeply, not the expected object,
unreadable), or one of another format version, is ignored with ONE warning per
path and reason (never an exception): its rows are not used. A directory at the
path is ignored the same way, and this process then keeps its rows in memory.
A corrupt or older-version file is replaced by the next write; a file of a
*newer* version (a newer lycoris_ops) is left alone and this process keeps its
rows in memory.
A *foreign* file - a JSON list, the format of lycoris-lora's own tuning table,
which defaults to the same ``~/.cache/lycoris_kernels/tuning.json`` - is left
alone too: this table then lives beside it, in ``<name>.lycoris_ops.json``
(``sibling``), read and written there, with one warning naming both paths.
A table that cannot be written (read-only directory, full disk) warns once and
keeps working from memory. Pure standard library: no torch here.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from typing import Dict, Iterator, Optional, Tuple

try:  # POSIX: serialize concurrent writers (optional; the merge alone keeps most rows)
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
    _fcntl = None

from lycoris_ops import settings

__all__ = ["JsonTable", "read_json_table", "cache_dir", "ENV_CACHE_DIR"]

ENV_CACHE_DIR = "LYCORIS_KERNEL_CACHE_DIR"


def cache_dir() -> str:
    """The directory of the tuning and device tables (``LYCORIS_KERNEL_CACHE_DIR``, read per use)."""
    return os.path.expanduser(settings.get(ENV_CACHE_DIR))

_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(path: str, reason: str, message: str) -> None:
    with _warn_lock:
        if (path, reason) in _warned:
            return
        _warned.add((path, reason))
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def read_json_table(path: str, version: int, section: str) -> Tuple[Dict[str, dict], Optional[str], object]:
    """``(rows, problem, found_version)`` of the file at ``path``: rows is ``{}`` when the
    file is missing (problem None), a directory (problem DIRECTORY), unreadable/corrupt
    (problem "corrupt: ...") or of another version (problem "version"). Never raises for
    a bad file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return {}, None, None
    except IsADirectoryError:
        return {}, DIRECTORY, None
    except OSError as exc:
        return {}, f"corrupt: cannot read ({exc})", None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return {}, f"corrupt: not UTF-8 text ({exc})", None
    try:
        data = json.loads(text)
    except ValueError as exc:
        return {}, f"corrupt: not JSON ({exc})", None
    except RecursionError:  # json's decoder recurses once per nesting level
        return {}, "corrupt: JSON nested too deeply", None
    if isinstance(data, list):
        return {}, FOREIGN, None
    if not isinstance(data, dict):
        return {}, "corrupt: not a JSON object", None
    found = data.get("version")
    if found != version:
        return {}, "version", found
    rows = data.get(section)
    if not isinstance(rows, dict):
        return {}, f"corrupt: no '{section}' object", found
    return {str(k): v for k, v in rows.items() if isinstance(v, dict)}, None, found


#: ``read_json_table``'s problem for a JSON list: another program's table (lycoris-lora's format)
FOREIGN = "foreign"
#: ``read_json_table``'s problem for a directory at the table's path (it can be neither read nor replaced)
DIRECTORY = "directory"


def sibling(path: str) -> str:
    """Where a table lives when ``path`` holds another program's table: ``tuning.json`` ->
    ``tuning.lycoris_ops.json``."""
    root, ext = os.path.splitext(path)
    return f"{root}.lycoris_ops{ext or '.json'}"


@contextlib.contextmanager
def _locked(path: str, enabled: bool) -> Iterator[None]:
    if not enabled or _fcntl is None:
        yield
        return
    fd = None
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        _fcntl.flock(fd, _fcntl.LOCK_EX)
    except OSError:
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            try:
                _fcntl.flock(fd, _fcntl.LOCK_UN)
            finally:
                os.close(fd)


class JsonTable:
    """One JSON table file (see the module docstring).

    ``get(key)`` / ``rows`` read the rows loaded at first use; ``put(key, row)``
    stores a row in memory and writes it through (merge with disk, atomic
    replace). ``lock=False`` skips the advisory file lock (the merge still runs)."""

    def __init__(self, path: str, version: int, section: str = "rows", *, what: str = "table",
                 lock: bool = True):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.version = version
        self.section = section
        self.what = what
        self.lock = lock
        self._rows: Optional[Dict[str, dict]] = None
        self._own: Dict[str, dict] = {}
        self._mutex = threading.RLock()
        self.writable = True

    # ----------------------------------------------------------------- reading
    def _report(self, problem: Optional[str], found) -> None:
        if problem is None:
            return
        if problem == FOREIGN:
            return  # _read moved to the sibling file and said so
        if problem == DIRECTORY:
            self.writable = False  # os.replace cannot put a file there: one warning, not a second one
            _warn_once(self.path, DIRECTORY,
                       f"lycoris_ops: ignoring the {self.what} {self.path}: it is a directory; results are "
                       f"kept in memory only (remove it, or set LYCORIS_KERNEL_CACHE_DIR elsewhere)")
        elif problem == "version":
            _warn_once(self.path, "version",
                       f"lycoris_ops: ignoring the {self.what} {self.path}: format version {found!r}, "
                       f"this lycoris_ops reads version {self.version}")
        else:
            _warn_once(self.path, "corrupt", f"lycoris_ops: ignoring the {self.what} {self.path} ({problem})")

    def _read(self):
        """``read_json_table`` of this table's file; a foreign file at ``path`` moves the table
        to ``sibling(path)`` (once, with one warning) and reads that instead."""
        rows, problem, found = read_json_table(self.path, self.version, self.section)
        if problem == FOREIGN:
            foreign, self.path = self.path, sibling(self.path)
            _warn_once(foreign, FOREIGN,
                       f"lycoris_ops: {foreign} holds another program's table (a JSON list: lycoris-lora "
                       f"keeps its tuning table at the same default path); it is left alone and this "
                       f"{self.what} is kept in {self.path}. Set LYCORIS_KERNEL_CACHE_DIR to separate them.")
            rows, problem, found = read_json_table(self.path, self.version, self.section)
        return rows, problem, found

    @property
    def rows(self) -> Dict[str, dict]:
        if self._rows is None:
            with self._mutex:
                if self._rows is None:
                    rows, problem, found = self._read()
                    self._report(problem, found)
                    rows.update(self._own)
                    self._rows = rows
        return self._rows

    def get(self, key: str) -> Optional[dict]:
        return self.rows.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    # ----------------------------------------------------------------- writing
    def put(self, key: str, row: dict, *, write: bool = True) -> bool:
        """Store ``row`` under ``key`` (memory, then disk when ``write``); True when written."""
        with self._mutex:
            self.rows[key] = row
            self._own[key] = row
            return self.flush() if write else False

    def flush(self) -> bool:
        """Merge this process's rows over the rows on disk and replace the file atomically."""
        with self._mutex:
            if not self._own or not self.writable:
                return False
            directory = os.path.dirname(self.path)
            tmp = None
            try:
                os.makedirs(directory, exist_ok=True)
                with _locked(self.path, self.lock):
                    # a foreign file written since this process read the table moves it aside too
                    disk, problem, found = self._read()
                    tmp = f"{self.path}.tmp.{os.getpid()}.{threading.get_ident()}"
                    if problem == "version" and isinstance(found, int) and not isinstance(found, bool) \
                            and found > self.version:
                        _warn_once(self.path, "newer",
                                   f"lycoris_ops: the {self.what} {self.path} has the newer format version "
                                   f"{found}; it is left alone and results are kept in memory only")
                        self.writable = False
                        return False
                    self._report(problem, found)
                    if not self.writable:  # a directory at the path (_report said so)
                        return False
                    disk.update(self._own)
                    data = {"version": self.version, self.section: dict(sorted(disk.items()))}
                    with open(tmp, "w", encoding="utf-8") as f:
                        json.dump(data, f, indent=1, sort_keys=False)
                        f.write("\n")
                        f.flush()
                        os.fsync(f.fileno())
                    _replace(tmp, self.path)
                    # rows other processes stored meanwhile become visible too
                    merged = dict(disk)
                    if self._rows is not None:
                        self._rows.update(merged)
                return True
            except OSError as exc:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                _warn_once(self.path, "write",
                           f"lycoris_ops: cannot write the {self.what} {self.path} ({exc}); results are "
                           "kept in memory only (set LYCORIS_KERNEL_CACHE_DIR to a writable directory)")
                self.writable = False
                return False


def _replace(src: str, dst: str) -> None:
    """``os.replace``, retried briefly where another handle may hold the file (Windows)."""
    if os.name != "nt":
        os.replace(src, dst)
        return
    import time  # pragma: no cover

    for attempt in range(20):  # pragma: no cover
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if attempt == 19:
                raise
            time.sleep(0.05)
