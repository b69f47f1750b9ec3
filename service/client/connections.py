"""Kept-alive `http.client` connections that read a response body straight into its final buffer.

httpx reads a body 64 KiB at a time through h11, which copies every byte into its own buffer, out
as `bytes`, and the client copies it once more; for a multi-megabyte record that costs more than the
server's whole response (BENCHMARKS.md, "Single-stream fetch"). Here the body lands with `readinto`
in a buffer sized from Content-Length: one copy from the socket. Failures are raised as the httpx
exceptions the rest of the client (retries, callers) already handles.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

from service.wire.buffers import uninitialized

_STALE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class Connections:
    """A small pool of kept-alive connections to one `http://host:port[/prefix]`; safe to share between threads."""

    def __init__(self, base_url: str, headers: dict[str, str], connect_timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"plain http://host[:port] URLs only, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.headers = headers
        self.connect_timeout = connect_timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get(
        self, path: str, params: dict[str, str], timeout: float
    ) -> tuple[int, httpx.Headers, bytearray | memoryview]:
        """GET `path?params`: status, headers and the whole body."""
        return self.send("GET", path, params, timeout=timeout)

    def send(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> tuple[int, httpx.Headers, bytearray | memoryview]:
        """Any request: status, headers and the whole body."""
        with self.request(method, path, params, body=body, headers=headers, timeout=timeout) as resp:
            return resp.status, httpx.Headers(resp.getheaders()), _read_into_buffer(resp)

    @contextmanager
    def request(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> Iterator[http.client.HTTPResponse]:
        """A response to read inside the block; its connection is kept when the body was read to the end.

        A kept connection the server closed while idle is replaced by one new connection (not a failure).
        """
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        all_headers = {**self.headers, **(headers or {})}
        conn, reused = self._take()
        try:
            try:
                resp = _send(conn, method, target, body, all_headers, timeout)
            except _STALE:
                if not reused:
                    raise
                conn.close()
                conn = self._connect()
                resp = _send(conn, method, target, body, all_headers, timeout)
            yield resp
        except BaseException as exc:
            conn.close()
            mapped = _as_httpx(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        if resp.isclosed() and not resp.will_close:
            with self._lock:
                self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if _idle_and_open(conn):
                return conn, True
            conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise _as_httpx(exc, connecting=True) from exc
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


def _send(
    conn: http.client.HTTPConnection,
    method: str,
    target: str,
    body: bytes | None,
    headers: dict[str, str],
    timeout: float,
) -> http.client.HTTPResponse:
    conn.sock.settimeout(timeout)
    conn.request(method, target, body=body, headers=headers)
    return conn.getresponse()


def _idle_and_open(conn: http.client.HTTPConnection) -> bool:
    """An idle kept-alive socket that is readable has been closed by the server (or holds junk)."""
    if conn.sock is None:
        return False
    readable, _, _ = select.select([conn.sock], [], [], 0)
    return not readable


def _read_into_buffer(resp: http.client.HTTPResponse) -> bytearray | memoryview:
    """The body in one writable buffer (arrays over it need no copy; torch accepts it)."""
    length = resp.getheader("Content-Length")
    if length is None or not length.isdigit():
        return bytearray(resp.read())
    buf = uninitialized(int(length))
    filled = fill(resp, buf)
    if filled < len(buf):
        raise http.client.IncompleteRead(bytes(buf[:filled]), len(buf) - filled)
    return buf


def fill(body: Any, buf: bytearray | memoryview) -> int:
    """`readinto` until `buf` is full or `body` ends; the number of bytes read."""
    view, filled = memoryview(buf), 0
    while filled < len(buf) and (n := body.readinto(view[filled:])):
        filled += n
    return filled


def _as_httpx(exc: BaseException, connecting: bool = False) -> BaseException:
    """The httpx exception the rest of the client retries or reports for this transport failure."""
    if isinstance(exc, httpx.HTTPError) or not isinstance(exc, OSError | http.client.HTTPException):
        return exc
    if connecting:
        return httpx.ConnectTimeout(str(exc)) if isinstance(exc, TimeoutError) else httpx.ConnectError(str(exc))
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(str(exc))
    if isinstance(exc, http.client.HTTPException):
        return httpx.RemoteProtocolError(str(exc) or type(exc).__name__)
    return httpx.ReadError(str(exc) or type(exc).__name__)
