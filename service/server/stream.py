"""`GET /routed_experts/{rid}?stream=true`: rows sent as frames as the engine writes them, until final.

Why its own module: the stream is a state machine over a record that changes under it (rows arrive, the
record is finalized, aborted, deleted, or restarted when SGLang retracts the request), and each ending has
its own frame; read here alone, every transition is in `stream_frames` and the three steps it takes.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response

from service.server.errors import ApiError
from service.server.metrics import Fetch
from service.server.record_answer import (
    RESTARTED_DETAIL,
    CountedResponse,
    counted,
    empty_frame,
    gone,
    missing,
    ok_headers,
    open_bin,
    refused_suspect,
    row_chunks,
    select,
    served,
    version_fields,
)
from service.server.store import Store
from service.spool.record.meta import RecordMeta
from service.wire import formats
from service.wire.frames import FRAMES_MEDIA_TYPE, frame_header


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """What a stream sends, fixed before its headers: the record as first seen, range, layers, frame size."""

    rid: str
    first: RecordMeta
    lo: int
    end: int | None
    out_layers: list[int]
    slots: list[int] | None
    rows_per_frame: int
    allow_suspect: bool = False  # `suspect=allow`: rows of a record the row check marked are sent too

    @property
    def limit(self) -> int | None:
        """One past the last row to send (rows counted from the record's start), or None: until final."""
        return None if self.end is None else self.end - self.first.start


async def stream_record(
    store: Store,
    rid: str,
    items: list[formats.LayerItem] | None,
    start: int | None,
    end: int | None,
    wait: float,
    fetch: Fetch,
    allow_suspect: bool = False,
) -> Response:
    """Check what can be checked before the headers (exists, served, not suspect, range, layers), then stream."""
    meta = await fetch.wait(store.wait_until(rid, lambda m: m is not None, wait))
    if meta is None:
        raise missing(store, rid)
    if meta.final and not served(meta):
        raise gone(meta)
    if (refused := refused_suspect(meta, allow_suspect)) is not None:
        raise refused
    out_layers, slots = select(meta, items)
    lo = meta.start if start is None else start
    if lo < meta.start or (end is not None and end < lo) or (meta.final and max(lo, end or lo) > meta.end):
        raise ApiError(
            416, "range_not_satisfiable", f"start={lo}, end={end} do not fit the record starting at {meta.start}"
        )
    row_bytes = len(out_layers) * meta.topk * meta.itemsize
    rows_per_frame = max(1, store.settings.chunk_bytes // max(1, row_bytes))
    plan = StreamPlan(rid, meta, lo, end, out_layers, slots, rows_per_frame, allow_suspect)
    shape = (max(0, meta.rows - (lo - meta.start)), len(out_layers), meta.topk)
    headers = ok_headers(meta, meta.dtype, shape, lo, out_layers, final=meta.final)
    body = counted(stream_frames(store, plan, fetch), fetch)
    return CountedResponse(body, media_type=FRAMES_MEDIA_TYPE, headers=headers)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a stream ends: its last frame (none when the last rows' frame was final) and the outcome counted."""

    frame: bytes
    status: int
    record_status: str = "ok"
    error: str | None = None


@dataclass(slots=True)
class Progress:
    """Where a stream stands: rows sent and rows the record had when last seen (both from the record's start)."""

    sent: int
    seen: int
    ending: Ending | None = None


async def stream_frames(store: Store, plan: StreamPlan, fetch: Fetch) -> AsyncIterator[bytes]:
    """The stream's frames, from `plan.lo` until the record is final (or `end`); its one outcome (the last
    frame's status) is counted as it ends.

    Each turn looks at the record as it is now: an ending that rules out more rows (`interrupted`), else the rows
    that arrived (`row_frames`), then the end of a record that is complete (`completed`); else it waits for the
    record to change (`store.wait_until`).
    """
    progress = Progress(sent=plan.lo - plan.first.start, seen=plan.first.rows)  # `sent` may lie past the rows
    current: RecordMeta | None = plan.first
    while True:
        ending = interrupted(store, plan, current, progress)
        if ending is None and current is not None:
            stop = current.rows if plan.limit is None else min(current.rows, plan.limit)
            async for chunk in row_frames(store, plan, current, progress, stop):
                yield chunk
            ending = progress.ending or completed(plan, current, progress)
        if ending is not None:
            if ending.frame:
                yield ending.frame
            fetch.count(ending.status, ending.record_status, error=ending.error)
            return
        current = await fetch.wait(
            store.wait_until(
                plan.rid,
                lambda m, seen=progress.sent: m is None or m.final or m.rows > seen or m.created != plan.first.created,
                store.settings.rescan_s,
            )
        )


def interrupted(store: Store, plan: StreamPlan, current: RecordMeta | None, progress: Progress) -> Ending | None:
    """The ending when the record as seen now allows no more rows: gone (404/410), started over under the same
    rid (409: a retracted request, whose new rows must never be spliced onto the old ones a reader has), or
    finalized shorter than the range asked for (416)."""
    rid = plan.rid
    if current is None:
        err = missing(store, rid)
        return Ending(empty_frame(rid, err.status, None, error=err.code, detail=err.detail), err.status, error=err.code)
    if current.created != plan.first.created or current.rows < progress.seen:
        return Ending(empty_frame(rid, 409, current, error="record_restarted", detail=RESTARTED_DETAIL), 409)
    progress.seen = current.rows
    if (refused := refused_suspect(current, plan.allow_suspect)) is not None:  # marked while streamed
        frame = empty_frame(rid, 422, current, error=refused.code, detail=refused.detail)
        return Ending(frame, 422, error=refused.code)
    if current.final and served(current) and current.rows < max(progress.sent, plan.limit or 0):
        detail = f"start={plan.lo}, end={plan.end} do not fit the end ({current.end}) the record was finalized with"
        return Ending(empty_frame(rid, 416, current, error="range_not_satisfiable", detail=detail), 416)
    return None


async def row_frames(
    store: Store, plan: StreamPlan, current: RecordMeta, progress: Progress, stop: int
) -> AsyncIterator[bytes]:
    """Rows `[progress.sent, stop)` in frames of at most `rows_per_frame`. Sets `progress.ending` when the stream
    ends here: the record's last rows went in a final frame, or its `.bin` cannot serve them."""
    while progress.sent < stop:
        upto = min(stop, progress.sent + plan.rows_per_frame)
        try:
            bin_file = open_bin(store, current, upto)
        except ApiError as err:
            frame = empty_frame(plan.rid, err.status, current, error=err.code, detail=err.detail)
            progress.ending = Ending(frame, err.status, error=err.code)
            return
        header = rows_header(plan, current, progress.sent, upto)
        try:
            yield frame_header(header)
            for chunk in row_chunks(store, current, progress.sent, upto, plan.slots, bin_file=bin_file):
                yield chunk
        finally:
            bin_file.close()
        progress.sent = upto
        if header["final"]:
            progress.ending = Ending(b"", 200, current.status)
            return


def rows_header(plan: StreamPlan, current: RecordMeta, sent: int, upto: int) -> dict:
    """The header of the frame holding rows `[sent, upto)`; final when they are a served record's last."""
    return {
        "rid": plan.rid,
        "status": 200,
        "dtype": current.dtype,
        "shape": [upto - sent, len(plan.out_layers), current.topk],
        "start": current.start + sent,
        "layers": plan.out_layers,
        "final": current.final and upto == current.rows and served(current),
        "record_status": current.status,
        "created": current.created,
        **version_fields(current),
    }


def completed(plan: StreamPlan, current: RecordMeta, progress: Progress) -> Ending | None:
    """The ending of a record with nothing left to send (final, or `end` reached): an empty final frame, 200
    (an aborted record ends like a finished one, `record_status` says why) or 410 for a record not served."""
    if not (current.final or (plan.limit is not None and progress.sent >= plan.limit)):
        return None
    status = 200 if served(current) or not current.final else 410
    extra = {} if status == 200 else {"error": f"record_{current.status}", "detail": "record ended"}
    frame = empty_frame(plan.rid, status, current, layers=plan.out_layers, record_status=current.status, **extra)
    return Ending(frame, status, current.status, extra.get("error"))
