"""The client's kept-alive GET connections (`service.client.connections`) on real sockets.

A scripted HTTP server on 127.0.0.1 answers each request as a test says (a record, a close without an
answer, a short body, nothing at all), so the failure paths are the kernel's, not a mock's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import live_server
from waiting import wait_until

from service.client import RoutedExpertsClient
from service.client.connections import Connections
from service.server.settings import Settings
from service.spool import Spool
from service.wire.formats import npy_header

ROWS = np.arange(5 * 2 * 4, dtype=np.uint8).reshape(5, 2, 4)
BODY = npy_header(ROWS.dtype, ROWS.shape) + ROWS.tobytes()
HEAD = (
    "HTTP/1.1 200 OK\r\nContent-Type: application/x-npy\r\nX-R3-Dtype: uint8\r\nX-R3-Shape: 5,2,4\r\n"
    "X-R3-Start: 0\r\nX-R3-Prompt-Len: 2\r\nX-R3-Layers: 0,1\r\nX-R3-Final: true\r\n"
)
OK = (HEAD + f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
SHORT = (HEAD + f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n").encode() + BODY[:-7]

Script = Callable[[int, int], str]
"""(connection, request on it) -> "ok", "ok-close" (answer, close), "short", "drop" (close, no answer), "hang"."""


class ScriptedServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.closed = 0
        self.requests: list[tuple[int, str]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, self.connections), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with contextlib.ExitStack() as serving:
            serving.callback(self._count_close)
            serving.enter_context(conn)
            pending, served = b"", 0
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, pending = pending.split(b"\r\n\r\n", 1)
                self.requests.append((number, head.split(b"\r\n")[0].decode()))
                served += 1
                action = self.script(number, served)
                if action == "hang":
                    conn.recv(1)
                    return
                if action == "drop":
                    return
                conn.sendall(SHORT if action == "short" else OK)
                if action != "ok":
                    return

    def _count_close(self) -> None:
        self.closed += 1

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(autouse=True)
def over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count the client's connections and requests: same-node reads would add `GET /v1/node`."""
    monkeypatch.setenv("R3_LOCAL_READS", "0")


@pytest.fixture
def scripted() -> Iterator[Callable[[Script], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def make(script: Script) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def test_one_connection_is_kept_for_many_gets(scripted) -> None:
    server = scripted(lambda _conn, _req: "ok")
    with RoutedExpertsClient(server.url, retries=0) as client:
        for _ in range(5):
            np.testing.assert_array_equal(client.get("r").array, ROWS)
    assert server.connections == 1 and len(server.requests) == 5
    assert server.requests[0][1] == "GET /routed_experts/r?format=npy HTTP/1.1"


def test_a_kept_connection_the_server_dropped_is_replaced_without_a_retry(scripted) -> None:
    server = scripted(lambda conn, req: "drop" if (conn, req) == (1, 2) else "ok")
    with RoutedExpertsClient(server.url, retries=0) as client:
        client.get("r")
        np.testing.assert_array_equal(client.get("r").array, ROWS)  # conn 1 drops request 2: conn 2 answers
    assert server.connections == 2


def test_a_kept_connection_closed_while_idle_is_not_reused(scripted) -> None:
    server = scripted(lambda _conn, _req: "ok-close")  # answers, then closes without saying so
    with RoutedExpertsClient(server.url, retries=0) as client:
        for n in range(1, 4):
            np.testing.assert_array_equal(client.get("r").array, ROWS)
            # the server's FIN arrives while the connection sits in the pool
            wait_until(lambda n=n: server.closed == n, 10, f"the server closed connection {n}")
    assert server.connections == 3 and len(server.requests) == 3


def test_a_short_body_is_a_retryable_protocol_error(scripted) -> None:
    server = scripted(lambda _conn, _req: "short")
    with pytest.raises(httpx.RemoteProtocolError):
        Connections(server.url, {}, 1.0).get("/x", {}, 1.0)
    with RoutedExpertsClient(server.url, retries=1, backoff_s=0.01) as client, pytest.raises(httpx.RemoteProtocolError):
        client.get("r")
    assert server.connections == 3  # one for the bare pool, two for the client's tries


def test_a_short_body_is_retried_on_a_new_connection(scripted) -> None:
    server = scripted(lambda conn, _req: "short" if conn == 1 else "ok")
    with RoutedExpertsClient(server.url, retries=1, backoff_s=0.01) as client:
        np.testing.assert_array_equal(client.get("r").array, ROWS)
    assert server.connections == 2


def test_a_fresh_connection_dropped_before_the_answer_is_a_retryable_error(scripted) -> None:
    server = scripted(lambda _conn, _req: "drop")
    with RoutedExpertsClient(server.url, retries=2, backoff_s=0.01) as client, pytest.raises(httpx.RemoteProtocolError):
        client.get("r")
    assert server.connections == 3


def test_no_answer_is_a_read_timeout_and_not_retried(scripted) -> None:
    server = scripted(lambda _conn, _req: "hang")
    with RoutedExpertsClient(server.url, retries=3, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.get("r")
    assert server.connections == 1


def test_the_same_answer_as_httpx_from_a_real_sidecar(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    rows = np.random.default_rng(3).integers(0, 384, (300, 3, 8), dtype=np.uint16)
    writer = spool.writer("rid/with?odd#chars", num_experts=384, topk=8, layers=[3, 4, 9], start=17, prompt_len=40)
    writer.append(rows)
    writer.finalize()
    with (
        live_server(Settings(spool_dir=tmp_path, auth_token="t0ken")) as url,
        RoutedExpertsClient(url, token="t0ken") as fast,
        RoutedExpertsClient(url, token="t0ken", transport=httpx.HTTPTransport()) as slow,
    ):
        assert fast._conns is not None and slow._conns is None
        for kwargs in ({}, {"start": 20, "end": 30, "layers": [9, 3]}):
            a, b = fast.get("rid/with?odd#chars", **kwargs), slow.get("rid/with?odd#chars", **kwargs)
            np.testing.assert_array_equal(a.array, b.array)
            assert (a.start, a.prompt_len, a.layers, a.dtype, a.final) == (
                b.start,
                b.prompt_len,
                b.layers,
                b.dtype,
                b.final,
            )
        np.testing.assert_array_equal(fast.get("rid/with?odd#chars").array, rows)
        assert fast.fetch_bytes("rid/with?odd#chars", "raw") == rows.tobytes()
        rids = ["rid/with?odd#chars", "absent", "rid/with?odd#chars"]
        many, same = fast.get_many(rids, layers=[4]), slow.get_many(rids, layers=[4])
        assert [type(r).__name__ for r in many] == ["RoutedExperts", "RecordNotFound", "RoutedExperts"]
        assert [type(r).__name__ for r in same] == [type(r).__name__ for r in many]
        np.testing.assert_array_equal(many[2].array, rows[:, 1:2])
        np.testing.assert_array_equal(many[0].array, same[0].array)
