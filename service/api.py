"""The HTTP API of Contract 2: `create_app(settings)` builds the FastAPI app with every route.

Bodies stream straight from the spool files (`os.pread` chunks through the pure encoders of
`service.formats`), so a record is never built whole in memory. Every error is JSON
`{"error": code, "detail": text}`, FastAPI's own validation and routing errors included, and the
OpenAPI schema documents each status, media type and header a route can return.
"""

import asyncio
import hmac
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal
from urllib.parse import quote

import numpy as np
import orjson
from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import formats
from service.frames import FRAMES_MEDIA_TYPE, frame_header
from service.metrics import CODE_ABORT, CODE_CLIENT_GONE, Fetch, Metrics
from service.settings import Settings
from service.spool import RecordMeta, Spool, SpoolFormatError
from service.store import Store

log = logging.getLogger("r3.api")

MAX_RID_CHARS = 1024


# ---- errors -----------------------------------------------------------------------------------
class ApiError(Exception):
    """An error response: HTTP status, a short machine code and a sentence for a person."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


class ErrorBody(BaseModel):
    error: str = Field(description="Short machine-readable code, e.g. `not_found`.")
    detail: str = Field(description="What was wrong, for a person.")


class Pending(BaseModel):
    rid: str
    rows: int = Field(description="Rows written so far.")
    final: Literal[False]
    detail: str = Field(description="The same, for a person: rows so far and the positions they cover.")


class Health(BaseModel):
    status: str


class Engines(BaseModel):
    engines: list[dict[str, Any]] = Field(description="Engine files (Contract 1), one per engine process.")


def error_response(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("query", "path", "body"))
        parts.append(f"{loc or 'request'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as `{"error", "detail"}` JSON, including FastAPI's and Starlette's own."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_parameter", _validation_detail(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        """An unexpected fault before the headers: still a JSON error (Starlette's default is plain text)."""
        detail = f"{type(exc).__name__} while answering {request.method} {request.url.path}"
        return error_response(500, "internal_error", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. not UTF-8): malformed input, 422
            return error_response(422, "invalid_body", detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(sorted(_allowed_methods(app, request.scope)))
            detail = f"{request.method} not allowed here; allowed: {headers['Allow']}"
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), detail, headers)


def _allowed_methods(app: FastAPI, scope: Scope) -> set[str]:
    """Methods of every route sharing the path template of the first route that matches this path."""
    template = None
    methods: set[str] = set()
    for route in app.router.routes:
        path = getattr(route, "path_format", None)
        if template is None and path is not None and route.matches(scope)[0] != Match.NONE:
            template = path
        if template is not None and path == template:
            methods |= getattr(route, "methods", None) or set()
    return methods


class BodyLimit:
    """Pure ASGI middleware: refuse request bodies over `max_bytes` with 413 before the app reads them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = f"request body over {self.max_bytes} bytes"
        await error_response(413, "body_too_large", detail)(scope, receive, send)


class ClientGone(OSError):
    """The client closed its connection while its answer was being sent."""


class SidecarApp(FastAPI):
    """FastAPI with a send timeout: a client that takes no body chunk for `send_timeout_s` is cut off.

    Without it, a stalled reader holds its connection, a body chunk and an open `.bin` forever (the
    server's `send` waits on flow control). The timeout watches the server's own `send`, outside every
    middleware, so on expiry it can abort the transport (uvicorn exposes it on the bound `send`),
    which frees the socket at once instead of waiting for buffered bytes that will never drain. One
    timer per request watches every send (a timeout context per send costs more than the rest of a small
    response's sends together).
    """

    send_timeout_s: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.send_timeout_s
        if timeout is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        sending_since: float | None = None
        aborted = False

        def watch() -> None:
            nonlocal watchdog, aborted
            now = loop.time()
            if sending_since is not None and now - sending_since >= timeout:
                aborted = True
                if transport is not None:
                    transport.abort()  # the server's pending send returns; watched_send raises
                elif task is not None:
                    task.cancel()  # a server without a transport to abort: interrupt the pending send
                return
            watchdog = loop.call_at((sending_since if sending_since is not None else now) + timeout, watch)

        async def watched_send(message: Message) -> None:
            nonlocal sending_since
            if transport is not None and transport.is_closing() and message["type"] == "http.response.body":
                # uvicorn drops writes to a closed connection without a word: the body would run to its end
                # and be counted as served. Stop it here; the body counts the answer 499.
                raise ClientGone("client closed the connection")
            if not aborted:
                sending_since = loop.time()
                try:
                    await send(message)
                except asyncio.CancelledError:
                    if not aborted or task is None:
                        raise
                    task.uncancel()
                finally:
                    sending_since = None
            if aborted:
                raise OSError(f"client read nothing for {timeout}s; connection closed")

        watchdog = loop.call_later(timeout, watch)
        try:
            await super().__call__(scope, receive, watched_send)
        except ClientGone:
            pass  # nobody to answer, nothing wrong with the server: no traceback in the log
        finally:
            watchdog.cancel()


# ---- OpenAPI descriptions ---------------------------------------------------------------------
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TEXT = {"type": "string"}
_X_HEADERS = {
    "X-R3-Rid": "The rid, percent-encoded UTF-8.",
    "X-R3-Dtype": "numpy dtype of the numbers in the body (`int32` for `sglang_b64`).",
    "X-R3-Shape": "`rows,layers,topk` of the returned array.",
    "X-R3-Start": "Token position of the first returned row.",
    "X-R3-Prompt-Len": "Prompt length of the request.",
    "X-R3-Layers": "Comma list of the model layer index of each returned layer slot.",
    "X-R3-Final": "`true` when the record is complete.",
    "X-R3-Status": "The record's status: `ok`, or `aborted` (the rows the request produced before it was aborted).",
    "X-R3-Num-Hidden-Layers": "The model's layer count (SGLang's payload width), when the record says it.",
    "X-R3-Clamped": "`true` when `clamp=true` cut the range asked for to the rows the record holds.",
}

_ERRORS = {
    401: "Missing or wrong bearer token (only when R3_AUTH_TOKEN is set).",
    404: "No such record.",
    410: "The record ended in error, was corrupt, or expired.",
    416: "`start`/`end` outside the record's rows (and `clamp` not set).",
    422: "Malformed parameters, layers the record does not hold, or SGLang's layout of a record that cannot give it.",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": _ERRORS[code]} for code in codes}


SERVER_400: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "Malformed or oversized HTTP request, refused by the HTTP server before the app sees it.",
        "content": {"text/plain": {"schema": _TEXT}},
    }
}


def record_responses(auth_errors: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {**_RECORD_OK, **SERVER_400, **_errors(*auth_errors, 404, 410, 416, 422)}


_RECORD_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The rows, in the requested format (or frames with `stream=true`).",
        "headers": {name: {"description": text, "schema": {"type": "string"}} for name, text in _X_HEADERS.items()},
        "content": {
            "application/x-npy": _BINARY,
            "application/octet-stream": _BINARY,
            "application/json": {"schema": {"type": "object"}},
            "text/plain": {"schema": _TEXT},
            FRAMES_MEDIA_TYPE: _BINARY,
        },
    },
    202: {"model": Pending, "description": "The record exists but is not final after `wait`."},
}


# ---- helpers ----------------------------------------------------------------------------------
def header_rid(rid: str) -> str:
    return quote(rid, safe=":")


def _gone(meta: RecordMeta) -> ApiError:
    return ApiError(410, f"record_{meta.status}", f"record {meta.rid!r} ended with status {meta.status!r}")


def _missing(store: Store, rid: str) -> ApiError:
    if store.expired(rid):
        return ApiError(410, "expired", f"record {rid!r} expired and was deleted")
    return ApiError(404, "not_found", f"no record {rid!r}")


def _select(meta: RecordMeta, items: list[formats.LayerItem] | None) -> tuple[list[int], list[int] | None]:
    """(model layers to return, their slots in a stored row or None for all) for a `layers` query."""
    if items is None:
        return list(meta.layers), None
    try:
        wanted = formats.resolve_layers(meta.layers, items)
        return wanted, formats.layer_slots(meta.layers, wanted)
    except ValueError as exc:
        raise ApiError(422, "invalid_layers", str(exc)) from None


def _sglang_layers(meta: RecordMeta) -> int:
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


def _range(meta: RecordMeta, start: int | None, end: int | None, clamp: bool) -> tuple[int, int, bool]:
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


def _served(meta: RecordMeta) -> bool:
    """Whether a final record's rows are served: `ok`, and `aborted` (rows so far, as SGLang returns them inline)."""
    return meta.status != "error"


def _pending_body(meta: RecordMeta) -> dict[str, Any]:
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


def _open_bin(store: Store, meta: RecordMeta, row_hi: int) -> OpenBin:
    """Open the record's `.bin` able to serve rows `[0, row_hi)`, or raise the answer the failure deserves.

    Missing or shorter than its metadata promises: the record is gone or corrupt, 410 (counted in
    `r3_spool_skipped_total`). Present but unreadable (a directory, no permission, an I/O error): the
    spool is at fault, not the request: 500, so it reaches `r3_served_total{code="500"}` and the 5xx alert.
    """
    if row_hi * meta.row_bytes == 0:
        return OpenBin(None)
    try:
        return OpenBin(store.spool.open_rows(meta, row_hi))
    except SpoolFormatError as exc:
        store.count_skip(exc.reason, meta)
        raise ApiError(410, exc.reason, f"record {meta.rid!r}: .bin holds fewer than {row_hi} rows (corrupt)") from None
    except OSError as exc:
        store.count_skip("unreadable_bin", meta)
        log.warning("record %r: cannot read %s: %s", meta.rid, store.spool.bin_path(meta.rid), exc)
        raise ApiError(
            500, "unreadable_record", f"record {meta.rid!r}: its .bin cannot be read ({exc.strerror})"
        ) from None


def _row_chunks(
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


def _frame(rid: str, status: int, meta: RecordMeta | None, **extra: Any) -> bytes:
    """Header of a frame without payload (status ≠ 200, or an empty final frame)."""
    layers = list(meta.layers) if meta else []
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


def _ok_headers(
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
    }
    if meta.sglang_layers is not None:
        headers["X-R3-Num-Hidden-Layers"] = str(meta.sglang_layers)
    return headers


# ---- app --------------------------------------------------------------------------------------
def create_app(settings: Settings) -> FastAPI:
    """The sidecar app over `settings.spool_dir`; its store starts and stops with the app's lifespan."""
    spool = Spool(settings.spool_dir, create=False)  # made at startup: building an app touches no files
    store = Store(spool, settings)
    metrics = Metrics(store)
    token = settings.auth_token.encode() if settings.auth_token else None
    bearer = HTTPBearer(auto_error=False, description="Required when the sidecar runs with R3_AUTH_TOKEN.")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        try:
            yield
        finally:
            await store.stop()

    app = SidecarApp(
        title="r3-sidecar",
        version="1",
        summary="Routed experts of MoE requests, served from the r3 spool (Contract 2).",
        lifespan=lifespan,
        **({"openapi_url": None, "docs_url": None, "redoc_url": None} if token is not None else {}),
    )
    app.state.settings, app.state.store, app.state.metrics = settings, store, metrics
    app.send_timeout_s = settings.send_timeout_s or None  # R3_SEND_TIMEOUT_S; 0 disables
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=64 * 1024 + settings.max_batch * (4 * MAX_RID_CHARS + 8))

    async def authorized(creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> None:
        if token is not None and (creds is None or not hmac.compare_digest(creds.credentials.encode(), token)):
            raise ApiError(401, "unauthorized", "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    async def open_access() -> None:
        """Without a token the API is open, and the schema says so (no security, no 401)."""

    Auth = Annotated[None, Security(authorized)] if token is not None else Annotated[None, Depends(open_access)]
    auth_errors = (401,) if token is not None else ()
    Wait = Annotated[
        float,
        Query(ge=0, le=settings.max_wait_s, description="Seconds to wait until the record exists and is final."),
    ]
    Rid = Annotated[str, StringConstraints(min_length=1, max_length=MAX_RID_CHARS)]

    class BatchItem(BaseModel):
        """One rid with its own token range (multi-turn and resumed requests need different starts)."""

        model_config = ConfigDict(extra="forbid", strict=True)
        rid: Rid
        start: NonNegativeInt | None = Field(None, description="First token position (default: the record's start).")
        end: NonNegativeInt | None = Field(None, description="One past the last token position (default: its end).")

    class BatchRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        rids: list[Rid | BatchItem] = Field(
            max_length=settings.max_batch,
            description='Answered in this order; each a rid, or `{"rid", "start", "end"}` for a range of it.',
        )
        wait: float = Field(0.0, ge=0, le=settings.max_wait_s, description="Seconds to wait for all of them.")
        layers: list[NonNegativeInt] | str | None = Field(
            None,
            min_length=1,
            description="Model layers for every rid (default: all of each record's): a list of indices, or the "
            "GET query's text, ranges included (`0-15`).",
        )
        clamp: bool = Field(False, description="Cut each range to the rows its record holds instead of a 416 frame.")

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

    # ---- POST /routed_experts/batch (registered first: `{rid:path}` would also match "batch") ---
    @app.post(
        "/routed_experts/batch",
        response_class=Response,
        responses={
            200: {
                "description": "One frame per rid in request order, each header with its own `status`.",
                "content": {FRAMES_MEDIA_TYPE: _BINARY},
            },
            413: {"model": ErrorBody, "description": "Request body too large."},
            **SERVER_400,
            **_errors(*auth_errors, 422),
        },
        summary="Several records at once, as frames",
    )
    async def batch(request: BatchRequest, _auth: Auth) -> StreamingResponse:
        fetch = metrics.fetch("batch")
        try:
            if isinstance(request.layers, str):
                items: list[formats.LayerItem] | None = formats.parse_layers(request.layers)
            else:
                items = request.layers
                if items is not None and len(set(items)) != len(items):
                    raise ValueError(f"layers {items} repeat an index")
        except ValueError as exc:
            fetch.count(422)
            fetch.finish()
            raise ApiError(422, "invalid_layers", str(exc)) from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.wait

        async def frames() -> AsyncIterator[bytes]:
            """One frame per rid; each rid's outcome is counted once its frame is out."""
            for item in request.rids:
                rid, start, end = (item, None, None) if isinstance(item, str) else (item.rid, item.start, item.end)
                meta = await fetch.wait(store.wait_final(rid, deadline - loop.time()))
                if meta is None:
                    err = _missing(store, rid)
                    yield _frame(rid, err.status, None, error=err.code, detail=err.detail)
                    fetch.count(err.status, error=err.code)
                    continue
                if not meta.final:
                    detail = _pending_body(meta)["detail"]
                    yield _frame(rid, 202, meta, rows=meta.rows, error="not_final", detail=detail)
                    fetch.count(202)
                    continue
                if not _served(meta):
                    err = _gone(meta)
                    yield _frame(rid, 410, meta, error=err.code, detail=err.detail)
                    fetch.count(410, error=err.code)
                    continue
                try:
                    layers, slots = _select(meta, items)
                    lo, hi, clamped = _range(meta, start, end, request.clamp)
                    bin_file = _open_bin(store, meta, hi - meta.start)
                except ApiError as err:
                    yield _frame(rid, err.status, meta, error=err.code, detail=err.detail)
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
                    **({"clamped": clamped} if request.clamp else {}),
                }
                try:
                    yield frame_header(header)
                    row_lo, row_hi = lo - meta.start, hi - meta.start
                    for chunk in _row_chunks(store, meta, row_lo, row_hi, slots, bin_file=bin_file):
                        yield chunk
                finally:
                    bin_file.close()
                fetch.count(200, meta.status)

        return StreamingResponse(counted(frames(), fetch), media_type=FRAMES_MEDIA_TYPE)

    # ---- GET /routed_experts/{rid} ---------------------------------------------------------
    @app.get(
        "/routed_experts/{rid:path}",
        response_class=Response,
        responses=record_responses(auth_errors),
        summary="One record's routed experts",
    )
    async def get_record(
        rid: str,
        _auth: Auth,
        fmt: Annotated[formats.Format, Query(alias="format", description="Body format.")] = "npy",
        start: Annotated[int | None, Query(ge=0, description="First token position (default: record start).")] = None,
        end: Annotated[int | None, Query(ge=0, description="One past the last token position.")] = None,
        layers: Annotated[
            str | None,
            Query(  # no `pattern=`: `formats.parse_layers` says what is wrong in words
                max_length=65536,
                description="Comma list of model layer indices (each must be stored) and inclusive model-layer "
                "ranges such as `0-15` (the stored layers inside; may be none).",
            ),
        ] = None,
        wait: Wait = 0.0,
        stream: Annotated[bool, Query(description="Send frames as rows arrive, until final.")] = False,
        clamp: Annotated[
            bool, Query(description="Cut `start`/`end` to the rows the record holds instead of answering 416.")
        ] = False,
    ) -> Response:
        fetch = metrics.fetch("frames" if stream else fmt)
        try:
            if not rid or len(rid) > MAX_RID_CHARS:
                raise ApiError(422, "invalid_rid", f"rid must be 1 … {MAX_RID_CHARS} characters")
            try:
                items = formats.parse_layers(layers) if layers is not None else None
            except ValueError as exc:
                raise ApiError(422, "invalid_layers", str(exc)) from None
            if stream:
                if clamp:
                    raise ApiError(
                        422, "invalid_parameter", "clamp applies to whole fetches; a stream waits for its rows"
                    )
                return await stream_record(rid, items, start, end, wait, fetch)
            return await fetch_record(rid, fmt, items, start, end, wait, clamp, fetch)
        except Exception as exc:  # an answer before the headers: count it here (bodies count themselves)
            if isinstance(exc, ApiError):
                fetch.count(exc.status, error=exc.code)
            else:
                fetch.count(500)
            fetch.finish()
            raise

    async def fetch_record(
        rid: str,
        fmt: str,
        items: list[formats.LayerItem] | None,
        start: int | None,
        end: int | None,
        wait: float,
        clamp: bool,
        fetch: Fetch,
    ) -> Response:
        meta = await fetch.wait(store.wait_final(rid, wait)) if wait > 0 else store.lookup(rid)
        if meta is None:
            raise _missing(store, rid)
        if not meta.final:
            fetch.count(202)
            fetch.finish()
            return JSONResponse(_pending_body(meta), status_code=202)
        if not _served(meta):
            raise _gone(meta)
        out_layers, slots = _select(meta, items)
        lo, hi, clamped = _range(meta, start, end, clamp)
        sglang = fmt == "sglang_b64" and items is None  # SGLang's own payload: every model layer, dense as zeros
        width = _sglang_layers(meta) if sglang else 0
        row_lo, row_hi = lo - meta.start, hi - meta.start
        bin_file = _open_bin(store, meta, row_hi)
        dtype = np.dtype(meta.dtype)
        chunks = _row_chunks(store, meta, row_lo, row_hi, slots, rows_of_3=fmt == "sglang_b64", bin_file=bin_file)
        if sglang:
            shape = (row_hi - row_lo, width, meta.topk)
            out_layers = list(range(width))
            body = formats.encode_b64(formats.to_sglang_rows(chunks, dtype, meta.layers, width, meta.topk))
        else:
            shape = (row_hi - row_lo, len(out_layers), meta.topk)
            head = {"rid": rid, "dtype": meta.dtype, "shape": list(shape), "start": lo, "layers": out_layers}
            body = formats.encode(fmt, chunks, dtype=dtype, shape=shape, head=head)
        headers = _ok_headers(meta, formats.payload_dtype(fmt, meta.dtype), shape, lo, out_layers, final=True)
        if clamp:
            headers["X-R3-Clamped"] = "true" if clamped else "false"
        length = formats.body_length(fmt, dtype, shape)
        if length is not None:
            headers["Content-Length"] = str(length)
        body = counted(body, fetch, ok=(200, meta.status), bin_file=bin_file)
        return StreamingResponse(body, media_type=formats.MEDIA_TYPES[fmt], headers=headers)

    async def stream_record(
        rid: str, items: list[formats.LayerItem] | None, start: int | None, end: int | None, wait: float, fetch: Fetch
    ) -> Response:
        meta = await fetch.wait(store.wait_until(rid, lambda m: m is not None, wait))
        if meta is None:
            raise _missing(store, rid)
        if meta.final and not _served(meta):
            raise _gone(meta)
        out_layers, slots = _select(meta, items)
        lo = meta.start if start is None else start
        if lo < meta.start or (end is not None and end < lo) or (meta.final and max(lo, end or lo) > meta.end):
            raise ApiError(
                416, "range_not_satisfiable", f"start={lo}, end={end} do not fit the record starting at {meta.start}"
            )
        row_bytes = len(out_layers) * meta.topk * meta.itemsize
        rows_per_frame = max(1, settings.chunk_bytes // max(1, row_bytes))
        limit = None if end is None else end - meta.start
        shape = (max(0, meta.rows - (lo - meta.start)), len(out_layers), meta.topk)
        headers = _ok_headers(meta, meta.dtype, shape, lo, out_layers, final=meta.final)

        async def frames() -> AsyncIterator[bytes]:
            """The stream's frames; its one outcome (the last frame's status) is counted as it ends."""
            sent = lo - meta.start  # may lie past the rows written so far: the stream waits for them
            seen = meta.rows
            current: RecordMeta | None = meta
            while True:
                if current is None:
                    err = _missing(store, rid)
                    yield _frame(rid, err.status, None, error=err.code, detail=err.detail)
                    fetch.count(err.status, error=err.code)
                    return
                if current.created != meta.created or current.rows < seen:
                    # A retracted request's record starts over under the same rid: never splice its new rows
                    # onto the old ones a reader already has.
                    yield _frame(rid, 409, current, error="record_restarted", detail=RESTARTED_DETAIL)
                    fetch.count(409)
                    return
                seen = current.rows
                if current.final and _served(current) and current.rows < max(sent, limit or 0):
                    detail = f"start={lo}, end={end} do not fit the end ({current.end}) the record was finalized with"
                    yield _frame(rid, 416, current, error="range_not_satisfiable", detail=detail)
                    fetch.count(416)
                    return
                stop = current.rows if limit is None else min(current.rows, limit)
                while sent < stop:
                    upto = min(stop, sent + rows_per_frame)
                    is_last = current.final and upto == current.rows
                    try:
                        bin_file = _open_bin(store, current, upto)
                    except ApiError as err:
                        yield _frame(rid, err.status, current, error=err.code, detail=err.detail)
                        fetch.count(err.status, error=err.code)
                        return
                    header = {
                        "rid": rid,
                        "status": 200,
                        "dtype": current.dtype,
                        "shape": [upto - sent, len(out_layers), current.topk],
                        "start": current.start + sent,
                        "layers": out_layers,
                        "final": is_last and _served(current),
                        "record_status": current.status,
                        "created": current.created,
                    }
                    try:
                        yield frame_header(header)
                        for chunk in _row_chunks(store, current, sent, upto, slots, bin_file=bin_file):
                            yield chunk
                    finally:
                        bin_file.close()
                    sent = upto
                    if header["final"]:
                        fetch.count(200, current.status)
                        return
                done = current.final or (limit is not None and sent >= limit)
                if done:  # an aborted record ends like a finished one: a final frame, `record_status` says why
                    status = 200 if _served(current) or not current.final else 410
                    extra = {} if status == 200 else {"error": f"record_{current.status}", "detail": "record ended"}
                    yield _frame(rid, status, current, record_status=current.status, **extra)
                    fetch.count(status, current.status, error=extra.get("error"))
                    return
                current = await fetch.wait(
                    store.wait_until(
                        rid,
                        lambda m, seen=sent: m is None or m.final or m.rows > seen or m.created != meta.created,
                        settings.rescan_s,
                    )
                )

        return StreamingResponse(counted(frames(), fetch), media_type=FRAMES_MEDIA_TYPE, headers=headers)

    # ---- DELETE ------------------------------------------------------------------------------
    @app.delete(
        "/routed_experts/{rid:path}",
        status_code=204,
        response_class=Response,
        responses={
            204: {"description": "Deleted; the spool space is freed."},
            **SERVER_400,
            **_errors(*auth_errors, 404, 422),
        },
        summary="Acknowledge a record: delete its files",
    )
    async def delete_record(rid: str, _auth: Auth) -> Response:
        if not rid or len(rid) > MAX_RID_CHARS:
            raise ApiError(422, "invalid_rid", f"rid must be 1 … {MAX_RID_CHARS} characters")
        if not store.delete(rid):
            raise ApiError(404, "not_found", f"no record {rid!r}")
        return Response(status_code=204)

    # ---- engines, health, metrics -----------------------------------------------------------
    @app.get(
        "/v1/engines", response_model=Engines, responses=_errors(*auth_errors), summary="Engine budget and occupancy"
    )
    async def engines(_auth: Auth) -> Response:
        return Response(orjson.dumps({"engines": store.engines()}), media_type="application/json")

    @app.get("/healthz", response_model=Health, summary="Liveness")
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get(
        "/readyz",
        response_model=Health,
        responses={503: {"model": ErrorBody, "description": "The spool index is not ready."}},
        summary="Readiness: the spool is indexed and watched",
    )
    async def readyz() -> Response:
        if not store.ready or not spool.records_dir.is_dir():
            return error_response(503, "not_ready", f"spool {spool.root} is not indexed or not present")
        return JSONResponse({"status": "ready"})

    any_char_rids(app)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": _TEXT}}}},
        summary="Prometheus metrics (Contract 3)",
    )
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if token is not None:  # the schema needs the token too; /docs and /redoc (browsers cannot send it) are off

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(_auth: Auth) -> Response:
            return JSONResponse(app.openapi())

    return app


def any_char_rids(app: FastAPI) -> None:
    """Let `{rid:path}` match every character: Starlette's `.*$` stops at a newline (and `$` matches before a
    trailing one), so a rid holding `%0A` would not reach its route or would arrive cut short."""
    for route in app.router.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and "(?P<rid>.*)" in regex.pattern and regex.pattern.endswith("$"):
            route.path_regex = re.compile(regex.pattern[:-1] + r"\Z", re.DOTALL)


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory service.api:app_from_env`: settings from `R3_*` variables."""
    from service.heap import keep_freed_chunks

    settings = Settings()
    keep_freed_chunks(settings.chunk_bytes)
    return create_app(settings)


__all__ = ["ApiError", "SpoolFormatError", "app_from_env", "create_app"]
