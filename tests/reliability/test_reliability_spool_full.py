"""Item 2: the spool is full.

The engine writer (`engine_ext.writer.SpoolWriter`, used directly as the scheduler hook uses it) refuses the
reservation, so the request keeps SGLang's inline payload and `fallback_inline` counts it; no partial record is
ever served as final while that happens; and once trainers acknowledge (DELETE), reservations succeed again.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest
from r3_harness import LAYERS, NUM_EXPERTS, TOPK, expected_rows

from engine_ext.writer import Op, RecordSpec, SpoolWriter
from service.spool import Spool

ROWS = 64
ROW_BYTES = len(LAYERS) * TOPK
CAPACITY = 24_000  # ~ 10 records of 1.5 KiB rows plus metadata


def _spec(rid: str) -> RecordSpec:
    return RecordSpec(rid=rid, num_experts=NUM_EXPERTS, topk=TOPK, layers=LAYERS, start=0, prompt_len=ROWS // 2,
                      dtype="uint8", engine="rel/dp0")


def _offer(writer: SpoolWriter, rid: str) -> np.ndarray | None:
    """What the scheduler hook does at request finish: the inline payload it keeps, or None when spooled."""
    rows = expected_rows(rid, ROWS)
    if writer.reserve(rows.nbytes) is not None:
        writer.note_fallback()
        return rows  # the request keeps SGLang's inline payload
    assert writer.submit(Op(rid, spec=_spec(rid), rows=rows, status="ok"), reserved=True)
    return None


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

    def watch() -> None:
        """Poll every rid while the writer works: a 200 must always be the whole, exact record."""
        with httpx.Client(base_url=side.url, timeout=10) as client:
            while not stop.is_set():
                for rid in rids:
                    r = client.get(f"/routed_experts/{rid}", params={"format": "raw"})
                    if r.status_code == 200:
                        served_final[rid] = True
                        if r.headers.get("X-R3-Final", "").lower() != "true" or \
                                r.content != expected_rows(rid, ROWS).tobytes():
                            bad.append(f"{rid}: {len(r.content)} bytes, final={r.headers.get('X-R3-Final')}")
                    elif r.status_code not in (202, 404):
                        bad.append(f"{rid}: HTTP {r.status_code}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        inline = {rid: kept for rid in rids if (kept := _offer(writer, rid)) is not None}
        assert writer.flush(10)
        time.sleep(0.5)
    finally:
        stop.set()
        watcher.join(30)
    stats = writer.snapshot()
    spooled = [rid for rid in rids if rid not in inline]
    print(f"spool full: capacity {CAPACITY} B, {len(spooled)} spooled, {len(inline)} kept inline, stats {stats}")
    assert inline, "the tiny spool refused some requests"
    assert 5 <= len(spooled) < len(rids)
    assert stats["fallback_inline"] == len(inline) == stats["spool_full"]
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
        deadline = time.monotonic() + 10
        again = [f"again-{i:03d}" for i in range(len(spooled))]
        while writer.reserve(ROWS * ROW_BYTES) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        writer.release(ROWS * ROW_BYTES)
        recovered_after = 10 - (deadline - time.monotonic())
        refused_again = [rid for rid in again if _offer(writer, rid) is not None]
        assert writer.flush(10)
        assert len(refused_again) <= 1, refused_again
        for rid in again:
            if rid not in refused_again:
                r = client.get(f"/routed_experts/{rid}", params={"format": "raw", "wait": 5})
                assert r.status_code == 200 and r.content == expected_rows(rid, ROWS).tobytes(), rid
    writer.close()
    print(f"spool full: recovered {recovered_after:.2f}s after the DELETEs; "
          f"{len(again) - len(refused_again)}/{len(again)} new records spooled")


@pytest.mark.xfail(strict=True, reason="engine_ext/writer.py: reservations count row bytes only (Op.nbytes = "
                                       "rows.nbytes); each record's metadata file lands on top, so the spool "
                                       "overshoots R3_SPOOL_MAX_BYTES by ~250 B per record queued at once")
def test_spool_never_exceeds_its_cap(spool_dir):
    writer = SpoolWriter(spool_dir, max_bytes=CAPACITY, queue_bytes=1 << 20, engine="rel/dp0").start()
    for i in range(30):
        _offer(writer, f"cap-{i:03d}")
    assert writer.flush(10)
    writer.close()
    used = Spool(spool_dir).usage_bytes()
    assert used <= CAPACITY, f"spool holds {used} B with R3_SPOOL_MAX_BYTES={CAPACITY}"
