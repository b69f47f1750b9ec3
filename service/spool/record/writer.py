"""The writing side of a spool record: append rows, publish metadata, never rewrite a row below `rows`."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from service.spool.bin_unlink import holding, locked, unlink_if_held
from service.spool.files import _write_all
from service.spool.record.meta import STATUSES, RecordMeta, Suspect, Weights


class RecordFiles(Protocol):
    """What a writer needs of its spool (`Spool` is one): where a record's rows go, how its `.json` is
    replaced. A protocol, so the writer does not import the spool that hands writers out."""

    def bin_path(self, rid: str) -> Path: ...

    def write_meta(self, meta: RecordMeta) -> None: ...


class RecordWriter:
    """Appends rows to one record. One writer per rid; not shared between threads.

    Creation publishes `rows=0` before replacing `.bin` with a new file, so a reader never trusts stale bytes
    of an older record with the same rid, and one that opened the older `.bin` still reads that record's rows.
    An append only counts its rows; `meta` is built when it is read
    (a publish), so a live record's per-step append costs a write, not a new `RecordMeta`.
    """

    def __init__(self, spool: RecordFiles, meta: RecordMeta) -> None:
        self.spool = spool
        self._meta = meta
        self.rows = meta.rows  # rows in `.bin`; `meta` catches up when read
        self._updated = meta.updated
        self._shape = (len(meta.layers), meta.topk)
        self._dtype = np.dtype(meta.dtype)
        self._lock = threading.Lock()
        path = spool.bin_path(meta.rid)
        # `rows=0` first, then a new `.bin`, not a truncated one: a reader of the old record keeps its rows. Both
        # under the old file's lock, so a delete of the old record sees which record the name holds (`Spool.delete`)
        with holding(path) as old:
            spool.write_meta(meta)
            if old is not None:
                unlink_if_held(old, path)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)

    @property
    def meta(self) -> RecordMeta:
        """The record's metadata as of the last append (what `publish` writes)."""
        meta = self._meta
        if meta.rows != self.rows:
            meta = self._meta = replace(meta, rows=self.rows, updated=self._updated)
        return meta

    @property
    def nbytes(self) -> int:
        """Bytes of rows in `.bin`."""
        return self.rows * self._meta.row_bytes

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, rows: np.ndarray, *, publish: bool = True) -> None:
        """Append rows of shape `(n, layers, topk)`; cast to the record's dtype; publish the new count."""
        if rows.ndim != 3 or rows.shape[1:] != self._shape:
            raise ValueError(f"rows of shape {rows.shape}, record wants (n, {self._shape[0]}, {self._shape[1]})")
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"record {self._meta.rid!r} is already final")
            data = np.ascontiguousarray(rows, dtype=self._dtype)
            _write_all(self._fd, data.data)
            self.rows += rows.shape[0]
            self._updated = time.time()
            if publish:
                self._publish(self.meta, self._fd)

    def _publish(self, meta: RecordMeta, fd: int | None) -> bool:
        """Replace `.json` with `meta` unless a delete has unlinked this record's `.bin` (`fd`, open), after which
        the record stays deleted. Under the file's lock, so a delete is wholly before or after (`locked`)."""
        if fd is None:
            self.spool.write_meta(meta)
            return True
        with locked(fd, self.spool.bin_path(meta.rid)) as named:
            if named:
                self.spool.write_meta(meta)
            return named

    @property
    def suspect(self) -> bool:
        return self._meta.suspect is not None

    def mark_suspect(self, found: Suspect) -> None:
        """Mark the record `suspect` (the first finding stays): its next publish and its final say so, whatever
        status it ends with (an `error` end still wins: its rows are never served)."""
        with self._lock:
            if self._meta.suspect is None:
                self._meta = replace(self.meta, status="suspect", suspect=found)

    def publish(self) -> None:
        """Make every appended row visible to readers (replace `.json`)."""
        with self._lock:
            self._publish(self.meta, self._fd)

    def finalize(self, status: str = "ok", *, weights: Weights | None = None) -> RecordMeta:
        """Close the record: no rows follow. `status` is one of `ok`, `aborted`, `error`; `weights`, when
        given, are the versions known at the end (a live record opened before a weight update)."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} not in {STATUSES}")
        versions = {} if weights is None else {"weight_version": weights[0], "weight_versions": tuple(weights[1])}
        with self._lock:
            fd, self._fd = self._fd, None
            if self._meta.suspect is not None and status != "error":
                status = "suspect"
            elif status == "error":
                versions["suspect"] = None
            meta = self._meta = replace(self.meta, final=True, status=status, updated=time.time(), **versions)
            try:
                self._publish(meta, fd)
            finally:
                if fd is not None:
                    os.close(fd)
            return meta

    def abort(self) -> RecordMeta:
        return self.finalize("aborted")

    def close(self) -> None:
        """Close the file without publishing: for a record about to be replaced under the same rid."""
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):
                    os.close(fd)
