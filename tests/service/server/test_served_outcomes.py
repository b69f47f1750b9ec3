"""Errors are errors: what `r3_served_total` counts for every way an answer can end, on a live sidecar.

An unreadable record never yields a 200: the sidecar opens and size-checks the `.bin` before any header
(500 JSON for a spool fault, 410 for a record that is gone or corrupt). A fault after the headers cuts the
connection (the client cannot mistake the body for a complete one) and is counted `abort`. Batches and
streams count each rid's outcome, and long-poll waits stay out of `r3_fetch_seconds`.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import random_rows, when_waited, write_record
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from service.client.decoding import FrameDecoder
from service.spool import Spool


def served(base: str) -> dict[tuple[str, str], float]:
    """`{(format, code): count}` of `r3_served_total`."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name == "r3_served_total":
                out[(s.labels["format"], s.labels["code"])] = s.value
    return out


def sample(base: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            if s.name == name and not s.labels:
                return s.value
    raise AssertionError(f"no {name}")


def bin_becomes_directory(spool: Spool, rid: str) -> None:
    """The record's `.bin` replaced by a directory: open() succeeds on Linux, every read fails (EISDIR)."""
    path = spool.bin_path(rid)
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"\0" * 4096)  # a directory whose size looks like data


def frames(body: bytes) -> list[dict]:
    dec = FrameDecoder()
    return [frame.header for frame in dec.feed(body)]


def test_unreadable_bin_is_a_json_500_never_a_200(serve, spool: Spool) -> None:
    base = serve()
    write_record(spool, "dir", random_rows(12))
    bin_becomes_directory(spool, "dir")
    for fmt in ("npy", "raw", "json", "sglang_b64"):
        r = httpx.get(f"{base}/routed_experts/dir", params={"format": fmt})
        assert r.status_code == 500, (fmt, r.status_code, r.content[:200])
        assert r.json()["error"] == "unreadable_record" and "dir" in r.json()["detail"]
    assert served(base) == {(fmt, "500"): 1.0 for fmt in ("npy", "raw", "json", "sglang_b64")}


def test_truncated_bin_is_410_and_counted(serve, spool: Spool) -> None:
    base = serve()
    meta = write_record(spool, "short", random_rows(12))
    with open(spool.bin_path("short"), "r+b") as f:
        f.truncate(meta.row_bytes * 4)
    r = httpx.get(f"{base}/routed_experts/short")
    assert r.status_code == 410 and r.json()["error"] == "truncated_bin"
    # A range the short file still holds is served: the check is on the rows asked for.
    assert httpx.get(f"{base}/routed_experts/short", params={"end": 4}).status_code == 200
    assert served(base) == {("npy", "410"): 1.0, ("npy", "200"): 1.0}
    write_record(spool, "cut", random_rows(3), status="aborted")
    assert httpx.get(f"{base}/routed_experts/cut").status_code in (200, 410)  # 200 once aborted rows are served
    text = httpx.get(f"{base}/metrics").text
    assert 'r3_served_gone_total{reason="truncated_bin"} 1.0' in text
    assert 'r3_served_gone_total{reason="expired"} 0.0' in text  # created at 0: ratios find it


def test_batch_and_stream_count_each_rid(serve, spool: Spool) -> None:
    base = serve()
    write_record(spool, "good", random_rows(5))
    write_record(spool, "dir", random_rows(5))
    write_record(spool, "open", random_rows(2), final=False)
    bin_becomes_directory(spool, "dir")
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["good", "none", "dir", "open", "good"]})
    assert r.status_code == 200
    statuses = [h["status"] for h in frames(r.content)]
    assert statuses == [200, 404, 500, 202, 200]
    counts = served(base)
    assert {k: v for k, v in counts.items() if k[0] == "batch"} == {
        ("batch", "200"): 2.0,
        ("batch", "404"): 1.0,
        ("batch", "500"): 1.0,
        ("batch", "202"): 1.0,
    }
    r = httpx.get(f"{base}/routed_experts/good", params={"stream": "true"})
    assert [h["status"] for h in frames(r.content)] == [200]
    r = httpx.get(f"{base}/routed_experts/dir", params={"stream": "true"})
    assert [h["status"] for h in frames(r.content)] == [500]
    counts = served(base)
    assert counts[("frames", "200")] == 1 and counts[("frames", "500")] == 1


def test_failure_after_headers_cuts_the_connection_and_counts_abort(
    serve, spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `.bin` passes the check, then the medium fails mid-body (EIO on the second read)."""
    base = serve(chunk_bytes=4096)
    meta = write_record(spool, "flaky", random_rows(600))
    assert meta.nbytes > 3 * 4096
    real_iter_rows = Spool.iter_rows

    def failing(self: Spool, *args: object, **kwargs: object) -> Iterator[bytes]:
        chunks = real_iter_rows(self, *args, **kwargs)
        yield next(chunks)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Spool, "iter_rows", failing)
    for fmt, params in (("raw", {"format": "raw"}), ("frames", {"stream": "true"})):
        with pytest.raises(httpx.RemoteProtocolError):  # short of Content-Length, or an unterminated chunked body
            httpx.get(f"{base}/routed_experts/flaky", params=params)
        assert served(base).get((fmt, "abort")) == 1.0, served(base)
    assert ("raw", "200") not in served(base)


LEAVING_REQUESTS = {
    "raw": b"GET /routed_experts/big?format=raw HTTP/1.1\r\nHost: x\r\n\r\n",
    "frames": b"GET /routed_experts/big?stream=true HTTP/1.1\r\nHost: x\r\n\r\n",
    "batch": b"POST /routed_experts/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 16\r\n\r\n{"rids":["big"]}',
}


@pytest.mark.usefixtures("gc_off")  # the count may not wait for the collector to close the body
@pytest.mark.parametrize("fmt", LEAVING_REQUESTS)
def test_client_that_leaves_mid_body_is_499(serve, spool: Spool, fmt: str) -> None:
    base = serve(chunk_bytes=4096)
    write_record(spool, "big", random_rows(400_000))  # 12.8 MB: far more than the socket buffers hold
    host, port = base.removeprefix("http://").split(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(LEAVING_REQUESTS[fmt])
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST
    wait_until(lambda: served(base).get((fmt, "499")) == 1.0, 10, lambda: f"one {fmt} 499 counted: {served(base)}")
    assert (fmt, "200") not in served(base)


def test_long_poll_waits_are_not_fetch_latency(serve, spool: Spool) -> None:
    """A long poll's wait is booked as waiting, not as fetch latency, and no second is booked twice.

    Both bounds follow from the order of events, not from the machine's speed: the record is written `HELD_S`
    after the request was seen waiting, so the wait took at least that; and the two histograms split one
    request's time, so together they cannot exceed what the client measured around it (a wait counted in
    fetch latency too would add `HELD_S` again)."""
    held_s = 0.5
    base = serve()

    def write_later() -> None:
        time.sleep(held_s)  # not a wait: how long the long poll waits is the input here
        write_record(spool, "later", random_rows(3))

    t0 = time.perf_counter()
    with when_waited(base, "later", write_later):
        r = httpx.get(f"{base}/routed_experts/later", params={"wait": 30}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200
    assert sample(base, "r3_fetch_wait_seconds_count") == 1
    assert sample(base, "r3_fetch_seconds_count") == 1
    waited, fetched = sample(base, "r3_fetch_wait_seconds_sum"), sample(base, "r3_fetch_seconds_sum")
    assert waited >= held_s, f"the wait booked {waited:.3f} s, the record was held {held_s} s"
    assert waited + fetched <= elapsed, f"wait {waited:.3f} + fetch {fetched:.3f} s > the request's {elapsed:.3f} s"


def test_unexpected_fault_before_headers_is_json_500(serve, spool: Spool, monkeypatch: pytest.MonkeyPatch) -> None:
    base = serve()
    write_record(spool, "x", random_rows(2))

    def broken(*_a: object, **_k: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(Spool, "open_rows", broken)
    r = httpx.get(f"{base}/routed_experts/x")
    assert r.status_code == 500 and r.json()["error"] == "internal_error"
    assert served(base) == {("npy", "500"): 1.0}


def test_open_rows_refuses_what_cannot_be_served(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    meta = write_record(spool, "r", random_rows(3))
    bin_becomes_directory(spool, "r")
    with pytest.raises(IsADirectoryError):
        spool.open_rows(meta)
    shutil.rmtree(spool.bin_path("r"))
    with pytest.raises(Exception, match="missing_bin"):
        spool.open_rows(meta)
