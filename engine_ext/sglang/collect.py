"""Sync-free collection of finished requests' routed experts, and the spool-or-inline decision.

Upstream `get_topk` reads `req_to_token[pool_idx, start:seqlen-1].cpu()` once per finished request: a
blocking device read on the scheduler thread. Here the finished requests of one step are batched into
one device-side concatenation of their `req_to_token` rows and one non-blocking copy into pinned host
memory (`StepGather.launch`); nothing waits. The rows are gathered from the host cache later
(`StepGather.drain`), before any host-cache write that could land on a freed slot:

- overlap scheduling: a slot freed while processing step N can be handed out at the earliest to step N+2
  (step N+1 was allocated before N was processed), whose host-cache write is `TopkCaptureOutput.finalize`
  while processing N+2; draining at every `finalize` (and at `on_forward_end` in the non-overlap path)
  is therefore early enough, and by then the copy finished a forward ago;
- idle engine: a ticker drains as soon as the copy's event has completed.

The slot ids are the very `req_to_token` values `get_topk` reads, so rows and positions are identical
to SGLang's `[start_len, seqlen - 1)` rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engine_ext.core.settings import Mode
from engine_ext.core.writer import NOT_WRITABLE, RECENT_RIDS, Op, RecordSpec, SpoolWriter, undelivered_reason
from engine_ext.sglang.weight_versions import Span, record_weights
from service.spool.record_meta import Weights


def row_range(start_len: int, seqlen: int) -> tuple[int, int]:
    """Token positions `[lo, hi)` whose rows a finished request returns: upstream's `get_topk` clamp."""
    if start_len < 0:
        raise ValueError(f"start_len={start_len} must be non-negative")
    hi = max(seqlen - 1, 0)
    return min(start_len, hi), hi


# ---- the spool-or-inline decision ------------------------------------------------------------------


class Route:
    """What to do with one finished request."""

    SKIP = "skip"  # neither spool nor inline (not captured, or a rank that does not publish)
    INLINE = "inline"  # SGLang's own path only
    SPOOL = "spool"  # spool only: the inline payload stays None
    BOTH = "both"  # SGLang's inline path, and the spool from its host tensor (mirror)


def choose_route(*, mode: Mode, wants_inline: bool, capture_all: bool, publisher: bool, reserved: bool | None) -> str:
    """Route of a finished request; `reserved` is None until a reservation was tried.

    Call once with `reserved=None`: SKIP/INLINE need no reservation; any other answer means "reserve,
    then ask again" with the outcome.
    """
    if mode is Mode.OFF or not (wants_inline or capture_all):
        return Route.INLINE if wants_inline else Route.SKIP
    if not publisher:
        # Only attn-tp rank 0 publishes; other ranks' payloads never leave the scheduler.
        return Route.INLINE if (wants_inline and mode is Mode.MIRROR) else Route.SKIP
    if reserved is None:
        return Route.SPOOL
    if not reserved:
        return Route.INLINE if wants_inline else Route.SKIP
    if mode is Mode.MIRROR and wants_inline:
        return Route.BOTH
    return Route.SPOOL


# ---- one batched, non-blocking slot read per step --------------------------------------------------


@dataclass(slots=True)
class _Batch:
    tickets: list[Any]
    lengths: list[int]
    slots: torch.Tensor  # host, pinned when the pool lives on a device
    event: Any = None  # torch.cuda.Event recorded after the copy; None when already on the host

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


@dataclass(slots=True)
class StepGather:
    """Finished requests' slot ids: queued during a step, copied to host once per step, gathered later."""

    _queued: list[tuple[Any, int, int, int]] = field(default_factory=list)
    _inflight: list[_Batch] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    launches: int = 0
    waits: int = 0

    def add(self, ticket: Any, pool_idx: int, lo: int, hi: int) -> None:
        """Queue rows `[lo, hi)` of `req_to_token[pool_idx]` for `ticket` (scheduler thread, host ints)."""
        self._queued.append((ticket, pool_idx, lo, hi))

    def pending(self) -> bool:
        return bool(self._queued or self._inflight)

    def queued(self) -> bool:
        """Requests added this step and not yet launched."""
        return bool(self._queued)

    def inflight(self) -> bool:
        """Launched reads whose rows have not been drained."""
        return bool(self._inflight)

    def launch(self, req_to_token: torch.Tensor) -> None:
        """Read every queued request's slot ids with one concatenation and one non-blocking copy."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        views = [req_to_token[pool_idx, lo:hi] for _, pool_idx, lo, hi in queued]
        flat = torch.cat(views) if len(views) > 1 else views[0]
        if flat.device.type == "cpu":
            host, event = flat.clone(), None
        else:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
            host.copy_(flat, non_blocking=True)  # pinned: the host does not wait for the stream
            event = None
            if flat.is_cuda:
                event = torch.cuda.Event()
                event.record()
        batch = _Batch([t for t, *_ in queued], [hi - lo for *_, lo, hi in queued], host, event)
        with self._lock:
            self._inflight.append(batch)
            self.launches += 1

    def discard(self) -> list[Any]:
        """Forget every queued and launched read without reading the host cache; returns their tickets."""
        with self._lock:
            tickets = [t for t, *_ in self._queued] + [t for batch in self._inflight for t in batch.tickets]
            self._queued, self._inflight = [], []
        return tickets

    def drain(self, host_buffer: torch.Tensor, *, wait: bool) -> list[tuple[Any, torch.Tensor]]:
        """Rows of every launched batch whose copy is done (all of them with `wait`), in launch order.

        Call before any write to `host_buffer` that could reuse a freed slot. Returns host int32 tensors
        of shape `(rows, layers, topk)`, one per ticket.
        """
        out: list[tuple[Any, torch.Tensor]] = []
        with self._lock:
            while self._inflight:
                batch = self._inflight[0]
                if not batch.ready():
                    if not wait:
                        break
                    self.waits += 1
                    batch.event.synchronize()
                self._inflight.pop(0)
                rows = gather_slots(host_buffer, batch.slots)
                offset = 0
                for ticket, n in zip(batch.tickets, batch.lengths, strict=True):
                    out.append((ticket, rows[offset : offset + n]))
                    offset += n
        return out


def gather_slots(host_buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`host_buffer[slots]`; on the host one numpy `take`, which copies about twice as fast as torch's index."""
    if host_buffer.device.type == "cpu" and slots.device.type == "cpu":
        return torch.from_numpy(np.take(host_buffer.numpy(), slots.numpy(), axis=0))
    return host_buffer[slots]


def select_layers(rows: np.ndarray, layer_slots: Sequence[int] | None) -> np.ndarray:
    """Keep the host-cache layer slots that route (`None`: all); a contiguous run is a view, not a copy."""
    if layer_slots is None:
        return rows
    first, count = layer_slots[0], len(layer_slots)
    if tuple(layer_slots) == tuple(range(first, first + count)):
        return rows[:, first : first + count]
    return np.take(rows, layer_slots, axis=1)


def to_spool_rows(rows: torch.Tensor, layer_slots: Sequence[int] | None, dtype: str) -> np.ndarray:
    """Host int32 rows → C-contiguous rows of the spool dtype, routing layers only: one copy that also casts."""
    return np.ascontiguousarray(select_layers(rows.numpy(), layer_slots), dtype=dtype)


# ---- the finish-time path: reserve, gather without waiting, hand to the writer ---------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What every record of one engine shares: expert count, top-k, and which host-cache slots route."""

    num_experts: int
    topk: int
    layers: tuple[int, ...]  # model layer index of each stored layer
    layer_slots: tuple[int, ...] | None  # host-cache layer slots to keep (None: all, = layers)
    num_hidden_layers: int | None = None  # host-cache layer slots = the model's layers (SGLang's payload width)


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request, as plain values read off SGLang's `Req`."""

    rid: str
    wants_inline: bool
    start_len: int
    prompt_len: int
    seqlen: int
    pool_idx: int
    aborted: bool
    # First token position this server's forwards routed: 0, or the prompt length on a PD decode server,
    # which receives the prompt's KV, never routes the prompt, and so holds no prompt rows.
    first_pos: int = 0
    weight_version: str | None = None  # the engine's serving version at finish (`--weight-version`, updates)
    version_spans: tuple[Span, ...] = ()  # SGLang's per-request spans over output tokens (`weight_versions.py`)

    def rows(self) -> tuple[int, int]:
        """Positions `[lo, hi)` of the record: upstream's `[start_len, seqlen - 1)` from `first_pos` on."""
        lo, hi = row_range(self.start_len, self.seqlen)
        return max(lo, min(self.first_pos, hi)), hi

    def weights(self) -> Weights:
        """The record's `(weight_version, weight_versions)`."""
        lo, hi = self.rows()
        return record_weights(self.version_spans, self.weight_version, prompt_len=self.prompt_len, lo=lo, hi=hi)


class Ticket(Protocol):
    """Whoever asked for a request's rows: called with them once the batched read has landed."""

    def deliver(self, rows: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class _WholeRecord:
    """A finished request's whole record: compacted and handed to the writer in one op."""

    collector: Collector
    spec: RecordSpec
    nbytes: int
    status: str

    def deliver(self, rows: torch.Tensor) -> None:
        data = to_spool_rows(rows, self.collector.shape.layer_slots, self.spec.dtype)
        if data.nbytes != self.nbytes:
            raise AssertionError(f"{self.spec.rid}: gathered {data.nbytes} bytes, reserved {self.nbytes}")
        self.collector.writer.submit(Op(self.spec.rid, spec=self.spec, rows=data, status=self.status), reserved=True)


class Collector:
    """Routes finished requests to the spool (`StepGather` → `SpoolWriter`) or to SGLang's inline path."""

    def __init__(
        self,
        writer: SpoolWriter,
        shape: ModelShape,
        *,
        mode: Mode,
        capture_all: bool,
        dtype: str,
        engine: str,
    ) -> None:
        self.writer = writer
        self.shape = shape
        self.mode = mode
        self.capture_all = capture_all
        self.dtype = dtype
        self.engine = engine
        self.gather = StepGather()
        self.dropped = 0  # requests whose rows reached neither the spool nor an inline payload (also in the writer)
        self._host_buffer: torch.Tensor | None = None
        self._ready = threading.Event()
        self._mirror: dict[str, tuple[RecordSpec, int, str]] = {}
        self._reopened: set[str] = set()  # rids whose old record `reopen` replaced, until their finish
        self._spooled: OrderedDict[str, None] = OrderedDict()  # rids sent to the spool at finish, newest last
        self._drain_lock = threading.Lock()  # the ticker and the scheduler: a batch's rows reach the writer in order

    def spec(self, fin: Finished) -> RecordSpec:
        lo, _ = fin.rows()
        version, versions = fin.weights()
        return RecordSpec(
            rid=fin.rid,
            num_experts=self.shape.num_experts,
            topk=self.shape.topk,
            layers=self.shape.layers,
            start=lo,
            prompt_len=fin.prompt_len,
            dtype=self.dtype,
            engine=self.engine,
            weight_version=version,
            weight_versions=versions,
            num_hidden_layers=self.shape.num_hidden_layers,
        )

    def reopen(self, rid: str, *, prompt_len: int, start_len: int) -> bool:
        """A new request under a rid this writer already wrote: replace the old record now, at arrival.

        Why: its finish-time record reaches the spool only after SGLang has answered, so a trainer fetching at
        once would be served the old request's rows (verl resumes an aborted request under the same rid). The
        replacement (`rows=0`, not final) makes the sidecar wait for this request's record instead. One
        metadata write, only for reused rids; refused like any reservation (then nothing changes).
        """
        if rid not in self._spooled and not self.writer.written(rid):
            return False
        if self.gather.inflight():  # the old request's rows may still be on their way: they go to the writer first
            self.drain(wait=True)
        spec = RecordSpec(
            rid=rid,
            num_experts=self.shape.num_experts,
            topk=self.shape.topk,
            layers=self.shape.layers,
            start=start_len,
            prompt_len=prompt_len,
            dtype=self.dtype,
            engine=self.engine,
            num_hidden_layers=self.shape.num_hidden_layers,
        )
        if self.writer.reserve(0) is not None:
            return False
        self.writer.submit(Op(rid, spec=spec), reserved=True)
        self._reopened.add(rid)
        return True

    def finish(self, fin: Finished, *, publisher: bool) -> str:
        """Decide and, for the spool, reserve and queue the request's slot read. Returns its `Route`."""
        reopened = fin.rid in self._reopened
        self._reopened.discard(fin.rid)
        route = choose_route(
            mode=self.mode,
            wants_inline=fin.wants_inline,
            capture_all=self.capture_all,
            publisher=publisher,
            reserved=None,
        )
        if route != Route.SPOOL:
            return route
        spec = self.spec(fin)
        lo, hi = fin.rows()
        nbytes = (hi - lo) * spec.row_bytes
        refusal = self.writer.reserve(nbytes)
        route = choose_route(
            mode=self.mode,
            wants_inline=fin.wants_inline,
            capture_all=self.capture_all,
            publisher=publisher,
            reserved=refusal is None,
        )
        if refusal is not None:
            inline = route == Route.INLINE
            self.writer.note_undelivered(undelivered_reason(refusal), rid=fin.rid, inline=inline)
            self.dropped += 0 if inline else 1
            if refusal != NOT_WRITABLE:  # no record could be written there either
                self._end_refused(fin.rid, None if reopened else spec)
            return route
        status = "aborted" if fin.aborted else "ok"
        self._note_spooled(fin.rid)
        if route == Route.BOTH:  # SGLang's inline rows start at start_len: skip those this server did not route
            self._mirror[fin.rid] = (spec, nbytes, status, lo - row_range(fin.start_len, fin.seqlen)[0])
        else:
            self.gather.add(_WholeRecord(self, spec, nbytes, status), fin.pool_idx, lo, hi)
        return route

    def spool_whole(self, fin: Finished) -> bool:
        """Write the whole record of a finished request from the host cache (live rows' fallback)."""
        spec = self.spec(fin)
        lo, hi = fin.rows()
        nbytes = (hi - lo) * spec.row_bytes
        refusal = self.writer.reserve(nbytes)
        if refusal is not None:  # the live record broke; only mirror mode built an inline payload besides
            inline = self.mode is Mode.MIRROR and fin.wants_inline
            self.writer.note_undelivered(undelivered_reason(refusal), rid=fin.rid, inline=inline)
            self.dropped += 0 if inline else 1
            if refusal != NOT_WRITABLE:
                self._end_refused(fin.rid, spec)
            return False
        self._note_spooled(fin.rid)
        self.gather.add(_WholeRecord(self, spec, nbytes, "aborted" if fin.aborted else "ok"), fin.pool_idx, lo, hi)
        return True

    def _note_spooled(self, rid: str) -> None:
        """Remember a rid whose rows go to the spool (`reopen` must replace its record even before it is written)."""
        self._spooled[rid] = None
        self._spooled.move_to_end(rid)
        if len(self._spooled) > RECENT_RIDS:
            self._spooled.popitem(last=False)

    def _end_refused(self, rid: str, spec: RecordSpec | None) -> None:
        """A request whose rows the spool refused gets a record that ends at once, `error`, with no rows.

        Why: a pointer to it (mirror mode attaches one beside the inline rows; a trainer may also hold the
        rid) must get 410 from the sidecar at once, not 404 after its whole `wait`. Metadata only, a few
        hundred bytes, outside the byte reservation; `spec` None: the record is already open (`reopen`).
        """
        self.writer.submit(Op(rid, spec=spec, status="error"), reserved=True)

    def read_rows(self, ticket: Ticket, pool_idx: int, lo: int, hi: int) -> None:
        """Queue rows `[lo, hi)` of a running request for this step's batched slot read (live prefixes)."""
        self.gather.add(ticket, pool_idx, lo, hi)

    def mirror(self, rid: str, rows: torch.Tensor | None) -> None:
        """Mirror mode: hand the inline payload SGLang just built to the writer (no second gather)."""
        spec, nbytes, status, skip = self._mirror.pop(rid)
        if rows is not None and skip:
            rows = rows[skip:]
        if rows is None or rows.shape[0] * spec.row_bytes != nbytes:
            self.writer.release(nbytes)
            self.writer.note_undelivered("mirror_mismatch", rid=rid, inline=rows is not None)
            if rows is None:
                self.dropped += 1
            self._end_refused(rid, spec)
            return
        data = to_spool_rows(rows, self.shape.layer_slots, spec.dtype)
        self.writer.submit(Op(rid, spec=spec, rows=data, status=status), reserved=True)

    def end_step(self, req_to_token: torch.Tensor, host_buffer: torch.Tensor) -> None:
        """After a step's results: one batched slot read for the step's finished requests."""
        self._host_buffer = host_buffer
        if self.gather.queued():
            self.gather.launch(req_to_token)
            self._ready.set()
        self.drain(wait=False)

    def drain(self, *, wait: bool) -> int:
        """Gather launched requests' rows from the host cache and hand them to the writer."""
        if self._host_buffer is None or not self.gather.inflight():
            return 0
        with self._drain_lock:
            done = self.gather.drain(self._host_buffer, wait=wait)
            for ticket, rows in done:
                ticket.deliver(rows)
        return len(done)

    def abandon(self) -> None:
        """The plugin stepped aside (a hook failed): no more reads of the host cache, which SGLang alone writes
        from now on, and every request not yet handed whole to the writer ends `error` (410), never a record
        whose rows a later forward could have overwritten."""
        with self._drain_lock:
            self._host_buffer = None  # `drain` reads nothing from here on
            tickets = self.gather.discard()
        for ticket in tickets:
            if isinstance(ticket, _WholeRecord):
                self.writer.release(ticket.nbytes)
                self._end_refused(ticket.spec.rid, ticket.spec)
        for rid, (spec, nbytes, *_) in self._mirror.items():
            self.writer.release(nbytes)
            self._end_refused(rid, spec)
        self._mirror.clear()
        for rid in self._reopened:
            self._end_refused(rid, None)
        self._reopened.clear()

    def run_ticker(self, stop: threading.Event, poll_s: float = 0.002) -> None:
        """Drain copies that completed while the engine is idle (a daemon thread's body)."""
        while not stop.is_set():
            if not self._ready.wait(0.5):
                continue
            while self.gather.inflight() and not stop.is_set():
                self.drain(wait=False)
                stop.wait(poll_s)
            self._ready.clear()
            if self.gather.inflight():
                self._ready.set()
