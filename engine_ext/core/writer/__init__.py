"""The spool writer: the scheduler thread reserves bytes and hands rows to one bounded background thread.

- `spool_writer`: `SpoolWriter`, the reservations (in-memory counters) and the writer thread;
- `op`: `Op`, the writer thread's unit of work (open, append, finalize);
- `counts`: what the writer counts (`WriterStats`, the engine file's `writer` object) and why it refuses a
  reservation (`SPOOL_FULL`, `QUEUE_FULL`, `NOT_WRITABLE`, `undelivered_reason`).

The adapters take the names below from here. A test that patches a module constant (`USAGE_REFRESH_S`) patches
`spool_writer`, the module that reads it.
"""

from engine_ext.core.writer.counts import NOT_WRITABLE, QUEUE_FULL, SPOOL_FULL, undelivered_reason
from engine_ext.core.writer.op import Op
from engine_ext.core.writer.spool_writer import SpoolWriter

__all__ = ["NOT_WRITABLE", "QUEUE_FULL", "SPOOL_FULL", "Op", "SpoolWriter", "undelivered_reason"]
