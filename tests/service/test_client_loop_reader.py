"""The asyncio client's loop-read bodies (`service.aconnections`) on real sockets.

A raw server on 127.0.0.1 sends each answer as a test scripts it (split anywhere, chunked or sized, cut short),
so partial reads, frame boundaries inside reads and a server hanging up mid-body are the kernel's.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import live_server

from service.aconnections import AsyncConnections
from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient
from service.frames import frame_header, parse_frames
from service.results import aread_frames
from service.settings import Settings
from service.spool import Spool

Answer = Callable[[int], tuple[list[bytes], bool]]
"""(request number) -> (the pieces to send, each its own `send`; close the connection after them)."""


class RawServer:
    """Answers each request with the scripted pieces, a short pause between pieces (so reads come back partial)."""

    def __init__(self, answer: Answer, pause_s: float = 0.0005) -> None:
        self.answer, self.pause_s = answer, pause_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                _, pending = pending.split(b"\r\n\r\n", 1)
                self.requests += 1
                pieces, close = self.answer(self.requests)
                try:
                    for piece in pieces:
                        conn.sendall(piece)
                        time.sleep(self.pause_s)
                except OSError:
                    return
                if close:
                    return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def raw() -> Iterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    def make(answer: Answer, **kwargs: float) -> RawServer:
        servers.append(RawServer(answer, **kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def frames_body(n: int = 3, rows: int = 50) -> tuple[bytes, list[np.ndarray]]:
    arrays = [np.random.default_rng(i).integers(0, 255, (rows + i, 2, 8), dtype=np.uint8) for i in range(n)]
    body = b""
    for i, a in enumerate(arrays):
        header = {"rid": f"r{i}", "status": 200, "dtype": "uint8", "shape": list(a.shape), "start": 0, "layers": [0, 1]}
        body += frame_header(header) + a.tobytes()
    body += frame_header({"rid": "gone", "status": 404, "detail": "no record 'gone'"})
    return body, arrays


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def chunked(data: bytes, size: int) -> bytes:
    out = b"".join(b"%x\r\n" % len(part) + part + b"\r\n" for part in split(data, size))
    return out + b"0\r\n\r\n"


def head(extra: str) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.r3.frames\r\n{extra}\r\n".encode()


async def read_batch(conns: AsyncConnections) -> list:
    async with conns.request("POST", "/routed_experts/batch", body=b"{}", timeout=5) as resp:
        return await aread_frames(resp.fill)


@pytest.mark.parametrize("piece", [1, 5, 4099, 1 << 16])
@pytest.mark.parametrize("chunk", [3, 777, 1 << 20])
def test_chunked_frames_read_in_any_split(raw, piece: int, chunk: int) -> None:
    """Chunk-size lines, frame headers and payloads cut at every kind of boundary decode to the same frames."""
    body, arrays = frames_body()
    wire = head("Transfer-Encoding: chunked\r\n") + chunked(body, chunk)
    server = raw(lambda _n: (split(wire, piece), False), pause_s=0 if piece < 64 else 0.0005)

    async def main() -> list:
        conns = AsyncConnections(server.url, {}, 5)
        try:
            first = await asyncio.wait_for(read_batch(conns), 30)
            second = await asyncio.wait_for(read_batch(conns), 30)  # the same connection, kept
            assert [f.header for f in first] == [f.header for f in second]
            return first
        finally:
            conns.close()

    frames = asyncio.run(main())
    expected = parse_frames(body)
    assert [f.header for f in frames] == [h for h, _ in expected]
    for frame, a in zip(frames, arrays, strict=False):
        np.testing.assert_array_equal(frame.result().array, a)
        assert frame.result().array.flags.writeable
    assert frames[-1].status == 404
    assert server.connections == 1


def test_sized_body_and_error_body(raw) -> None:
    payload = bytes(range(256)) * 4000
    ok = head(f"Content-Length: {len(payload)}\r\n") + payload
    missing = b'HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n{"detail":"nope"}'
    server = raw(lambda n: (split(ok if n % 2 else missing, 3001), False))

    async def main() -> None:
        conns = AsyncConnections(server.url, {}, 5)
        status, headers, body = await conns.send("GET", "/x", timeout=5)
        assert (status, bytes(body)) == (200, payload) and headers["content-length"] == str(len(payload))
        status, _, body = await conns.send("GET", "/y", timeout=5)
        assert (status, bytes(body)) == (404, b'{"detail":"nope"}')
        conns.close()

    asyncio.run(main())
    assert server.connections == 1


@pytest.mark.parametrize("framing", ["sized", "chunked", "frames"])
def test_server_closing_mid_body_is_a_clear_error_not_a_hang(raw, framing: str) -> None:
    body, _ = frames_body()
    if framing == "sized":
        wire = head(f"Content-Length: {len(body)}\r\n") + body[: len(body) // 2]
    elif framing == "chunked":
        wire = head("Transfer-Encoding: chunked\r\n") + chunked(body, 1000)[: len(body) // 2]
    else:  # the chunked framing ends cleanly, inside a frame
        wire = head("Transfer-Encoding: chunked\r\n") + chunked(body[: len(body) // 2], 1000)
    server = raw(lambda _n: ([wire], True))

    async def main() -> None:
        conns = AsyncConnections(server.url, {}, 5)
        t = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError):
            if framing == "sized":
                await asyncio.wait_for(conns.send("GET", "/x", timeout=30), 10)
            else:
                await asyncio.wait_for(read_batch(conns), 10)
        assert time.monotonic() - t < 5  # the hang-up is seen at once, not after the 30 s timeout
        assert conns._idle == []

    asyncio.run(main())


def test_no_answer_is_a_read_timeout_and_the_connection_is_dropped(raw) -> None:
    server = raw(lambda _n: ([], False))

    async def main() -> None:
        conns = AsyncConnections(server.url, {}, 5)
        with pytest.raises(httpx.ReadTimeout):
            await conns.send("GET", "/x", timeout=0.3)
        assert conns._idle == []

    asyncio.run(main())


def test_a_kept_connection_the_server_closed_is_replaced(raw) -> None:
    ok = head("Content-Length: 2\r\n") + b"ok"
    server = raw(lambda _n: ([ok], True))  # answers, then hangs up without saying so

    async def main() -> None:
        conns = AsyncConnections(server.url, {}, 5)
        for _ in range(3):
            assert bytes((await conns.send("GET", "/x", timeout=5))[2]) == b"ok"
            await asyncio.sleep(0.05)
        conns.close()

    asyncio.run(main())
    assert server.connections == 3


def test_a_cancelled_read_closes_its_connection(raw) -> None:
    big = b"x" * (8 << 20)
    server = raw(lambda _n: (split(head(f"Content-Length: {len(big)}\r\n") + big, 1 << 16), False), pause_s=0.01)

    async def main() -> None:
        conns = AsyncConnections(server.url, {}, 5)
        task = asyncio.create_task(conns.send("GET", "/x", timeout=5))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conns._idle == []

    asyncio.run(main())


def test_large_and_many_concurrent_bodies_match_the_blocking_client(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    big = np.random.default_rng(1).integers(0, 128, (30_000, 48, 8), dtype=np.uint8)  # 11.5 MB
    for rid, rows in [("big", big)] + [(f"r{i}", big[i * 100 : i * 100 + 50 + i]) for i in range(64)]:
        w = spool.writer(rid, num_experts=128, topk=8, layers=list(range(48)), prompt_len=10)
        w.append(rows)
        w.finalize()
    rids = [f"r{i}" for i in range(64)]
    with live_server(Settings(spool_dir=tmp_path)) as url, RoutedExpertsClient(url) as blocking:
        expected = [blocking.get(r).array for r in rids]

        async def main() -> None:
            async with AsyncRoutedExpertsClient(url) as client:
                got = await asyncio.gather(client.get("big"), *(client.get(r) for r in rids))
                np.testing.assert_array_equal(got[0].array, big)
                for r, a in zip(got[1:], expected, strict=True):
                    np.testing.assert_array_equal(r.array, a)
                many = await client.get_many(["big", *rids, "absent"], layers=[5, 40])
                np.testing.assert_array_equal(many[0].array, big[:, [5, 40]])
                for r, a in zip(many[1:-1], expected, strict=True):
                    np.testing.assert_array_equal(r.array, a[:, [5, 40]])
                assert type(many[-1]).__name__ == "RecordNotFound"
                assert len(client._io.direct._idle) == 65  # every connection kept for the next request

        asyncio.run(main())
