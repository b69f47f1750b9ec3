"""Every transport failure of the clients is an `R3Error` that names the URL and says what to do.

Real sockets only: a port nobody listens on (refused), a `.invalid` host (DNS, RFC 2606 guarantees it never
resolves), and a socket that listens but never answers (read timeout). Each client (blocking and asyncio) on
each of its paths: the direct plain-http reader and httpx (forced with a custom transport).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from service.client import AsyncRoutedExpertsClient, R3Error, RoutedExpertsClient
from service.client.errors import ConnectionRefused, HostNotFound, ReadTimedOut, SidecarUnreachable


@pytest.fixture
def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_url() -> Iterator[str]:
    """Accepts connections (the kernel's backlog does) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


PATHS = {"direct": {}, "httpx": {"transport": httpx.HTTPTransport()}}
ASYNC_PATHS = {"direct": {}, "httpx": {"transport": httpx.AsyncHTTPTransport()}}


def calls(client: RoutedExpertsClient) -> dict[str, Callable[[], object]]:
    return {
        "get": lambda: client.get("r/1"),
        "get_many": lambda: client.get_many(["r/1"]),
        "stream": lambda: list(client.stream("r/1")),
        "ack": lambda: client.ack("r/1"),
    }


def check(err: R3Error, kind: type[SidecarUnreachable], httpx_kind: type[Exception], url: str, hint: str) -> None:
    assert isinstance(err, kind) and isinstance(err, httpx_kind), type(err).mro()
    assert err.url.startswith(url) and url in str(err) and hint in str(err), str(err)
    assert err.status is None


@pytest.mark.parametrize("path", PATHS)
def test_refused_and_unknown_host_are_r3errors_naming_the_url(refused_url: str, path: str) -> None:
    for url, kind, httpx_kind, hint in (
        (refused_url, ConnectionRefused, httpx.ConnectError, "r3-sidecar serve"),
        ("http://no-such-sidecar.invalid:8000", HostNotFound, httpx.ConnectError, "does not resolve"),
    ):
        with RoutedExpertsClient(url, retries=1, backoff_s=0.01, **PATHS[path]) as client:
            for name, call in calls(client).items():
                with pytest.raises(R3Error) as caught:
                    call()
                check(caught.value, kind, httpx_kind, url, hint)
                assert "/routed_experts/" in caught.value.url, name


@pytest.mark.parametrize("path", PATHS)
def test_a_silent_server_is_a_read_timeout_naming_the_url(silent_url: str, path: str) -> None:
    client = RoutedExpertsClient(silent_url, timeout=0.3, retries=0, **PATHS[path])
    with client, pytest.raises(ReadTimedOut) as caught:
        client.get("r/1")
    check(caught.value, ReadTimedOut, httpx.ReadTimeout, silent_url, "longer timeout")


@pytest.mark.parametrize("path", ASYNC_PATHS)
def test_the_async_client_raises_the_same(refused_url: str, silent_url: str, path: str) -> None:
    async def run() -> list[R3Error]:
        errors = []
        async with AsyncRoutedExpertsClient(refused_url, retries=1, backoff_s=0.01, **ASYNC_PATHS[path]) as c:
            for call in (lambda: c.get("r/1"), lambda: c.get_many(["r/1"]), lambda: c.engines()):
                with pytest.raises(R3Error) as caught:
                    await call()
                errors.append(caught.value)
            with pytest.raises(R3Error) as caught:
                [block async for block in c.stream("r/1")]
            errors.append(caught.value)
        async with AsyncRoutedExpertsClient(silent_url, timeout=0.3, retries=0, **ASYNC_PATHS[path]) as c:
            with pytest.raises(R3Error) as caught:
                await c.get("r/1", wait=0)
            errors.append(caught.value)
        return errors

    *refused, timed_out = asyncio.run(run())
    for err in refused:
        check(err, ConnectionRefused, httpx.ConnectError, refused_url, "r3-sidecar serve")
    check(timed_out, ReadTimedOut, httpx.ReadTimeout, silent_url, "longer timeout")
