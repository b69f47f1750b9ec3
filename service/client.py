"""Trainer-side client for the sidecar's HTTP API (DESIGN.md, Contract 2).

`RoutedExpertsClient(url).get(rid).array` is what a trainer calls where it used to decode
`meta_info["routed_experts"]`: the rows arrive as compact binary and are parsed without an extra copy.
The sync and async clients share every pure piece (errors, npy and frame parsing); only their I/O differs.
"""

from __future__ import annotations

import asyncio
import io
import random
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote

import httpx
import numpy as np
import orjson
from numpy.lib import format as npy_format

from service import frames as wire
from service.connections import Connections, fill
from service.responses import sidecar_base

if TYPE_CHECKING:
    import torch

__all__ = [
    "AsyncRoutedExpertsClient",
    "BadRequest",
    "BatchItem",
    "FrameDecoder",
    "NotReady",
    "R3Error",
    "RangeNotSatisfiable",
    "RecordGone",
    "RecordNotFound",
    "RoutedExperts",
    "RoutedExpertsClient",
    "ServerError",
    "Unauthorized",
    "parse_npy",
]

_REFS = ("RoutedExpertsRef", "fetch_many", "afetch_many", "SidecarPool", "AsyncSidecarPool")


def __getattr__(name: str) -> Any:
    """Contract 4's names live in `service.refs` (built on this module); importable from here as DESIGN.md says."""
    if name in _REFS:
        from service import refs

        return getattr(refs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Transport failures worth another try: the request never reached a server, or the connection dropped.
# Timeouts on reads are not retried (the server is alive and slow; a retry would only double its load).
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
# A stream also resumes after sitting idle past its read timeout (a half-open connection looks the same).
_STREAM_RETRYABLE = (*_RETRYABLE, httpx.ReadTimeout)

T = TypeVar("T")


# ---- result -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """Rows of one record: `array[i, j, :]` are the experts of token `start + i` at model layer `layers[j]`."""

    rid: str
    array: np.ndarray
    start: int
    prompt_len: int
    layers: tuple[int, ...]
    final: bool
    dtype: str
    status: str = "ok"  # the record's status: `aborted` rows are the request's rows up to its abort
    num_hidden_layers: int | None = None  # the model's layer count, when the record says it
    clamped: bool = False  # `clamp=True` cut the range asked for to the rows the record holds
    weight_version: str | int | None = None  # the engine's weight version that routed the last row
    weight_versions: tuple[tuple[int, str | int], ...] = ()  # (position, version) when the rows span an update

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def end(self) -> int:
        """One past the last token position held."""
        return self.start + self.rows

    def to_torch(self) -> torch.Tensor:
        """The rows as a torch tensor sharing this array's memory (`torch.from_numpy`, no copy)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is optional for trainers that use numpy
            raise R3Error("torch is not importable; use .array (numpy)") from exc
        return torch.from_numpy(self.array)

    def to_sglang_layout(self, num_hidden_layers: int | None = None) -> np.ndarray:
        """`(rows, num_hidden_layers, topk)` int32 with zeros for dense layers: SGLang's inline layout.

        For code written against `meta_info["routed_experts"]`: `base64(to_sglang_layout().tobytes())` is the
        server's `format=sglang_b64` body for the same rows. `num_hidden_layers` defaults to the record's
        (records of older engine plugins do not carry it: pass the model's `num_hidden_layers` then).
        """
        width = self.num_hidden_layers if num_hidden_layers is None else num_hidden_layers
        if width is None:
            raise R3Error(
                "this record does not say the model's num_hidden_layers (an older engine plugin wrote it): "
                "pass to_sglang_layout(num_hidden_layers=hf_config.num_hidden_layers)",
                rid=self.rid,
            )
        if self.num_hidden_layers is not None and width != self.num_hidden_layers:
            raise R3Error(f"num_hidden_layers={width}; the record's model has {self.num_hidden_layers}", rid=self.rid)
        if self.layers and max(self.layers) >= width:
            raise R3Error(f"layer {max(self.layers)} does not fit num_hidden_layers={width}", rid=self.rid)
        out = np.zeros((self.rows, width, self.array.shape[2]), dtype=np.int32)
        out[:, list(self.layers), :] = self.array
        return out


# ---- errors -------------------------------------------------------------------------------------------


class R3Error(Exception):
    """Any failure the sidecar reported; `status` is the HTTP status, `detail` the server's explanation."""

    status: int | None = None

    def __init__(self, detail: str, *, rid: str | None = None, status: int | None = None, body: Any = None) -> None:
        super().__init__(f"{rid}: {detail}" if rid else detail)
        self.detail = detail
        self.rid = rid
        self.body = body
        if status is not None:
            self.status = status


class NotReady(R3Error):
    """202: the record exists but is not final yet; `rows` says how many rows it has so far (also in the message)."""

    status = 202

    def __init__(self, detail: str, *, rid: str | None = None, status: int | None = None, body: Any = None) -> None:
        rows = body.get("rows") if isinstance(body, dict) else None
        if rows is not None and str(rows) not in detail:  # an older server's 202 carries no detail
            detail = f"record is not final yet: {rows} rows so far ({detail})"
        super().__init__(detail, rid=rid, status=status, body=body)

    @property
    def rows(self) -> int | None:
        return self.body.get("rows") if isinstance(self.body, dict) else None


class Unauthorized(R3Error):
    """401: missing or wrong bearer token."""

    status = 401


class RecordNotFound(R3Error):
    """404: no record with this rid (after waiting, when `wait` was given)."""

    status = 404


class RecordGone(R3Error):
    """410: the record ended in error, is corrupt, or has expired (an aborted record is served: `status`)."""

    status = 410


class RangeNotSatisfiable(R3Error):
    """416: `start`/`end` outside the rows the record holds."""

    status = 416


class RecordRestarted(R3Error):
    """409: the record started over while it was being streamed (its request was retracted and recomputed).

    Rows already yielded belong to the abandoned attempt: discard them and read the record again.
    """

    status = 409


class BadRequest(R3Error):
    """422 or another 4xx: the request itself was malformed."""


class ServerError(R3Error):
    """5xx: the sidecar failed."""


RESTARTED_DETAIL = "the record started over while it was streamed (its request was retracted): read it again"

_BY_STATUS: dict[int, type[R3Error]] = {
    202: NotReady,
    401: Unauthorized,
    404: RecordNotFound,
    409: RecordRestarted,
    410: RecordGone,
    416: RangeNotSatisfiable,
}


def error_for(status: int, body: Any, rid: str | None = None) -> R3Error:
    """The exception for an HTTP status and its (JSON) body; `detail` falls back to the body's text."""
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or f"HTTP {status}"
    else:
        detail = str(body or "")[:500] or f"HTTP {status}"
    if not isinstance(detail, str):
        detail = orjson.dumps(detail).decode()
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else BadRequest)
    return cls(detail, rid=rid, status=status, body=body)


def _json_or_text(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")


# ---- parsing (pure) -----------------------------------------------------------------------------------


def parse_npy(buf: bytes | bytearray | memoryview) -> np.ndarray:
    """An array over `buf`'s own memory: `numpy.lib.format` reads the header, `np.frombuffer` the rest (no copy)."""
    view = memoryview(buf)
    major, _ = npy_format.read_magic(io.BytesIO(view[:8]))
    if major not in (1, 2):
        raise ValueError(f"unsupported .npy version {major}")
    width = 2 if major == 1 else 4
    (hlen,) = struct.unpack_from("<H" if major == 1 else "<I", view, 8)
    offset = 8 + width + hlen
    read_header = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(io.BytesIO(view[8:offset]), max_header_size=max(10_000, hlen + 1))
    if fortran_order:
        raise ValueError("Fortran-ordered .npy is not a routed-experts payload")
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)


def _meta_from_headers(rid: str, headers: httpx.Headers) -> dict[str, Any]:
    layers = headers.get("x-r3-layers", "")
    return {
        "rid": rid,
        "start": int(headers.get("x-r3-start", "0")),
        "prompt_len": int(headers.get("x-r3-prompt-len", "0")),
        "layers": tuple(int(x) for x in layers.split(",") if x.strip()),
        "final": headers.get("x-r3-final", "true").lower() in ("1", "true"),
        "dtype": headers.get("x-r3-dtype", ""),
        "status": headers.get("x-r3-status", "ok"),
        "num_hidden_layers": int(n) if (n := headers.get("x-r3-num-hidden-layers")) else None,
        "clamped": headers.get("x-r3-clamped", "false").lower() == "true",
        "weight_version": unquote(v) if (v := headers.get("x-r3-weight-version")) is not None else None,
        "weight_versions": tuple(
            (int(pos), unquote(ver))
            for pos, _, ver in (p.partition(":") for p in headers.get("x-r3-weight-versions", "").split(",") if p)
        ),
    }


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of `application/vnd.r3.frames`: its JSON header and its payload bytes (writable)."""

    header: dict[str, Any]
    payload: bytearray

    @property
    def status(self) -> int:
        return int(self.header.get("status", 200))

    def result(self, prompt_len: int = 0) -> RoutedExperts:
        """The frame's rows (status 200 only); the array views the payload, no copy."""
        h = self.header
        shape = tuple(int(x) for x in h["shape"])
        array = np.frombuffer(self.payload, dtype=np.dtype(h["dtype"])).reshape(shape)
        return RoutedExperts(
            rid=h["rid"],
            array=array,
            start=int(h.get("start", 0)),
            prompt_len=int(h.get("prompt_len", prompt_len) or prompt_len),
            layers=tuple(int(x) for x in h.get("layers", ())),
            final=bool(h.get("final", True)),
            dtype=h["dtype"],
            status=str(h.get("record_status") or "ok"),
            num_hidden_layers=h.get("num_hidden_layers"),
            clamped=bool(h.get("clamped", False)),
            weight_version=h.get("weight_version"),
            weight_versions=tuple((int(p), v) for p, v in h.get("weight_versions", ())),
        )

    def error(self) -> R3Error:
        return error_for(self.status, self.header, rid=self.header.get("rid"))


class FrameDecoder:
    """`service.frames.FrameDecoder` yielding client `Frame`s; a stream that is not frames raises `R3Error`."""

    def __init__(self) -> None:
        self._decoder = wire.FrameDecoder()

    def feed(self, chunk: bytes) -> list[Frame]:
        try:
            return [Frame(header, payload) for header, payload in self._decoder.feed(chunk)]
        except wire.FrameError as exc:
            raise R3Error(str(exc)) from None

    @property
    def pending(self) -> bool:
        """Whether a partial frame is buffered (the stream ended mid-frame when this is true at EOF)."""
        return self._decoder.pending


def read_frames(body: io.RawIOBase | Any) -> list[Frame]:
    """Every frame of a body read with `readinto`: each payload lands in its own buffer with one copy."""
    try:
        decoded = wire.read_frames(lambda buf: fill(body, buf))
    except wire.FrameTruncated:
        raise httpx.RemoteProtocolError("batch response ended inside a frame") from None
    except wire.FrameError as exc:
        raise R3Error(str(exc)) from None
    return [Frame(header, payload) for header, payload in decoded]


Layers = Iterable[int] | str
"""Model layers to fetch: indices (each must be stored), or the server's text, ranges included: `"0-15"`."""


def _layers_param(layers: Layers) -> str:
    return layers if isinstance(layers, str) else ",".join(str(int(x)) for x in layers)


def _params(
    *,
    start: int | None = None,
    end: int | None = None,
    layers: Layers | None = None,
    wait: float = 0,
    **extra: Any,
) -> dict[str, str]:
    params = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in extra.items() if v is not None}
    if start is not None:
        params["start"] = str(start)
    if end is not None:
        params["end"] = str(end)
    if layers is not None:
        params["layers"] = _layers_param(layers)
    if wait:
        params["wait"] = str(wait)
    return params


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One rid of `get_many` with its own token range `[start, end)` (multi-turn, resumed requests)."""

    rid: str
    start: int | None = None
    end: int | None = None


BatchRid = str | BatchItem | tuple[str, int | None, int | None] | dict[str, Any]
"""A rid, or a rid with a range: `BatchItem(rid, start, end)`, `(rid, start, end)` or `{"rid", "start", "end"}`."""


def _batch_body(rids: Sequence[BatchRid], wait: float, layers: Layers | None, clamp: bool) -> dict[str, Any]:
    """The JSON of `POST /routed_experts/batch`: plain rids stay strings, ranged ones become objects."""
    items: list[Any] = []
    for item in rids:
        if isinstance(item, str):
            items.append(item)
            continue
        if isinstance(item, dict):
            item = BatchItem(**item)
        elif isinstance(item, tuple):
            item = BatchItem(*item)
        ranged = {"rid": item.rid, "start": item.start, "end": item.end}
        items.append({k: v for k, v in ranged.items() if v is not None})
    body: dict[str, Any] = {"rids": items, "wait": wait}
    if layers is not None:
        body["layers"] = layers if isinstance(layers, str) else [int(x) for x in layers]
    if clamp:
        body["clamp"] = True
    return body


def _backoff(attempt: int, base: float, cap: float) -> float:
    """Full-jitter exponential backoff: spreads many trainers' retries after a sidecar restart."""
    return random.uniform(0, min(cap, base * (2**attempt)))


# ---- clients ------------------------------------------------------------------------------------------


class _Base:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retries: int = 5,
        backoff_s: float = 0.1,
        backoff_max_s: float = 2.0,
        stream_idle_s: float = 120.0,
    ) -> None:
        self.base_url = sidecar_base(base_url)  # a pointer (…/routed_experts/<rid>) names its sidecar too
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stream_idle_s = stream_idle_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _timeout(self, wait: float = 0) -> httpx.Timeout:
        """Reads may legitimately block for `wait` seconds while the server waits for the record."""
        return httpx.Timeout(self.timeout + wait, connect=self.connect_timeout)

    def _stream_timeout(self, wait: float = 0) -> httpx.Timeout:
        """A stream may sit idle while the engine prefills or pauses; past `stream_idle_s` it reconnects."""
        return httpx.Timeout(self.timeout, read=self.stream_idle_s + wait, connect=self.connect_timeout)

    @staticmethod
    def _path(rid: str) -> str:
        """Percent-encode every byte; a rid of dots alone goes as `%2E`s, since URL normalisation drops `.`/`..`."""
        encoded = quote(rid, safe="")
        if rid and set(rid) == {"."}:
            encoded = "%2E" * len(rid)
        return f"/routed_experts/{encoded}"


class RoutedExpertsClient(_Base):
    """Blocking client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str, *, transport: httpx.BaseTransport | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, transport=transport)
        # record bodies are read with http.client over plain http (one copy; see service.connections);
        # httpx serves the rest, https and custom transports
        plain = transport is None and self.base_url.startswith("http://")
        self._conns = Connections(self.base_url, self._headers, self.connect_timeout) if plain else None

    def __enter__(self) -> RoutedExpertsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        if self._conns is not None:
            self._conns.close()

    def _retry(self, call: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return call()
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                time.sleep(_backoff(attempt, self.backoff_s, self.backoff_max_s))
        raise AssertionError("unreachable")

    def _fetch(self, method: str, url: str, rid: str | None, wait: float = 0, **kwargs: Any) -> _Reply:
        """One request with its body read into a writable buffer (sized from Content-Length when given)."""

        def call() -> _Reply:
            if method == "GET" and self._conns is not None:
                return _Reply(*self._conns.get(url, kwargs.get("params") or {}, self.timeout + wait))
            with self._http.stream(method, url, timeout=self._timeout(wait), **kwargs) as resp:
                return _Reply(resp.status_code, resp.headers, _read_body(resp.headers, resp.iter_bytes()))

        return self._retry(call).checked(rid)

    def get(
        self,
        rid: str,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
    ) -> RoutedExperts:
        """Rows `[start, end)` of a record (all by default); `wait` seconds for it to exist and be final.

        `layers`: model layer indices, or a range such as `"0-15"` (a pipeline stage: the MoE layers inside).
        `clamp=True`: a range past the record's rows returns the rows that exist (`.clamped` says so), not a 416.
        """
        params = _params(start=start, end=end, layers=layers, wait=wait, format="npy", clamp=clamp or None)
        resp = self._fetch("GET", self._path(rid), rid, wait, params=params)
        return _result(rid, resp)

    def fetch_bytes(self, rid: str, fmt: str = "npy", **kwargs: Any) -> bytes:
        """The body in any of the server's formats (`npy`, `raw`, `json`, `sglang_b64`) as bytes."""
        wait = kwargs.get("wait", 0)
        resp = self._fetch("GET", self._path(rid), rid, wait, params=_params(format=fmt, **kwargs))
        return bytes(resp.body)

    def get_many(
        self, rids: Sequence[BatchRid], wait: float = 0, layers: Layers | None = None, clamp: bool = False
    ) -> list[RoutedExperts | R3Error]:
        """One round trip for many records; results in request order, each a record or its error (not raised).

        Each rid may carry its own range: `BatchItem(rid, start, end)` (or a `(rid, start, end)` tuple).
        """
        body = _batch_body(rids, wait, layers, clamp)

        def call() -> list[Frame]:
            if self._conns is not None:
                return self._get_many_direct(body, wait)
            decoder = FrameDecoder()
            frames: list[Frame] = []
            with self._http.stream(
                "POST",
                "/routed_experts/batch",
                content=orjson.dumps(body),
                timeout=self._timeout(wait),
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise error_for(resp.status_code, _json_or_text(resp.content))
                for chunk in resp.iter_bytes():
                    frames += decoder.feed(chunk)
            if decoder.pending:
                raise httpx.RemoteProtocolError("batch response ended inside a frame")
            return frames

        return [f.result() if f.status == 200 else f.error() for f in self._retry(call)]

    def _get_many_direct(self, body: dict[str, Any], wait: float) -> list[Frame]:
        assert self._conns is not None
        with self._conns.request(
            "POST",
            "/routed_experts/batch",
            body=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
            timeout=self.timeout + wait,
        ) as resp:
            if resp.status != 200:
                raise error_for(resp.status, _json_or_text(resp.read()))
            return read_frames(resp)

    def stream(
        self, rid: str, start: int | None = None, layers: Layers | None = None, wait: float = 0
    ) -> Iterator[RoutedExperts]:
        """Yield blocks of rows as the engine produces them, until the record is final.

        A dropped connection is resumed from the next row (`start=`), so no row is yielded twice or lost.
        """
        layer_list = _layers_param(layers) if layers is not None else None
        next_start = start
        failures = 0
        created: list[float] = []
        while True:
            params = _params(start=next_start, layers=layer_list, wait=wait, stream="true")
            decoder = FrameDecoder()
            try:
                with self._http.stream(
                    "GET", self._path(rid), params=params, timeout=self._stream_timeout(wait)
                ) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        raise error_for(resp.status_code, _json_or_text(resp.content), rid)
                    for chunk in resp.iter_bytes():
                        for frame in decoder.feed(chunk):
                            failures = 0
                            block = _stream_block(frame, created)
                            if block.rows:
                                next_start = block.end
                                yield block
                            if block.final:
                                return
                raise httpx.RemoteProtocolError("stream ended before the record was final")
            except _STREAM_RETRYABLE:
                if failures >= self.retries:
                    raise
                time.sleep(_backoff(failures, self.backoff_s, self.backoff_max_s))
                failures += 1

    def ack(self, rid: str, missing_ok: bool = False) -> bool:
        """Tell the sidecar the trainer has the rows (`DELETE`): frees the spool. False when already gone."""
        try:
            self._fetch("DELETE", self._path(rid), rid)
        except RecordNotFound:
            if missing_ok:
                return False
            raise
        return True

    def ack_many(
        self, rids: Sequence[str] | None = None, *, before_weight_version: int | str | None = None
    ) -> dict[str, Any]:
        """Free a step's records in one call (`POST /routed_experts/ack`): by `rids`, or every final record whose
        weight version is an integer below `before_weight_version`. Returns the sidecar's counts."""
        body = _ack_body(rids, before_weight_version)
        return orjson.loads(self._fetch("POST", "/routed_experts/ack", None, json=body).body)

    def engines(self) -> list[dict[str, Any]]:
        """Every engine's budget and occupancy report (`GET /v1/engines`, Contract 1 engine files)."""
        return orjson.loads(self._fetch("GET", "/v1/engines", None).body)["engines"]


class AsyncRoutedExpertsClient(_Base):
    """The same API for asyncio trainers and rollout managers."""

    def __init__(self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, transport=transport)

    async def __aenter__(self) -> AsyncRoutedExpertsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return await call()
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(_backoff(attempt, self.backoff_s, self.backoff_max_s))
        raise AssertionError("unreachable")

    async def _fetch(self, method: str, url: str, rid: str | None, wait: float = 0, **kwargs: Any) -> _Reply:
        async def call() -> _Reply:
            async with self._http.stream(method, url, timeout=self._timeout(wait), **kwargs) as resp:
                return _Reply(resp.status_code, resp.headers, await _aread_body(resp.headers, resp.aiter_bytes()))

        return (await self._retry(call)).checked(rid)

    async def get(
        self,
        rid: str,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
    ) -> RoutedExperts:
        params = _params(start=start, end=end, layers=layers, wait=wait, format="npy", clamp=clamp or None)
        return _result(rid, await self._fetch("GET", self._path(rid), rid, wait, params=params))

    async def get_many(
        self, rids: Sequence[BatchRid], wait: float = 0, layers: Layers | None = None, clamp: bool = False
    ) -> list[RoutedExperts | R3Error]:
        body = _batch_body(rids, wait, layers, clamp)

        async def call() -> list[Frame]:
            decoder = FrameDecoder()
            frames: list[Frame] = []
            async with self._http.stream(
                "POST",
                "/routed_experts/batch",
                content=orjson.dumps(body),
                timeout=self._timeout(wait),
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise error_for(resp.status_code, _json_or_text(resp.content))
                async for chunk in resp.aiter_bytes():
                    frames += decoder.feed(chunk)
            if decoder.pending:
                raise httpx.RemoteProtocolError("batch response ended inside a frame")
            return frames

        return [f.result() if f.status == 200 else f.error() for f in await self._retry(call)]

    async def stream(
        self, rid: str, start: int | None = None, layers: Layers | None = None, wait: float = 0
    ) -> AsyncIterator[RoutedExperts]:
        layer_list = _layers_param(layers) if layers is not None else None
        next_start = start
        failures = 0
        created: list[float] = []
        while True:
            params = _params(start=next_start, layers=layer_list, wait=wait, stream="true")
            decoder = FrameDecoder()
            try:
                async with self._http.stream(
                    "GET", self._path(rid), params=params, timeout=self._stream_timeout(wait)
                ) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        raise error_for(resp.status_code, _json_or_text(resp.content), rid)
                    async for chunk in resp.aiter_bytes():
                        for frame in decoder.feed(chunk):
                            failures = 0
                            block = _stream_block(frame, created)
                            if block.rows:
                                next_start = block.end
                                yield block
                            if block.final:
                                return
                raise httpx.RemoteProtocolError("stream ended before the record was final")
            except _STREAM_RETRYABLE:
                if failures >= self.retries:
                    raise
                await asyncio.sleep(_backoff(failures, self.backoff_s, self.backoff_max_s))
                failures += 1

    async def ack(self, rid: str, missing_ok: bool = False) -> bool:
        try:
            await self._fetch("DELETE", self._path(rid), rid)
        except RecordNotFound:
            if missing_ok:
                return False
            raise
        return True

    async def ack_many(
        self, rids: Sequence[str] | None = None, *, before_weight_version: int | str | None = None
    ) -> dict[str, Any]:
        body = _ack_body(rids, before_weight_version)
        return orjson.loads((await self._fetch("POST", "/routed_experts/ack", None, json=body)).body)

    async def engines(self) -> list[dict[str, Any]]:
        return orjson.loads((await self._fetch("GET", "/v1/engines", None)).body)["engines"]


def _ack_body(rids: Sequence[str] | None, before_weight_version: int | str | None) -> dict[str, Any]:
    if (rids is None) == (before_weight_version is None):
        raise ValueError("give exactly one of rids and before_weight_version")
    return {"rids": list(rids)} if rids is not None else {"before_weight_version": before_weight_version}


# ---- shared response handling ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reply:
    """A fully read response: status, headers, and the body in a writable buffer."""

    status: int
    headers: httpx.Headers
    body: bytearray

    def checked(self, rid: str | None) -> _Reply:
        """Self on a 2xx with content; else the matching `R3Error` (202 means not final yet)."""
        if self.status >= 300 or self.status == 202:
            raise error_for(self.status, _json_or_text(bytes(self.body)), rid)
        return self


def _result(rid: str, resp: _Reply) -> RoutedExperts:
    array = parse_npy(resp.body)
    meta = _meta_from_headers(rid, resp.headers)
    return RoutedExperts(array=array, **{**meta, "dtype": meta["dtype"] or array.dtype.name})


def _stream_block(frame: Frame, created: list[float]) -> RoutedExperts:
    """A stream frame's rows; raises its error, or `RecordRestarted` when a resumed stream meets a new record.

    `created` holds the creation time of the record this stream began on: a resume after a dropped
    connection must not splice a recomputed record's rows onto the old ones.
    """
    if frame.status != 200:
        raise frame.error()
    stamp = frame.header.get("created")
    if stamp is not None:
        if created and created[0] != stamp:
            raise RecordRestarted(RESTARTED_DETAIL, rid=frame.header.get("rid"), status=409, body=frame.header)
        created[:1] = [stamp]
    return frame.result()


def _body_buffer(headers: httpx.Headers) -> bytearray:
    length = headers.get("content-length")
    return bytearray(int(length)) if length and length.isdigit() else bytearray()


def _read_body(headers: httpx.Headers, chunks: Iterable[bytes]) -> bytearray:
    """Read the body into one writable buffer: arrays over it need no copy and torch accepts them."""
    buf = _body_buffer(headers)
    sized, filled = bool(buf), 0
    for chunk in chunks:
        if sized and filled + len(chunk) <= len(buf):
            buf[filled : filled + len(chunk)] = chunk
        else:
            sized = False
            del buf[filled:]
            buf += chunk
        filled += len(chunk)
    del buf[filled:]
    return buf


async def _aread_body(headers: httpx.Headers, chunks: AsyncIterator[bytes]) -> bytearray:
    buf = _body_buffer(headers)
    sized, filled = bool(buf), 0
    async for chunk in chunks:
        if sized and filled + len(chunk) <= len(buf):
            buf[filled : filled + len(chunk)] = chunk
        else:
            sized = False
            del buf[filled:]
            buf += chunk
        filled += len(chunk)
    del buf[filled:]
    return buf
