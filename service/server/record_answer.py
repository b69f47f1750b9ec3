"""One record's answer, piece by piece: range and layer checks, the `.bin` opened before headers, row chunks,
`X-R3-*` headers, payload-less frames, and the body wrapper that counts what was served.

Why one module: a whole fetch, a stream and a batch answer the same questions about a record (is it served?
which rows? which layers?) and must answer them alike; each route composes these pieces.
"""

import logging
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal
from urllib.parse import quote

import numpy as np
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.server.errors import ApiError
from service.server.metrics import CODE_ABORT, CODE_CLIENT_GONE, Fetch
from service.server.store import Store
from service.spool.record.meta import RecordMeta, SpoolFormatError
from service.wire import formats
from service.wire.frames import frame_header

log = logging.getLogger("r3.api")

MAX_RID_CHARS = 1024


def header_rid(rid: str) -> str:
    return quote(rid, safe=":")


def gone(meta: RecordMeta) -> ApiError:
    detail = f"record {meta.rid!r} ended with status {meta.status!r}"
    if meta.status == "error":  # why is counted in the engine file's `writer.undelivered`
        detail += (
            ": its rows did not reach the spool (r3_engine_undelivered_total says why); a request that asked"
            " for routed experts has them inline in its response"
        )
    return ApiError(410, f"record_{meta.status}", detail)


def missing(store: Store, rid: str) -> ApiError:
    """410 for a record that left (TTL, or a trainer acknowledged it), 404 for one this sidecar never saw."""
    reason = store.gone_reason(rid)
    if reason == "expired":
        return ApiError(410, "expired", f"record {rid!r} expired and was deleted")
    if reason == "acknowledged":
        return ApiError(410, "acknowledged", f"record {rid!r} was acknowledged (DELETE or ack) and its rows freed")
    return ApiError(404, "not_found", f"no record {rid!r} (never written here, or gone too long to remember)")


def select(meta: RecordMeta, items: list[formats.LayerItem] | None) -> tuple[list[int], list[int] | None]:
    """(model layers to return, their slots in a stored row or None for all) for a `layers` query."""
    if items is None:
        return list(meta.layers), None
    try:
        wanted = formats.resolve_layers(meta.layers, items, meta.sglang_layers)
        return wanted, formats.layer_slots(meta.layers, wanted)
    except ValueError as exc:
        raise ApiError(422, "invalid_layers", str(exc)) from None


def sglang_layers(meta: RecordMeta) -> int:
    """SGLang's payload width for `format=sglang_b64`, or a 422 saying why this record cannot give it."""
    width = meta.sglang_layers
    if width is None:
        raise ApiError(
            422,
            "sglang_layout_unknown",
            f"record {meta.rid!r} holds model layers {formats.format_layer_items(list(meta.layers))} but was written "
            "without num_hidden_layers (an older engine plugin), so SGLang's layout (every model layer, dense ones "
            "as zeros) cannot be rebuilt: fetch npy and call RoutedExperts.to_sglang_layout(num_hidden_layers), or "
            "pass layers= for int32 of the stored layers only",
        )
    return width


def token_range(meta: RecordMeta, start: int | None, end: int | None, clamp: bool) -> tuple[int, int, bool]:
    """Token positions `[lo, hi)` to return and whether `clamp` cut them; 416 when outside and not clamping."""
    lo = meta.start if start is None else start
    hi = meta.end if end is None else end
    if hi < lo:
        raise ApiError(
            416, "range_not_satisfiable", f"end={hi} is before start={lo} (the record holds [{meta.start}, {meta.end}))"
        )
    if clamp:
        c_lo, c_hi = min(max(lo, meta.start), meta.end), max(min(hi, meta.end), meta.start)
        c_hi = max(c_hi, c_lo)
        return c_lo, c_hi, (c_lo, c_hi) != (lo, hi)
    if not meta.start <= lo <= hi <= meta.end:
        raise ApiError(
            416,
            "range_not_satisfiable",
            f"[{lo}, {hi}) is not inside the record's [{meta.start}, {meta.end}) "
            "(clamp=true returns the rows that exist)",
        )
    return lo, hi, False


def served(meta: RecordMeta) -> bool:
    """Whether a final record's rows are served: `ok`, and `aborted` (rows so far, as SGLang returns them inline)."""
    return meta.status != "error"


SuspectParam = Literal["refuse", "allow"]
SUSPECT_HELP = (
    "`allow`: serve a record the engine's row check marked `suspect` (rows no true route has: repeated or "
    "out-of-range expert ids, or a dense slot that is not zero); `refuse` (default): 422 `record_suspect`, "
    "naming the first bad row, its layer and why."
)


def refused_suspect(meta: RecordMeta, allow: bool) -> ApiError | None:
    """422 `record_suspect` for a record the row check marked (`service.spool.row_check`) unless the caller
    asked for it (`suspect=allow`): its rows include ones no true route has, and a trainer that replays them
    trains on experts the rollout never used. The detail names the first bad row (and token position), layer, why."""
    if meta.status != "suspect" or allow or meta.suspect is None:
        return None
    detail = (
        f"record {meta.rid!r} is suspect: {meta.suspect.describe(meta.start)}; ask with suspect=allow "
        "(allow_suspect=True in the client) to get its rows anyway"
    )
    return ApiError(422, "record_suspect", detail)


def pending_body(meta: RecordMeta) -> dict[str, Any]:
    return {
        "rid": meta.rid,
        "rows": meta.rows,
        "final": False,
        "detail": f"record is not final yet: {meta.rows} rows so far (positions [{meta.start}, {meta.end}))",
    }


class OpenBin:
    """A record's `.bin`, opened and size-checked before any header is sent (the reader contract's check).

    The body reads through this fd, so what was checked is what is served. `close` is idempotent; `__del__`
    closes a body that was never iterated (the client left before the response started).
    """

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    __del__ = close


def open_bin(store: Store, meta: RecordMeta, row_hi: int) -> OpenBin:
    """Open the record's `.bin` able to serve rows `[0, row_hi)`, or raise the answer the failure deserves.

    Its rid reused for a new record since `meta` was read (the `.bin` now the new record's, shorter, or not yet
    made): 409, ask again, as when `replaced` finds it after a good open. Missing or shorter than its metadata
    promises otherwise: the record is gone or corrupt, 410 (counted in `r3_spool_skipped_total`). Present but
    unreadable (a directory, no permission, an I/O error): the spool is at fault, not the request: 500, so it
    reaches `r3_served_total{code="500"}` and the 5xx alert.
    """
    if row_hi * meta.row_bytes == 0:
        return OpenBin(None)
    try:
        return OpenBin(store.spool.open_rows(meta, row_hi))
    except (SpoolFormatError, OSError) as exc:
        if reused(store, meta):  # a race with the rid's next writer, not a damaged spool: nothing to count
            raise ApiError(409, "record_replaced", f"record {meta.rid!r} was replaced while read: ask again") from None
        if isinstance(exc, SpoolFormatError):
            store.count_skip(exc.reason, meta)
            detail = f"record {meta.rid!r}: .bin holds fewer than {row_hi} rows (corrupt)"
            raise ApiError(410, exc.reason, detail) from None
        store.count_skip("unreadable_bin", meta)
        log.warning("record %r: cannot read %s: %s", meta.rid, store.spool.bin_path(meta.rid), exc)
        detail = f"record {meta.rid!r}: its .bin cannot be read ({exc.strerror})"
        raise ApiError(500, "unreadable_record", detail) from None


def reused(store: Store, meta: RecordMeta) -> bool:
    """Whether the rid now names a new record, not `meta`'s (acked or expired records are not reused)."""
    now = store.reread(meta.rid)
    return now is not None and _another_record(now, meta)


def replaced(store: Store, meta: RecordMeta) -> bool:
    """Whether the rid names another record than `meta` now (reused since `meta` was read; acked or expired too).

    Checked after `open_bin`: a writer replaces `.json` before it recreates `.bin`, so while the rid still names
    `meta`'s record the `.bin` just opened is that record's; once it does not, the fd may hold the new record's
    rows under the old metadata, and the answer is made again from the rid's current state. The file is read
    again, not stat-checked (`Store.reread`): a rid reused as fast as a writer can go defeats a stat stamp."""
    now = store.reread(meta.rid)
    return now is None or _another_record(now, meta)


def _another_record(now: RecordMeta, meta: RecordMeta) -> bool:
    """`now`, read under `meta`'s rid, is a different record: made again, or of another length."""
    return now.created != meta.created or now.rows != meta.rows


def row_chunks(
    store: Store,
    meta: RecordMeta,
    row_lo: int,
    row_hi: int,
    slots: list[int] | None,
    *,
    rows_of_3: bool = False,
    bin_file: OpenBin | None = None,
) -> Iterator[bytes]:
    """Rows `[row_lo, row_hi)` narrowed to `slots`, chunk by chunk (one `pread` each, through `bin_file`'s fd).

    `rows_of_3` makes every chunk but the last hold a multiple of 3 rows (carry-free base64).
    """
    rows = max(1, store.settings.chunk_bytes // meta.row_bytes)
    if rows_of_3:
        rows = formats.b64_chunk_rows(rows)
    fd = bin_file.fd if bin_file is not None else None
    chunks = store.spool.iter_rows(meta, row_lo, row_hi, chunk_bytes=rows * meta.row_bytes, fd=fd)
    return formats.select_layers(chunks, np.dtype(meta.dtype), len(meta.layers), meta.topk, slots)


RESTARTED_DETAIL = "the record started over (its request was retracted and recomputed): read it again from its start"


def empty_frame(
    rid: str, status: int, meta: RecordMeta | None, *, layers: list[int] | None = None, **extra: Any
) -> bytes:
    """Header of a frame without payload (status ≠ 200, or an empty final frame); `layers`: the selection's
    (default: the record's)."""
    layers = list(layers if layers is not None else meta.layers if meta else [])
    header = {
        "rid": rid,
        "status": status,
        "dtype": meta.dtype if meta else "uint8",
        "shape": [0, len(layers), meta.topk if meta else 0],
        "start": meta.end if meta else 0,
        "layers": layers,
        "final": bool(meta and meta.final),
        **extra,
    }
    return frame_header(header)


def ok_headers(
    meta: RecordMeta, dtype: str, shape: tuple[int, int, int], lo: int, layers: list[int], *, final: bool
) -> dict[str, str]:
    """The `X-R3-*` headers of a 200."""
    headers = {
        "X-R3-Rid": header_rid(meta.rid),
        "X-R3-Dtype": dtype,
        "X-R3-Shape": ",".join(map(str, shape)),
        "X-R3-Start": str(lo),
        "X-R3-Prompt-Len": str(meta.prompt_len),
        "X-R3-Layers": ",".join(map(str, layers)),
        "X-R3-Final": "true" if final else "false",
        "X-R3-Status": meta.status,
        "X-R3-Created": repr(meta.created),
    }
    if meta.sglang_layers is not None:
        headers["X-R3-Num-Hidden-Layers"] = str(meta.sglang_layers)
    if meta.weight_version is not None:
        headers["X-R3-Weight-Version"] = header_rid(str(meta.weight_version))
    if meta.weight_versions:
        headers["X-R3-Weight-Versions"] = ",".join(f"{pos}:{quote(str(v), safe='')}" for pos, v in meta.weight_versions)
    return headers


def version_fields(meta: RecordMeta) -> dict[str, Any]:
    """A frame header's `weight_version` and (when the rows span an update) `weight_versions`."""
    out: dict[str, Any] = {"weight_version": meta.weight_version}
    if meta.weight_versions:
        out["weight_versions"] = [list(p) for p in meta.weight_versions]
    return out


async def counted(
    body: Iterator[bytes] | AsyncIterator[bytes],
    fetch: Fetch,
    *,
    ok: tuple[int, str] | None = None,
    bin_file: OpenBin | None = None,
) -> AsyncIterator[bytes]:
    """Pass the body through, counting bytes; account the answer when it ends.

    `ok` = (code, record status) is counted when the body ends whole; bodies of frames (`ok=None`) count
    each rid themselves. The headers are sent by then, so a failure can no longer become an error status:
    it propagates, and the server cuts the connection (the client sees a body shorter than promised or an
    unterminated chunked body, never one that looks complete), counted `abort`. A client that leaves
    first is counted `499`.
    """
    sent = 0
    outcome: tuple[int | str, str] | None = None
    chunks = aiter(body) if isinstance(body, AsyncIterator) else None
    sync = body if isinstance(body, Iterator) else None
    try:
        while True:
            try:
                chunk = next(sync) if sync is not None else await anext(chunks)  # type: ignore[arg-type]
            except (StopIteration, StopAsyncIteration):
                break
            except Exception:
                outcome = (CODE_ABORT, "ok")
                log.exception("answer to a %s fetch failed after its headers; connection cut", fetch.fmt)
                raise
            except BaseException:  # cancelled while waiting for rows: the client left
                outcome = (CODE_CLIENT_GONE, "ok")
                raise
            sent += len(chunk)
            try:
                yield chunk
            except BaseException:  # the consumer stopped: client gone, or it read nothing for too long
                outcome = (CODE_CLIENT_GONE, "ok")
                raise
        outcome = ok
    finally:
        if bin_file is not None:
            bin_file.close()
        if outcome is not None:
            fetch.count(*outcome)
        fetch.finish(sent)


class CountedResponse(StreamingResponse):
    """A streamed answer whose body generator is closed the moment the answer ends, however it ends.

    Starlette leaves a body generator suspended when `send` fails (the client left, or the send timeout cut
    it off); it is closed only when the garbage collector reaches it, and `counted` accounts the answer in
    its `finally`. Closing it here makes the 499 (and the `.bin`'s close) prompt, not a matter of GC timing.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# ---- POST /routed_experts/batch (registered first: `{rid:path}` would also match "batch") ---
