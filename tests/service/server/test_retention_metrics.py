"""Retention (TTL after final, stale records aborted) and the Contract 3 metrics, on a live sidecar."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from helpers import engine_report, random_rows, write_record
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from service.spool import Spool

CONTRACT3 = [
    "r3_records",
    "r3_spool_bytes",
    "r3_spool_capacity_bytes",
    "r3_served_total",
    "r3_served_bytes_total",
    "r3_fetch_seconds",
    "r3_records_expired_total",
    "r3_buffer_capacity",
    "r3_buffer_peak",
    "r3_buffer_headroom_ratio",
    "r3_budget_capacity",
    "r3_budget_demand",
    "r3_budget_ok",
    "r3_host_cache_used_tokens",
    "r3_host_cache_capacity_tokens",
    "r3_engine_fallback_inline_total",
    "r3_engine_undelivered_total",
    "r3_engine_queued_bytes",
    "r3_engine_stale",
]


# Seconds long enough that a loaded machine (load 17 here, 2026-11-29) answers a request inside them: at 0.4-0.6 s
# a record went stale or expired before the test's first look, which found it aborted or gone.
STALE_S = 2.0
TTL_S = 4.0


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """Every sample as `{(name, sorted labels): value}`."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_final_record_expires_after_ttl(serve, spool: Spool) -> None:
    base = serve(ttl_s=TTL_S, rescan_s=60)
    write_record(spool, "short-lived", random_rows(10))
    assert httpx.get(f"{base}/routed_experts/short-lived").status_code == 200
    wait_until(
        lambda: not spool.meta_path("short-lived").exists() and not spool.bin_path("short-lived").exists(),
        30,
        "housekeeping deletes both files",
        interval=0.02,
    )
    r = httpx.get(f"{base}/routed_experts/short-lived")
    assert r.status_code == 410 and r.json()["error"] == "expired"
    assert scrape(base)[("r3_records_expired_total", ())] == 1


def test_stale_record_is_aborted_then_expires(serve, spool: Spool) -> None:
    base = serve(stale_s=STALE_S, ttl_s=TTL_S, rescan_s=60)
    write_record(spool, "stalled", random_rows(5), final=False)
    assert httpx.get(f"{base}/routed_experts/stalled").status_code == 202
    wait_until(lambda: spool.read_meta("stalled").final, 30, "the stale record turns final", interval=0.02)
    meta = spool.read_meta("stalled")
    assert meta.status == "aborted" and meta.rows == 5
    assert spool.read_array(meta).shape == (5, 4, 8), "rows so far are kept"
    r = httpx.get(f"{base}/routed_experts/stalled", params={"format": "raw"})
    assert r.status_code == 200 and r.headers["x-r3-status"] == "aborted" and len(r.content) == 5 * 4 * 8
    wait_until(
        lambda: not spool.meta_path("stalled").exists(), 30, "an aborted record is kept only for the TTL", interval=0.02
    )


def test_updated_record_is_not_stale(serve, spool: Spool) -> None:
    base = serve(stale_s=STALE_S, rescan_s=60)
    writer = spool.writer("busy", num_experts=8, topk=1, layers=[0])
    for _ in range(17):
        writer.append(np.zeros((1, 1, 1)))
        time.sleep(0.25)  # not a wait: the producer's pace, 4.25 s in all, twice stale_s, one append per 0.25 s
        assert httpx.get(f"{base}/routed_experts/busy").status_code == 202
    writer.finalize()
    assert httpx.get(f"{base}/routed_experts/busy", params={"format": "raw"}).content == b"\0" * 17


def test_metrics_expose_every_contract3_name(serve, spool: Spool) -> None:
    base = serve(spool_max_bytes=10_000_000)
    spool.write_engine(engine_report("pod-a/dp0"))
    spool.write_engine(engine_report("pod-a/dp1", updated=time.time() - 3600))
    write_record(spool, "m1", random_rows(100))
    write_record(spool, "m2", random_rows(3), final=False)
    assert httpx.get(f"{base}/routed_experts/m1").status_code == 200
    assert httpx.get(f"{base}/routed_experts/nope", params={"format": "raw"}).status_code == 404
    text = httpx.get(f"{base}/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in CONTRACT3:
        assert name in text, name
    assert "r3_fetch_seconds" in names
    s = scrape(base)
    engine, buf = ("engine", "pod-a/dp0"), ("buffer", "device_cache")
    assert s[("r3_buffer_capacity", (buf, engine))] == 8192
    assert s[("r3_buffer_peak", (buf, engine))] == 2048
    assert s[("r3_buffer_headroom_ratio", (buf, engine))] == pytest.approx(0.75)
    assert s[("r3_budget_capacity", (buf, engine))] == 8192
    assert s[("r3_budget_demand", (buf, engine))] == 4096
    assert s[("r3_budget_ok", (buf, engine))] == 1
    assert s[("r3_host_cache_used_tokens", (engine,))] == 2500
    assert s[("r3_host_cache_capacity_tokens", (engine,))] == 100000
    assert s[("r3_engine_fallback_inline_total", (engine,))] == 2
    for reason, count in (("spool_full", 2), ("queue_full", 0), ("spool_not_writable", 1), ("mirror_mismatch", 0)):
        assert s[("r3_engine_undelivered_total", (engine, ("reason", reason)))] == count, reason
    assert s[("r3_engine_queued_bytes", (engine,))] == 1234
    assert s[("r3_engine_stale", (engine,))] == 0
    assert s[("r3_engine_stale", (("engine", "pod-a/dp1"),))] == 1
    assert s[("r3_records", (("state", "ok"),))] == 1 and s[("r3_records", (("state", "open"),))] == 1
    assert s[("r3_spool_capacity_bytes", ())] == 10_000_000
    assert s[("r3_spool_bytes", ())] >= 100 * 32
    assert s[("r3_served_total", (("code", "200"), ("format", "npy")))] == 1
    assert s[("r3_served_total", (("code", "404"), ("format", "raw")))] == 1
    assert s[("r3_served_bytes_total", ())] >= 100 * 32
    assert s[("r3_fetch_seconds_count", ())] == 2


def test_malformed_engine_file_leaves_out_only_that_engine(serve, spool: Spool) -> None:
    base = serve()
    spool.write_engine(engine_report("good"))
    spool.write_engine({**engine_report("bad"), "occupancy": [{"buffer": "x", "capacity": "lots"}]})
    report = engine_report("bad-writer")
    spool.write_engine({**report, "writer": {**report["writer"], "undelivered": {"spool_full": "many"}}})
    s = scrape(base)
    assert ("r3_buffer_capacity", (("buffer", "device_cache"), ("engine", "good"))) in s
    assert not any(dict(labels).get("engine") in ("bad", "bad-writer") for _, labels in s)
    assert httpx.get(f"{base}/healthz").status_code == 200
