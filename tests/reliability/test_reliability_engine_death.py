"""Item 3: an engine (writer process) is SIGKILLed mid-request.

Its open records stop being updated; after `R3_STALE_S` the sidecar marks them `aborted` (rows so far kept),
so trainers waiting on them get those rows (200, `X-R3-Status: aborted`, as SGLang returns an aborted
request's rows inline) instead of waiting out their whole `wait`, and streams end.
Records the engine finished before it died are still served byte-exact.
"""

from __future__ import annotations

import struct
import threading
import time
from urllib.parse import quote

import httpx
import numpy as np
import orjson
from r3_harness import accepted_connections, check_record, read_ledger
from waiting import wait_until

from service.spool import Spool

STALE_S = 3.0  # the writer keeps its open records fresh 10 times a second while alive (r3_writer)
# A waiter asks for longer than any load here delays the kill: a timed-out wait would answer 202, so a 200
# `aborted` answer is the staleness sweep's, however long the machine took (no wall-clock bound needed).
WAIT_S = 300


def _frame_statuses(body: bytes) -> list[tuple[int, str | None]]:
    """(status, record_status) of the frames in a batch body (`[u32 LE header length][JSON header][payload]`)."""
    out, pos = [], 0
    while pos < len(body):
        (n,) = struct.unpack_from("<I", body, pos)
        header = orjson.loads(body[pos + 4 : pos + 4 + n])
        pos += 4 + n
        if header["status"] == 200:
            pos += int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize
        out.append((header["status"], header.get("record_status")))
    return out


OPEN = 4
ROWS = 32


def test_killed_engine_records_turn_aborted_and_waiters_get_their_rows(make_sidecar, make_writer, spool_dir, tmp_path):
    side = make_sidecar(spool_dir, env={"R3_STALE_S": str(STALE_S), "R3_RESCAN_S": "0.5", "R3_TTL_S": "600"})
    ledger = tmp_path / "ledger.jsonl"
    writer = make_writer(
        spool_dir, ledger, ["--prefix", "d", "--count", "3", "--rows", str(ROWS), "--chunk", "8", "--open", str(OPEN)]
    )
    wait_until(
        lambda: any(e.get("event") == "open_done" for e in read_ledger(ledger)),
        120,
        "the writer's open records written",
    )
    open_rids = [f"d-open-{j:04d}" for j in range(OPEN)]

    results: dict[str, tuple] = {}

    def wait_on(rid: str, stream: bool) -> None:
        t0 = time.monotonic()
        params = {"wait": str(WAIT_S), "format": "raw", **({"stream": "true"} if stream else {})}
        with httpx.Client(base_url=side.url, timeout=WAIT_S + 30) as client:
            r = client.get(f"/routed_experts/{quote(rid, safe='')}", params=params)
        status = r.headers.get("x-r3-status")
        results[("s:" if stream else "") + rid] = (r.status_code, time.monotonic() - t0, status, len(r.content))

    def batch_on(rids: list[str]) -> None:
        t0 = time.monotonic()
        with httpx.Client(base_url=side.url, timeout=WAIT_S + 30) as client:
            r = client.post("/routed_experts/batch", json={"rids": rids, "wait": WAIT_S})
        frames = _frame_statuses(r.content) if r.status_code == 200 else []
        results["batch"] = (r.status_code, time.monotonic() - t0)
        results["batch-frames"] = (frames, 0.0)

    waiters = [threading.Thread(target=wait_on, args=(rid, False)) for rid in open_rids]
    waiters += [threading.Thread(target=wait_on, args=(open_rids[0], True))]
    waiters += [threading.Thread(target=batch_on, args=(open_rids,))]
    for t in waiters:
        t.start()
    wait_until(lambda: len(accepted_connections(side.port)) >= len(waiters), 120, "every waiter connected")
    assert not results, f"answered while the engine was alive: {results}"  # its records were kept fresh
    writer.kill()
    killed_at = time.monotonic()
    for t in waiters:
        t.join(timeout=WAIT_S + 40)
    assert not any(t.is_alive() for t in waiters), "a waiter hung on a dead engine's record"

    for rid in open_rids:
        code, elapsed, status, size = results[rid]
        assert (code, status) == (200, "aborted"), f"{rid}: {code} {status} after {elapsed:.1f}s (want its rows)"
        assert size > 0, f"{rid}: the rows written before the engine died are served"
        assert elapsed < WAIT_S, f"{rid}: answered only when its wait ran out ({elapsed:.1f}s)"
    assert results["batch"][0] == 200 and results["batch-frames"][0] == [(200, "aborted")] * OPEN, results[
        "batch-frames"
    ]
    code = results["s:" + open_rids[0]][0]
    assert code == 200, f"stream on a dead engine's record ended with {code}"
    spool = Spool(spool_dir, create=False)
    for rid in open_rids:
        meta = spool.read_meta(rid)
        assert meta is not None and meta.final and meta.status == "aborted" and meta.rows == ROWS, meta
    with httpx.Client(base_url=side.url, timeout=10) as client:
        for rid in (e["rid"] for e in read_ledger(ledger) if e.get("final")):
            ok, reason = check_record(client, rid, ROWS)
            assert ok, reason
    print(
        f"engine death: {OPEN} open records aborted; waiters (GET, stream, batch) got their rows within "
        f"{max(v[1] for v in results.values()):.2f}s of waiting ({time.monotonic() - killed_at:.2f}s after kill)"
    )
