"""The engine file: built from real sources, validated, written atomically, and accepted by the sidecar."""

from __future__ import annotations

import time

import numpy as np
import pytest
from waiting import wait_until

from engine_ext.core.records import RecordSpec
from engine_ext.core.telemetry import Sources, Telemetry
from engine_ext.core.writer import Op, SpoolWriter
from engine_ext.sglang import capturer
from engine_ext.sglang.budget import BudgetInputs, budget_rows
from service.server.metrics import engine_families
from service.spool import Spool
from service.spool.engine_report import EngineReportError, validate_engine_report


def _telemetry(tmp_path, writer: SpoolWriter, **sources) -> Telemetry:
    rows = budget_rows(BudgetInputs(chunked_prefill_size=512, max_running_requests=64, num_layers=2, topk=2))
    return Telemetry(
        spool_dir=tmp_path,
        engine="pod-a/dp0",
        dp_rank=0,
        sources=Sources(
            budget=lambda: [r.as_contract() for r in rows],
            occupancy=capturer.occupancy_snapshot,
            host_cache=lambda: (4096, 300),
            writer=writer.snapshot,
            **sources,
        ),
        interval_s=0.05,
        sglang="0.5.23",
    )


def test_engine_file_is_accepted_by_the_sidecar(tmp_path):
    writer = SpoolWriter(tmp_path).start()
    spec = RecordSpec("r", num_experts=8, topk=2, layers=(0, 1), start=0, prompt_len=2, dtype="uint8")
    assert writer.submit(Op("r", spec=spec, rows=np.tile(np.uint8([[0, 1]]), (3, 2, 1)), status="ok"))
    assert writer.flush()
    occupancy = capturer.track("routed_experts_device_cache", 1024, window_s=60)
    occupancy.record(700)
    report = _telemetry(tmp_path, writer).tick()

    (path,) = Spool(tmp_path).engine_paths()
    on_disk = Spool(tmp_path).read_engine_file(path)
    assert on_disk["v"] == 1 and on_disk["engine"] == "pod-a/dp0" and path.name.startswith("~")  # "/" is unsafe
    assert validate_engine_report(on_disk) == on_disk
    undelivered = on_disk["writer"].pop("undelivered")
    assert on_disk["writer"] == {
        "queued_bytes": 0,
        "records_written": 1,
        "fallback_inline": 0,
        "spool_full": 0,
        "queue_full": 0,
        "write_errors": 0,
        "suspect_records": 0,
    }
    assert undelivered == {
        "spool_full": 0,
        "queue_full": 0,
        "spool_not_writable": 0,
        "mirror_mismatch": 0,
        "write_error": 0,
    }
    assert on_disk["host_cache"] == {"capacity_tokens": 4096, "used_tokens": 300}
    assert {"buffer": "routed_experts_device_cache", "capacity": 1024, "peak": 700, "window_s": 60} in on_disk[
        "occupancy"
    ]
    assert on_disk["budget"] and all(
        set(b) == {"buffer", "unit", "capacity", "demand", "ok", "formula"} for b in on_disk["budget"]
    )
    assert on_disk["updated"] == report["updated"]

    families = {f.name: f for f in engine_families([on_disk], stale_after_s=10, now=time.time())}
    (peak,) = [s for s in families["r3_buffer_peak"].samples if s.labels["buffer"] == "routed_experts_device_cache"]
    assert peak.value == 700
    assert families["r3_host_cache_used_tokens"].samples[0].value == 300
    assert len(families["r3_budget_ok"].samples) == len(on_disk["budget"])
    writer.close()


def test_thread_keeps_writing_when_a_source_fails(tmp_path):
    writer = SpoolWriter(tmp_path)

    def broken() -> list[dict]:
        raise RuntimeError("no occupancy yet")

    telemetry = _telemetry(tmp_path, writer, **{})
    telemetry.sources.occupancy = broken
    telemetry.start()
    try:
        wait_until(lambda: telemetry.writes >= 3, 10, lambda: f"three telemetry writes (now {telemetry.writes})")
    finally:
        telemetry.close()
    assert telemetry.writes >= 3
    (path,) = Spool(tmp_path).engine_paths()
    report = Spool(tmp_path).read_engine_file(path)
    assert report["occupancy"] == [] and report["budget"]
    assert time.time() - report["updated"] < 10


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": ""}, "engine"),
        ({"host_cache": {"capacity_tokens": 1}}, "used_tokens"),
        ({"writer": {"queued_bytes": -1}}, "queued_bytes"),
        ({"budget": [{"buffer": "x", "unit": "rows", "capacity": 1, "demand": 2, "ok": "yes", "formula": ""}]}, "ok"),
        ({"occupancy": {}}, "lists"),
    ],
)
def test_validation_names_the_bad_field(tmp_path, change, message):
    report = _telemetry(tmp_path, SpoolWriter(tmp_path)).report()
    with pytest.raises(EngineReportError, match=message):
        validate_engine_report({**report, **change})


def test_delivery_part_is_kept_and_validated(tmp_path):
    """The optional `delivery` part (mode in effect, configured mode, why inline is kept) survives the typed report."""
    telemetry = _telemetry(tmp_path, SpoolWriter(tmp_path))
    telemetry.delivery = {"mode": "mirror", "configured_mode": "sidecar", "inline_kept": "--tokenizer-worker-num 2"}
    telemetry.tick()
    (path,) = Spool(tmp_path).engine_paths()
    assert Spool(tmp_path).read_engine_file(path)["delivery"] == telemetry.delivery
    with pytest.raises(EngineReportError, match="inline_kept"):
        validate_engine_report({**telemetry.report(), "delivery": {**telemetry.delivery, "inline_kept": 2}})
