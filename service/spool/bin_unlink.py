"""Unlinking a record's `.bin` only while it is still the file one holds: the check and the unlink as one step.

Two processes unlink a record's `.bin` by name: the sidecar when a record is acknowledged or expires
(`Spool.delete`) and a writer that reuses the rid (`RecordWriter` replaces the old file with a new one). Each
opens the file it means, checks that the name still names it, then unlinks the name. Between the check and the
unlink the other side could unlink the old file and create its new one, and the unlink would remove the new
record's rows under metadata that promises them (a 410 "corrupt" for as long as the record lives). Both sides
therefore hold an exclusive `flock` on the file they mean across the check and the unlink: the other one waits
the few system calls it takes. A writer also publishes its metadata under its own file's lock (`locked`), and
not at all once a delete unlinked that file: a record acknowledged while still written stays deleted, instead of
reappearing as metadata that promises rows no file holds (D11). The wait is bounded (`WAIT_S`): a holder that
stalls past it (a stopped process) costs a warning, never a stopped engine writer or sidecar.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from service.spool.files import same_file

logger = logging.getLogger("r3_sidecar.spool")

WAIT_S = 1.0  # far above the microseconds a holder needs; a stalled holder is waited for no longer
_POLL_S = 0.001


@contextlib.contextmanager
def holding(path: Path | str) -> Iterator[int | None]:
    """Open `path` and hold an exclusive lock on that file for the block: yields its descriptor, None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # absent, or not ours to open: nothing is held, and nothing is unlinked through it
        yield None
        return
    try:
        _lock(fd, path)
        yield fd  # the lock goes with the descriptor's close
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(fd: int, path: Path | str) -> Iterator[bool]:
    """Hold the exclusive lock on the open file `fd` (the writer's own `.bin`) for the block; yields whether that
    file still has a name: False once a delete unlinked it, which then can no longer be racing this holder."""
    _lock(fd, path)
    try:
        yield os.fstat(fd).st_nlink > 0
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)


def unlink_if_held(fd: int, path: Path | str) -> bool:
    """Unlink `path` if it still names the file `fd` holds; whether it did. Call it inside `holding(path)`."""
    if not same_file(path, fd):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _lock(fd: int, path: Path | str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                logger.warning("%s: still locked after %.1f s; going on without the lock", path, WAIT_S)
                return
            time.sleep(_POLL_S)
        except OSError as exc:  # a filesystem without flock: the check and unlink go unguarded, as before
            logger.debug("%s: flock unavailable (%s)", path, exc)
            return
