"""The HTTP API of Contract 2: `create_app(settings)` builds the FastAPI app; each route is a named function.

Read a route top-down: its function says what it answers, its dependencies what it needs (`StoreDep`,
`MetricsDep`; auth is a router dependency), and `add_routes` lists every path with its documented statuses.
The work lives in one module per idea: `fetch` (a whole record), `stream` (rows as they arrive), `batch`
(many records as frames), `records` (the pieces they share), `errors`, `openapi` (descriptions) and `asgi`
(body limit, send timeout). Bodies stream straight from the spool files, so a record is never built whole
in memory; every error is JSON `{"error": code, "detail": text}`.
"""

import difflib
import functools
import hmac
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import orjson
from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StringConstraints

from service.server.ack import ack_request_model, version_number
from service.server.asgi import BodyLimit, SidecarApp, any_char_rids
from service.server.batch import batch_frames
from service.server.errors import ApiError, ErrorBody, error_response, install_error_handlers
from service.server.fetch import fetch_record
from service.server.metrics import Metrics
from service.server.openapi import BINARY, SERVER_400, TEXT, Engines, Health, errors, record_responses
from service.server.record_answer import MAX_RID_CHARS, SUSPECT_HELP, CountedResponse, SuspectParam, counted
from service.server.settings import Settings
from service.server.spool_advert import SpoolAdvert
from service.server.store import Store
from service.server.stream import stream_record
from service.spool import Spool
from service.spool.record.meta import SpoolFormatError
from service.wire import formats
from service.wire.frames import FRAMES_MEDIA_TYPE


# ---- dependencies -----------------------------------------------------------------------------
def get_store(request: Request) -> Store:
    return request.app.state.store


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
bearer = HTTPBearer(auto_error=False, description="Required when the sidecar runs with R3_AUTH_TOKEN.")


async def authorized(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> None:
    """The bearer token of `R3_AUTH_TOKEN`, compared in constant time; 401 otherwise."""
    token = request.app.state.settings.auth_token.encode()
    if creds is None or not hmac.compare_digest(creds.credentials.encode(), token):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


async def open_access() -> None:
    """Without a token the API is open, and the schema says so (no security, no 401)."""


def _query_names(route: Any) -> frozenset[str]:
    """The query parameters a route declares (by their public names, e.g. `format`)."""
    names: set[str] = set()
    pending = [route.dependant]
    while pending:  # the route's own parameters and those of its dependencies
        dependant = pending.pop()
        names.update(p.alias for p in dependant.query_params)
        pending.extend(dependant.dependencies)
    return frozenset(names)


async def known_query(request: Request) -> None:
    """A query parameter the route does not take is a 422 naming it: `?fromat=json` must not answer npy."""
    route = request.scope.get("route")
    if route is None or not request.query_params:
        return
    allowed = _query_names(route)
    unknown = sorted(set(request.query_params) - allowed)
    if not unknown:
        return
    hints = [
        f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, allowed, 1)) else name
        for name in unknown
    ]
    takes = ", ".join(sorted(allowed)) or "none"
    raise ApiError(422, "unknown_parameter", f"unknown query parameter {', '.join(hints)}; this route takes: {takes}")


Rid = Annotated[str, StringConstraints(min_length=1, max_length=MAX_RID_CHARS)]
Wait = Annotated[float, Query(ge=0, description="Seconds to wait until the record exists and is final.")]
"""Bound per app to `le=settings.max_wait_s` (`_with_limits`), so the schema states the limit."""


class BatchItem(BaseModel):
    """One rid with its own token range (multi-turn and resumed requests need different starts)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rid: Rid
    start: NonNegativeInt | None = Field(None, description="First token position (default: the record's start).")
    end: NonNegativeInt | None = Field(None, description="One past the last token position (default: its end).")


def batch_request_model(settings: Settings) -> type[BaseModel]:
    """The batch body with this app's limits (`R3_MAX_BATCH` rids, `R3_MAX_WAIT_S`) in its schema."""

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
        suspect: SuspectParam = Field("refuse", description=SUSPECT_HELP)

    return BatchRequest


# ---- routes -----------------------------------------------------------------------------------
# (No docstrings on routes: FastAPI would publish them as the schema's descriptions.)
# `POST /routed_experts/batch`: parse the shared `layers`, then one frame per rid (`service.server.batch`).
async def batch(request: Any, store: StoreDep, metrics: MetricsDep) -> CountedResponse:
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
    deadline = store.deadline_clock() + request.wait
    body = counted(batch_frames(store, request, items, deadline, fetch), fetch)
    return CountedResponse(body, media_type=FRAMES_MEDIA_TYPE)


# `GET /routed_experts/{rid}`: a whole record (`service.server.fetch`) or its rows as they arrive
# (`service.server.stream`).
async def get_record(
    rid: str,
    store: StoreDep,
    metrics: MetricsDep,
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
    suspect: Annotated[SuspectParam, Query(description=SUSPECT_HELP)] = "refuse",
    sglang_dtype: Annotated[
        Literal["int32", "uint16", "uint8"] | None,
        Query(
            description="`format=sglang_b64` only: encode as SGLang does under `SGLANG_ROUTED_EXPERTS_DTYPE` (the "
            "narrower dtype when every id fits, else int32); `X-R3-Dtype` names the one sent, as SGLang's "
            '`meta_info["routed_experts_dtype"]` does. Default: int32, every SGLang release\'s payload.'
        ),
    ] = None,
) -> Response:
    fetch = metrics.fetch("frames" if stream else fmt)
    try:
        if not rid or len(rid) > MAX_RID_CHARS:
            raise ApiError(422, "invalid_rid", f"rid must be 1 … {MAX_RID_CHARS} characters")
        try:
            items = formats.parse_layers(layers) if layers is not None else None
        except ValueError as exc:
            raise ApiError(422, "invalid_layers", str(exc)) from None
        if sglang_dtype is not None and (stream or fmt != "sglang_b64"):
            raise ApiError(422, "invalid_parameter", "sglang_dtype applies to format=sglang_b64 only")
        if stream:
            if clamp:
                raise ApiError(422, "invalid_parameter", "clamp applies to whole fetches; a stream waits for its rows")
            return await stream_record(store, rid, items, start, end, wait, fetch, suspect == "allow")
        allow = suspect == "allow"
        return await fetch_record(store, rid, fmt, items, start, end, wait, clamp, fetch, sglang_dtype, 3, allow)
    except Exception as exc:  # an answer before the headers: count it here (bodies count themselves)
        if isinstance(exc, ApiError):
            fetch.count(exc.status, error=exc.code)
        else:
            fetch.count(500)
        fetch.finish()
        raise


# `DELETE /routed_experts/{rid}`: the trainer's acknowledgement; frees the spool.
async def delete_record(rid: str, store: StoreDep) -> Response:
    if not rid or len(rid) > MAX_RID_CHARS:
        raise ApiError(422, "invalid_rid", f"rid must be 1 … {MAX_RID_CHARS} characters")
    if not store.delete(rid):  # 404 either way, so a repeated ack stays harmless (`ack(missing_ok=True)`)
        detail = "it was already acknowledged" if store.gone_reason(rid) == "acknowledged" else "no such record"
        raise ApiError(404, "not_found", f"no record {rid!r}: {detail}")
    return Response(status_code=204)


# `POST /routed_experts/ack`: free many records at once, by rids or by weight version (`service.server.ack`).
async def ack_records(request: Any, store: StoreDep) -> JSONResponse:
    if request.rids is not None:
        acked, missing = store.ack_rids(request.rids)
        return JSONResponse({"acked": acked, "missing": missing})
    await store.rescan()  # every record on disk now, not only those the watcher has reported yet
    acked, unordered = store.ack_before(version_number(request.before_weight_version), version_number)
    return JSONResponse({"acked": acked, "unordered": unordered})


# `GET /v1/engines`: the engine files as the engines wrote them.
async def engines(store: StoreDep) -> Response:
    return Response(orjson.dumps({"engines": store.engines()}), media_type="application/json")


# `GET /v1/node`: this sidecar's node and spool, for clients that can read final records themselves.
async def node(request: Request) -> Response:
    return Response(orjson.dumps(request.app.state.advert.body()), media_type="application/json")


class LocalReads(BaseModel):
    """What a client read straight from the spool since its last report (`service.client.local.reads`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    records: NonNegativeInt
    bytes: NonNegativeInt


# `POST /v1/local_reads`: counted as reads that did not go through this sidecar.
async def local_reads(request: LocalReads, metrics: MetricsDep) -> Response:
    metrics.local_reads.inc(request.records)
    metrics.local_read_bytes.inc(request.bytes)
    return Response(status_code=204)


async def healthz() -> Health:
    return Health(status="ok")


async def readyz(store: StoreDep) -> Response:
    if not store.ready or not store.spool.records_dir.is_dir():
        return error_response(503, "not_ready", f"spool {store.spool.root} is not indexed or not present")
    return JSONResponse({"status": "ready"})


async def prometheus(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    """The schema, behind the token when one is set (browsers cannot send it: /docs and /redoc are off)."""
    return JSONResponse(request.app.openapi())


# ---- assembly ---------------------------------------------------------------------------------
def _with_limits(endpoint: Callable[..., Any], **annotations: Any) -> Callable[..., Any]:
    """`endpoint` with some parameters' annotations replaced: this app's limits, which FastAPI reads from the
    signature (validation and schema alike). A wrapper per app, so apps with other settings are unaffected."""

    @functools.wraps(endpoint)
    async def bound(*args: Any, **kwargs: Any) -> Any:
        return await endpoint(*args, **kwargs)

    sig = inspect.signature(endpoint)
    params = [p.replace(annotation=annotations.get(p.name, p.annotation)) for p in sig.parameters.values()]
    bound.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return bound


def add_routes(app: FastAPI, settings: Settings) -> None:
    """Every route of Contract 2, with this app's auth and limits in its validation and schema."""
    token = bool(settings.auth_token)
    auth_errors = (401,) if token else ()
    auth = [Security(authorized) if token else Depends(open_access), Depends(known_query)]

    def guarded(path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        app.add_api_route(path, endpoint, dependencies=auth, **kwargs)

    wait = Annotated[float, Query(ge=0, le=settings.max_wait_s, description=Wait.__metadata__[0].description)]
    # POST batch first: `{rid:path}` would also match "batch".
    guarded(
        "/routed_experts/batch",
        _with_limits(batch, request=batch_request_model(settings)),
        methods=["POST"],
        response_class=Response,
        responses={
            200: {
                "description": "One frame per rid in request order, each header with its own `status`.",
                "content": {FRAMES_MEDIA_TYPE: BINARY},
            },
            413: {"model": ErrorBody, "description": "Request body too large."},
            **SERVER_400,
            **errors(*auth_errors, 422),
        },
        summary="Several records at once, as frames",
    )
    guarded(
        "/routed_experts/ack",
        _with_limits(ack_records, request=ack_request_model(settings.max_batch)),
        methods=["POST"],
        response_class=JSONResponse,
        responses={
            200: {
                "description": "`acked`: records freed; `missing`: unknown rids (by rids); `unordered`: final "
                "records kept because their weight version is not an integer (by version).",
            },
            413: {"model": ErrorBody, "description": "Request body too large."},
            **SERVER_400,
            **errors(*auth_errors, 422),
        },
        summary="Acknowledge many records: by rids, or every final record older than a weight version",
    )
    guarded(
        "/routed_experts/{rid:path}",
        _with_limits(get_record, wait=wait),
        methods=["GET"],
        response_class=Response,
        responses=record_responses(auth_errors),
        summary="One record's routed experts",
    )
    guarded(
        "/routed_experts/{rid:path}",
        delete_record,
        methods=["DELETE"],
        status_code=204,
        response_class=Response,
        responses={
            204: {"description": "Deleted; the spool space is freed."},
            **SERVER_400,
            **errors(*auth_errors, 404, 422),
        },
        summary="Acknowledge a record: delete its files",
    )
    guarded(
        "/v1/engines",
        engines,
        methods=["GET"],
        response_model=Engines,
        responses=errors(*auth_errors, 422),
        summary="Engine budget and occupancy",
    )
    guarded(
        "/v1/node",
        node,
        methods=["GET"],
        response_class=Response,
        responses={
            200: {"description": "The node (boot id, machine id, mount namespace), the spool's paths and a probe."}
        },
        summary="Where this sidecar's spool is, for same-node reads",
    )
    guarded(
        "/v1/local_reads",
        local_reads,
        methods=["POST"],
        status_code=204,
        response_class=Response,
        responses={204: {"description": "Counted."}, **errors(*auth_errors, 422)},
        summary="Count records a client read straight from the spool",
    )
    app.add_api_route("/healthz", healthz, methods=["GET"], response_model=Health, summary="Liveness")
    app.add_api_route(
        "/readyz",
        readyz,
        methods=["GET"],
        response_model=Health,
        responses={503: {"model": ErrorBody, "description": "The spool index is not ready."}},
        summary="Readiness: the spool is indexed and watched",
    )
    any_char_rids(app)
    app.add_api_route(
        "/metrics",
        prometheus,
        methods=["GET"],
        response_class=Response,
        responses={200: {"description": "Prometheus text exposition.", "content": {"text/plain": {"schema": TEXT}}}},
        summary="Prometheus metrics (Contract 3)",
    )
    if token:
        app.add_api_route(
            "/openapi.json", openapi, methods=["GET"], include_in_schema=False, dependencies=[Security(authorized)]
        )


def create_app(settings: Settings, *, deadline_clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The sidecar app over `settings.spool_dir`; its store starts and stops with the app's lifespan.

    `deadline_clock` times every `wait` (GET, stream, batch): injectable so tests decide when a wait runs out."""
    spool = Spool(settings.spool_dir, create=False)  # made at startup: building an app touches no files
    store = Store(spool, settings, deadline_clock=deadline_clock)
    advert = SpoolAdvert(spool, settings.ttl_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        advert.start()
        try:
            yield
        finally:
            advert.stop()
            await store.stop()

    closed = {"openapi_url": None, "docs_url": None, "redoc_url": None} if settings.auth_token else {}
    app = SidecarApp(
        title="r3-sidecar",
        version="1",
        summary="Routed experts of MoE requests, served from the r3 spool (Contract 2).",
        lifespan=lifespan,
        **closed,
    )
    app.state.settings, app.state.store, app.state.metrics = settings, store, Metrics(store)
    app.state.advert = advert
    app.send_timeout_s = settings.send_timeout_s or None  # R3_SEND_TIMEOUT_S; 0 disables
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=64 * 1024 + settings.max_batch * (4 * MAX_RID_CHARS + 8))
    add_routes(app, settings)
    return app


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory service.server.api:app_from_env`: settings from `R3_*` variables."""
    from service.server.heap import keep_freed_chunks

    settings = Settings()
    keep_freed_chunks(settings.chunk_bytes)
    return create_app(settings)


__all__ = ["ApiError", "SpoolFormatError", "app_from_env", "create_app"]
