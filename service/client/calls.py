"""Every request the clients make, built once: what to send, when to retry, how a stream resumes. No I/O.

`RoutedExpertsClient` and `AsyncRoutedExpertsClient` differ only in their transport (service.client.transport);
each public method is a `Call` built here, sent with the shared `Retry` policy, and read by service.client.decoding.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from service.client.decoding import Frame, FrameDecoder, RoutedExperts
from service.client.errors import RESTARTED_DETAIL, ConnectionLost, RecordRestarted

__all__ = ["BatchItem", "BatchRid", "Call", "ClientConfig", "Layers", "Retry", "StreamState"]

# Transport failures worth another try: the request never reached a server, or the connection dropped.
# Timeouts on reads are not retried (the server is alive and slow; a retry would only double its load).
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
# A stream also resumes after sitting idle past its read timeout (a half-open connection looks the same).
STREAM_RETRYABLE = (*RETRYABLE, httpx.ReadTimeout)

Layers = Iterable[int] | str
"""Model layers to fetch: indices (each must be stored), or the server's text, ranges included: `"0-15"`."""


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One rid of `get_many` with its own token range `[start, end)` (multi-turn, resumed requests)."""

    rid: str
    start: int | None = None
    end: int | None = None


BatchRid = str | BatchItem | tuple[str, int | None, int | None] | dict[str, Any]
"""A rid, or a rid with a range: `BatchItem(rid, start, end)`, `(rid, start, end)` or `{"rid", "start", "end"}`."""


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request of the API: `wait` lengthens its read timeout; `stream` gives it the idle timeout."""

    method: str
    path: str
    rid: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    wait: float = 0
    stream: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json"} if self.body is not None else {}


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """What both transports need to know of the client: where, who, and how long to wait."""

    base_url: str
    headers: dict[str, str]
    timeout: float = 30.0
    connect_timeout: float = 5.0
    stream_idle_s: float = 120.0

    def read_timeout(self, call: Call) -> float:
        """Seconds a whole answer may take: the server may hold it for the call's `wait` first."""
        return self.timeout + call.wait

    def timeout_for(self, call: Call) -> httpx.Timeout:
        """Reads may block for `wait` seconds while the server waits; a stream may sit idle past that, up to
        `stream_idle_s`, while the engine prefills or pauses (then it reconnects)."""
        if call.stream:
            return httpx.Timeout(self.timeout, read=self.stream_idle_s + call.wait, connect=self.connect_timeout)
        return httpx.Timeout(self.read_timeout(call), connect=self.connect_timeout)

    def stream_args(self, call: Call) -> dict[str, Any]:
        """`httpx.Client.stream`'s and `httpx.AsyncClient.stream`'s arguments for a call (the two take the same)."""
        return {
            "method": call.method,
            "url": call.path,
            "params": call.params,
            "content": call.body,
            "headers": call.headers,
            "timeout": self.timeout_for(call),
        }

    @property
    def plain(self) -> bool:
        return self.base_url.startswith("http://")


def layers_param(layers: Layers) -> str:
    return layers if isinstance(layers, str) else ",".join(str(int(x)) for x in layers)


def record_path(rid: str) -> str:
    """Percent-encode every byte; a rid of dots alone goes as `%2E`s, since URL normalisation drops `.`/`..`."""
    encoded = quote(rid, safe="")
    if rid and set(rid) == {"."}:
        encoded = "%2E" * len(rid)
    return f"/routed_experts/{encoded}"


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
        params["layers"] = layers_param(layers)
    if wait:
        params["wait"] = str(wait)
    return params


def get_call(
    rid: str,
    fmt: str = "npy",
    start: int | None = None,
    end: int | None = None,
    layers: Layers | None = None,
    wait: float = 0,
    clamp: bool = False,
    allow_suspect: bool = False,
) -> Call:
    """`GET /routed_experts/<rid>` in any format; `allow_suspect`: a `suspect` record's rows too (`suspect=allow`)."""
    suspect = "allow" if allow_suspect else None
    params = _params(start=start, end=end, layers=layers, wait=wait, format=fmt, clamp=clamp or None, suspect=suspect)
    return Call("GET", record_path(rid), rid, params, wait=wait)


def batch_call(
    rids: Sequence[BatchRid], wait: float, layers: Layers | None, clamp: bool, allow_suspect: bool = False
) -> Call:
    """`POST /routed_experts/batch`: plain rids stay strings, ranged ones become objects."""
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
    if allow_suspect:
        body["suspect"] = "allow"
    return Call("POST", "/routed_experts/batch", None, body=orjson.dumps(body), wait=wait)


BatchKey = tuple[str | None, float, bool]
"""What calls must share to go in one batch request: the `layers` text, `wait` and `clamp`."""


def batch_key(call: Call) -> BatchKey | None:
    """What a `get_call` shares with the calls one batch request can carry with it (`layers`, `wait`,
    `clamp`), or None for a call a batch cannot answer the same way (not an `.npy` GET of a record)."""
    if call.method != "GET" or call.stream or call.rid is None or call.params.get("format") != "npy":
        return None
    if "suspect" in call.params:  # rare (an opt-in): such calls go alone rather than widen the key
        return None
    return call.params.get("layers"), call.wait, call.params.get("clamp") == "true"


def batch_item(call: Call) -> BatchItem:
    """A `get_call`'s rid and range as one rid of a batch."""
    start, end = call.params.get("start"), call.params.get("end")
    return BatchItem(call.rid or "", int(start) if start is not None else None, int(end) if end is not None else None)


def ack_call(rid: str) -> Call:
    return Call("DELETE", record_path(rid), rid)


def ack_many_call(rids: Sequence[str] | None, before_weight_version: int | str | None) -> Call:
    """`POST /routed_experts/ack`: a step's records by `rids`, or every final record older than a weight version."""
    if (rids is None) == (before_weight_version is None):
        raise ValueError("give exactly one of rids and before_weight_version")
    body = {"rids": list(rids)} if rids is not None else {"before_weight_version": before_weight_version}
    return Call("POST", "/routed_experts/ack", None, body=orjson.dumps(body))


def engines_call() -> Call:
    return Call("GET", "/v1/engines")


def engines_of(body: bytes | bytearray) -> list[dict[str, Any]]:
    return orjson.loads(body)["engines"]


def json_of(body: bytes | bytearray) -> dict[str, Any]:
    return orjson.loads(body)


def batch_of(frames: list[Frame]) -> list[Any]:
    """Each frame's record, or its error in its place (not raised)."""
    return [f.result() if f.status == 200 else f.error() for f in frames]


@dataclass(slots=True)
class Retry:
    """Connection failures are retried with full-jitter exponential backoff (spreads many trainers' retries
    after a sidecar restart); `delay(attempt)` says how long to sleep, or None when the retries are spent."""

    retries: int = 5
    base_s: float = 0.1
    cap_s: float = 2.0

    def delay(self, attempt: int) -> float | None:
        if attempt >= self.retries:
            return None
        return random.uniform(0, min(self.cap_s, self.base_s * (2**attempt)))


@dataclass(slots=True)
class StreamState:
    """One `stream()`'s progress across reconnects: each attempt asks from the next row, so no row is yielded
    twice or lost, and a resume that meets a recomputed record (another `created`) raises `RecordRestarted`."""

    rid: str
    start: int | None
    layers: str | None
    wait: float
    retry: Retry
    failures: int = 0
    created: float | None = None
    done: bool = False
    allow_suspect: bool = False

    def call(self) -> Call:
        suspect = "allow" if self.allow_suspect else None
        params = _params(start=self.start, layers=self.layers, wait=self.wait, stream="true", suspect=suspect)
        return Call("GET", record_path(self.rid), self.rid, params, wait=self.wait, stream=True)

    def on_frame(self, frame: Frame) -> RoutedExperts | None:
        """The block to yield for a frame (None for an empty frame that is not the last); raises the frame's error.

        The record's last frame is yielded even when it holds no rows (a record finalized, or aborted, after its
        last rows were sent): the writer's last append and its finalize are two metadata writes, so the sidecar
        may send the rows before it knows they are the last. Only that frame says the record is final and its
        status (`ok`, `aborted`), so a caller's last block always has `final` set."""
        self.failures = 0
        if frame.status != 200:
            raise frame.error()
        stamp = frame.header.get("created")
        if stamp is not None:
            if self.created is not None and self.created != stamp:
                raise RecordRestarted(RESTARTED_DETAIL, rid=frame.header.get("rid"), status=409, body=frame.header)
            self.created = stamp
        block = frame.result()
        self.done = block.final
        if not block.rows and not block.final:
            return None
        self.start = block.end
        return block

    def blocks(self, decoder: FrameDecoder, chunk: bytes) -> Iterator[RoutedExperts]:
        """The rows of each frame a chunk completes, each yielded before the next frame is read (an error frame
        raises after the rows before it), until the record's final frame (then `done`)."""
        for frame in decoder.feed(chunk):
            block = self.on_frame(frame)
            if block is not None:
                yield block
            if self.done:
                return

    def failed(self) -> float | None:
        """After a dropped stream: seconds to wait before resuming, or None when the retries are spent."""
        delay = self.retry.delay(self.failures)
        self.failures += 1
        return delay


def stream_ended(cfg: ClientConfig, state: StreamState) -> ConnectionLost:
    """A stream's body that ended before the record's final frame: a dropped connection, resumed like one."""
    url = cfg.base_url.rstrip("/") + record_path(state.rid)
    return ConnectionLost(f"{url}: the stream ended before the record was final", url=url, rid=state.rid)


def stream_state(
    rid: str, start: int | None, layers: Layers | None, wait: float, retry: Retry, allow_suspect: bool = False
) -> StreamState:
    layers_text = layers_param(layers) if layers is not None else None
    return StreamState(rid, start, layers_text, wait, retry, allow_suspect=allow_suspect)
