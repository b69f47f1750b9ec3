"""Body buffers the client's reader threads allocate without holding the GIL.

Why: a multi-megabyte `np.empty` is a glibc `malloc` that, for fresh memory, is an `mmap`; the kernel makes
that `mmap` wait for the process's memory map while the other reader threads fault their bodies' pages in,
and numpy holds the GIL all the while. Measured: `np.empty` of 12.6 MB in a reader thread took up to 175 ms,
and the asyncio client's event loop, waiting for the GIL, stalled as long (BENCHMARKS.md, "Trainer API").
Here the same `malloc` (and the same `MADV_HUGEPAGE` numpy asks for) goes through ctypes, which releases the
GIL around each call; the buffer is freed with `free` when the last array over it dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import weakref

import numpy as np

__all__ = ["uninitialized"]

_OFF_GIL_BYTES = 64 << 10  # smaller blocks come from the heap without a system call: numpy is as good
_HUGE_PAGE = 2 << 20
_HUGE_BYTES = 4 << 20  # numpy's own threshold for asking for huge pages
_MADV_HUGEPAGE = 14  # Linux's value; elsewhere no advice is given
_LINUX = sys.platform.startswith("linux")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
        libc.madvise.restype, libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_LIBC = _libc()


def uninitialized(n: int) -> memoryview:
    """A writable buffer of `n` bytes left unfilled: the socket fills it (zeroing 12 MB first would hold the GIL
    for milliseconds). Arrays over it need no copy, and torch accepts them."""
    if _LIBC is None or n < _OFF_GIL_BYTES:
        return np.empty(n, dtype=np.uint8).data
    addr = _LIBC.malloc(n)
    if not addr:
        raise MemoryError(f"cannot allocate a body of {n} bytes")
    if _LINUX and n >= _HUGE_BYTES:
        lo = (addr + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        hi = (addr + n) & ~(_HUGE_PAGE - 1)
        if hi > lo:
            _LIBC.madvise(lo, hi - lo, _MADV_HUGEPAGE)
    block = (ctypes.c_ubyte * n).from_address(addr)
    weakref.finalize(block, _LIBC.free, addr).atexit = False  # arrays may outlive the interpreter's exit hooks
    return memoryview(block).cast("B")
