"""`GET /routed_experts/{rid}` without `stream`: one record's rows, whole, in the format asked for.

Everything that can fail is checked before the headers (exists, final, served, layers, range, `.bin` long
enough); after them the body streams from the spool through the pure encoders of `service.wire.formats`.
"""

import numpy as np
from fastapi.responses import JSONResponse, Response

from service.server.errors import ApiError
from service.server.metrics import Fetch
from service.server.record_answer import (
    CountedResponse,
    OpenBin,
    counted,
    gone,
    missing,
    ok_headers,
    open_bin,
    pending_body,
    refused_suspect,
    replaced,
    row_chunks,
    select,
    served,
    sglang_layers,
    token_range,
)
from service.server.store import Store
from service.spool.record.meta import RecordMeta
from service.wire import formats


async def fetch_record(
    store: Store,
    rid: str,
    fmt: str,
    items: list[formats.LayerItem] | None,
    start: int | None,
    end: int | None,
    wait: float,
    clamp: bool,
    fetch: Fetch,
    sglang_dtype: str | None = None,
    tries: int = 3,
    allow_suspect: bool = False,
) -> Response:
    """The record's rows `[start, end)` in `fmt`, after `wait` for it to be final; 202 while it is not.

    `sglang_dtype` (`sglang_b64` only): the `SGLANG_ROUTED_EXPERTS_DTYPE` to encode as, SGLang's way. A rid reused
    between the metadata and the `.bin` (`records.replaced`) is answered again from its new state."""
    meta = await fetch.wait(store.wait_final(rid, wait)) if wait > 0 else store.lookup(rid)
    if meta is None:
        raise missing(store, rid)
    if not meta.final:
        fetch.count(202)
        fetch.finish()
        return JSONResponse(pending_body(meta), status_code=202)
    if not served(meta):
        raise gone(meta)
    if (refused := refused_suspect(meta, allow_suspect)) is not None:
        raise refused
    out_layers, slots = select(meta, items)
    lo, hi, clamped = token_range(meta, start, end, clamp)
    sglang = fmt == "sglang_b64" and items is None  # SGLang's own payload: every model layer, dense as zeros
    width = sglang_layers(meta) if sglang else 0
    row_lo, row_hi = lo - meta.start, hi - meta.start
    bin_file = open_unreplaced(store, rid, meta, row_hi, last_try=tries <= 1)
    if bin_file is None:  # the rid was reused meanwhile: answer from the new record
        return await fetch_record(
            store, rid, fmt, items, start, end, 0, clamp, fetch, sglang_dtype, tries - 1, allow_suspect
        )
    dtype = np.dtype(meta.dtype)
    wire = sglang_wire(store, meta, sglang_dtype, row_lo, row_hi, slots)
    chunks = row_chunks(store, meta, row_lo, row_hi, slots, rows_of_3=fmt == "sglang_b64", bin_file=bin_file)
    if sglang:
        shape = (row_hi - row_lo, width, meta.topk)
        out_layers = list(range(width))
        body = formats.encode_b64(formats.to_sglang_rows(chunks, dtype, meta.layers, width, meta.topk, wire))
    else:
        shape = (row_hi - row_lo, len(out_layers), meta.topk)
        head = {"rid": rid, "dtype": meta.dtype, "shape": list(shape), "start": lo, "layers": out_layers}
        body = formats.encode(fmt, chunks, dtype=dtype, shape=shape, head=head, wire=wire)
    headers = ok_headers(meta, formats.payload_dtype(fmt, meta.dtype, wire), shape, lo, out_layers, final=True)
    if clamp:
        headers["X-R3-Clamped"] = "true" if clamped else "false"
    length = formats.body_length(fmt, dtype, shape, wire)
    if length is not None:
        headers["Content-Length"] = str(length)
    body = counted(body, fetch, ok=(200, meta.status), bin_file=bin_file)
    return CountedResponse(body, media_type=formats.MEDIA_TYPES[fmt], headers=headers)


def open_unreplaced(store: Store, rid: str, meta: RecordMeta, row_hi: int, last_try: bool) -> OpenBin | None:
    """The record's `.bin`, opened before the headers; None when its rid was reused for a new record meanwhile
    (the `.bin` unlinked for the new record's, or the one opened no longer the metadata's): ask again. On the last
    try a failed open raises as it is, and a reused rid is a 409 rather than rows the metadata does not describe."""
    try:
        bin_file = open_bin(store, meta, row_hi)
    except ApiError:
        if not last_try and replaced(store, meta):
            return None
        raise
    if replaced(store, meta):
        bin_file.close()
        if last_try:
            raise ApiError(409, "record_replaced", f"record {rid!r} was replaced while read: ask again")
        return None
    return bin_file


def sglang_wire(
    store: Store, meta: RecordMeta, asked: str | None, row_lo: int, row_hi: int, slots: list[int] | None
) -> np.dtype:
    """`sglang_b64`'s dtype, decided before the headers as SGLang's encoder decides it: the narrower dtype asked
    for when every id of the answer fits it, else int32. The record's expert count settles it without reading
    the rows, except when it exceeds the dtype (then the rows' own largest id does: one more read)."""
    if asked is None:
        return formats.SGLANG_DTYPE
    wire = formats.sglang_sent_dtype(asked, meta.num_experts - 1)
    if wire == formats.sglang_wire_dtype(asked):
        return wire
    top = 0
    for chunk in row_chunks(store, meta, row_lo, row_hi, slots):
        if len(chunk):
            top = max(top, int(np.frombuffer(chunk, dtype=meta.dtype).max()))
    return formats.sglang_sent_dtype(asked, top)
