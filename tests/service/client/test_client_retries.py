"""A refused connection, retried: the client keeps trying while no sidecar listens (one coming up on the port
later is answered), and gives up after its last retry. Each test runs its own sidecar, or none; that HTTP
errors are not retried is `test_client.py`'s, against the shared one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from client_records import put
from waiting import wait_until

from service.client import RoutedExperts, RoutedExpertsClient
from service.client.calls import Retry
from service.server.api import create_app
from service.server.settings import Settings
from service.spool import Spool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def sidecar_on_port(spool_dir: Path, port: int) -> Iterator[str]:
    """A sidecar on a port chosen in advance (`live_server` picks its own), for the connection-refused test."""
    cfg = Settings(spool_dir=spool_dir, host="127.0.0.1", port=port)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "the sidecar's thread ended"
        return server.started

    wait_until(started, 15, "the sidecar started", interval=0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_retries_connection_refused_until_the_server_comes_up(spool: Spool) -> None:
    array, _ = put(spool, "late", rows=4)
    port = free_port()
    result: dict[str, object] = {}

    def fetch() -> None:
        with RoutedExpertsClient(f"http://127.0.0.1:{port}", retries=12, backoff_s=0.1, backoff_max_s=0.4) as c:
            try:
                result["r"] = c.get("late")
            except Exception as exc:
                result["r"] = exc

    retried = threading.Event()
    delay = Retry.delay

    def spied(self: Retry, attempt: int) -> float | None:
        if attempt >= 1:
            retried.set()  # refused twice: the client is retrying while nothing listens
        return delay(self, attempt)

    thread = threading.Thread(target=fetch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Retry, "delay", spied)
        thread.start()
        assert retried.wait(15), "the client never retried"
        assert thread.is_alive(), "the client should still be retrying while nothing listens"
        with sidecar_on_port(spool.root, port):
            thread.join(15)
    assert isinstance(result["r"], RoutedExperts), result["r"]
    np.testing.assert_array_equal(result["r"].array, array)


def test_connection_refused_is_raised_after_the_last_retry() -> None:
    import httpx

    with (
        RoutedExpertsClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01) as c,
        pytest.raises(httpx.ConnectError),
    ):
        c.get("anything")
