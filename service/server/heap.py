"""Keep freed response chunks in the process heap (glibc), so sending a record does not page-fault.

Every body chunk is a fresh `bytes` from `os.pread` (1 MiB by default). glibc serves blocks that large
with `mmap` and trims the heap top above 128 KiB of free space, so each chunk's pages are handed back to
the kernel after the send and faulted in again for the next one: measured 0.8 ms per 3 MB record, a
third of the fetch (BENCHMARKS.md, findings). Raising both thresholds above the chunk size lets the
same heap pages serve chunk after chunk, at the cost of up to `trim` bytes of free heap kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("r3.heap")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit


def thresholds(chunk_bytes: int) -> tuple[int, int]:
    """(mmap threshold, trim threshold) for body chunks of `chunk_bytes`: room for a few in flight."""
    mmap = min(_MMAP_THRESHOLD_MAX, max(4 << 20, 2 * chunk_bytes))
    return mmap, 4 * mmap


def keep_freed_chunks(chunk_bytes: int) -> bool:
    """Set glibc's thresholds for this process; False (and nothing changed) on a C library without `mallopt`."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mmap, trim = thresholds(chunk_bytes)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))
    log.debug("glibc heap: mmap threshold %d, trim threshold %d (%s)", mmap, trim, "set" if ok else "refused")
    return ok
