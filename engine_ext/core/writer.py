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
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_ext.core.degraded import guarded_thread
from service.spool import Spool
from service.spool.engine_report import UNDELIVERED_REASONS, WriterCounters
from service.spool.record_meta import Weights, default_dtype, dtype_holds
from service.spool.record_writer import RecordWriter

# `UNDELIVERED_REASONS` (Contract 1, `service.spool`): why a request's rows did not reach the spool: refused
# reservations (`spool_full`, `queue_full`, `spool_not_writable`), a mirror-mode inline payload that did not
# match its reservation, or a write that failed on the writer thread.

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


def spool_dtype(configured: str, num_experts: int) -> str:
    """The record dtype: `R3_DTYPE` when set and wide enough, else the smallest that holds every id."""
    if configured in ("", "auto"):
        return default_dtype(num_experts)
    if not dtype_holds(configured, num_experts):
        raise ValueError(f"R3_DTYPE={configured} cannot hold expert id {num_experts - 1}")
    return configured


def compact(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows `(n, layers, topk)` as a C-contiguous array of the spool dtype (a copy unless already so)."""
    return np.ascontiguousarray(rows, dtype=dtype)


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """Everything a record's metadata needs besides its rows."""

    rid: str
    num_experts: int
    topk: int
    layers: tuple[int, ...]
    start: int
    prompt_len: int
    dtype: str
    engine: str = ""
    weight_version: str | int | None = None
    weight_versions: tuple[tuple[int, str | int], ...] = ()  # (position, version) when the rows span an update
    num_hidden_layers: int | None = None  # the model's layer count: SGLang's payload has this many slots

    @property
    def row_bytes(self) -> int:
        return len(self.layers) * self.topk * np.dtype(self.dtype).itemsize


@dataclass(slots=True)
class Op:
    """One unit of work for the writer thread.

    `open` starts (or restarts) the record of `spec`; `rows` are appended; `status` finalizes it. The
    finish-time path sends all three in one op; live rows send an open, many appends, one final.
    """

    rid: str
    spec: RecordSpec | None = None
    rows: np.ndarray | None = None
    status: str | None = None
    weights: Weights | None = None  # with `status`: the versions known at the end (live records)
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.nbytes = 0 if self.rows is None else int(self.rows.nbytes)


UNDELIVERED_LOG_EVERY_S = 10.0


@dataclass(slots=True)
class WriterStats:
    """The counters behind the engine file's `writer` object (Contract 1); all of them are exported."""

    queued_bytes: int = 0
    records_written: int = 0
    fallback_inline: int = 0
    spool_full: int = 0  # refused reservations for lack of room (live appends included)
    queue_full: int = 0
    write_errors: int = 0
    undelivered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNDELIVERED_REASONS, 0))

    def contract(self) -> dict[str, Any]:
        """The engine file's `writer` object (`service.spool.WriterCounters`)."""
        return WriterCounters(
            queued_bytes=self.queued_bytes,
            records_written=self.records_written,
            fallback_inline=self.fallback_inline,
            spool_full=self.spool_full,
            queue_full=self.queue_full,
            write_errors=self.write_errors,
            undelivered=dict(self.undelivered),
        ).to_dict()


class Refusal(str):
    """Why a reservation was refused: `spool_full`, `queue_full` or `not_writable`."""


SPOOL_FULL = Refusal("spool_full")
QUEUE_FULL = Refusal("queue_full")
NOT_WRITABLE = Refusal("not_writable")
_REFUSAL_REASON = {SPOOL_FULL: "spool_full", QUEUE_FULL: "queue_full", NOT_WRITABLE: "spool_not_writable"}


def undelivered_reason(refusal: str) -> str:
    """The `undelivered` reason of a refused reservation."""
    return _REFUSAL_REASON.get(refusal, str(refusal))


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
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.max_bytes = max_bytes
        self.queue_bytes = queue_bytes
        self.engine = engine
        self.publish_interval_s = publish_interval_s
        self.stats = WriterStats()
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
        self._recent: OrderedDict[str, None] = OrderedDict()  # rids of finished records, newest last (under _lock)
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
        """Give back a reservation that will not be submitted (e.g. the request vanished)."""
        self._settle(nbytes, opens)

    def _settle(self, nbytes: int, opens: bool) -> None:
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

    def note_fallback(self) -> None:
        """Count a request that kept SGLang's inline payload because the spool refused it."""
        with self._lock:
            self.stats.fallback_inline += 1

    def note_undelivered(self, reason: str, *, rid: str, inline: bool) -> None:
        """Count a request whose rows did not reach the spool; `inline`: it keeps SGLang's inline payload.

        Logged at most once per reason every `UNDELIVERED_LOG_EVERY_S` (a full spool refuses every request,
        and the scheduler thread must not format a line for each), always with the running count.
        """
        now = time.monotonic()
        with self._lock:
            counts = self.stats.undelivered
            counts[reason] = counts.get(reason, 0) + 1
            if inline:
                self.stats.fallback_inline += 1
            total = counts[reason]
            due = now - self._undelivered_logged.get(reason, -UNDELIVERED_LOG_EVERY_S) >= UNDELIVERED_LOG_EVERY_S
            if due:
                self._undelivered_logged[reason] = now
        if due:
            logger.warning(
                "r3-sidecar: rows of request %r not delivered to the spool (%s; %s); %d such requests so far",
                rid,
                reason,
                "SGLang's inline payload kept" if inline else "no inline payload was asked for: rows lost",
                total,
            )

    def written(self, rid: str) -> bool:
        """Whether this writer finished a record of `rid` recently (the last `RECENT_RIDS` rids)."""
        with self._lock:
            return rid in self._recent

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
            with self._lock:
                while not self._ops and not self._stopping and not self._publish_all:
                    due = self._next_publish if self._dirty else None
                    wait = USAGE_REFRESH_S if due is None else min(USAGE_REFRESH_S, due - time.monotonic())
                    if wait > 0:
                        self._wake.wait(wait)
                    now = time.monotonic()
                    if self._ops or (due is not None and now >= due) or now - self._last_refresh >= USAGE_REFRESH_S:
                        break
                stopping = not self._ops and self._stopping
                ops = [self._ops.popleft() for _ in range(min(len(self._ops), MAX_OPS_PER_PUBLISH))]
                self._busy = bool(ops)
                publish_all, self._publish_all = self._publish_all or stopping, False
            if ops:
                touched: dict[str, RecordWriter] = {}
                for op in ops:
                    self._apply(op, touched)
                self._dirty.update(touched)
                for op in ops:
                    self._settle(op.nbytes, op.spec is not None)
            self._publish_due(publish_all)
            with self._lock:
                self._busy = False
            if stopping:
                return
            if time.monotonic() - self._last_refresh >= USAGE_REFRESH_S:
                self._probe(scan=time.monotonic() - self._last_scan >= self._scan_every)

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
        """Apply one op; appends to records that stay open are published by the caller, once per batch."""
        spool = self._spool
        assert spool is not None
        writer = self._open.get(op.rid)
        try:
            if op.spec is not None:
                if writer is not None:
                    writer.close()  # starting over: the new record replaces it, never final in between
                self._forget(op.rid)  # a publish still waiting would put the old record's rows back
                s = op.spec
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
                self._open[op.rid] = writer
                size, blocks = self._costs(0, True)
                with self._lock:
                    self._usage += size  # until the next rescan measures it
                    self._free -= blocks
            if writer is None:
                logger.warning("r3-sidecar: rows for %r without an open record; dropped", op.rid)
                if op.status is not None and op.rid not in self._failed:  # its rows never became a record
                    self.note_undelivered("write_error", rid=op.rid, inline=False)
                if op.status is not None:
                    self._failed.discard(op.rid)
                return
            if op.rows is not None and op.rows.shape[0]:
                block, before = self._block, writer.nbytes
                grown = -(-(before + op.nbytes) // block) * block - -(-before // block) * block
                writer.append(op.rows, publish=False)
                if op.status is None:
                    touched[op.rid] = writer
                with self._lock:
                    self._usage += op.nbytes
                    self._free -= grown  # whole pages, as tmpfs charges them
            elif op.spec is not None and op.status is None:
                touched[op.rid] = writer
            if op.status is not None:
                self._open.pop(op.rid, None)
                touched.pop(op.rid, None)
                self._forget(op.rid)
                writer.finalize(op.status, weights=op.weights)
                with self._lock:
                    self.stats.records_written += op.status != "error"  # a refused request's tombstone is no record
                    self._recent[op.rid] = None
                    self._recent.move_to_end(op.rid)
                    if len(self._recent) > RECENT_RIDS:
                        self._recent.popitem(last=False)
        except Exception as exc:  # the writer thread must outlive any one record
            logger.error("r3-sidecar: writing record %r failed: %s", op.rid, exc)
            if op.rid not in self._failed:  # once per request; its later ops find no open record
                self.note_undelivered("write_error", rid=op.rid, inline=False)  # the record ends `error` (410)
            if op.status is None:
                self._failed.add(op.rid)
            with self._lock:
                self.stats.write_errors += 1
                if isinstance(exc, OSError):
                    self._writable = False  # refuse until the next probe (<= USAGE_REFRESH_S) finds it usable
            self._open.pop(op.rid, None)
            touched.pop(op.rid, None)
            self._forget(op.rid)
            if writer is not None and not writer.closed:
                with contextlib.suppress(OSError):
                    writer.finalize("error")
