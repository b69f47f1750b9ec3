"""`POST /routed_experts/batch`: many records in one answer, one frame per rid in request order.

Why its own module: a batch answers each rid the way a whole fetch would (404, 202, 410, 416 or the rows),
but as a frame inside one 200 body, under one shared deadline; those rules live here, the route only parses.
"""

from collections.abc import AsyncIterator
from typing import Any

from service.server.errors import ApiError
from service.server.metrics import Fetch
from service.server.record_answer import (
    empty_frame,
    gone,
    missing,
    open_bin,
    pending_body,
    refused_suspect,
    replaced,
    row_chunks,
    select,
    served,
    token_range,
    version_fields,
)
from service.server.store import Store
from service.wire import formats
from service.wire.frames import frame_header


async def batch_frames(
    store: Store, request: Any, items: list[formats.LayerItem] | None, deadline: float, fetch: Fetch
) -> AsyncIterator[bytes]:
    """One frame per rid of `request` (a `BatchRequest`), in its order; all rids share one `deadline` (on
    `store.deadline_clock`), and each rid's outcome is counted once its frame is out."""
    for item in request.rids:
        rid, start, end = (item, None, None) if isinstance(item, str) else (item.rid, item.start, item.end)
        meta = await fetch.wait(store.wait_final(rid, deadline - store.deadline_clock()))
        if meta is None:
            err = missing(store, rid)
            yield empty_frame(rid, err.status, None, error=err.code, detail=err.detail)
            fetch.count(err.status, error=err.code)
            continue
        if not meta.final:
            detail = pending_body(meta)["detail"]
            yield empty_frame(rid, 202, meta, rows=meta.rows, error="not_final", detail=detail)
            fetch.count(202)
            continue
        if not served(meta):
            err = gone(meta)
            yield empty_frame(rid, 410, meta, error=err.code, detail=err.detail)
            fetch.count(410, error=err.code)
            continue
        refused = refused_suspect(meta, request.suspect == "allow")
        if refused is not None:
            yield empty_frame(rid, 422, meta, error=refused.code, detail=refused.detail)
            fetch.count(422, error=refused.code)
            continue
        try:
            layers, slots = select(meta, items)
            lo, hi, clamped = token_range(meta, start, end, request.clamp)
            bin_file = open_bin(store, meta, hi - meta.start)
            if replaced(store, meta):
                bin_file.close()
                raise ApiError(409, "record_replaced", f"record {rid!r} was replaced while read: ask again")
        except ApiError as err:
            if err.status != 409 and replaced(store, meta):
                err = ApiError(409, "record_replaced", f"record {rid!r} was replaced while read: ask again")
            yield empty_frame(rid, err.status, meta, error=err.code, detail=err.detail)
            fetch.count(err.status, error=err.code)
            continue
        header = {
            "rid": rid,
            "status": 200,
            "dtype": meta.dtype,
            "shape": [hi - lo, len(layers), meta.topk],
            "start": lo,
            "layers": layers,
            "final": True,
            "prompt_len": meta.prompt_len,
            "record_status": meta.status,
            "num_hidden_layers": meta.sglang_layers,
            "created": meta.created,
            **version_fields(meta),
            **({"clamped": clamped} if request.clamp else {}),
        }
        try:
            yield frame_header(header)
            row_lo, row_hi = lo - meta.start, hi - meta.start
            for chunk in row_chunks(store, meta, row_lo, row_hi, slots, bin_file=bin_file):
                yield chunk
        finally:
            bin_file.close()
        fetch.count(200, meta.status)
