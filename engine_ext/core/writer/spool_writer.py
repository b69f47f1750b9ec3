"""The spool writer: the scheduler thread reserves bytes and hands rows to one bounded background thread.

Why: the scheduler must never wait on I/O or on a full queue (docs/design.md, "Nothing lost"). Everything the
scheduler thread calls here (`reserve`, `submit`, `release`, `note_undelivered`) touches in-memory counters
under a lock held for a few arithmetic operations; files are written only by the writer thread, through
`service.spool` (the one definition of the spool contract). A refused reservation (spool full, queue
full, spool not writable) is the caller's cue to keep SGLang's inline path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from engine_ext.core.bounded_rids import BoundedRids
from engine_ext.core.degraded import guarded_thread
from engine_ext.core.records import RecordSpec
from engine_ext.core.row_audit import RowAudit
from engine_ext.core.writer.counts import (
    NOT_WRITABLE,
    QUEUE_FULL,
    SPOOL_FULL,
    UNDELIVERED_LOG_EVERY_S,
    Refusal,
    WriterStats,
    undelivered_reason,
)
from engine_ext.core.writer.op import Op
from service.spool import Spool
from service.spool.record.writer import RecordWriter

logger = logging.getLogger("r3_sidecar.writer")

USAGE_REFRESH_S = 1.0
"""How often the writer thread re-checks the spool (free bytes; the sidecar deletes records)."""
USAGE_SCAN_CPU_SHARE = 0.01
"""Under `R3_SPOOL_MAX_BYTES`, the records' usage is a directory scan (about 5 µs a file): it is repeated no
more often than keeps it under this share of the writer thread's time (10,000 files: every ~5 s)."""
META_ESTIMATE_BYTES = 1024
"""A record's metadata file, counted before the next rescan sees it."""
MAX_OPS_PER_PUBLISH = 1024
"""Ops the writer thread applies before publishing the records they grew (a backlog coalesces publishes)."""
RECENT_RIDS = 65536
"""Rids of records this writer finished, remembered (oldest forgotten first) so that a new request under one of
them can replace the old record at arrival (`Collector.reopen`): about 100 bytes each."""
DEFAULT_PUBLISH_INTERVAL_S = 0.1
"""Least time between two publishes of open records' rows (`R3_LIVE_PUBLISH_S`); finals are immediate.

Why one cadence for all records rather than a timer each: the sidecar pays per batch of file events as much
as per file, so the open records grown since the last publish are published together."""


class SpoolWriter:
    """Bounded hand-off from the scheduler thread to one daemon thread that writes the spool."""

    def __init__(
        self,
        spool_dir: Path | str,
        *,
        max_bytes: int = 0,
        queue_bytes: int = 256 << 20,
        engine: str = "",
        publish_interval_s: float = DEFAULT_PUBLISH_INTERVAL_S,
        sentinels: tuple[int, ...] = (),
        row_check: bool = True,
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self.engine = engine
        self.publish_interval_s = publish_interval_s
        self.stats = WriterStats()
        self.audit = RowAudit(sentinels, enabled=row_check)  # sentinels: the engine's values for unused slots
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ops: deque[Op] = deque()
        # Two views of the same files: their sizes (what R3_SPOOL_MAX_BYTES caps) and the file system's
        # blocks they take (what ENOSPC is about: tmpfs gives a 300-byte file a whole page).
        self._reserved = 0  # sizes promised to ops not yet written
        self._reserved_blocks = 0  # blocks promised to ops not yet written, in bytes
        self._usage = 0  # record file sizes, as last scanned by the writer thread (+ its own writes since)
        self._capacity = 0
        self._free = 0  # the file system's free bytes at the last probe, less the blocks written since
        self._block = 4096
        self._writable = False
        self._stopping = False
        self._open: dict[str, RecordWriter] = {}
        self._spool: Spool | None = None
        self._thread: threading.Thread | None = None
        self._last_refresh = 0.0
        self._last_scan = 0.0
        self._scan_every = USAGE_REFRESH_S
        self._busy = False
        self._undelivered_logged: dict[str, float] = {}
        self._failed: set[str] = set()  # rids whose write failed and whose last op has not come yet (writer thread)
        # Open records whose appended rows wait for the next publish, and when it is due (writer thread).
        self._dirty: dict[str, RecordWriter] = {}
        self._next_publish = 0.0
        self._publish_all = False  # `flush` asks for every waiting publish now
        self._recent = BoundedRids(RECENT_RIDS)  # rids of finished records
        self._claimed = BoundedRids(RECENT_RIDS)  # rids whose record was claimed at finish
        self._probe()

    # ---- scheduler thread: in-memory counters only ---------------------------------------------------
    def _costs(self, nbytes: int, opens: bool) -> tuple[int, int]:
        """(file-size bytes, file-system bytes) that `nbytes` of rows take; a new record adds its metadata."""
        block = self._block
        pages = -(-nbytes // block) * block  # an append may start a page too: never undercount
        if not opens:
            return nbytes, pages
        return nbytes + META_ESTIMATE_BYTES, pages + block

    def reserve(self, nbytes: int, *, opens: bool = True) -> Refusal | None:
        """Promise room for `nbytes` of rows (of a new record unless `opens=False`); None, or why not (counted)."""
        size, blocks = self._costs(nbytes, opens)
        with self._lock:
            if not self._writable:
                return NOT_WRITABLE
            if self.stats.queued_bytes + nbytes > self.queue_bytes:
                self.stats.queue_full += 1
                return QUEUE_FULL
            margin = 2 * self._block  # one metadata replace in flight (its temporary file), directory growth
            over_cap = self._usage + self._reserved + size > self._capacity
            if over_cap or self._reserved_blocks + blocks + margin > self._free:
                self.stats.spool_full += 1
                return SPOOL_FULL
            self._reserved += size
            self._reserved_blocks += blocks
            self.stats.queued_bytes += nbytes
            return None

    def release(self, nbytes: int, *, opens: bool = True) -> None:
        """Give back a reservation that will not be submitted (the request vanished); a submitted op's reservation
        is settled as the op is written (`_settle`)."""
        size, blocks = self._costs(nbytes, opens)
        with self._lock:
            self._reserved -= size
            self._reserved_blocks -= blocks
            self.stats.queued_bytes -= nbytes

    def submit(self, op: Op, *, reserved: bool = False) -> bool:
        """Queue `op` without waiting; False (nothing queued) when its bytes cannot be reserved.

        With `reserved=True` the caller already holds `reserve(op.nbytes, opens=op.spec is not None)`.
        """
        opens = op.spec is not None
        if not reserved and (op.nbytes or opens) and self.reserve(op.nbytes, opens=opens) is not None:
            return False
        with self._lock:
            if not self._writable and not reserved:
                return False
            self._ops.append(op)
            self._wake.notify()
        return True

    def claim(self, spec: RecordSpec, nbytes: int, *, inline: bool, reopened: bool = False) -> Refusal | None:
        """Reserve a finished request's record, or settle its refusal here: None, or why not.

        A refusal is counted (`undelivered`; `inline`: SGLang's inline payload is kept) and, where the spool can
        take metadata, the record ends `error` at once, no rows (`reopened`: it is open): a pointer to it gets
        410 at once, not 404 after its whole `wait`. A claimed rid is `known` from now on.
        """
        refusal = self.reserve(nbytes)
        if refusal is None:
            self._claimed.add(spec.rid)
            return None
        self.note_undelivered(undelivered_reason(refusal), rid=spec.rid, inline=inline)
        if refusal != NOT_WRITABLE:  # no record could be written there either
            self.end_refused(spec.rid, None if reopened else spec)
        return refusal

    def end_refused(self, rid: str, spec: RecordSpec | None) -> None:
        """End a request's record `error`, no rows (`spec` None: it is open): metadata only, outside any reservation."""
        self.submit(Op(rid, spec=spec, status="error"), reserved=True)

    def note_fallback(self) -> None:
        """Count a request that kept SGLang's inline payload because the spool refused it."""
        with self._lock:
            self.stats.fallback_inline += 1

    def note_undelivered(self, reason: str, *, rid: str, inline: bool, detail: str = "") -> None:
        """Count a request whose rows did not reach the spool; `inline`: it keeps SGLang's inline payload;
        `detail`: what the log line adds to the reason (the row counts of a mismatch).

        Logged at most once per reason every `UNDELIVERED_LOG_EVERY_S` (a full spool refuses every request,
        and the scheduler thread must not format a line for each), always with the running count.
        """
        now = time.monotonic()
        with self._lock:
            counts = self.stats.undelivered
            counts[reason] = counts.get(reason, 0) + 1
            self.stats.fallback_inline += inline
            total = counts[reason]
            due = now - self._undelivered_logged.get(reason, -UNDELIVERED_LOG_EVERY_S) >= UNDELIVERED_LOG_EVERY_S
            if due:
                self._undelivered_logged[reason] = now
        if due:
            logger.warning(
                "r3-sidecar: rows of request %r not delivered to the spool (%s%s; %s); %d such requests so far",
                rid,
                reason,
                f": {detail}" if detail else "",
                "SGLang's inline payload kept" if inline else "no inline payload was asked for: rows lost",
                total,
            )

    def written(self, rid: str) -> bool:
        """Whether this writer finished a record of `rid` recently (the last `RECENT_RIDS` rids)."""
        return rid in self._recent

    def known(self, rid: str) -> bool:
        """Whether a record of `rid` was claimed or finished recently: a new request under it replaces it."""
        return rid in self._claimed or rid in self._recent

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.stats.contract()

    @property
    def writable(self) -> bool:
        return self._writable

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> SpoolWriter:
        if self._thread is None:
            body = guarded_thread("r3-spool-writer", self._run)
            self._thread = threading.Thread(target=body, name="r3-spool-writer", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout`), then stop the thread."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the queue is empty and every row is published (tests and shutdown; never the scheduler)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._ops and self.stats.queued_bytes == 0 and not self._busy and not self._dirty:
                    return True
                self._publish_all = True
                self._wake.notify()
            time.sleep(0.002)
        return False

    # ---- writer thread ---------------------------------------------------------------------------
    def _probe(self, *, scan: bool = True) -> None:
        """(Re)check the spool: (re)create it, measure capacity and the file system's free bytes; under a byte
        cap also the records' usage, by a directory scan when `scan` (without a cap the file system's own
        counts are the usage, at no cost: the scan once took 54 ms of CPU over 10,000 files)."""
        usage = None
        try:
            self._spool = Spool(self.spool_dir)
            writable = os.access(self._spool.records_dir, os.W_OK)
            capacity = self._spool.capacity_bytes(self.max_bytes)
            st = os.statvfs(self._spool.root)
            free, block = st.f_bavail * st.f_frsize, max(st.f_frsize, 512)
            if self.max_bytes <= 0:
                usage = (st.f_blocks - st.f_bfree) * st.f_frsize
            elif scan:
                started = time.thread_time()
                usage = self._spool.usage_bytes()
                self._scan_every = max(USAGE_REFRESH_S, (time.thread_time() - started) / USAGE_SCAN_CPU_SHARE)
                self._last_scan = time.monotonic()
        except OSError as exc:
            if self._writable or self._last_refresh == 0.0:
                logger.warning("r3-sidecar: spool %s not usable: %s", self.spool_dir, exc)
            writable, capacity, usage, free, block = False, 0, 0, 0, self._block
        with self._lock:
            self._writable = writable
            self._capacity = capacity
            if usage is not None:
                self._usage = usage
            self._free = free
            self._block = block
        self._last_refresh = time.monotonic()

    def _run(self) -> None:
        while True:
            ops, publish_all, stopping = self._next_batch()
            if ops:
                touched: dict[str, RecordWriter] = {}
                for op in ops:
                    self._apply(op, touched)
                self._dirty.update(touched)
            self._publish_due(publish_all)
            with self._lock:
                self._busy = False
            if stopping:
                return
            if time.monotonic() - self._last_refresh >= USAGE_REFRESH_S:
                self._probe(scan=time.monotonic() - self._last_scan >= self._scan_every)

    def _next_batch(self) -> tuple[list[Op], bool, bool]:
        """Wait for work (ops, a publish due, a probe due, `flush`, `close`); take up to `MAX_OPS_PER_PUBLISH` ops.

        Returns (ops, publish every waiting record now, stop after this batch)."""
        with self._lock:
            while not (self._ops or self._stopping or self._publish_all):
                if self._due():
                    break
            stopping = not self._ops and self._stopping
            ops = [self._ops.popleft() for _ in range(min(len(self._ops), MAX_OPS_PER_PUBLISH))]
            # Busy until `_run` has written and published this batch, a batch without ops too: a publish that
            # `flush` asked for is on disk before `flush` may return (a live record once read back at 0 rows).
            self._busy = True
            publish_all, self._publish_all = self._publish_all or stopping, False
        return ops, publish_all, stopping

    def _due(self) -> bool:
        """Wait (under `_lock`) up to the next publish or probe; True when either is due or ops came."""
        due = self._next_publish if self._dirty else None
        wait = USAGE_REFRESH_S if due is None else min(USAGE_REFRESH_S, due - time.monotonic())
        if wait > 0:
            self._wake.wait(wait)
        now = time.monotonic()
        return bool(self._ops) or (due is not None and now >= due) or now - self._last_refresh >= USAGE_REFRESH_S

    def _publish_due(self, now_anyway: bool) -> None:
        """Publish the grown open records, together, once the interval since the last publish has run out
        (or at once: `flush`, `close`). After a quiet spell the first rows go out at once."""
        now = time.monotonic()
        if not self._dirty or (now < self._next_publish and not now_anyway):
            return
        self._next_publish = now + self.publish_interval_s
        dirty, self._dirty = self._dirty, {}
        for rid, writer in dirty.items():  # one metadata replace per record per interval
            try:
                writer.publish()
            except OSError as exc:
                logger.error("r3-sidecar: publishing record %r failed: %s", rid, exc)

    def _forget(self, rid: str) -> None:
        """The record is final or starts over: no publish of it waits any more."""
        self._dirty.pop(rid, None)

    def _apply(self, op: Op, touched: dict[str, RecordWriter]) -> None:
        """Apply one op, then move its bytes from its reservation to usage (`_settle`); appends to records that
        stay open are published by the caller, once per batch."""
        writer = self._open.get(op.rid)
        size = blocks = 0  # what the op wrote: file sizes, file-system bytes
        try:
            if op.spec is not None:
                writer = self._open_record(op.spec, writer)
                size, blocks = self._costs(0, True)
            if writer is None:
                self._orphan(op)
                return
            grows = op.rows is not None and op.rows.shape[0] > 0
            if grows:
                size, blocks = size + op.nbytes, blocks + self._append(writer, op)
            if op.status is None and (grows or op.spec is not None):
                touched[op.rid] = writer
            if op.status is not None:
                touched.pop(op.rid, None)
                self._finalize(writer, op)
        except Exception as exc:  # the writer thread must outlive any one record
            touched.pop(op.rid, None)
            self._write_failed(op, writer, exc)
        finally:
            self._settle(op, size, blocks)

    def _settle(self, op: Op, size: int, blocks: int) -> None:
        """Count what `op` wrote (file sizes, file-system bytes) as usage and give back its reservation, in one
        step: a reservation made meanwhile sees those bytes once. Released only after a whole batch, they were
        counted twice until then, and a spool with room refused requests (they fell back inline)."""
        reserved_size, reserved_blocks = self._costs(op.nbytes, op.spec is not None)
        with self._lock:
            self._usage += size  # until the next rescan measures it
            self._free -= blocks
            self._reserved -= reserved_size
            self._reserved_blocks -= reserved_blocks
            self.stats.queued_bytes -= op.nbytes

    def _open_record(self, s: RecordSpec, old: RecordWriter | None) -> RecordWriter:
        """Start (or start over) the record of `s`: the new record replaces the old, never final in between."""
        spool = self._spool
        assert spool is not None
        if old is not None:
            old.close()
        self._forget(s.rid)  # a publish still waiting would put the old record's rows back
        writer = spool.writer(
            s.rid,
            num_experts=s.num_experts,
            topk=s.topk,
            layers=s.layers,
            start=s.start,
            prompt_len=s.prompt_len,
            engine=s.engine,
            dtype=s.dtype,
            weight_version=s.weight_version,
            weight_versions=s.weight_versions,
            num_hidden_layers=s.num_hidden_layers,
        )
        self._open[s.rid] = writer
        return writer

    def _orphan(self, op: Op) -> None:
        """Rows or a final for a record that is not open (its open failed): dropped, counted once."""
        logger.warning("r3-sidecar: rows for %r without an open record; dropped", op.rid)
        if op.status is not None and op.rid not in self._failed:  # its rows never became a record
            self.note_undelivered("write_error", rid=op.rid, inline=False)
        if op.status is not None:
            self._failed.discard(op.rid)

    def _append(self, writer: RecordWriter, op: Op) -> int:
        """Append `op`'s rows; the file-system bytes they take (whole pages, as tmpfs charges them)."""
        block, before = self._block, writer.nbytes
        grown = -(-(before + op.nbytes) // block) * block - -(-before // block) * block
        if self.audit.check(writer, op.rows) is not None:
            with self._lock:
                self.stats.suspect_records += 1
        writer.append(op.rows, publish=False)
        return grown

    def _finalize(self, writer: RecordWriter, op: Op) -> None:
        self._open.pop(op.rid, None)
        self._forget(op.rid)
        writer.finalize(op.status, weights=op.weights)
        with self._lock:
            self.stats.records_written += op.status != "error"  # a refused request's tombstone is no record
        self._recent.add(op.rid)

    def _write_failed(self, op: Op, writer: RecordWriter | None, exc: Exception) -> None:
        """A write failed: the record ends `error` (410), counted once per request; its later ops find no record."""
        logger.error("r3-sidecar: writing record %r failed: %s", op.rid, exc)
        if op.rid not in self._failed:
            self.note_undelivered("write_error", rid=op.rid, inline=False)
        if op.status is None:
            self._failed.add(op.rid)
        with self._lock:
            self.stats.write_errors += 1
            if isinstance(exc, OSError):
                self._writable = False  # refuse until the next probe (<= USAGE_REFRESH_S) finds it usable
        self._open.pop(op.rid, None)
        self._forget(op.rid)
        if writer is not None and not writer.closed:
            with contextlib.suppress(OSError):
                writer.finalize("error")
