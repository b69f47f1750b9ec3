"""Concurrent async `get`s to one sidecar go as one batch request (service.client.coalesce), against a real sidecar
whose requests are counted as they arrive."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from helpers import FakeClock, live_app
from waiting import await_until

from service.client import AsyncRoutedExpertsClient, RoutedExperts, RoutedExpertsClient
from service.client.errors import ConnectionRefused, NotReady, RangeNotSatisfiable, RecordGone, RecordNotFound
from service.server.api import create_app
from service.server.settings import Settings
from service.spool import Spool

LAYERS = (1, 3, 5, 7)
TOPK = 4
BATCH = ("POST", "/routed_experts/batch")


class Counted:
    """The sidecar's ASGI app, noting each HTTP request's method and path as it arrives."""

    def __init__(self, app: Any) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = self.seen, []
        return seen


@pytest.fixture(autouse=True)
def over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """This file is about the HTTP requests the client makes: same-node reads (on by default) would skip them."""
    monkeypatch.setenv("R3_LOCAL_READS", "0")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Spool:
    return Spool(tmp_path_factory.mktemp("coalesce-spool"))


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="module")
def served(store: Spool, clock: FakeClock) -> Iterator[tuple[str, Counted]]:
    app = Counted(create_app(Settings(spool_dir=store.root, rescan_s=0.5), deadline_clock=clock))
    with live_app(app) as base:
        yield base, app


def put(spool: Spool, rid: str, rows: int = 12, *, final: bool = True, status: str = "ok", seed: int = 0):
    array = np.random.default_rng(seed).integers(0, 64, (rows, len(LAYERS), TOPK), dtype=np.uint8)
    writer = spool.writer(rid, num_experts=64, topk=TOPK, layers=LAYERS, prompt_len=rows // 2, engine="t/dp0")
    writer.append(array)
    if final:
        writer.finalize(status)
    return array, writer


def same_record(a: RoutedExperts, b: RoutedExperts) -> None:
    """Every field a caller sees, the array's bytes included, equal between the batch and the single path."""
    np.testing.assert_array_equal(a.array, b.array)
    assert a.array.dtype == b.array.dtype
    fields = [f for f in RoutedExperts.__dataclass_fields__ if f != "array"]
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}


def same_error(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b) and str(a) == str(b)
    assert (a.rid, a.status) == (b.rid, b.status)  # type: ignore[attr-defined]


def test_concurrent_gets_are_one_batch_each_caller_its_own_rows(store: Spool, served) -> None:
    url, app = served
    arrays = {f"co-{i}": put(store, f"co-{i}", rows=5 + i, seed=i)[0] for i in range(10)}

    async def main() -> list[RoutedExperts]:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            return await asyncio.gather(*(ac.get(rid, start=i % 3) for i, rid in enumerate(arrays)))

    got = asyncio.run(main())
    assert sorted(app.take()) == [("GET", "/routed_experts/co-0"), BATCH]  # the first goes at once, alone
    with RoutedExpertsClient(url) as sc:
        for i, (rid, r) in enumerate(zip(arrays, got, strict=True)):
            np.testing.assert_array_equal(r.array, arrays[rid][i % 3 :])
            same_record(r, sc.get(rid, start=i % 3))
    assert len({r.array.ctypes.data for r in got}) == len(got)  # each its own memory


def test_each_error_raises_only_in_its_caller_as_a_lone_get_would(store: Spool, served) -> None:
    url, app = served
    put(store, "er-ok", rows=6, seed=1)
    put(store, "er-open", rows=3, final=False)
    put(store, "er-failed", rows=2, status="error")
    calls = [("er-ok", {}), ("er-missing", {}), ("er-open", {}), ("er-failed", {}), ("er-ok", {"start": 50})]

    async def main() -> tuple[list[Any], list[Any]]:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            together = await asyncio.gather(*(ac.get(rid, **kw) for rid, kw in calls), return_exceptions=True)
            assert sorted(app.take()) == [("GET", "/routed_experts/er-ok"), BATCH]
            alone = [await asyncio.gather(ac.get(rid, **kw), return_exceptions=True) for rid, kw in calls]
            assert [m for m, _ in app.take()] == ["GET"] * len(calls)
            return together, [a[0] for a in alone]

    together, alone = asyncio.run(main())
    same_record(together[0], alone[0])
    kinds = [RecordNotFound, NotReady, RecordGone, RangeNotSatisfiable]
    for got, single, kind in zip(together[1:], alone[1:], kinds, strict=True):
        assert isinstance(got, kind)
        same_error(got, single)
    assert together[2].rows == alone[2].rows == 3


def test_mixed_parameters_split_into_batches_that_can_carry_them(store: Spool, served) -> None:
    url, app = served
    arrays = {f"mx-{i}": put(store, f"mx-{i}", rows=8, seed=10 + i)[0] for i in range(4)}
    rids = list(arrays)

    async def main() -> list[Any]:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            return await asyncio.gather(
                ac.get(rids[0]),  # the first of its kind goes alone
                ac.get(rids[1], layers=[3, 5]),  # alone
                ac.get(rids[2]),  # batch 1
                ac.get(rids[3], layers="3-5"),  # the same layers in other words: its own key, alone
                ac.get(rids[0], layers=[3, 5], end=4),  # batch 2
                ac.get(rids[1], end=99, clamp=True),  # alone
                ac.fetch_bytes(rids[2], fmt="raw"),  # never coalesced
                ac.get(rids[3]),  # batch 1
                ac.get(rids[2], layers=[3, 5]),  # batch 2
            )

    got = asyncio.run(main())
    gets = [("GET", f"/routed_experts/{rid}") for rid in (rids[0], rids[1], rids[3], rids[1], rids[2])]
    assert sorted(app.take()) == sorted([BATCH, BATCH, *gets])
    np.testing.assert_array_equal(got[0].array, arrays[rids[0]])
    np.testing.assert_array_equal(got[1].array, arrays[rids[1]][:, [1, 2]])
    np.testing.assert_array_equal(got[2].array, arrays[rids[2]])
    np.testing.assert_array_equal(got[3].array, arrays[rids[3]][:, [1, 2]])
    np.testing.assert_array_equal(got[4].array, arrays[rids[0]][:4, [1, 2]])
    assert got[5].clamped and got[5].rows == 8
    assert got[6] == arrays[rids[2]].tobytes()
    np.testing.assert_array_equal(got[7].array, arrays[rids[3]])
    np.testing.assert_array_equal(got[8].array, arrays[rids[2]][:, [1, 2]])


def test_a_lone_get_goes_alone(store: Spool, served) -> None:
    url, app = served
    array, _ = put(store, "lone", rows=4, seed=5)

    async def main() -> RoutedExperts:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            first = await ac.get("lone")
            await asyncio.gather(ac.get("lone"), asyncio.sleep(0))  # not a wait: something else, not a get
            return first

    np.testing.assert_array_equal(asyncio.run(main()).array, array)
    assert app.take() == [("GET", "/routed_experts/lone")] * 2


def test_a_batch_refused_whole_falls_back_to_each_callers_own_get(store: Spool, served) -> None:
    url, app = served
    put(store, "rf-a", rows=4)

    async def main() -> tuple[list[Any], Any]:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            rids = ("rf-a", "rf-b", "rf-c")
            together = await asyncio.gather(*(ac.get(r, layers="3-x") for r in rids), return_exceptions=True)
            alone = (await asyncio.gather(ac.get("rf-a", layers="3-x"), return_exceptions=True))[0]
            return together, alone

    together, alone = asyncio.run(main())
    seen = app.take()
    assert seen.count(BATCH) == 1 and seen[-1] == ("GET", "/routed_experts/rf-a")
    assert sorted(s for s in seen[:-1] if s != BATCH) == [("GET", f"/routed_experts/rf-{x}") for x in "abc"]
    for got in together:
        assert type(got) is type(alone) and got.status == alone.status == 422


def test_cancelling_one_caller_leaves_the_others_their_rows(store: Spool, served, clock: FakeClock) -> None:
    url, app = served
    a, _ = put(store, "cx-a", rows=3, seed=7)
    b, writer = put(store, "cx-b", rows=2, final=False, seed=8)
    more = np.full((2, len(LAYERS), TOPK), 9, dtype=np.uint8)

    async def main() -> list[Any]:
        async with AsyncRoutedExpertsClient(url, retries=1) as ac:
            app.take()
            tasks = [asyncio.create_task(ac.get(r, wait=30)) for r in ("cx-a", "cx-b", "cx-a")]
            # the batch (cx-b, cx-a) is on the server, waiting for cx-b
            await await_until(lambda: BATCH in app.seen, 30, "the batch request on the server")
            tasks[2].cancel()
            await await_until(tasks[2].done, 10, "the cancelled caller has left")
            writer.append(more)
            writer.finalize()
            return await asyncio.gather(*tasks, return_exceptions=True)

    got = asyncio.run(main())
    assert sorted(app.take()) == [("GET", "/routed_experts/cx-a"), BATCH]
    np.testing.assert_array_equal(got[0].array, a)
    np.testing.assert_array_equal(got[1].array, np.concatenate([b, more]))
    assert isinstance(got[2], asyncio.CancelledError)


def test_coalesce_false_sends_each_get_alone(store: Spool, served) -> None:
    url, app = served
    arrays = {f"off-{i}": put(store, f"off-{i}", rows=3, seed=20 + i)[0] for i in range(3)}

    async def main() -> list[RoutedExperts]:
        async with AsyncRoutedExpertsClient(url, retries=1, coalesce=False) as ac:
            app.take()
            return await asyncio.gather(*(ac.get(rid) for rid in arrays))

    for rid, r in zip(arrays, asyncio.run(main()), strict=True):
        np.testing.assert_array_equal(r.array, arrays[rid])
    assert sorted(app.take()) == [("GET", f"/routed_experts/{rid}") for rid in arrays]


def test_a_batch_that_cannot_connect_raises_in_every_caller_after_the_retries() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> list[Any]:
        async with AsyncRoutedExpertsClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as ac:
            return await asyncio.gather(*(ac.get(f"r{i}") for i in range(4)), return_exceptions=True)

    errors = asyncio.run(main())
    assert [type(e) for e in errors] == [ConnectionRefused] * 4  # an R3Error naming the URL, still an httpx one
    assert all(isinstance(e, httpx.ConnectError) and f"127.0.0.1:{port}" in str(e) for e in errors)
