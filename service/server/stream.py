"""`GET /routed_experts/{rid}?stream=true`: rows sent as frames as the engine writes them, until final.

Why its own module: the stream is a state machine over a record that changes under it (rows arrive, the
record is finalized, aborted, deleted, or restarted when SGLang retracts the request), and each ending has
its own frame; read here alone, every transition is in one function.
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
    row_chunks,
    select,
    served,
    version_fields,
)
from service.server.store import Store
from service.spool.record_meta import RecordMeta
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
) -> Response:
    """Check what can be checked before the headers (exists, served, range, layers), then stream."""
    meta = await fetch.wait(store.wait_until(rid, lambda m: m is not None, wait))
    if meta is None:
        raise missing(store, rid)
    if meta.final and not served(meta):
        raise gone(meta)
    out_layers, slots = select(meta, items)
    lo = meta.start if start is None else start
    if lo < meta.start or (end is not None and end < lo) or (meta.final and max(lo, end or lo) > meta.end):
        raise ApiError(
            416, "range_not_satisfiable", f"start={lo}, end={end} do not fit the record starting at {meta.start}"
        )
    row_bytes = len(out_layers) * meta.topk * meta.itemsize
    rows_per_frame = max(1, store.settings.chunk_bytes // max(1, row_bytes))
    plan = StreamPlan(rid, meta, lo, end, out_layers, slots, rows_per_frame)
    shape = (max(0, meta.rows - (lo - meta.start)), len(out_layers), meta.topk)
    headers = ok_headers(meta, meta.dtype, shape, lo, out_layers, final=meta.final)
    body = counted(stream_frames(store, plan, fetch), fetch)
    return CountedResponse(body, media_type=FRAMES_MEDIA_TYPE, headers=headers)


async def stream_frames(store: Store, plan: StreamPlan, fetch: Fetch) -> AsyncIterator[bytes]:
    """The stream's frames, from `plan.lo` until the record is final (or `end`); its one outcome (the last
    frame's status) is counted as it ends.

    States: waiting for rows (`store.wait_until`), sending the rows that arrived in frames of at most
    `rows_per_frame`, and the endings: record gone (404/410), restarted under the same rid (409), finalized
    shorter than asked (416), final (200, or 410 for an `error` record).
    """
    rid, meta, lo, end, limit = plan.rid, plan.first, plan.lo, plan.end, plan.limit
    out_layers, slots, rows_per_frame = plan.out_layers, plan.slots, plan.rows_per_frame
    sent = lo - meta.start  # may lie past the rows written so far: the stream waits for them
    seen = meta.rows
    current: RecordMeta | None = meta
    while True:
        if current is None:
            err = missing(store, rid)
            yield empty_frame(rid, err.status, None, error=err.code, detail=err.detail)
            fetch.count(err.status, error=err.code)
            return
        if current.created != meta.created or current.rows < seen:
            # A retracted request's record starts over under the same rid: never splice its new rows
            # onto the old ones a reader already has.
            yield empty_frame(rid, 409, current, error="record_restarted", detail=RESTARTED_DETAIL)
            fetch.count(409)
            return
        seen = current.rows
        if current.final and served(current) and current.rows < max(sent, limit or 0):
            detail = f"start={lo}, end={end} do not fit the end ({current.end}) the record was finalized with"
            yield empty_frame(rid, 416, current, error="range_not_satisfiable", detail=detail)
            fetch.count(416)
            return
        stop = current.rows if limit is None else min(current.rows, limit)
        while sent < stop:
            upto = min(stop, sent + rows_per_frame)
            is_last = current.final and upto == current.rows
            try:
                bin_file = open_bin(store, current, upto)
            except ApiError as err:
                yield empty_frame(rid, err.status, current, error=err.code, detail=err.detail)
                fetch.count(err.status, error=err.code)
                return
            header = {
                "rid": rid,
                "status": 200,
                "dtype": current.dtype,
                "shape": [upto - sent, len(out_layers), current.topk],
                "start": current.start + sent,
                "layers": out_layers,
                "final": is_last and served(current),
                "record_status": current.status,
                "created": current.created,
                **version_fields(current),
            }
            try:
                yield frame_header(header)
                for chunk in row_chunks(store, current, sent, upto, slots, bin_file=bin_file):
                    yield chunk
            finally:
                bin_file.close()
            sent = upto
            if header["final"]:
                fetch.count(200, current.status)
                return
        done = current.final or (limit is not None and sent >= limit)
        if done:  # an aborted record ends like a finished one: a final frame, `record_status` says why
            status = 200 if served(current) or not current.final else 410
            extra = {} if status == 200 else {"error": f"record_{current.status}", "detail": "record ended"}
            yield empty_frame(rid, status, current, layers=out_layers, record_status=current.status, **extra)
            fetch.count(status, current.status, error=extra.get("error"))
            return
        current = await fetch.wait(
            store.wait_until(
                rid,
                lambda m, seen=sent: m is None or m.final or m.rows > seen or m.created != meta.created,
                store.settings.rescan_s,
            )
        )
