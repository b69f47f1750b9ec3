"""Finished requests to the spool or to SGLang's inline path: the spool-or-inline decision, and the collector.

A finished request's record goes one way (docs/design.md, "Where each idea lives"): the collector decides its route and
builds its spec (`core.records`), the writer claims its bytes or settles its refusal (`core.writer`), and the
step's batched slot read (`gather.StepGather`) hands the rows to the writer later. The rows are gathered from
the host cache before any host-cache write that could land on a freed slot:

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
from dataclasses import dataclass

import torch

from engine_ext.core.records import Finished, ModelShape, RecordSpec
from engine_ext.core.settings import Mode
from engine_ext.core.writer import Op, SpoolWriter
from engine_ext.sglang.build_check import PENDING, BuildCheck
from engine_ext.sglang.gather import StepGather, Ticket, WholeRecord, to_spool_rows
from engine_ext.sglang.weight_versions import Span, record_weights
from service.spool.record.meta import Weights


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


# ---- the finish-time path: reserve, gather without waiting, hand to the writer ---------------------


@dataclass(frozen=True, slots=True)
class FinishedReq:
    """One finished request, as plain values read off SGLang's `Req` (its record: `record()`)."""

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

    def inline_start(self) -> int:
        """First position of SGLang's own inline rows (`start_len`, clamped), which may precede `rows()`."""
        return row_range(self.start_len, self.seqlen)[0]

    def weights(self) -> Weights:
        """The record's `(weight_version, weight_versions)`."""
        lo, hi = self.rows()
        return record_weights(self.version_spans, self.weight_version, prompt_len=self.prompt_len, lo=lo, hi=hi)

    def record(self) -> Finished:
        """The finished record, rows still in the host cache: what its spec is built from."""
        version, versions = self.weights()
        status = "aborted" if self.aborted else "ok"
        return Finished(self.rid, None, self.rows()[0], self.prompt_len, status, version, versions)


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
        self.configured_mode = mode
        self.check: BuildCheck | None = None  # an unproven build's self-check (`build_check`), set by `Delivery`
        self._checking: set[str] = set()  # rids whose rows the check gathers the plugin's way too
        self.capture_all = capture_all
        self.dtype = dtype
        self.engine = engine
        self.gather = StepGather()
        self.dropped = 0  # requests whose rows reached neither the spool nor an inline payload (also in the writer)
        self._host_buffer: torch.Tensor | None = None
        self._ready = threading.Event()
        self._mirror: dict[str, tuple[RecordSpec, int, str, int]] = {}
        self._reopened: set[str] = set()  # rids whose old record `reopen` replaced, until their finish
        self._drain_lock = threading.Lock()  # the ticker and the scheduler: a batch's rows reach the writer in order

    @property
    def mode(self) -> Mode:
        """The mode in effect: mirror while an unproven build's check is pending, else the configured one."""
        if self.check is not None and self.check.state == PENDING and self.configured_mode is Mode.SIDECAR:
            return Mode.MIRROR
        return self.configured_mode

    def reopen(self, rid: str, *, prompt_len: int, start_len: int) -> bool:
        """A new request under a rid this writer already claimed or wrote: replace the old record now, at arrival.

        Why: its finish-time record reaches the spool only after SGLang has answered, so a trainer fetching at
        once would be served the old request's rows (verl resumes an aborted request under the same rid). The
        replacement (`rows=0`, not final) makes the sidecar wait for this request's record instead. One
        metadata write, only for reused rids; refused like any reservation (then nothing changes).
        """
        if not self.writer.known(rid):
            return False
        if self.gather.inflight():  # the old request's rows may still be on their way: they go to the writer first
            self.drain(wait=True)
        spec = self.shape.spec(Finished(rid, None, start_len, prompt_len), dtype=self.dtype, engine=self.engine)
        if self.writer.reserve(0) is not None:
            return False
        self.writer.submit(Op(rid, spec=spec), reserved=True)
        self._reopened.add(rid)
        return True

    def finish(self, fin: FinishedReq, *, publisher: bool) -> str:
        """Decide and, for the spool, claim the record's bytes and queue its slot read. Returns its `Route`."""
        reopened = fin.rid in self._reopened
        self._reopened.discard(fin.rid)
        asked = {"mode": self.mode, "wants_inline": fin.wants_inline, "capture_all": self.capture_all}
        route = choose_route(**asked, publisher=publisher, reserved=None)
        if route != Route.SPOOL:
            return route
        refused = choose_route(**asked, publisher=publisher, reserved=False)
        reserved = choose_route(**asked, publisher=publisher, reserved=True)
        inline = refused == Route.INLINE
        spooled = self._spool(fin, inline=inline, reopened=reopened, mirror=reserved == Route.BOTH)
        return reserved if spooled else refused

    def spool_whole(self, fin: FinishedReq) -> bool:
        """Write the whole record of a finished request from the host cache (live rows' fallback).

        A refusal: the live record broke; only mirror mode built an inline payload besides."""
        return self._spool(fin, inline=self.mode is Mode.MIRROR and fin.wants_inline, reopened=False, mirror=False)

    def _spool(self, fin: FinishedReq, *, inline: bool, reopened: bool, mirror: bool) -> bool:
        """The record's one way: spec (`core.records`), then the writer's claim, then the step's slot read (or,
        mirrored, SGLang's own inline payload: `mirror`). False when the writer refused it (settled there)."""
        lo, hi = fin.rows()
        skip = lo - fin.inline_start()  # SGLang's inline rows start at start_len: skip those this server did not route
        record = fin.record()
        spec = self.shape.spec(record, dtype=self.dtype, engine=self.engine)
        nbytes = (hi - lo) * spec.row_bytes
        if self.writer.claim(spec, nbytes, inline=inline, reopened=reopened) is not None:
            self.dropped += 0 if inline else 1
            return False
        if mirror:
            self._mirror[fin.rid] = (spec, nbytes, record.status, skip)
            if self.check is not None and self.check.wants():  # the plugin's own gather too, to compare
                self._checking.add(fin.rid)
                self.gather.add(self.check.ticket(fin.rid, self.shape.layer_slots, spec.dtype), fin.pool_idx, lo, hi)
        else:
            self.gather.add(
                WholeRecord(self.writer, self.shape.layer_slots, spec, nbytes, record.status), fin.pool_idx, lo, hi
            )
        return True

    def read_rows(self, ticket: Ticket, pool_idx: int, lo: int, hi: int) -> None:
        """Queue rows `[lo, hi)` of a running request for this step's batched slot read (live prefixes)."""
        self.gather.add(ticket, pool_idx, lo, hi)

    def mirror(self, rid: str, rows: torch.Tensor | None, *, past_stop: int = 0) -> None:
        """Mirror mode: hand the inline payload SGLang just built to the writer (no second gather).

        `past_stop`: tokens SGLang sampled after the request's stop (`output_ids` beyond `finished_len`). SGLang's
        rows run to its last sampled token, the record's to the stop: a `max_new_tokens=0` request (SGLang's
        prefix-caching request for `n>1`) samples one token it discards, so its payload has one row more. The
        record keeps the rows of the tokens the request kept, as sidecar mode's gather does."""
        spec, nbytes, status, skip = self._mirror.pop(rid)
        check = self.check if rid in self._checking else None
        self._checking.discard(rid)
        want = nbytes // spec.row_bytes
        if rows is not None and skip:
            rows = rows[skip:]
        if rows is not None and past_stop > 0 and rows.shape[0] == want + past_stop:
            rows = rows[:want]
        if rows is None or rows.shape[0] != want:
            if check is not None:
                check.theirs(rid, None)
            self.writer.release(nbytes)
            got = "no rows" if rows is None else f"{rows.shape[0]} rows"
            self.writer.note_undelivered(
                "mirror_mismatch", rid=rid, inline=rows is not None, detail=f"{got}, {want} expected"
            )
            if rows is None:
                self.dropped += 1
            self.writer.end_refused(rid, spec)
            return
        data = to_spool_rows(rows, self.shape.layer_slots, spec.dtype)
        self.writer.submit(Op(rid, spec=spec, rows=data, status=status), reserved=True)
        if check is not None:
            check.theirs(rid, data)

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
            if isinstance(ticket, WholeRecord):
                self.writer.release(ticket.nbytes)
                self.writer.end_refused(ticket.spec.rid, ticket.spec)
        for rid, (spec, nbytes, *_) in self._mirror.items():
            self.writer.release(nbytes)
            self.writer.end_refused(rid, spec)
        self._mirror.clear()
        for rid in self._reopened:
            self.writer.end_refused(rid, None)
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
