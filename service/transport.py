"""The clients' two thin transports: send a `Call`, hand back the whole answer, its frames, or a stream's chunks.

Over plain `http://` both read whole bodies with one copy from the socket into the body's final buffer: the
blocking one through `service.connections` (`http.client`), the async one on the event loop through
`service.aconnections` (non-blocking sockets, a bounded read per loop turn: no reader threads to contend with
the loop for the GIL). `https://`, custom httpx transports and
`stream=true` go through httpx (`httpx.Client` / `httpx.AsyncClient`). Nothing here decides a retry or an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx

from service.aconnections import AsyncConnections
from service.client_errors import error_for, json_or_text
from service.connections import Connections
from service.requests import Call, ClientConfig
from service.results import Frame, FrameDecoder, Reply, aread_frames, read_frames

__all__ = ["AsyncTransport", "SyncTransport"]


class BodyBuffer:
    """A body read chunk by chunk into one writable buffer, sized from Content-Length when given: arrays over it
    need no copy, and torch accepts them."""

    def __init__(self, headers: httpx.Headers) -> None:
        length = headers.get("content-length")
        self.buf = bytearray(int(length)) if length and length.isdigit() else bytearray()
        self._sized, self._filled = bool(self.buf), 0

    def add(self, chunk: bytes) -> None:
        n, buf = len(chunk), self.buf
        if self._sized and self._filled + n <= len(buf):
            buf[self._filled : self._filled + n] = chunk
        else:
            self._sized = False
            del buf[self._filled :]
            buf += chunk
        self._filled += n

    def done(self) -> bytearray:
        del self.buf[self._filled :]
        return self.buf


def _direct_send(conns: Connections, cfg: ClientConfig, call: Call) -> Reply:
    status, headers, body = conns.send(
        call.method, call.path, call.params, body=call.body, headers=call.headers, timeout=cfg.read_timeout(call)
    )
    return Reply(status, headers, body)


def _direct_frames(conns: Connections, cfg: ClientConfig, call: Call) -> list[Frame]:
    with conns.request(
        call.method, call.path, call.params, body=call.body, headers=call.headers, timeout=cfg.read_timeout(call)
    ) as resp:
        if resp.status != 200:
            raise error_for(resp.status, json_or_text(resp.read()), call.rid)
        return read_frames(resp)


def _ended(decoder: FrameDecoder, frames: list[Frame]) -> list[Frame]:
    if decoder.pending:
        raise httpx.RemoteProtocolError("batch response ended inside a frame")
    return frames


class SyncTransport:
    """Blocking I/O: `service.connections` for whole bodies over plain http, `httpx.Client` for the rest."""

    def __init__(self, cfg: ClientConfig, transport: httpx.BaseTransport | None = None) -> None:
        self.cfg = cfg
        self._http = httpx.Client(base_url=cfg.base_url, headers=cfg.headers, transport=transport)
        direct = transport is None and cfg.plain
        self.direct = Connections(cfg.base_url, cfg.headers, cfg.connect_timeout) if direct else None

    def send(self, call: Call) -> Reply:
        if self.direct is not None:
            return _direct_send(self.direct, self.cfg, call)
        with self._open(call) as resp:
            body = BodyBuffer(resp.headers)
            for chunk in resp.iter_bytes():
                body.add(chunk)
            return Reply(resp.status_code, resp.headers, body.done())

    def frames(self, call: Call) -> list[Frame]:
        if self.direct is not None:
            return _direct_frames(self.direct, self.cfg, call)
        decoder, frames = FrameDecoder(), []
        with self.chunks(call) as chunks:
            for chunk in chunks:
                frames += decoder.feed(chunk)
        return _ended(decoder, frames)

    @contextmanager
    def chunks(self, call: Call) -> Iterator[Iterator[bytes]]:
        """A 200's body as it arrives; any other status raises its error."""
        with self._open(call) as resp:
            if resp.status_code != 200:
                resp.read()
                raise error_for(resp.status_code, json_or_text(resp.content), call.rid)
            yield resp.iter_bytes()

    def _open(self, call: Call) -> httpx.Response:
        return self._http.stream(**self.cfg.stream_args(call))

    def close(self) -> None:
        self._http.close()
        if self.direct is not None:
            self.direct.close()


class AsyncTransport:
    """The same for asyncio: whole bodies over plain http are read by the event loop itself
    (`service.aconnections`: no threads, a bounded copy per loop turn), everything else through
    `httpx.AsyncClient` on the loop."""

    def __init__(self, cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self._http = httpx.AsyncClient(base_url=cfg.base_url, headers=cfg.headers, transport=transport)
        direct = transport is None and cfg.plain
        self.direct = AsyncConnections(cfg.base_url, cfg.headers, cfg.connect_timeout) if direct else None

    async def send(self, call: Call) -> Reply:
        if self.direct is not None:
            status, headers, body = await self.direct.send(
                call.method,
                call.path,
                call.params,
                body=call.body,
                headers=call.headers,
                timeout=self.cfg.read_timeout(call),
            )
            return Reply(status, headers, body)
        async with self._open(call) as resp:
            body = BodyBuffer(resp.headers)
            async for chunk in resp.aiter_bytes():
                body.add(chunk)
            return Reply(resp.status_code, resp.headers, body.done())

    async def frames(self, call: Call) -> list[Frame]:
        if self.direct is not None:
            async with self.direct.request(
                call.method,
                call.path,
                call.params,
                body=call.body,
                headers=call.headers,
                timeout=self.cfg.read_timeout(call),
            ) as resp:
                if resp.status != 200:
                    raise error_for(resp.status, json_or_text(bytes(await resp.read())), call.rid)
                return await aread_frames(resp.fill)
        decoder, frames = FrameDecoder(), []
        async with self.chunks(call) as chunks:
            async for chunk in chunks:
                frames += decoder.feed(chunk)
        return _ended(decoder, frames)

    @asynccontextmanager
    async def chunks(self, call: Call) -> AsyncIterator[AsyncIterator[bytes]]:
        async with self._open(call) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise error_for(resp.status_code, json_or_text(resp.content), call.rid)
            yield resp.aiter_bytes()

    def _open(self, call: Call) -> httpx.Response:
        return self._http.stream(**self.cfg.stream_args(call))

    async def aclose(self) -> None:
        await self._http.aclose()
        if self.direct is not None:
            self.direct.close()
