"""`stream=true` and `POST /routed_experts/batch`: frames delivered as rows arrive, in request order."""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import numpy as np
import orjson
import pytest
from helpers import FakeClock, random_rows, when_waited, write_record

from service.spool import Spool
from service.wire.frames import FRAMES_MEDIA_TYPE, parse_frames


def iter_frames(response: httpx.Response) -> Iterator[tuple[dict, bytes]]:
    """Parse frames incrementally from a streaming response: each (header, payload) as soon as it is complete."""
    buf = b""
    for chunk in response.iter_bytes():
        buf += chunk
        while len(buf) >= 4:
            (hlen,) = struct.unpack_from("<I", buf)
            if len(buf) < 4 + hlen:
                break
            header = orjson.loads(buf[4 : 4 + hlen])
            size = int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize
            if len(buf) < 4 + hlen + size:
                break
            yield header, buf[4 + hlen : 4 + hlen + size]
            buf = buf[4 + hlen + size :]
    assert buf == b"", "stray bytes after the last frame"


def read_frames(response: httpx.Response) -> list[tuple[dict, bytes]]:
    return list(iter_frames(response))


def test_stream_delivers_rows_as_written_then_ends_at_final(serve, spool: Spool) -> None:
    """Each piece is written, and the record finalized, only once the stream has delivered every row before it:
    so the rows arrive while the record is open (a stream holding them back would hang this test until its
    30 s timeout), and the final frame comes after."""
    base = serve(rescan_s=60, chunk_bytes=4096)
    pieces = [random_rows(n, seed=n) for n in (5, 600, 1, 30)]  # 600 rows of 32 B cross several 4 KiB frames
    writer = spool.writer("live/1", num_experts=128, topk=8, layers=[0, 1, 2, 3], start=10, prompt_len=8)
    writer.append(pieces[0])
    frames: list[tuple[dict, bytes]] = []

    with httpx.stream(
        "GET", f"{base}/routed_experts/{quote('live/1', safe='')}", params={"stream": "true"}, timeout=30
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"] == FRAMES_MEDIA_TYPE
        assert r.headers["x-r3-final"] == "false"
        incoming = iter_frames(r)

        def take_rows(written: int) -> None:
            while sum(h["shape"][0] for h, _ in frames) < written:
                frames.append(next(incoming))

        for i, piece in enumerate(pieces[1:], 1):
            take_rows(sum(len(p) for p in pieces[:i]))
            writer.append(piece)
        take_rows(sum(len(p) for p in pieces))
        while_open = len(frames)
        writer.finalize()
        frames += incoming
    data = b"".join(payload for _, payload in frames)
    assert data == np.concatenate(pieces).astype(np.uint8).tobytes()
    assert frames[-1][0]["final"] is True and all(not h["final"] for h, _ in frames[:-1])
    starts = [h["start"] for h, _ in frames if h["shape"][0]]
    assert starts[0] == 10 and starts == sorted(starts)
    assert while_open >= 3, "rows must arrive in several frames while the record is still open"


def test_stream_may_start_past_the_rows_written_so_far(serve, spool: Spool) -> None:
    """A trainer may ask for rows the engine has not produced yet: the stream waits for them (no 409)."""
    base = serve(rescan_s=60)
    rows = random_rows(30, seed=3)
    writer = spool.writer("ahead", num_experts=128, topk=8, layers=[0, 1, 2, 3])
    writer.append(rows[:5])

    def produce() -> None:
        for lo, hi in ((5, 12), (12, 30)):
            time.sleep(0.2)  # not a wait: the producer's pace, so the stream waits for rows past those written
            writer.append(rows[lo:hi])
        writer.finalize()

    with httpx.stream("GET", f"{base}/routed_experts/ahead", params={"stream": 1, "start": 20}, timeout=30) as r:
        threading.Thread(target=produce).start()
        frames = read_frames(r)
    assert all(h["status"] == 200 for h, _ in frames), [h for h, _ in frames]
    assert b"".join(p for _, p in frames) == rows[20:].astype(np.uint8).tobytes()
    assert frames[0][0]["start"] == 20 and frames[-1][0]["final"]


@pytest.mark.parametrize(("start", "end", "want"), [(9, None, [416]), (1, 9, [200, 416]), (1, 4, [200, 200])])
def test_stream_past_the_end_a_record_is_finalized_with_ends_in_416(
    serve, spool: Spool, start: int, end: int | None, want: list[int]
) -> None:
    """Rows asked for but never written are an error, not a silently short stream."""
    base = serve(rescan_s=60)
    rows = random_rows(4)
    writer = spool.writer("short", num_experts=128, topk=8, layers=[0, 1, 2, 3])
    writer.append(rows)
    params = {"stream": 1, "start": start, **({"end": end} if end is not None else {})}
    # A range past the rows written waits for more: the record is finalized once the stream waits. A range
    # within them ends without waiting.
    finalize = when_waited(base, "short", writer.finalize) if want[-1] == 416 else contextlib.nullcontext()
    with httpx.stream("GET", f"{base}/routed_experts/short", params=params, timeout=30) as r, finalize:
        frames = read_frames(r)
    assert [h["status"] for h, _ in frames] == want
    assert b"".join(p for _, p in frames) == rows[start:end].astype(np.uint8).tobytes()
    if want[-1] == 416:
        assert frames[-1][0]["error"] == "range_not_satisfiable" and f"start={start}" in frames[-1][0]["detail"]
    else:
        assert frames[-1][1] == b"", "the range is whole: an empty closing frame"


def test_stream_of_final_record_and_layers(serve, spool: Spool) -> None:
    base = serve()
    rows = random_rows(40, layers=4, topk=2)
    write_record(spool, "done", rows, layers=[4, 8, 12, 16])
    with httpx.stream("GET", f"{base}/routed_experts/done", params={"stream": 1, "layers": "16,4", "start": 5}) as r:
        frames = read_frames(r)
    assert b"".join(p for _, p in frames) == rows[5:, [3, 0]].astype(np.uint8).tobytes()
    assert frames[0][0]["layers"] == [16, 4] and frames[-1][0]["final"]


def test_stream_ends_with_final_frame_when_aborted(serve, spool: Spool) -> None:
    base = serve(rescan_s=60)
    writer = spool.writer("dies", num_experts=8, topk=1, layers=[0])
    writer.append(np.zeros((3, 1, 1)))
    with (
        httpx.stream("GET", f"{base}/routed_experts/dies", params={"stream": "true"}, timeout=30) as r,
        when_waited(base, "dies", writer.abort),
    ):
        frames = read_frames(r)
    assert frames[0][0]["status"] == 200 and frames[0][1] == b"\0\0\0"
    last = frames[-1][0]
    assert last["status"] == 200 and last["final"] and last["record_status"] == "aborted"
    assert all(h["status"] == 200 for h, _ in frames)


def test_stream_errors_before_it_starts(serve, spool: Spool) -> None:
    base = serve()
    write_record(spool, "gone", random_rows(2), status="error")
    assert httpx.get(f"{base}/routed_experts/nobody", params={"stream": "true"}).status_code == 404
    assert httpx.get(f"{base}/routed_experts/gone", params={"stream": "true"}).status_code == 410
    write_record(spool, "cut", random_rows(2, seed=5), status="aborted")
    with httpx.stream("GET", f"{base}/routed_experts/cut", params={"stream": "true"}) as r:
        frames = read_frames(r)
    assert r.status_code == 200 and r.headers["x-r3-status"] == "aborted"
    assert frames[-1][0]["final"] and frames[-1][0]["record_status"] == "aborted"
    assert b"".join(p for _, p in frames) == random_rows(2, seed=5).astype(np.uint8).tobytes()
    write_record(spool, "s416", random_rows(2), start=4)
    assert httpx.get(f"{base}/routed_experts/s416", params={"stream": "true", "start": 1}).status_code == 416


def test_batch_keeps_request_order_with_per_rid_status(serve, spool: Spool) -> None:
    base = serve()
    a, b = random_rows(30, seed=1), random_rows(7, seed=2)
    write_record(spool, "a", a, layers=[0, 1, 2, 3], start=3)
    write_record(spool, "b/é", b, layers=[0, 1, 2, 3])
    write_record(spool, "open", b, final=False)
    write_record(spool, "aborted", b, status="aborted")
    write_record(spool, "failed", b, status="error")
    rids = ["b/é", "missing", "a", "open", "aborted", "a", "failed"]
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": rids, "layers": [2, 0]})
    assert r.status_code == 200 and r.headers["content-type"] == FRAMES_MEDIA_TYPE
    frames = parse_frames(r.content)
    assert [h["rid"] for h, _ in frames] == rids
    assert [h["status"] for h, _ in frames] == [200, 404, 200, 202, 200, 200, 410]
    assert frames[4][0]["record_status"] == "aborted" and frames[4][1] == b[:, [2, 0]].astype(np.uint8).tobytes()
    assert frames[0][0]["record_status"] == "ok" and "7 rows so far" in frames[3][0]["detail"]
    assert frames[0][1] == b[:, [2, 0]].astype(np.uint8).tobytes()
    assert frames[2][1] == frames[5][1] == a[:, [2, 0]].astype(np.uint8).tobytes()
    assert frames[2][0]["start"] == 3 and frames[2][0]["shape"] == [30, 2, 8] and frames[2][0]["layers"] == [2, 0]
    assert frames[3][0]["rows"] == 7 and frames[3][1] == b""
    write_record(spool, "other-layers", b, layers=[5, 6, 7, 8])
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["other-layers"], "layers": [2]})
    assert parse_frames(r.content)[0][0]["status"] == 422


def test_batch_wait_shares_one_deadline(serve, spool: Spool) -> None:
    """One deadline for all rids, not one per rid: the clock passes it once, and every rid still missing is
    answered (a deadline per rid would keep the next one waiting on a clock that no longer moves, until the
    client's 30 s timeout)."""
    clock = FakeClock()
    base = serve(rescan_s=60, deadline_clock=clock)
    rows = random_rows(4)
    rids = ["soon", "never-1", "never-2", "never-3", "never-4"]
    with httpx.stream("POST", f"{base}/routed_experts/batch", json={"rids": rids, "wait": 0.6}, timeout=30) as r:
        incoming = iter_frames(r)
        clock.wait_reads(2)  # the batch is under way: its deadline set, its wait on "soon" begun
        write_record(spool, "soon", rows)  # arrives during the wait: the clock has not moved
        frames = [next(incoming)]
        clock.advance(0.6 + 1)  # the one deadline passes
        frames += incoming
    assert [h["status"] for h, _ in frames] == [200, 404, 404, 404, 404]
    assert frames[0][1] == rows.astype(np.uint8).tobytes()
