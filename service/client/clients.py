"""The blocking and the asyncio sidecar clients: the same methods, one implementation, two transports.

Each method is a `Call` built in service.client.calls, sent under the shared retry policy through its transport
(service.client.transport), and read by service.client.decoding. Import them from `service.client`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import httpx

from service.client import calls as req
from service.client.calls import BatchRid, Call, ClientConfig, Layers, Retry
from service.client.coalesce import Coalescer
from service.client.decoding import FrameDecoder, RoutedExperts, record_of
from service.client.engine_responses import sidecar_base
from service.client.errors import R3Error, RecordNotFound
from service.client.local.reads import LocalReads, as_items, layers_text, merged
from service.client.local.spool import Allocator
from service.client.transport import AsyncTransport, SyncTransport

__all__ = ["AsyncRoutedExpertsClient", "RoutedExpertsClient"]

T = TypeVar("T")


class _Base:
    """Configuration both clients share; `base_url` may be a sidecar's base URL or a pointer into it."""

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
        local_reads: bool | None = None,
        local_view: bool = False,
        local_buffers: Allocator | None = None,
    ) -> None:
        """`local_reads`: read final records straight from the spool when the sidecar is on this node (default:
        `R3_LOCAL_READS`, on); `local_view`: those reads as read-only arrays over the spool file, no copy;
        `local_buffers(n)`: where their rows land (e.g. `service.client.pinned_buffers()` for GPU-bound rows)."""
        self._local_args = {"enabled": local_reads, "view": local_view, "alloc": local_buffers}
        self.base_url = sidecar_base(base_url)  # a pointer (…/routed_experts/<rid>) names its sidecar too
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.stream_idle_s = stream_idle_s
        self._retry = Retry(retries, backoff_s, backoff_max_s)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._config = ClientConfig(self.base_url, headers, timeout, connect_timeout, stream_idle_s)


class RoutedExpertsClient(_Base):
    """Blocking client. Use as a context manager, or call `close()`."""

    def __init__(self, base_url: str, *, transport: httpx.BaseTransport | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._io = SyncTransport(self._config, transport)
        self.local = LocalReads(self._io.direct, self.timeout, **self._local_args)

    def __enter__(self) -> RoutedExpertsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.local.close()
        self._io.close()

    @property
    def _conns(self) -> Any:
        """The plain-http body reader, None when httpx serves every request (https, a custom transport)."""
        return self._io.direct

    def _run(self, send: Callable[[Call], T], call: Call) -> T:
        attempt = 0
        while True:
            try:
                return send(call)
            except req.RETRYABLE:
                delay = self._retry.delay(attempt)
                if delay is None:
                    raise
                time.sleep(delay)
                attempt += 1

    def _body(self, call: Call) -> bytearray:
        return self._run(self._io.send, call).checked(call.rid).body

    def get(
        self,
        rid: str,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> RoutedExperts:
        """Rows `[start, end)` of a record (all by default); `wait` seconds for it to exist and be final.

        `layers`: model layer indices, or a range such as `"0-15"` (a pipeline stage: the MoE layers inside).
        `clamp=True`: a range past the record's rows returns the rows that exist (`.clamped` says so), not a 416.
        `allow_suspect=True`: the rows of a record the engine's row check marked `suspect` (else `SuspectRows`).
        """
        call = req.get_call(rid, "npy", start, end, layers, wait, clamp, allow_suspect)
        local = self.local.read(call)
        if local is not None:
            return local
        return record_of(call.rid, self._run(self._io.send, call).checked(call.rid))

    def fetch_bytes(
        self,
        rid: str,
        fmt: str = "npy",
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> bytes:
        """The body in any of the server's formats (`npy`, `raw`, `json`, `sglang_b64`) as bytes."""
        return bytes(self._body(req.get_call(rid, fmt, start, end, layers, wait, clamp, allow_suspect)))

    def get_many(
        self,
        rids: Sequence[BatchRid],
        wait: float = 0,
        layers: Layers | None = None,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> list[RoutedExperts | R3Error]:
        """One round trip for many records; results in request order, each a record or its error (not raised).

        Each rid may carry its own range: `BatchItem(rid, start, end)` (or a `(rid, start, end)` tuple).
        """
        items = as_items(rids)
        local = self.local.read_many(items, layers_text(layers), clamp)
        rest = [item for item, got in zip(items, local, strict=True) if got is None]
        remote = (
            req.batch_of(self._run(self._io.frames, req.batch_call(rest, wait, layers, clamp, allow_suspect)))
            if rest
            else []
        )
        return merged(local, remote)

    def stream(
        self,
        rid: str,
        start: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        allow_suspect: bool = False,
    ) -> Iterator[RoutedExperts]:
        """Yield blocks of rows as the engine produces them, until the record is final.

        A dropped connection is resumed from the next row (`start=`), so no row is yielded twice or lost.
        """
        state = req.stream_state(rid, start, layers, wait, self._retry, allow_suspect)
        while True:
            decoder = FrameDecoder()
            try:
                with self._io.chunks(state.call()) as chunks:
                    for chunk in chunks:
                        yield from state.blocks(decoder, chunk)
                        if state.done:
                            return
                raise req.stream_ended(self._config, state)
            except req.STREAM_RETRYABLE:
                delay = state.failed()
                if delay is None:
                    raise
                time.sleep(delay)

    def ack(self, rid: str, missing_ok: bool = False) -> bool:
        """Tell the sidecar the trainer has the rows (`DELETE`): frees the spool. False when already gone."""
        try:
            self._body(req.ack_call(rid))
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
        return req.json_of(self._body(req.ack_many_call(rids, before_weight_version)))

    def engines(self) -> list[dict[str, Any]]:
        """Every engine's budget and occupancy report (`GET /v1/engines`, Contract 1 engine files)."""
        return req.engines_of(self._body(req.engines_call()))


class AsyncRoutedExpertsClient(_Base):
    """The same API for asyncio trainers and rollout managers; no method blocks the event loop.

    Over plain http, whole bodies are read on the client's threads (`threads` at most at once, default 8: more
    threads contend for the GIL with the loop; a `wait` holds its thread, so many long waits belong in one
    `get_many` / `afetch_many`). Concurrent `get`s go as one batch request (`service.client.coalesce`) unless
    `coalesce=False`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        threads: int = 8,
        coalesce: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_url, **kwargs)
        self._io = AsyncTransport(self._config, transport, threads=threads)
        self.local = LocalReads(self._io.direct, self.timeout, **self._local_args)
        self._together = Coalescer(lambda call: self._run(self._io.frames, call)) if coalesce else None

    async def __aenter__(self) -> AsyncRoutedExpertsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.local.on:
            await self._io.off_loop(self.local.close)
        await self._io.aclose()

    async def _run(self, send: Callable[[Call], Awaitable[T]], call: Call) -> T:
        attempt = 0
        while True:
            try:
                return await send(call)
            except req.RETRYABLE:
                delay = self._retry.delay(attempt)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                attempt += 1

    async def _body(self, call: Call) -> bytearray:
        return (await self._run(self._io.send, call)).checked(call.rid).body

    async def get(
        self,
        rid: str,
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> RoutedExperts:
        """`RoutedExpertsClient.get`. Calls made before the loop next runs, with the same `layers`, `wait` and
        `clamp`, go as one batch request (`service.client.coalesce`); each still gets its own rows or error."""
        call = req.get_call(rid, "npy", start, end, layers, wait, clamp, allow_suspect)
        if self.local.on:
            local = await self._io.off_loop(self.local.read, call)
            if local is not None:
                return local
        frame = await self._together.frame(call) if self._together is not None else None
        if frame is not None:
            if frame.status != 200:
                raise frame.error()
            return frame.result()
        return record_of(call.rid, (await self._run(self._io.send, call)).checked(call.rid))

    async def fetch_bytes(
        self,
        rid: str,
        fmt: str = "npy",
        start: int | None = None,
        end: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> bytes:
        """`RoutedExpertsClient.fetch_bytes`."""
        return bytes(await self._body(req.get_call(rid, fmt, start, end, layers, wait, clamp, allow_suspect)))

    async def get_many(
        self,
        rids: Sequence[BatchRid],
        wait: float = 0,
        layers: Layers | None = None,
        clamp: bool = False,
        allow_suspect: bool = False,
    ) -> list[RoutedExperts | R3Error]:
        """`RoutedExpertsClient.get_many`."""
        items = as_items(rids)
        local: list[RoutedExperts | None] = [None] * len(items)
        if self.local.on:
            local = await self._io.off_loop(self.local.read_many, items, layers_text(layers), clamp)
        rest = [item for item, got in zip(items, local, strict=True) if got is None]
        call = req.batch_call(rest, wait, layers, clamp, allow_suspect)
        return merged(local, req.batch_of(await self._run(self._io.frames, call)) if rest else [])

    async def stream(
        self,
        rid: str,
        start: int | None = None,
        layers: Layers | None = None,
        wait: float = 0,
        allow_suspect: bool = False,
    ) -> AsyncIterator[RoutedExperts]:
        """`RoutedExpertsClient.stream`, as an async iterator."""
        state = req.stream_state(rid, start, layers, wait, self._retry, allow_suspect)
        while True:
            decoder = FrameDecoder()
            try:
                async with self._io.chunks(state.call()) as chunks:
                    async for chunk in chunks:
                        for block in state.blocks(decoder, chunk):
                            yield block
                        if state.done:
                            return
                raise req.stream_ended(self._config, state)
            except req.STREAM_RETRYABLE:
                delay = state.failed()
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    async def ack(self, rid: str, missing_ok: bool = False) -> bool:
        """`RoutedExpertsClient.ack`."""
        try:
            await self._body(req.ack_call(rid))
        except RecordNotFound:
            if missing_ok:
                return False
            raise
        return True

    async def ack_many(
        self, rids: Sequence[str] | None = None, *, before_weight_version: int | str | None = None
    ) -> dict[str, Any]:
        """`RoutedExpertsClient.ack_many`."""
        return req.json_of(await self._body(req.ack_many_call(rids, before_weight_version)))

    async def engines(self) -> list[dict[str, Any]]:
        """`RoutedExpertsClient.engines`."""
        return req.engines_of(await self._body(req.engines_call()))
