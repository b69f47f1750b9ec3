"""Same-node reads (service.client.local.reads): a real sidecar, its spool on this machine, and clients that read final
records straight from the spool, falling back to HTTP for everything else with the same answers.

"Another node" and "another mount namespace" are real kernel facts here: a client process runs under
`unshare -m` with the boot id file bind-mounted over (what another kernel would show it), or with a fresh
tmpfs over the spool (the same path, other files). "No permission" runs the client as `nobody`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import when_waited
from waiting import wait_until

from service.client import (
    AsyncRoutedExpertsClient,
    BatchItem,
    RoutedExpertsClient,
    RoutedExpertsRef,
    afetch_many,
    fetch_many,
)
from service.client.errors import NotReady, RecordGone, RecordNotFound, RecordRestarted
from service.client.local import spool as local_spool
from service.client.refs import AsyncSidecarPool, SidecarPool
from service.spool import Spool

REPO = Path(__file__).resolve().parents[3]
LAYERS, TOPK = (0, 1, 2, 3, 4, 5), 4


def put(spool: Spool, rid: str, rows: int = 40, *, status: str = "ok", seed: int = 0, final: bool = True, **kw):
    data = np.random.default_rng(seed).integers(0, 128, (rows, len(LAYERS), TOPK), dtype=np.uint8)
    w = spool.writer(rid, num_experts=128, topk=TOPK, layers=LAYERS, prompt_len=7, num_hidden_layers=8, **kw)
    w.append(data)
    if final:
        w.finalize(status)
    return data, w


def fields(r) -> dict:
    return {k: v for k, v in asdict(r).items() if k not in ("array", "source")}


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("r3_local_read", "r3_served_total", "r3_served_bytes_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture
def url(serve) -> str:
    return serve()


def test_local_reads_equal_http_in_every_field(spool: Spool, url: str) -> None:
    data, _ = put(spool, "r1", weight_version=4)
    selections = ({}, {"start": 3, "end": 20}, {"layers": [1, 4]}, {"layers": "2-3"})
    selections += ({"start": 30, "end": 99, "clamp": True},)
    read = []
    with RoutedExpertsClient(url) as local, RoutedExpertsClient(url, local_reads=False) as http:
        for kw in selections:
            a, b = local.get("r1", **kw), http.get("r1", **kw)
            read.append(a)
            assert (a.source, b.source) == ("spool", "http")
            assert fields(a) == fields(b), kw
            np.testing.assert_array_equal(a.array, b.array)
            assert a.array.flags.writeable and a.array.dtype == np.uint8
        np.testing.assert_array_equal(read[0].array, data)
        many = local.get_many(["r1", BatchItem("r1", 5, 9), ("r1", 1, 2)])
        want = http.get_many(["r1", BatchItem("r1", 5, 9), ("r1", 1, 2)])
        for a, b in zip(many, want, strict=True):
            assert a.source == "spool" and fields(a) == fields(b)
            np.testing.assert_array_equal(a.array, b.array)
        read += many
        assert local.local.reads == 8 and local.local.reason is None
    seen = counters(url)  # the client reported its reads when it closed
    assert seen["r3_local_reads_total"] == 8
    assert seen["r3_local_read_bytes_total"] == sum(r.array.nbytes for r in read)
    assert seen['r3_served_total{code="200",format="npy"}'] == 5  # only the HTTP client's gets went through it


def test_everything_but_a_servable_final_record_goes_to_the_sidecar(spool: Spool, url: str) -> None:
    put(spool, "open", final=False)
    put(spool, "failed", status="error")
    aborted, _ = put(spool, "aborted", status="aborted")
    put(spool, "acked")
    put(spool, "old")
    meta = spool.read_meta("old")
    spool.write_meta(replace(meta, updated=time.time() - 10_000))  # past the sidecar's TTL (900 s)
    with RoutedExpertsClient(url, retries=0) as client:
        with pytest.raises(NotReady):
            client.get("open")
        with pytest.raises(RecordGone, match="error"):
            client.get("failed")
        r = client.get("aborted")
        assert (r.source, r.status) == ("spool", "aborted")
        np.testing.assert_array_equal(r.array, aborted)
        assert client.ack("acked")
        with pytest.raises(RecordGone, match="acknowledged"):  # 410 from the sidecar, as over HTTP
            client.get("acked")
        with pytest.raises(RecordGone, match="expired"):
            client.get("old")
        with pytest.raises(RecordNotFound):
            client.get("never")
        with pytest.raises(Exception) as bad_range:
            client.get("aborted", start=100, end=200)
        assert bad_range.value.status == 416  # the sidecar's own error, not a local guess
        got = client.get_many(["open", "failed", "aborted", "never"])
        assert [type(x).__name__ for x in got] == ["NotReady", "RecordGone", "RoutedExperts", "RecordNotFound"]
        assert got[2].source == "spool"
        assert client.local.reads == 2


def test_a_record_that_becomes_final_while_waiting_comes_over_http(spool: Spool, url: str) -> None:
    data, writer = put(spool, "later", final=False)
    with RoutedExpertsClient(url) as client, when_waited(url, "later", writer.finalize):  # first looks: open
        r = client.get("later", wait=20)
        assert r.source == "http"
        np.testing.assert_array_equal(r.array, data)
        assert client.get("later").source == "spool"  # final now


def test_off_by_env_and_by_keyword(spool: Spool, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    put(spool, "r")
    with RoutedExpertsClient(url, local_reads=False) as client:
        assert client.get("r").source == "http" and client.local.reason == "local_reads=False"
    monkeypatch.setenv("R3_LOCAL_READS", "0")
    with RoutedExpertsClient(url) as client:
        assert client.get("r").source == "http" and client.local.reason == "R3_LOCAL_READS=0"
    with RoutedExpertsClient(url, local_reads=True) as client:
        assert client.get("r").source == "spool"


def test_views_and_buffers(spool: Spool, url: str) -> None:
    data, _ = put(spool, "v", rows=3000)
    with RoutedExpertsClient(url, local_view=True) as client:
        r = client.get("v", start=100, end=2000)
        assert r.source == "spool" and not r.array.flags.writeable
        np.testing.assert_array_equal(r.array, data[100:2000])
    given = []

    def buffers(n: int) -> bytearray:
        given.append(bytearray(n))
        return given[-1]

    with RoutedExpertsClient(url, local_buffers=buffers) as client:
        r = client.get("v")
        assert np.shares_memory(r.array, np.frombuffer(given[0], dtype=np.uint8))
        np.testing.assert_array_equal(r.array, data)


def test_torch_buffers_share_memory_and_pinned_needs_cuda(spool: Spool, url: str) -> None:
    torch = pytest.importorskip("torch")
    from service.client.errors import R3Error
    from service.client.pinned import pinned_buffers, torch_buffers

    data, _ = put(spool, "t")
    with RoutedExpertsClient(url, local_buffers=torch_buffers()) as client:
        t = client.get("t").to_torch()
        assert torch.equal(t, torch.from_numpy(data))
    if torch.cuda.is_available():  # a lent GPU: rows land in page-locked memory
        with RoutedExpertsClient(url, local_buffers=pinned_buffers()) as client:
            assert client.get("t").to_torch().is_pinned()
    else:
        with pytest.raises(R3Error, match="CUDA"):
            pinned_buffers()


def test_refs_and_async_paths_read_locally(spool: Spool, url: str) -> None:
    rows = {f"a{i}": put(spool, f"a{i}", rows=30 + i, seed=i)[0] for i in range(6)}
    refs = [RoutedExpertsRef(rid, url=f"{url}/routed_experts/{rid}") for rid in rows]
    with SidecarPool() as pool:
        assert refs[0].fetch(pool=pool).source == "spool"
        assert [r.source for r in fetch_many(refs, pool=pool)] == ["spool"] * 6

    async def main():
        async with AsyncSidecarPool() as pool, AsyncRoutedExpertsClient(url) as client:
            one = await refs[1].afetch(pool=pool)
            many = await afetch_many(refs, pool=pool)
            gets = await asyncio.gather(*(client.get(rid) for rid in rows))
            batch = await client.get_many(list(rows))
            return [one, *many, *gets, *batch]

    got = asyncio.run(main())
    assert {r.source for r in got} == {"spool"}
    for r in got:
        np.testing.assert_array_equal(r.array, rows[r.rid])


def test_a_record_replaced_between_its_metadata_and_its_rows_is_never_mixed(
    spool: Spool, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worst moment, made to happen: the rid is reused after the reader parsed the old `.json` and before it
    opens `.bin`. The reader must notice and give the new record whole (or ask the sidecar), never old metadata
    over new rows."""
    put(spool, "reuse", rows=50, seed=1)
    new_rows: dict[str, np.ndarray] = {}
    real_open = os.open

    def replacing_open(path, flags, *args):
        if str(path).endswith("reuse.bin") and flags == os.O_RDONLY and "data" not in new_rows:
            new_rows["data"] = np.empty(0)
            new_rows["data"], _ = put(spool, "reuse", rows=20, seed=2)  # the writer's whole replacement
        return real_open(path, flags, *args)

    monkeypatch.setattr(local_spool.os, "open", replacing_open)
    with RoutedExpertsClient(url) as client:
        r = client.get("reuse")
    assert new_rows
    meta = spool.read_meta("reuse")
    assert r.created == meta.created and r.rows == 20
    np.testing.assert_array_equal(r.array, new_rows["data"])


def test_rid_reuse_while_readers_read(spool: Spool, url: str) -> None:
    """A writer reuses one rid as fast as it can while two readers read it: every answer is one record whole
    (its rows, its row count and its `created` agree), whichever path it took."""
    stop = threading.Event()
    made: dict[float, int] = {}

    def writer() -> None:
        g = 0
        while not stop.is_set():
            g += 1
            rows = 500 + 97 * (g % 11)
            w = spool.writer("hot", num_experts=256, topk=TOPK, layers=LAYERS, prompt_len=g, num_hidden_layers=8)
            made[w.meta.created] = g
            w.append(np.full((rows, len(LAYERS), TOPK), g % 251, dtype=np.uint8))
            w.finalize()

    results = {"spool": 0, "http": 0, "retry": 0}
    bad: list[str] = []

    def reader() -> None:
        with RoutedExpertsClient(url, retries=0) as client:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                try:
                    r = client.get("hot")
                except (NotReady, RecordNotFound, RecordRestarted):  # not final yet, or replaced on every try (409)
                    results["retry"] += 1
                    continue
                except Exception as exc:
                    bad.append(repr(exc))
                    continue
                g = r.prompt_len
                if r.rows != 500 + 97 * (g % 11) or not (r.array == g % 251).all() or made.get(r.created) != g:
                    bad.append(f"{r.source}: prompt_len {g}, {r.rows} rows, values {np.unique(r.array)[:4]}")
                results[r.source] += 1

    w = threading.Thread(target=writer)
    w.start()
    wait_until(lambda: len(made) >= 2, 10, "the writer finished its first record")
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    w.join()
    assert not bad, bad[:5]
    assert results["spool"] > 50, results


def _child(url: str, rid: str, wrap: list[str]) -> dict:
    script = (
        "import json, sys\n"
        "from service.client import RoutedExpertsClient\n"
        "with RoutedExpertsClient(sys.argv[1]) as c:\n"
        "    r = c.get(sys.argv[2])\n"
        "    print(json.dumps({'source': r.source, 'reason': c.local.reason, 'sum': int(r.array.sum())}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*wrap, sys.executable, "-c", script, url, rid], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (mount namespaces)"
)


@needs_root
def test_another_node_reads_over_http(spool: Spool, url: str, tmp_path: Path) -> None:
    data, _ = put(spool, "n")
    fake = tmp_path / "boot_id"
    fake.write_text("00000000-0000-4000-8000-000000000001\n")
    wrap = ["unshare", "-m", "--", "sh", "-c", f'mount --bind {fake} /proc/sys/kernel/random/boot_id && exec "$@"', "-"]
    got = _child(url, "n", wrap)
    assert got == {"source": "http", "reason": "other node (boot id differs)", "sum": int(data.sum())}
    assert _child(url, "n", [])["source"] == "spool"  # the same child, on this node


@needs_root
def test_another_mount_namespace_without_the_spool_reads_over_http(spool: Spool, url: str) -> None:
    data, _ = put(spool, "m")
    root = spool.root.resolve()
    wrap = ["unshare", "-m", "--", "sh", "-c", f'mount -t tmpfs r3test {root} && exec "$@"', "-"]
    got = _child(url, "m", wrap)
    assert got["source"] == "http" and "not visible here" in got["reason"], got
    assert got["sum"] == int(data.sum())
    shared = ["unshare", "-m", "--"]  # another mount namespace that sees the same spool: local
    assert _child(url, "m", shared)["source"] == "spool"


@needs_root
def test_no_permission_reads_over_http(spool: Spool, url: str) -> None:
    data, _ = put(spool, "p")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing")
    os.chmod(spool.root, 0o700)
    wrap = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    try:
        got = _child(url, "p", wrap)
    finally:
        os.chmod(spool.root, 0o755)
    assert got["source"] == "http" and "permission" in got["reason"], got
    assert got["sum"] == int(data.sum())
