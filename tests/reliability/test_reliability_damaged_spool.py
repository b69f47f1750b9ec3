"""Item 5 (end to end): damaged records dropped into a live sidecar's spool.

The same generator as the reader fuzz (`spool_cases.damaged_record`), but through the whole service: the store's
file-system watcher and rescans see every damaged file, and a trainer asks for it. Property: never a 5xx, the
sidecar keeps running, and a 200 carries exactly the record's first `rows * row_bytes` bytes of `.bin`.
"""

from __future__ import annotations

import collections
from urllib.parse import quote

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from r3_harness import Sidecar
from spool_cases import damaged_record

from service.spool.record.meta import RecordMeta, SpoolFormatError, safe_name

EXAMPLES = 100


def _accepted(stem: str, meta_bytes: bytes) -> RecordMeta | None:
    try:
        meta = RecordMeta.from_json(meta_bytes)
    except SpoolFormatError:
        return None
    return meta if safe_name(meta.rid) == stem else None


def test_damaged_records_in_a_live_spool(make_sidecar, spool_dir):
    # Generated timestamps are old: a TTL/stale period of ~forever keeps retention out of the picture.
    side: Sidecar = make_sidecar(spool_dir, env={"R3_RESCAN_S": "0.5", "R3_TTL_S": "1e12", "R3_STALE_S": "1e12"})
    records = spool_dir / "v1" / "records"
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(damaged_record())
    def prop(case):
        stem, meta_bytes, bin_data = case
        try:
            rid = orjson.loads(meta_bytes).get("rid")
        except (orjson.JSONDecodeError, AttributeError):
            rid = None
        if not isinstance(rid, str) or not rid:
            rid = stem
        (records / f"{stem}.bin").write_bytes(bin_data)
        (records / f"{stem}.json").write_bytes(meta_bytes)
        try:
            r = client.get(f"/routed_experts/{quote(rid, safe='')}", params={"format": "raw"})
            b = client.post("/routed_experts/batch", json={"rids": [rid]}) if len(rid) <= 1024 else None
            outcomes[str(r.status_code)] += 1
            assert r.status_code < 500, (r.status_code, r.text[:300])
            assert b is None or b.status_code < 500, (b.status_code, b.text[:300])
            if r.status_code == 200:
                meta = _accepted(stem, meta_bytes)
                assert meta is not None, "served a record the spool contract rejects"
                assert r.content == bin_data[: meta.nbytes] and len(bin_data) >= meta.nbytes
        finally:
            (records / f"{stem}.json").unlink(missing_ok=True)
            (records / f"{stem}.bin").unlink(missing_ok=True)

    with httpx.Client(base_url=side.url, timeout=10) as client:
        prop()
    print(f"damaged records through the live sidecar: {sum(outcomes.values())} cases, statuses {dict(outcomes)}")
    assert side.proc.poll() is None
    assert httpx.get(side.url + "/metrics").status_code == 200
