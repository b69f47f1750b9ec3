"""Atomic file replacement and full writes: how every spool file is written (readers never see half a file);
and whether a name still names a file held open, how a reader or an unlinker knows a record was not replaced."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_TMP_COUNTER = iter(range(1 << 62))


def atomic_write(path: Path | str, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a mix.

    Plain `os.path` strings: a live record is republished many times a second, and pathlib's objects cost
    more than the system calls."""
    head, name = os.path.split(os.fspath(path))
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{next(_TMP_COUNTER)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def same_file(path: Path | str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (an open inode's number is never reused)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    if view.nbytes == 0:
        return
    view = view.cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]
