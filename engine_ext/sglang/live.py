"""Live rows: a request's rows reach the spool as its steps finish, not in one gather at its end.

Why: a `stream=true` trainer sees rows during generation, and the O(sequence) gather at finish disappears
for these requests. Each step's rows come from the host copy SGLang already made for the host cache
(`TopkCaptureOutput.out_cache_loc`/`topk`, overlap scheduling); `hooks.live` reads the batch's layout and its
requests (`StepRequest`) off SGLang's objects as host integers, and `LiveRows.feed_step` does the rest.

Opt-in: `R3_LIVE_ROWS=1` for every captured request, or per request `sampling_params.custom_params =
{"r3_live_rows": true}` (false opts out); SGLang itself carries private keys in `custom_params`, and it
reaches the scheduler on every path (HTTP, engine API, sessions, disaggregation).

Rows are never rewritten (Contract 1). Retraction recomputes a request from scratch, and SGLang's own
rows then come from the recompute; so at the re-prefill the record starts over under the same rid (the
writer replaces its files: rows go back to 0 and the record is never final in between, so `wait` readers
see 202, then the whole record; a `stream` reader sees `rows` drop and starts over). A gap (a step whose
rows do not start where the record ends: unknown layout, a refused reservation) ends the live record as
`error`, and the finish-time path writes the request whole under the same rid. An aborted request ends
its live record `aborted` with the rows so far.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from engine_ext.core.records import Finished, RecordSpec
from engine_ext.core.writer import Op
from engine_ext.sglang.collect import FinishedReq
from engine_ext.sglang.gather import to_spool_rows

if TYPE_CHECKING:
    from engine_ext.sglang.collect import Collector

LIVE_PARAM = "r3_live_rows"
FORGET_AFTER_STEPS = 4096
T = TypeVar("T")

Layout = list[tuple[int, int, int]]
"""Per request of a batch, in batch order: (position of its first row, offset into the step's rows, rows)."""


def wants_live(all_requests: bool, custom_params: Any) -> bool:
    """Per-request `custom_params["r3_live_rows"]` wins over the `R3_LIVE_ROWS` default."""
    if isinstance(custom_params, dict) and LIVE_PARAM in custom_params:
        return bool(custom_params[LIVE_PARAM])
    return all_requests


def extend_layout(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> tuple[Layout, int]:
    """Extend (and mixed) forwards: request i routes positions `[prefix_i, prefix_i + extend_i)`."""
    layout: Layout = []
    offset = 0
    for prefix, n in zip(prefix_lens, extend_lens, strict=True):
        layout.append((int(prefix), offset, int(n)))
        offset += int(n)
    return layout, offset


def decode_layout(seq_lens: Sequence[int]) -> tuple[Layout, int]:
    """Decode forwards: one row per request, its input token at `seq_len - 1` (seq_len counts it)."""
    return [(int(s) - 1, i, 1) for i, s in enumerate(seq_lens)], len(seq_lens)


def verify_layout(seq_lens: Sequence[int], stride: int, accept_lens: Sequence[int]) -> tuple[Layout, int]:
    """Verify forwards: `stride` rows per request from `seq_len`; the first `accept_len` are kept (top-k 1)."""
    layout = [(int(s), i * stride, int(a)) for i, (s, a) in enumerate(zip(seq_lens, accept_lens, strict=True))]
    return layout, stride * len(seq_lens)


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request of a batch, as a live step needs it (`hooks.live` reads it off SGLang's `Req`)."""

    rid: str
    wants: bool  # in a first extend: it asks for live rows in this process (`Delivery.wants_live`)
    finished: bool
    retractions: int  # SGLang's `retraction_count`
    retracted: bool  # `is_retracted`: retracted while the next batch was scheduled, this step's result pending
    start: int  # `routed_experts_start_len`
    prompt_len: int
    limit: int  # positions below it have rows: prompt + output through the stop token - 1
    pool_idx: int | None  # its `req_to_token` row; None once SGLang has freed it (finished, retracted)


@dataclass(slots=True)
class LiveRecord:
    spec: RecordSpec
    next_pos: int  # rows cover [spec.start, next_pos) (including rows still held in `buffer`)
    retractions: int
    opened: bool = False  # the writer has been told to start the record
    waiting: bool = False  # prefix rows (a prefix-cache hit) are being read; later rows wait in `buffer`
    buffer: list[np.ndarray] = field(default_factory=list)
    broken: str | None = None
    finished: FinishedReq | None = None
    seen_step: int = 0  # the last step that carried this request


@dataclass(slots=True)
class LiveStats:
    records: int = 0
    rows: int = 0
    completed: int = 0
    restarted: int = 0  # live records begun again at a retracted request's re-prefill
    broken: int = 0  # live records ended as `error`, the request then written whole at finish
    forgotten: int = 0  # requests that stopped appearing (aborted while waiting after a retraction)


@dataclass(frozen=True, slots=True)
class _Prefix:
    live: LiveRows
    rid: str
    record: LiveRecord

    def deliver(self, rows: torch.Tensor) -> None:
        self.live.prefix_landed(self.rid, self.record, rows)


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: LiveRows, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class LiveRows:
    """The live records of one scheduler process (scheduler thread, plus prefix rows from the drain)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.writer = collector.writer
        self.records: dict[str, LiveRecord] = {}
        self.stats = LiveStats()
        self.step = 0
        self._lock = threading.RLock()  # prefix rows may land from the collector's idle ticker

    def get(self, rid: str) -> LiveRecord | None:
        return self.records.get(rid)

    @_locked
    def begin(
        self, rid: str, *, start: int, prompt_len: int, retractions: int, first_pos: int, pool_idx: int
    ) -> LiveRecord:
        """Track a request from its first extend; a cached prefix `[start, first_pos)` is read from the host cache.

        Called again at a retracted request's re-prefill, it starts the record over under the same rid: the
        writer replaces the old files (rows back to 0, never final in between, so waiting readers see 202),
        and the new rows are those of the recompute, as SGLang's own finish-time rows are.
        """
        if rid in self.records:
            self.stats.restarted += 1
            self.stats.records -= 1
        collector = self.collector
        opened = Finished(rid, None, start, prompt_len)
        spec = collector.shape.spec(opened, dtype=collector.dtype, engine=collector.engine)
        record = LiveRecord(spec=spec, next_pos=start, retractions=retractions, seen_step=self.step)
        if first_pos > start:
            record.waiting = True
            record.next_pos = first_pos
            collector.read_rows(_Prefix(self, rid, record), pool_idx, start, first_pos)
        self.records[rid] = record
        self.stats.records += 1
        return record

    @_locked
    def feed(self, rid: str, pos: int, rows: torch.Tensor | np.ndarray, *, limit: int) -> None:
        """Rows for positions `[pos, pos + n)`; those below the record start or at/after `limit` are dropped."""
        record = self.records.get(rid)
        if record is None or record.broken:
            return
        record.seen_step = self.step
        start = record.spec.start
        if pos < start:
            cut = min(rows.shape[0], start - pos)
            rows, pos = rows[cut:], pos + cut
        rows = rows[: max(0, limit - pos)]
        if rows.shape[0] == 0:
            return
        if pos != record.next_pos:
            self._break(rid, record, f"rows at {pos}, record ends at {record.next_pos}")
            return
        record.next_pos += rows.shape[0]
        self._emit(rid, record, self.spool_rows(rows))

    def spool_rows(self, rows: torch.Tensor | np.ndarray) -> np.ndarray:
        """Host rows in the record's form; a numpy array is taken as already in it (see `LiveRows.compact`)."""
        if isinstance(rows, np.ndarray):
            return rows
        return to_spool_rows(rows, self.collector.shape.layer_slots, self.collector.dtype)

    def compact(self, step_rows: torch.Tensor) -> np.ndarray:
        """A whole step's rows in the record's form, once, so each request's slice needs no conversion."""
        return to_spool_rows(step_rows, self.collector.shape.layer_slots, self.collector.dtype)

    def feed_step(
        self,
        name: str,
        layout: Layout,
        total: int,
        reqs: Sequence[StepRequest],
        topk: torch.Tensor,
        *,
        first_extend: bool,
    ) -> None:
        """One step's rows (host `topk`, in the batch's token order) to the live records of its requests.

        `layout` places each request's rows; a step whose rows do not match it breaks its requests' records
        (the finish-time path writes them whole). A record begins at a first extend (not a verify).
        """
        if total != topk.shape[0] or len(layout) != len(reqs):
            for req in reqs:
                self.break_record(req.rid, f"{name}: {topk.shape[0]} rows for a layout of {total}")
                if req.finished:
                    self.end(req.rid)
            return
        step_rows = None  # converted once per step, on the first request that takes rows
        for req, (pos, offset, n) in zip(reqs, layout, strict=True):
            if self._takes_rows(req, pos, first_extend=first_extend):
                if step_rows is None:
                    step_rows = self.compact(topk)
                self.feed(req.rid, pos, step_rows[offset : offset + n], limit=req.limit)
            if req.finished:  # whether or not its rows went live (a re-prefill that samples the last token)
                self.end(req.rid)

    def _takes_rows(self, req: StepRequest, pos: int, *, first_extend: bool) -> bool:
        """Whether a request's rows of this step go to a live record: its own, begun here at a first extend (a
        retracted request's re-prefill starts over); a retracted one's that is not back through a prefill breaks."""
        record = self.records.get(req.rid)
        retracted = record is not None and req.retractions != record.retractions
        if record is None or (retracted and first_extend):
            if not (first_extend and req.wants and not req.finished and not req.retracted and req.pool_idx is not None):
                return False
            self.begin(
                req.rid,
                start=req.start,
                prompt_len=req.prompt_len,
                retractions=req.retractions,
                first_pos=pos,
                pool_idx=req.pool_idx,
            )
        elif retracted and req.retracted:
            # Overlap scheduling retracts while scheduling the next batch, before this step's result is
            # processed: SGLang drops this step's token for the request, and so do we. Its record starts
            # over at the re-prefill; ending it here would turn a restart into a lost record.
            return False
        elif retracted:
            self.break_record(req.rid, "retracted, and not back through a prefill")
        return True

    @_locked
    def prefix_landed(self, rid: str, record: LiveRecord, rows: torch.Tensor) -> None:
        if self.records.get(rid) is not record or record.broken:
            return
        first = to_spool_rows(rows, self.collector.shape.layer_slots, record.spec.dtype)
        data = np.concatenate([first, *record.buffer]) if record.buffer else first
        record.waiting, record.buffer = False, []
        self._emit(rid, record, data)

    def _emit(self, rid: str, record: LiveRecord, data: np.ndarray) -> None:
        if record.waiting:
            record.buffer.append(data)
            return
        if not self.writer.submit(Op(rid, spec=None if record.opened else record.spec, rows=data)):
            self._break(rid, record, "spool refused the rows")
            return
        record.opened = True
        self.stats.rows += data.shape[0]

    def break_record(self, rid: str, reason: str) -> None:
        """End a live record as `error`; the finish-time path will write the request whole."""
        with self._lock:
            record = self.records.get(rid)
            if record is not None:
                self._break(rid, record, reason)

    def _break(self, rid: str, record: LiveRecord, reason: str) -> None:
        if record.broken:
            return
        record.broken = reason
        record.buffer = []
        self.stats.broken += 1
        if record.opened:
            self.writer.submit(Op(rid, status="error"))

    @_locked
    def note_finish(self, rid: str, fin: FinishedReq) -> bool:
        """From the finish hook: True when the live record will end this request (no finish-time gather)."""
        record = self.records.get(rid)
        if record is None:
            return False
        if record.broken:
            del self.records[rid]
            return False
        record.finished = fin
        return True

    @_locked
    def end(self, rid: str) -> None:
        """After the request's last step: final when complete, else rewritten whole by the finish-time path."""
        record = self.records.pop(rid, None)
        if record is None:
            return
        fin = record.finished
        if fin is None:  # finished without the finish hook (e.g. a discarded prefill): keep what we have
            if record.opened and not record.broken:
                self.writer.submit(Op(rid, status="aborted"))
            return
        status = "aborted" if fin.aborted else "ok"
        lo, hi = fin.rows()
        if record.broken is None and not record.waiting and record.spec.start == lo and record.next_pos == hi:
            spec = None if record.opened else record.spec
            self.writer.submit(Op(rid, spec=spec, status=status, weights=fin.weights()))
            self.stats.completed += 1
            return
        self._break(rid, record, f"incomplete at finish: rows end at {record.next_pos}, want {hi}")
        self.collector.spool_whole(fin)

    @_locked
    def abandon(self) -> None:
        """The plugin stepped aside (a hook failed): every live record ends `error`, none is served as whole."""
        for rid, record in self.records.items():
            if record.opened and not record.broken:
                self.writer.submit(Op(rid, status="error"))
        self.records.clear()

    @_locked
    def end_step(self, unseen_steps: int = FORGET_AFTER_STEPS) -> None:
        """Count a step; every `unseen_steps`, end records whose request stopped appearing in batches.

        A request that leaves without finishing through a batch result (aborted in the waiting queue after a
        retraction) would otherwise hold its record open until the sidecar's stale timeout. If it does come
        back, its next extend starts a new record, or its finish takes the finish-time path.
        """
        self.step += 1
        if self.step % unseen_steps:
            return
        for rid, record in list(self.records.items()):
            if self.step - record.seen_step >= unseen_steps:
                del self.records[rid]
                self.stats.forgotten += 1
                if record.opened and not record.broken:
                    self.writer.submit(Op(rid, status="error"))
