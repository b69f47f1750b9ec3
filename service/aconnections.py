"""Kept-alive plain-HTTP connections the event loop reads itself: the asyncio client's whole-body transport.

Why not threads: reader threads copying multi-megabyte bodies hold the GIL the loop needs, and each hand-off
can keep the loop waiting a switch interval or more (BENCHMARKS.md, "Trainer API"). Here the loop reads each
body from a non-blocking socket straight into its final buffer (`recv_into` on memoryview slices, no
per-chunk `bytes`), a bounded slice per turn so one turn copies a few MB at most, whatever the number of
bodies in flight. Framing (`Content-Length`, chunked, until close), pooling, stale-connection replacement and
the httpx exceptions raised are those of `service.connections`, the blocking client's reader.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from service.connections import STALE, as_httpx, endpoint, idle_and_open, request_target, uninitialized

__all__ = ["TURN_BYTES", "AsyncConnections", "AsyncResponse"]

TURN_BYTES = 4 << 20
"""Bytes all bodies in flight copy in one loop turn, at most (~1 ms of memcpy): each read takes its share."""
MIN_READ, MAX_READ = 64 << 10, 4 << 20
MAX_LINE = 64 << 10
"""A status line, header block or chunk-size line longer than this is not HTTP from the sidecar."""
_SMALL = 4096  # reads for the head and chunk-size lines: what they overshoot into a body is copied once

_reading = 0  # requests in flight on this process's loops: their reads share TURN_BYTES


class _Conn:
    """One non-blocking socket and the bytes read from it past what has been consumed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.timeout = 0.0  # each wait for the server: the request's, set when it is sent
        self.pending = bytearray()
        self._small = memoryview(bytearray(_SMALL))

    async def recv_into(self, view: memoryview) -> int:
        """Bytes into `view` (pending ones first); 0 when the server closed. One bounded read, then the loop's
        other tasks get a turn even when more data is already there."""
        if self.pending:
            n = min(len(view), len(self.pending))
            view[:n] = self.pending[:n]
            del self.pending[:n]
            return n
        return await self._recv(view)

    async def _recv(self, view: memoryview) -> int:
        cap = max(MIN_READ, min(MAX_READ, TURN_BYTES // max(1, _reading)))
        try:
            n = self.sock.recv_into(view, min(len(view), cap))
        except BlockingIOError:
            async with asyncio.timeout(self.timeout):
                return await asyncio.get_running_loop().sock_recv_into(self.sock, view[:cap])
        await asyncio.sleep(0)
        return n

    async def more(self) -> bool:
        """Read a little more into `pending` (a head or chunk-size line); False when the server closed."""
        n = await self._recv(self._small)
        self.pending += self._small[:n]
        return n > 0

    async def line(self, what: str) -> bytes:
        """The next CRLF-terminated line of `pending`, reading more as needed."""
        while (i := self.pending.find(b"\r\n")) < 0:
            if len(self.pending) > MAX_LINE:
                raise http.client.LineTooLong(what)
            if not await self.more():
                raise http.client.IncompleteRead(bytes(self.pending))
        line = bytes(self.pending[:i])
        del self.pending[: i + 2]
        return line

    def close(self) -> None:
        self.sock.close()


class AsyncResponse:
    """A response whose head is read; read its body with `fill` / `read` inside `AsyncConnections.request`."""

    def __init__(self, conn: _Conn, method: str) -> None:
        self._conn = conn
        self._method = method
        self.status = 0
        self.headers = httpx.Headers()
        self._length: int | None = None  # bytes left: of the body (Content-Length) or of the current chunk
        self._chunked = False
        self._chunks_started = False
        self._keep = True
        self.done = False

    async def read_head(self) -> None:
        conn = self._conn
        while (end := conn.pending.find(b"\r\n\r\n")) < 0:
            if len(conn.pending) > MAX_LINE:
                raise http.client.LineTooLong("header block")
            if not await conn.more():
                if conn.pending:
                    raise http.client.IncompleteRead(bytes(conn.pending))
                raise http.client.RemoteDisconnected("the server closed the connection without an answer")
        head = bytes(conn.pending[:end]).decode("latin-1")
        del conn.pending[: end + 4]
        status_line, *lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise http.client.BadStatusLine(status_line)
        self.status = int(code)
        pairs = [(name.strip(), value.strip()) for name, _, value in (h.partition(":") for h in lines)]
        self.headers = httpx.Headers(pairs)
        connection = self.headers.get("connection", "").lower()
        self._keep = version == "HTTP/1.1" and "close" not in connection
        if self._method == "HEAD" or self.status in (204, 304) or 100 <= self.status < 200:
            self._length, self.done = 0, True
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked, self._length = True, 0
        elif (length := self.headers.get("content-length")) is not None:
            if not length.isdigit():
                raise http.client.HTTPException(f"Content-Length {length!r}")
            self._length = int(length)
            self.done = self._length == 0
        else:
            self._keep = False  # the body runs until the server closes

    @property
    def length(self) -> int | None:
        """The body's size when the server said it (`Content-Length`)."""
        return None if self._chunked else self._length

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another request: the body was read to its end and kept alive."""
        return self.done and self._keep and not self._conn.pending

    async def readinto(self, view: memoryview) -> int:
        """Some bytes of the body into `view`; 0 at its end. A body cut short raises `IncompleteRead`."""
        if self.done or not view:
            return 0
        conn = self._conn
        if self._chunked and self._length == 0:
            await self._next_chunk()
            if self.done:
                return 0
        if self._length is None:  # until close
            n = await conn.recv_into(view)
            self.done = n == 0
            return n
        n = await conn.recv_into(view[: self._length])
        if n == 0:
            raise http.client.IncompleteRead(b"", self._length)
        self._length -= n
        self.done = self._length == 0 and not self._chunked
        return n

    async def fill(self, buf: bytearray | memoryview) -> int:
        """Read until `buf` is full or the body ends; the number of bytes read."""
        view, filled = memoryview(buf).cast("B"), 0
        while filled < len(view) and (n := await self.readinto(view[filled:])):
            filled += n
        return filled

    async def read(self) -> bytearray:
        """The rest of the body (an error's or an unsized one: small)."""
        out, chunk = bytearray(), bytearray(64 << 10)
        while n := await self.fill(chunk):
            out += memoryview(chunk)[:n]
        return out

    async def _next_chunk(self) -> None:
        conn = self._conn
        if self._chunks_started and await conn.line("chunk end"):
            raise http.client.HTTPException("chunk data longer than its size")
        self._chunks_started = True
        size = (await conn.line("chunk size")).split(b";", 1)[0].strip()
        try:
            self._length = int(size, 16)
        except ValueError:
            raise http.client.HTTPException(f"chunk size {size[:20]!r}") from None
        if self._length == 0:
            while await conn.line("trailer"):
                pass
            self.done = True


class AsyncConnections:
    """`service.connections.Connections` for asyncio: kept-alive sockets to one `http://host:port[/prefix]`,
    read by the running loop. Sockets belong to no loop between requests."""

    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout: float) -> None:
        self.host, self.port, self.prefix = endpoint(base_url)
        self.headers = headers
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []

    async def send(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> tuple[int, httpx.Headers, bytearray | memoryview]:
        """Any request: status, headers and the whole body (sized from Content-Length, left unfilled until read)."""
        async with self.request(method, path, params, body=body, headers=headers, timeout=timeout) as resp:
            if resp.length is None:
                return resp.status, resp.headers, await resp.read()
            buf = uninitialized(resp.length)
            filled = await resp.fill(buf)
            if filled < len(buf):
                raise http.client.IncompleteRead(b"", len(buf) - filled)
            return resp.status, resp.headers, buf

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> AsyncIterator[AsyncResponse]:
        """A response to read inside the block; its connection is kept when the body was read to the end.

        `timeout` bounds each wait for the server (as the blocking reader's socket timeout does). A kept
        connection the server closed while idle is replaced by one new connection (not a failure); any failure,
        a cancellation included, closes the connection.
        """
        data = self._encode(method, request_target(self.prefix, path, params), body, headers or {})
        global _reading
        conn = self._take()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        _reading += 1
        try:
            try:
                resp = await _exchange(conn, data, method, timeout)
            except STALE:
                if not reused:
                    raise
                conn.close()
                conn = await self._connect()
                resp = await _exchange(conn, data, method, timeout)
            yield resp
        except BaseException as exc:
            conn.close()
            mapped = as_httpx(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        finally:
            _reading -= 1
        if resp.reusable:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _encode(self, method: str, target: str, body: bytes | None, headers: dict[str, str]) -> bytes:
        host = self.host if self.port == 80 else f"{self.host}:{self.port}"
        fields = {"Host": host, "Accept-Encoding": "identity", **self.headers, **headers}
        if body is not None or method in ("POST", "PUT", "PATCH"):
            fields["Content-Length"] = str(len(body or b""))
        lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in fields.items())]
        text = "\r\n".join(lines) + "\r\n\r\n"
        if any(c in text[:-4].replace("\r\n", "") for c in "\r\n\0"):
            raise ValueError("a request line or header holds CR, LF or NUL")
        return text.encode("latin-1") + (body or b"")

    def _take(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if idle_and_open(conn.sock):
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                error: OSError | None = None
                for family, kind, proto, _, addr in infos:
                    sock = socket.socket(family, kind, proto)
                    sock.setblocking(False)
                    try:
                        await loop.sock_connect(sock, addr)
                    except BaseException as exc:
                        sock.close()
                        if not isinstance(exc, OSError):
                            raise
                        error = exc
                        continue
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return _Conn(sock)
                raise error or OSError(f"no address for {self.host}")
        except OSError as exc:
            raise as_httpx(exc, connecting=True) from exc


async def _exchange(conn: _Conn, data: bytes, method: str, timeout: float) -> AsyncResponse:
    """Send one request on `conn` and read the answer's head."""
    conn.timeout = timeout
    async with asyncio.timeout(timeout):
        await asyncio.get_running_loop().sock_sendall(conn.sock, data)
    resp = AsyncResponse(conn, method)
    await resp.read_head()
    return resp
