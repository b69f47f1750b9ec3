"""Item 2: the spool is full.

The engine writer (`engine_ext.core.writer.SpoolWriter`, used directly as the scheduler hook uses it) refuses the
reservation, so the request keeps SGLang's inline payload and `fallback_inline` counts it; no partial record is
ever served as final while that happens; and once trainers acknowledge (DELETE), reservations succeed again.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
from r3_harness import LAYERS, NUM_EXPERTS, TOPK, expected_rows
from waiting import WaitTimeout, wait_until

from engine_ext.core.records import RecordSpec
from engine_ext.core.writer import Op, SpoolWriter, undelivered_reason
from service.spool import Spool

ROWS = 64
ROW_BYTES = len(LAYERS) * TOPK
CAPACITY = 24_000  # ~ 10 records of 1.5 KiB rows plus metadata


def _spec(rid: str) -> RecordSpec:
    return RecordSpec(
        rid=rid,
        num_experts=NUM_EXPERTS,
        topk=TOPK,
        layers=LAYERS,
        start=0,
        prompt_len=ROWS // 2,
        dtype="uint8",
        engine="rel/dp0",
    )


def _offer(writer: SpoolWriter, rid: str) -> np.ndarray | None:
    """What the scheduler hook does at request finish: the inline payload it keeps, or None when spooled."""
    rows = expected_rows(rid, ROWS)
    refusal = writer.reserve(rows.nbytes)
    if refusal is not None:
        writer.note_undelivered(undelivered_reason(refusal), rid=rid, inline=True)  # as Collector.finish does
        return rows  # the request keeps SGLang's inline payload
    assert writer.submit(Op(rid, spec=_spec(rid), rows=rows, status="ok"), reserved=True)
    return None


def _room_for(writer: SpoolWriter, records: int) -> bool:
    """Whether `records` new records of `ROWS` rows fit now, each with its own metadata, as the offers will ask
    (one reservation of all their rows would count one record's metadata). Gives every reservation back."""
    taken = 0
    try:
        while taken < records and writer.reserve(ROWS * ROW_BYTES) is None:
            taken += 1
    finally:
        for _ in range(taken):
            writer.release(ROWS * ROW_BYTES)
    return taken == records


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_spool_full_falls_back_inline_and_recovers(make_sidecar, spool_dir):
    side = make_sidecar(spool_dir, env={"R3_SPOOL_MAX_BYTES": str(CAPACITY), "R3_RESCAN_S": "0.5"})
    writer = SpoolWriter(spool_dir, max_bytes=CAPACITY, queue_bytes=1 << 20, engine="rel/dp0").start()
    rids = [f"full-{i:03d}" for i in range(30)]
    served_final: dict[str, bool] = {}
    bad: list[str] = []
    stop = threading.Event()
    passes = [0]  # the watcher's finished passes over every rid

    def watch() -> None:
        """Poll every rid while the writer works: a 200 must always be the whole, exact record."""
        with httpx.Client(base_url=side.url, timeout=10) as client:
            while not stop.is_set():
                passes[0] += 1
                for rid in rids:
                    r = client.get(f"/routed_experts/{rid}", params={"format": "raw"})
                    if r.status_code == 200:
                        served_final[rid] = True
                        if (
                            r.headers.get("X-R3-Final", "").lower() != "true"
                            or r.content != expected_rows(rid, ROWS).tobytes()
                        ):
                            bad.append(f"{rid}: {len(r.content)} bytes, final={r.headers.get('X-R3-Final')}")
                    elif r.status_code not in (202, 404):
                        bad.append(f"{rid}: HTTP {r.status_code}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        inline = {rid: kept for rid in rids if (kept := _offer(writer, rid)) is not None}
        assert writer.flush(10)
        flushed = passes[0]  # the pass under way may have begun before the flush: the next one begins after it
        wait_until(lambda: passes[0] >= flushed + 2, 30, "a watcher pass over every rid after the flush")
    finally:
        stop.set()
        watcher.join(30)
    stats = writer.snapshot()
    spooled = [rid for rid in rids if rid not in inline]
    print(f"spool full: capacity {CAPACITY} B, {len(spooled)} spooled, {len(inline)} kept inline, stats {stats}")
    assert inline, "the tiny spool refused some requests"
    assert 5 <= len(spooled) < len(rids)
    assert stats["fallback_inline"] == len(inline) == stats["spool_full"] == stats["undelivered"]["spool_full"]
    assert all(np.array_equal(kept, expected_rows(rid, ROWS)) for rid, kept in inline.items())
    assert not bad, bad[:5]

    with httpx.Client(base_url=side.url, timeout=10) as client:
        for rid in spooled:
            r = client.get(f"/routed_experts/{rid}", params={"format": "raw", "wait": 5})
            assert r.status_code == 200 and r.content == expected_rows(rid, ROWS).tobytes(), rid
        for rid in inline:
            assert client.get(f"/routed_experts/{rid}").status_code == 404, f"{rid} was refused yet is served"
        metrics = client.get("/metrics").text
        assert _metric(metrics, "r3_spool_capacity_bytes") == CAPACITY
        assert _metric(metrics, "r3_spool_bytes") > 0

        # Trainers acknowledge; the writer's next usage refresh sees the room and reservations succeed again.
        for rid in spooled:
            assert client.delete(f"/routed_experts/{rid}").status_code == 204
        t0 = time.monotonic()
        again = [f"again-{i:03d}" for i in range(len(spooled))]
        with contextlib.suppress(WaitTimeout):  # judged below by the records refused again
            wait_until(lambda: _room_for(writer, len(again)), 10, "room for every record again", interval=0.1)
        recovered_after = time.monotonic() - t0
        refused_again = [rid for rid in again if _offer(writer, rid) is not None]
        assert writer.flush(10)
        assert len(refused_again) <= 1, refused_again
        for rid in again:
            if rid not in refused_again:
                r = client.get(f"/routed_experts/{rid}", params={"format": "raw", "wait": 5})
                assert r.status_code == 200 and r.content == expected_rows(rid, ROWS).tobytes(), rid
    writer.close()
    print(
        f"spool full: recovered {recovered_after:.2f}s after the DELETEs; "
        f"{len(again) - len(refused_again)}/{len(again)} new records spooled"
    )


def test_spool_never_exceeds_its_cap(spool_dir):
    writer = SpoolWriter(spool_dir, max_bytes=CAPACITY, queue_bytes=1 << 20, engine="rel/dp0").start()
    for i in range(30):
        _offer(writer, f"cap-{i:03d}")
    assert writer.flush(10)
    writer.close()
    used = Spool(spool_dir).usage_bytes()
    assert used <= CAPACITY, f"spool holds {used} B with R3_SPOOL_MAX_BYTES={CAPACITY}"


@contextlib.contextmanager
def _small_tmpfs(path, size: str):
    """A real, tiny tmpfs (like a full /dev/shm); needs CAP_SYS_ADMIN, so the test skips without it."""
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _record_blocks(path) -> int:
    """The file system's bytes for one record of `ROWS` rows: its rows and its metadata, a page each at least."""
    page = os.statvfs(path).f_frsize
    return (-(-ROWS * ROW_BYTES // page) + 1) * page


def test_real_enospc_never_serves_a_partial_record(make_sidecar, tmp_path):
    """No R3_SPOOL_MAX_BYTES: the cap is the file system's, and tmpfs charges whole pages per file."""
    with _small_tmpfs(tmp_path / "shm", "256k") as shm:
        spool_dir = shm / "spool"
        writer = SpoolWriter(spool_dir, queue_bytes=1 << 20, engine="rel/dp0").start()
        side = make_sidecar(spool_dir, env={"R3_STALE_S": "1", "R3_RESCAN_S": "0.5"})
        rids = [f"enospc-{i:03d}" for i in range(120)]
        inline = {rid for rid in rids if _offer(writer, rid) is not None}
        assert writer.flush(20)
        free_when_full = _free_bytes(shm)
        time.sleep(2.5)  # not a wait: stale_s (1 s) elapses twice over, so what can still be marked turns aborted
        accepted = [rid for rid in rids if rid not in inline]
        served, partial, lost = [], [], []
        with httpx.Client(base_url=side.url, timeout=10) as client:
            for rid in accepted:
                r = client.get(f"/routed_experts/{rid}", params={"format": "raw"})
                if r.status_code == 200 and r.headers["x-r3-status"] == "aborted":
                    lost.append((rid, "aborted"))  # served for what it is: the rows so far, flagged
                elif r.status_code == 200:
                    (served if r.content == expected_rows(rid, ROWS).tobytes() else partial).append(rid)
                else:
                    lost.append((rid, r.status_code))
            waiting = [rid for rid, code in lost if code == 202]
            for rid in served:
                client.delete(f"/routed_experts/{rid}")

            def statuses() -> dict:
                answers = {rid: client.get(f"/routed_experts/{rid}") for rid, _ in lost}
                return {
                    rid: r.status_code if r.status_code != 200 else r.headers["x-r3-status"]
                    for rid, r in answers.items()
                }

            after: dict = {}

            def ended() -> bool:  # with room again, the sidecar can mark the silent records aborted
                after.update(statuses())
                return set(after.values()) <= {404, 410, "aborted"}

            with contextlib.suppress(WaitTimeout):  # judged below, after what else the run says
                wait_until(ended, 30, "the silent records ended", interval=0.2)
        stats = writer.stats
        writer.close()
        print(
            f"real ENOSPC: {len(accepted)} accepted, {len(inline)} inline, served exact {len(served)}, "
            f"partial {len(partial)}, accepted but not served {len(lost)} {lost[:3]}, write_errors "
            f"{stats.write_errors}"
        )
        # The premise: the file system, not a byte cap (none is set), filled. The writer refused the rest as
        # `spool_full` on its free-block count, and what was left could not hold one more record.
        record_blocks = _record_blocks(shm)
        assert inline and stats.spool_full == len(inline), f"the tmpfs never filled: {stats}"
        assert free_when_full < 2 * record_blocks, f"{free_when_full} B still free, a record takes {record_blocks}"
        assert not partial, f"partial records served as final: {partial[:5]}"
        assert side.proc.poll() is None
        assert set(after.values()) <= {404, 410, "aborted"}, f"once the spool has room, silent records end: {after}"
        print(
            f"real ENOSPC: {len(waiting)} records stayed 202 while the spool was full; after DELETEs: "
            f"{dict(collections.Counter(after.values()))}"
        )


def test_stale_record_on_a_full_spool_is_served_aborted(make_sidecar, tmp_path):
    with _small_tmpfs(tmp_path / "shm", "64k") as shm:
        spool = Spool(shm / "spool")
        w = spool.writer("silent", num_experts=NUM_EXPERTS, topk=TOPK, layers=LAYERS)
        w.append(expected_rows("silent", 8))
        with contextlib.suppress(OSError):
            (shm / "filler").write_bytes(b"\0" * (1 << 20))  # the spool's file system is now full
        side = make_sidecar(spool.root, env={"R3_STALE_S": "0.5", "R3_RESCAN_S": "0.5"})
        r = httpx.get(f"{side.url}/routed_experts/silent", params={"wait": "4", "format": "raw"}, timeout=10)
        assert r.status_code == 200 and r.headers["x-r3-status"] == "aborted", f"{r.status_code} {r.text[:200]}"
        assert r.content == expected_rows("silent", 8).tobytes(), "the rows written before the engine fell silent"


def test_real_enospc_loses_no_accepted_request(make_sidecar, tmp_path):
    with _small_tmpfs(tmp_path / "shm", "256k") as shm:
        spool_dir = shm / "spool"
        writer = SpoolWriter(spool_dir, queue_bytes=1 << 20, engine="rel/dp0").start()
        accepted = [rid for rid in (f"e2-{i:03d}" for i in range(120)) if _offer(writer, rid) is None]
        assert writer.flush(20)
        writer.close()
        spool = Spool(spool_dir, create=False)
        bad = [
            rid
            for rid in accepted
            if not ((m := spool.read_meta(rid)) and m.final and m.status == "ok" and m.rows == ROWS)
        ]
        assert not bad, f"{len(bad)} of {len(accepted)} accepted records not written whole: {bad[:3]}"


def test_finish_path_keeps_inline_when_the_spool_refuses(make_sidecar, spool_dir):
    """The engine's own finish-time path (`engine_ext.sglang.collect.Collector`: reserve, route, batched slot gather,
    hand-off) over a host cache on CPU: refused requests are routed INLINE (SGLang keeps their payload) and
    counted; accepted ones are routed SPOOL and served exact."""
    torch = pytest.importorskip("torch")
    from engine_ext.core.records import ModelShape
    from engine_ext.core.settings import Mode
    from engine_ext.sglang.collect import Collector, Route
    from engine_ext.sglang.collect import FinishedReq as Finished

    n_req, seqlen = 30, ROWS + 1  # a finished request returns seqlen - 1 rows
    side = make_sidecar(spool_dir, env={"R3_SPOOL_MAX_BYTES": str(CAPACITY)})
    writer = SpoolWriter(spool_dir, max_bytes=CAPACITY, queue_bytes=1 << 20, engine="rel/dp0").start()
    collector = Collector(
        writer,
        ModelShape(NUM_EXPERTS, TOPK, LAYERS, None),
        mode=Mode.SIDECAR,
        capture_all=False,
        dtype="uint8",
        engine="rel/dp0",
    )
    rids = [f"fin-{i:03d}" for i in range(n_req)]
    # Host cache and token map as SGLang lays them out: request i's positions live in slots [i*seqlen, ...).
    host = torch.zeros((n_req * seqlen, len(LAYERS), TOPK), dtype=torch.int32)
    req_to_token = torch.arange(n_req * seqlen, dtype=torch.int32).reshape(n_req, seqlen)
    for i, rid in enumerate(rids):
        host[i * seqlen : i * seqlen + ROWS] = torch.from_numpy(expected_rows(rid, ROWS).astype(np.int32))
    routes = {
        rid: collector.finish(
            Finished(
                rid=rid, wants_inline=True, start_len=0, prompt_len=ROWS // 2, seqlen=seqlen, pool_idx=i, aborted=False
            ),
            publisher=True,
        )
        for i, rid in enumerate(rids)
    }
    collector.end_step(req_to_token, host)
    collector.drain(wait=True)
    assert writer.flush(10)
    stats = writer.snapshot()
    writer.close()
    inline = [rid for rid, route in routes.items() if route == Route.INLINE]
    spooled = [rid for rid, route in routes.items() if route == Route.SPOOL]
    print(f"finish path, spool full: {len(spooled)} routed to the spool, {len(inline)} kept inline, stats {stats}")
    assert len(inline) + len(spooled) == n_req and inline and spooled
    assert stats["fallback_inline"] == len(inline) == sum(stats["undelivered"].values()), stats
    with httpx.Client(base_url=side.url, timeout=10) as client:
        for rid in spooled:
            r = client.get(f"/routed_experts/{rid}", params={"format": "raw", "wait": 5})
            assert r.status_code == 200 and r.content == expected_rows(rid, ROWS).tobytes(), rid
        for rid in inline:  # refused: its record ended at once, `error` (no pointer or held rid waits it out)
            gone = client.get(f"/routed_experts/{rid}")
            assert gone.status_code == 410 and gone.json()["error"] == "record_error", rid
