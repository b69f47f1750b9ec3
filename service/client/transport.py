"""The clients' two thin transports: send a `Call`, hand back the whole answer, its frames, or a stream's chunks.

Over plain `http://` both read whole bodies through `service.client.connections` (one copy from the socket into the
body's final buffer); the async one runs those reads on its own threads, so the event loop never copies or
parses a body and the async path is as fast as the blocking one. (The loop reading the sockets itself, with no
threads, was built and measured: longer loop stalls, since the copying and page faults then run on the loop
thread; BENCHMARKS.md, "Trainer API".) `https://`, custom httpx transports and
`stream=true` go through httpx (`httpx.Client` / `httpx.AsyncClient`). Nothing here decides a retry; a transport
failure leaves as the `R3Error` that names the URL and what to do (`service.client.errors.unreachable`), which is
also the httpx exception the retry policy knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import TypeVar

import httpx

from service.client.calls import Call, ClientConfig
from service.client.connections import Connections
from service.client.decoding import Frame, FrameDecoder, Reply, read_frames
from service.client.errors import error_for, json_or_text, unreachable

__all__ = ["AsyncTransport", "SyncTransport"]

T = TypeVar("T")


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


def _reported(cfg: ClientConfig, call: Call, exc: httpx.TransportError) -> Exception:
    timeout = cfg.connect_timeout if isinstance(exc, httpx.ConnectTimeout) else cfg.timeout_for(call).read
    return unreachable(exc, cfg.base_url.rstrip("/") + call.path, timeout=timeout or 0, rid=call.rid)


@contextmanager
def reported(cfg: ClientConfig, call: Call) -> Iterator[None]:
    """Inside: an httpx transport failure leaves as the `R3Error` saying what happened at which URL."""
    try:
        yield
    except httpx.TransportError as exc:
        raise _reported(cfg, call, exc) from exc


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
    """Blocking I/O: `service.client.connections` for whole bodies over plain http, `httpx.Client` for the rest."""

    def __init__(self, cfg: ClientConfig, transport: httpx.BaseTransport | None = None) -> None:
        self.cfg = cfg
        self._transport = transport
        self._made: httpx.Client | None = None  # made at first use: plain-http bodies never need it
        direct = transport is None and cfg.plain
        self.direct = Connections(cfg.base_url, cfg.headers, cfg.connect_timeout) if direct else None

    def send(self, call: Call) -> Reply:
        with reported(self.cfg, call):
            return self._send(call)

    def _send(self, call: Call) -> Reply:
        if self.direct is not None:
            return _direct_send(self.direct, self.cfg, call)
        with self._open(call) as resp:
            body = BodyBuffer(resp.headers)
            for chunk in resp.iter_bytes():
                body.add(chunk)
            return Reply(resp.status_code, resp.headers, body.done())

    def frames(self, call: Call) -> list[Frame]:
        with reported(self.cfg, call):
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
        with reported(self.cfg, call), self._open(call) as resp:
            if resp.status_code != 200:
                resp.read()
                raise error_for(resp.status_code, json_or_text(resp.content), call.rid)
            yield resp.iter_bytes()

    @property
    def _http(self) -> httpx.Client:
        if self._made is None:
            self._made = httpx.Client(base_url=self.cfg.base_url, headers=self.cfg.headers, transport=self._transport)
        return self._made

    def _open(self, call: Call) -> httpx.Response:
        return self._http.stream(**self.cfg.stream_args(call))

    def close(self) -> None:
        if self._made is not None:
            self._made.close()
        if self.direct is not None:
            self.direct.close()


class AsyncTransport:
    """The same for asyncio: whole bodies over plain http are read on this transport's threads (`threads` at
    most at once: each waits out its own `wait`), everything else through `httpx.AsyncClient` on the loop."""

    def __init__(
        self, cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None = None, *, threads: int = 8
    ) -> None:
        self.cfg = cfg
        self._transport = transport
        # Made at first use, on a thread: building an httpx client loads TLS certificates (0.2-0.4 s measured on
        # a loaded 2-core machine), which on the loop stalled a fresh process's first fetch; plain-http bodies
        # never need it (BENCHMARKS.md, "Same-node reads", cold start).
        self._made: asyncio.Future[httpx.AsyncClient] | None = None
        direct = transport is None and cfg.plain
        self.direct = Connections(cfg.base_url, cfg.headers, cfg.connect_timeout) if direct else None
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="r3-client") if direct else None

    async def send(self, call: Call) -> Reply:
        with reported(self.cfg, call):
            return await self._send(call)

    async def _send(self, call: Call) -> Reply:
        if self.direct is not None:
            return await self._off_loop(_direct_send, call)
        async with self._open(call) as resp:
            body = BodyBuffer(resp.headers)
            async for chunk in resp.aiter_bytes():
                body.add(chunk)
            return Reply(resp.status_code, resp.headers, body.done())

    async def frames(self, call: Call) -> list[Frame]:
        with reported(self.cfg, call):
            if self.direct is not None:
                return await self._off_loop(_direct_frames, call)
            decoder, frames = FrameDecoder(), []
            async with self.chunks(call) as chunks:
                async for chunk in chunks:
                    frames += decoder.feed(chunk)
            return _ended(decoder, frames)

    @asynccontextmanager
    async def chunks(self, call: Call) -> AsyncIterator[AsyncIterator[bytes]]:
        with reported(self.cfg, call):
            async with self._open(call) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise error_for(resp.status_code, json_or_text(resp.content), call.rid)
                yield resp.aiter_bytes()

    @asynccontextmanager
    async def _open(self, call: Call) -> AsyncIterator[httpx.Response]:
        if self._made is None:
            make = functools.partial(httpx.AsyncClient, base_url=self.cfg.base_url, headers=self.cfg.headers)
            self._made = asyncio.ensure_future(self.off_loop(make, transport=self._transport))
        http = await asyncio.shield(self._made)
        async with http.stream(**self.cfg.stream_args(call)) as resp:
            yield resp

    async def _off_loop(self, fn: Callable[[Connections, ClientConfig, Call], T], call: Call) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, fn, self.direct, self.cfg, call)

    async def off_loop(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """`fn(*args, **kwargs)` on this transport's threads (or the loop's default executor): work that must not
        block the loop (a same-node read, building the httpx client)."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    async def aclose(self) -> None:
        if self._made is not None:
            made, self._made = self._made, None
            with contextlib.suppress(Exception):
                await (await made).aclose()
        if self.direct is not None:
            self.direct.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
