"""Atomic file writes, the one way the project writes a file a reader may see half-done.

``open_temporary(path)`` creates a new temporary file beside ``path`` (``.<name>.<12 hex>.tmp``,
``O_EXCL``, mode 0o666 through the process umask: 0o644 under the usual 0o022, where
``mkstemp``'s 0o600 would hide results from the group). ``write_bytes_atomic(path, data)``
writes ``data`` there, fsyncs it, renames it over ``path`` and fsyncs the directory: a failed or
interrupted write leaves ``path`` as it was and no temporary behind (the error is re-raised).
Callers that commit several files together (``loop_state``) use ``open_temporary`` and rename
themselves. Names ending in ``TMP_SUFFIX`` and starting with a dot are what stale-file cleanup
removes.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TMP_SUFFIX = ".tmp"


def open_temporary(path: str | Path) -> tuple[int, Path]:
    """``(fd, tmp)``: a new, empty temporary file beside ``path``, open for binary writing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    return fd, tmp


def fsync_directory(directory: str | Path) -> None:
    """Make renames in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns ``path``."""
    path = Path(path)
    fd, tmp = open_temporary(path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(path.parent)
    return path
