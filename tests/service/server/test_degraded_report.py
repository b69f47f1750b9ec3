"""The engine file's `degraded` part: what a failed hook leaves (`engine_ext/core/degraded.py`), written by the
real telemetry thread's tick into a real spool, parsed by the sidecar (`EngineReport`), exported as
`r3_engine_degraded_hooks_total{engine,hook}`."""

from __future__ import annotations

import pytest
from helpers import engine_report

from engine_ext.core.degraded import DEGRADED, Degraded
from engine_ext.core.telemetry import Sources, Telemetry
from service.server.metrics import engine_families
from service.spool import Spool
from service.spool.engine_report import EngineReport, EngineReportError


@pytest.fixture
def degraded():
    DEGRADED.clear()
    yield DEGRADED
    DEGRADED.clear()


def test_a_failed_hook_is_in_the_engine_file_once_with_its_error(tmp_path, degraded) -> None:
    telemetry = Telemetry(spool_dir=tmp_path, engine="e/pid7", dp_rank=None, sources=Sources(), sglang="0.5.23")
    assert telemetry.tick()["degraded"] == []  # a healthy engine says so
    assert degraded.note("_around_collect", "sglang.X._maybe_collect", KeyError("rid"))
    assert not degraded.note("_around_collect", "sglang.X._maybe_collect", OSError("later"))  # the first one stands
    telemetry.tick()
    (path,) = Spool(tmp_path).engine_paths()
    on_disk = Spool(tmp_path).read_engine_file(path)
    (fault,) = on_disk["degraded"]
    assert fault["hook"] == "_around_collect" and fault["target"] == "sglang.X._maybe_collect"
    assert fault["error"] == "KeyError: 'rid'" and fault["since"] > 0
    assert EngineReport.from_dict(on_disk).to_dict()["degraded"] == on_disk["degraded"]


def test_the_sidecar_counts_each_failed_hook_per_engine(degraded) -> None:
    faults = Degraded()
    faults.note("_record_forward_extent", "sglang.M._forward_raw", RuntimeError("x"))
    sick = _report("e/dp0", faults.snapshot())
    healthy, older = _report("e/dp1", []), _report("e/dp2", None)
    families = {f.name: f for f in engine_families([sick, healthy, older], stale_after_s=1e12, now=1e9)}
    samples = [(s.name, s.labels, s.value) for s in families["r3_engine_degraded_hooks"].samples]
    assert samples == [("r3_engine_degraded_hooks_total", {"engine": "e/dp0", "hook": "_record_forward_extent"}, 1)]


def test_a_malformed_degraded_part_names_the_field() -> None:
    with pytest.raises(EngineReportError, match="a list of failed hooks"):
        EngineReport.from_dict(_report("e", {"hook": "x"}))
    with pytest.raises(EngineReportError, match=r"degraded\[0\]\.error"):
        EngineReport.from_dict(_report("e", [{"hook": "x", "target": "t", "error": 3, "since": 1}]))
    assert "degraded" not in EngineReport.from_dict(_report("e", None)).to_dict()  # older plugins' files


def _report(engine: str, degraded: object) -> dict:
    report = engine_report(engine, updated=1e9)
    return report if degraded is None else report | {"degraded": degraded}
