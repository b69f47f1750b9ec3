"""The trainer client against the module's one real sidecar (uvicorn on 127.0.0.1): GET, batches, acks, streams
that resume or refuse to splice, torch and asyncio. Its pure parsers are `test_client_parsers.py`'s, its retries of a
refused connection `test_client_retries.py`'s."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from client_records import LAYERS, TOPK, put
from helpers import FakeClock, live_server
from tcp_proxy import Proxy

from service.client import AsyncRoutedExpertsClient, R3Error, RoutedExperts, RoutedExpertsClient
from service.client.errors import (
    BadRequest,
    NotReady,
    RangeNotSatisfiable,
    RecordGone,
    RecordNotFound,
    RecordRestarted,
    Unauthorized,
)
from service.server.settings import Settings
from service.spool import Spool


@pytest.fixture(scope="module")
def shared_spool(tmp_path_factory: pytest.TempPathFactory) -> Spool:
    """The spool the module's one sidecar (`url`) serves; each test writes its own rids into it."""
    return Spool(tmp_path_factory.mktemp("shared-spool"))


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    """The module sidecar's deadline clock: it moves only when a test runs a wait out (`clock.run_out`)."""
    return FakeClock()


@pytest.fixture(scope="module")
def url(shared_spool: Spool, clock: FakeClock) -> Iterator[str]:
    with live_server(Settings(spool_dir=shared_spool.root, rescan_s=0.5), deadline_clock=clock) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[RoutedExpertsClient]:
    with RoutedExpertsClient(url, timeout=10, retries=2, backoff_s=0.05) as c:
        yield c


# ---- GET ------------------------------------------------------------------------------------------


def test_get_returns_rows_and_metadata_without_copy(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    array, _ = put(shared_spool, "get-whole", rows=33, start=7)
    r = client.get("get-whole")
    assert isinstance(r, RoutedExperts)
    np.testing.assert_array_equal(r.array, array)
    assert (r.rid, r.start, r.end, r.prompt_len, r.layers, r.final, r.dtype) == (
        "get-whole",
        7,
        40,
        7 + 33 // 2,
        LAYERS,
        True,
        "uint8",
    )
    # Parsed in place: the array views the body buffer it was read into, and that buffer is writable.
    assert r.array.base is not None and r.array.flags.writeable


def test_get_ranges_and_layers(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    array, _ = put(shared_spool, "get-range", rows=20, start=100)
    np.testing.assert_array_equal(client.get("get-range", start=105, end=112).array, array[5:12])
    r = client.get("get-range", start=110, layers=[7, 1])
    assert r.start == 110 and r.layers == (7, 1)
    np.testing.assert_array_equal(r.array, array[10:, [3, 0], :])
    with pytest.raises(RangeNotSatisfiable) as exc:
        client.get("get-range", start=99)
    assert exc.value.status == 416 and exc.value.detail
    with pytest.raises(RangeNotSatisfiable):
        client.get("get-range", start=110, end=121)
    with pytest.raises(BadRequest) as bad:
        client.get("get-range", layers=[2])
    assert bad.value.status == 422 and "2" in bad.value.detail


def test_wait_until_final(shared_spool: Spool, client: RoutedExpertsClient, clock: FakeClock) -> None:
    array, writer = put(shared_spool, "get-wait", rows=5, final=False)
    with pytest.raises(NotReady) as exc:
        client.get("get-wait")
    assert exc.value.status == 202 and exc.value.rows == 5

    more = np.full((3, len(LAYERS), TOPK), 9, dtype=np.uint8)

    reads = clock.reads

    def finish() -> None:
        clock.wait_reads(reads + 1)  # the server's wait has begun: the rows arrive during it
        writer.append(more)
        writer.finalize()

    thread = threading.Thread(target=finish)
    thread.start()
    r = client.get("get-wait", wait=10)
    thread.join()
    assert r.final and r.rows == 8
    np.testing.assert_array_equal(r.array, np.concatenate([array, more]))


def test_errors_carry_the_server_detail(shared_spool: Spool, client: RoutedExpertsClient, clock: FakeClock) -> None:
    with pytest.raises(RecordNotFound) as missing:
        client.get("no-such-rid")
    assert missing.value.status == 404 and missing.value.detail and missing.value.rid == "no-such-rid"

    def get_missing_after_wait() -> RecordNotFound:
        with pytest.raises(RecordNotFound) as waited:
            client.get("no-such-rid", wait=0.4)
        return waited.value

    # The client sends its wait; the server answers 404 only once that wait has run out on its clock.
    assert clock.run_out(get_missing_after_wait, 0.4).status == 404
    put(shared_spool, "get-failed", rows=4, status="error")
    with pytest.raises(RecordGone) as gone:
        client.get("get-failed")
    assert gone.value.status == 410 and "error" in gone.value.detail
    aborted, _ = put(shared_spool, "get-aborted", rows=4, status="aborted")
    r = client.get("get-aborted")
    assert r.status == "aborted" and r.final
    np.testing.assert_array_equal(r.array, aborted)
    put(shared_spool, "get-open", rows=5, final=False)
    with pytest.raises(NotReady) as pending:
        client.get("get-open")
    assert pending.value.rows == 5 and "5 rows so far" in str(pending.value)
    assert all(issubclass(e, R3Error) for e in (RecordNotFound, RecordGone, RangeNotSatisfiable, NotReady))


def test_unauthorized(spool: Spool) -> None:
    array, _ = put(spool, "secret", rows=3)
    with live_server(Settings(spool_dir=spool.root, auth_token="s3cret")) as base:
        with RoutedExpertsClient(base) as anonymous, pytest.raises(Unauthorized) as exc:
            anonymous.get("secret")
        assert exc.value.status == 401
        with RoutedExpertsClient(base, token="wrong") as wrong, pytest.raises(Unauthorized):
            wrong.get("secret")
        with RoutedExpertsClient(base, token="s3cret") as ok:
            np.testing.assert_array_equal(ok.get("secret").array, array)


@pytest.mark.parametrize("rid", ["a/b", "req 1 ü?#&=%", "../etc", "x" * 300, ".", ".."])
def test_rids_that_need_escaping(shared_spool: Spool, client: RoutedExpertsClient, rid: str) -> None:
    array, _ = put(shared_spool, rid, rows=3)
    r = client.get(rid)
    assert r.rid == rid
    np.testing.assert_array_equal(r.array, array)
    assert [x.rid for x in client.get_many([rid])] == [rid]
    assert sum(b.rows for b in client.stream(rid)) == 3
    assert client.ack(rid)


# ---- batch, ack, engines ---------------------------------------------------------------------------------


def test_get_many_keeps_order_and_per_rid_status(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    a, _ = put(shared_spool, "many-a", rows=6, seed=1)
    b, _ = put(shared_spool, "many-b", rows=9, seed=2)
    put(shared_spool, "many-gone", rows=2, status="error")
    results = client.get_many(["many-b", "many-missing", "many-a", "many-gone", "many-b"])
    assert [type(x).__name__ for x in results] == [
        "RoutedExperts",
        "RecordNotFound",
        "RoutedExperts",
        "RecordGone",
        "RoutedExperts",
    ]
    np.testing.assert_array_equal(results[0].array, b)
    np.testing.assert_array_equal(results[2].array, a)
    np.testing.assert_array_equal(results[4].array, b)
    assert results[1].rid == "many-missing"
    narrowed = client.get_many(["many-a"], layers=[5])
    np.testing.assert_array_equal(narrowed[0].array, a[:, [2], :])


def test_ack_frees_the_record(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    put(shared_spool, "acked", rows=3)
    assert client.ack("acked") is True
    assert not shared_spool.meta_path("acked").exists() and not shared_spool.bin_path("acked").exists()
    with pytest.raises(RecordGone, match="acknowledged"):  # 410: it left, it did not never exist
        client.get("acked")
    with pytest.raises(RecordNotFound, match="already acknowledged"):
        client.ack("acked")
    assert client.ack("acked", missing_ok=True) is False


def test_engines(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    shared_spool.write_engine({"engine": "pod-a/dp0", "dp_rank": 0, "budget": [], "occupancy": []})
    assert "pod-a/dp0" in [e["engine"] for e in client.engines()]


# ---- streaming ------------------------------------------------------------------------------------------


def append_each_read(writer, blocks: list[np.ndarray]) -> Callable[[], None]:
    """`step()` after each block a stream yields appends the next block (the last one also finalizes the record):
    rows arrive while the record is open, one block per read, with no timed pause to race the reader."""
    pending = list(blocks)

    def step() -> None:
        if pending:
            writer.append(pending.pop(0))
            if not pending:
                writer.finalize()

    return step


def test_stream_yields_rows_as_they_are_appended(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    prompt, writer = put(shared_spool, "streamed", rows=10, final=False)
    blocks = [np.full((1, len(LAYERS), TOPK), i, dtype=np.uint8) for i in range(4)]
    step, seen = append_each_read(writer, blocks), []
    for block in client.stream("streamed"):
        seen.append(block)
        step()
    assert len([b for b in seen if b.rows]) == 1 + len(blocks), "each appended block arrives as its own block"
    assert all(b.rows for b in seen[:-1]) and [b.start for b in seen] == sorted(b.start for b in seen)
    assert seen[-1].final and not any(b.final for b in seen[:-1])  # the last block says so, rows or not
    np.testing.assert_array_equal(np.concatenate([b.array for b in seen]), np.concatenate([prompt, *blocks]))


@pytest.mark.parametrize("status", ["ok", "aborted"])
def test_a_stream_whose_record_ends_without_new_rows_yields_a_final_block(
    shared_spool: Spool, client: RoutedExpertsClient, status: str
) -> None:
    """The record is finalized after the stream sent its rows, with no rows of its own: the sidecar's closing
    frame is empty, and the last block the caller gets says the record is final and how it ended."""
    prompt, writer = put(shared_spool, f"ends-{status}", rows=6, final=False)
    seen = []
    for block in client.stream(f"ends-{status}"):
        seen.append(block)
        if len(seen) == 1:
            writer.finalize(status)
    assert [(b.rows, b.final) for b in seen] == [(6, False), (0, True)]
    assert seen[-1].status == status and seen[-1].start == 6
    np.testing.assert_array_equal(np.concatenate([b.array for b in seen]), prompt)


def test_stream_resumes_after_a_dropped_connection(shared_spool: Spool, url: str) -> None:
    prompt, writer = put(shared_spool, "resumed", rows=40, final=False)
    proxy = Proxy(int(url.rsplit(":", 1)[1]))
    blocks = [np.full((2, len(LAYERS), TOPK), 50 + i, dtype=np.uint8) for i in range(4)]
    try:
        with RoutedExpertsClient(f"http://127.0.0.1:{proxy.port}", retries=3, backoff_s=0.05) as client:
            stream = client.stream("resumed")
            seen = [next(stream)]
            assert seen[0].rows == 40
            proxy.cut_all()
            for block in blocks:  # the record grows and ends while the client reconnects
                writer.append(block)
            writer.finalize()
            seen += list(stream)
    finally:
        proxy.close()
    assert proxy.connections >= 2, "the first connection was cut, so the client must have reconnected"
    assert "start=" not in proxy.requests[0] and "start=40" in proxy.requests[1], proxy.requests
    got = np.concatenate([b.array for b in seen])
    np.testing.assert_array_equal(got, np.concatenate([prompt, *blocks]))


def test_stream_never_splices_a_restarted_record(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    """A retracted request's live record starts over under the same rid: the open stream must say so (409)
    instead of appending the recomputed rows to the ones it already yielded."""
    put(shared_spool, "restarted", rows=6, final=False)
    stream = client.stream("restarted")
    assert next(stream).rows == 6
    _, again = put(shared_spool, "restarted", rows=0, final=False, seed=1)
    again.append(np.zeros((8, len(LAYERS), TOPK), dtype=np.uint8))
    with pytest.raises(RecordRestarted) as exc:
        next(stream)
    assert exc.value.status == 409 and exc.value.body["error"] == "record_restarted", "the server's own 409 frame"
    again.finalize()
    assert client.get("restarted").rows == 8, "read again from its start, the new record is whole"


def test_resumed_stream_notices_a_restart_across_reconnects(shared_spool: Spool, url: str) -> None:
    put(shared_spool, "restarted-offline", rows=4, final=False)
    proxy = Proxy(int(url.rsplit(":", 1)[1]))
    try:
        with RoutedExpertsClient(f"http://127.0.0.1:{proxy.port}", retries=3, backoff_s=0.05) as client:
            stream = client.stream("restarted-offline")
            assert next(stream).rows == 4
            proxy.cut_all()
            _, again = put(shared_spool, "restarted-offline", rows=0, final=False, seed=2)
            again.append(np.zeros((9, len(LAYERS), TOPK), dtype=np.uint8))
            again.finalize()
            with pytest.raises(RecordRestarted):
                list(stream)
    finally:
        proxy.close()


def test_stream_reconnects_after_sitting_idle(shared_spool: Spool, url: str) -> None:
    prompt, writer = put(shared_spool, "idle", rows=5, final=False)
    proxy = Proxy(int(url.rsplit(":", 1)[1]))
    late = np.full((2, len(LAYERS), TOPK), 3, dtype=np.uint8)

    def append_once_reconnected() -> None:
        if proxy.wait_connections(2, timeout=30):  # the first stream sat idle past stream_idle_s and was dropped
            writer.append(late)
        writer.finalize()

    thread = threading.Thread(target=append_once_reconnected)
    thread.start()
    try:
        with RoutedExpertsClient(f"http://127.0.0.1:{proxy.port}", stream_idle_s=0.3, backoff_s=0.01) as client:
            seen = list(client.stream("idle"))
    finally:
        thread.join()
        proxy.close()
    assert proxy.connections >= 2 and "start=5" in proxy.requests[-1], proxy.requests
    np.testing.assert_array_equal(np.concatenate([b.array for b in seen]), np.concatenate([prompt, late]))


# ---- retries, torch, async ---------------------------------------------------------------------------------


def test_http_errors_are_not_retried(shared_spool: Spool, url: str) -> None:
    proxy = Proxy(int(url.rsplit(":", 1)[1]))
    try:
        with RoutedExpertsClient(f"http://127.0.0.1:{proxy.port}", retries=5) as c, pytest.raises(RecordNotFound):
            c.get("never-there")
    finally:
        proxy.close()
    assert proxy.connections == 1


def test_to_torch_shares_memory(shared_spool: Spool, client: RoutedExpertsClient) -> None:
    torch = pytest.importorskip("torch")
    array, _ = put(shared_spool, "torch", rows=6)
    r = client.get("torch")
    t = r.to_torch()
    assert t.dtype == torch.uint8 and tuple(t.shape) == array.shape
    assert t.data_ptr() == r.array.ctypes.data
    assert torch.equal(t, torch.from_numpy(array))


def test_async_client(shared_spool: Spool, url: str) -> None:
    a, _ = put(shared_spool, "async-a", rows=7, seed=3)
    prompt, writer = put(shared_spool, "async-stream", rows=3, final=False)
    blocks = [np.full((1, len(LAYERS), TOPK), 7, dtype=np.uint8)] * 3

    async def main() -> None:
        async with AsyncRoutedExpertsClient(url, retries=2) as client:
            r = await client.get("async-a", start=2, end=5, layers=[3])
            np.testing.assert_array_equal(r.array, a[2:5, [1], :])
            many = await client.get_many(["async-a", "async-nope"])
            assert isinstance(many[0], RoutedExperts) and isinstance(many[1], RecordNotFound)
            step, seen = append_each_read(writer, blocks), []
            async for block in client.stream("async-stream"):
                seen.append(block)
                step()
            np.testing.assert_array_equal(np.concatenate([b.array for b in seen]), np.concatenate([prompt, *blocks]))
            put(shared_spool, "async-gone", rows=1, status="error")
            with pytest.raises(RecordGone):
                await client.get("async-gone")
            assert await client.ack("async-a") is True

    asyncio.run(main())
