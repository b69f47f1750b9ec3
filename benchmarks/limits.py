"""The machine's limits for the same bytes: memcpy (numpy copy) and raw loopback TCP (a socket pair, streaming
and one record per round trip)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from benchmarks.stats import samples, summary

RECV_CHUNK = 1 << 20


def memcpy_gbps(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of `np.copyto` between two buffers of `nbytes` (both touched first: no page-fault cost)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = samples(lambda: np.copyto(dst, src), reps)
    s = summary(times)
    return {"bytes": nbytes, "gbps": nbytes / s["p50"] / 1e9, "best_gbps": nbytes / s["min"] / 1e9, **s}


def _pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, client


def loopback_gbps(message_bytes: int, messages: int, reps: int) -> dict[str, float]:
    """GB/s of `messages` payloads of `message_bytes` sent over one loopback TCP connection.

    The sender is a thread (`sendall` releases the GIL), the receiver `recv_into`s a preallocated buffer,
    so the number is the kernel's loopback path, not Python's.
    """
    payload = np.random.default_rng(0).integers(0, 255, message_bytes, dtype=np.uint8).tobytes()
    sink = bytearray(message_bytes)
    total = message_bytes * messages
    times = []
    for _ in range(reps + 1):
        server, client = _pair()

        def send(sock: socket.socket = server) -> None:
            for _ in range(messages):
                sock.sendall(payload)

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        view = memoryview(sink)
        received = 0
        while received < total:
            n = client.recv_into(view[received % message_bytes :][:RECV_CHUNK])
            if n == 0:
                raise ConnectionError("loopback sender closed early")
            received += n
        sender.join()
        times.append(time.perf_counter() - t0)
        server.close()
        client.close()
    s = summary(times[1:])
    return {"bytes": total, "gbps": total / s["p50"] / 1e9, "best_gbps": total / s["min"] / 1e9, **s}


def loopback_round_trips_gbps(message_bytes: int, requests: int, reps: int) -> dict[str, float]:
    """GB/s of one loopback connection used the way `get` uses it: a tiny request, then one payload back.

    The server is a thread that answers each 3-byte request with `sendall(payload)`; the client
    `recv_into`s a preallocated buffer. The ceiling for fetching records one round trip at a time.
    """
    payload = np.random.default_rng(1).integers(0, 255, message_bytes, dtype=np.uint8).tobytes()
    sink = bytearray(message_bytes)
    view = memoryview(sink)
    times = []
    for _ in range(reps + 1):
        server, client = _pair()

        def answer(sock: socket.socket = server) -> None:
            for _ in range(requests):
                if not sock.recv(3):
                    return
                sock.sendall(payload)

        answering = threading.Thread(target=answer)
        answering.start()
        t0 = time.perf_counter()
        for _ in range(requests):
            client.sendall(b"GET")
            received = 0
            while received < message_bytes:
                n = client.recv_into(view[received:][:RECV_CHUNK])
                if n == 0:
                    raise ConnectionError("loopback server closed early")
                received += n
        times.append(time.perf_counter() - t0)
        answering.join()
        server.close()
        client.close()
    s = summary(times[1:])
    total = message_bytes * requests
    return {"bytes": total, "gbps": total / s["p50"] / 1e9, "best_gbps": total / s["min"] / 1e9, **s}
