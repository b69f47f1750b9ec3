"""The engine file (Contract 1): budget, occupancy, host-cache tokens and writer counters, once per interval.

A daemon thread builds the report from plain-value sources and writes it through `Spool.write_engine`;
the scheduler thread never takes part (its sources are host integers and locked snapshots). A source
that fails leaves its part empty for that tick, logged once, and the file keeps coming.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.spool import Spool

logger = logging.getLogger("r3_sidecar.telemetry")

WRITER_KEYS = ("queued_bytes", "records_written", "fallback_inline", "spool_full")


class EngineReportError(ValueError):
    """An engine report that does not follow Contract 1."""


def _count(obj: Any, key: str, where: str) -> int | float:
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise EngineReportError(f"{where}.{key}={value!r} (a non-negative number)")
    return value


def validate_engine_report(report: dict[str, Any]) -> dict[str, Any]:
    """Check every field Contract 1 names (types and presence); returns the report."""
    if not isinstance(report.get("engine"), str) or not report["engine"]:
        raise EngineReportError("engine must be a non-empty string")
    if report.get("dp_rank") is not None and not isinstance(report["dp_rank"], int):
        raise EngineReportError(f"dp_rank={report['dp_rank']!r}")
    _count(report, "pid", "report")
    _count(report, "updated", "report")
    if not isinstance(report.get("sglang"), str):
        raise EngineReportError("sglang must be the version string")
    if not isinstance(report.get("budget"), list) or not isinstance(report.get("occupancy"), list):
        raise EngineReportError("budget and occupancy must be lists")
    for i, row in enumerate(report["budget"]):
        for key in ("buffer", "unit", "formula"):
            if not isinstance(row.get(key), str):
                raise EngineReportError(f"budget[{i}].{key}={row.get(key)!r}")
        _count(row, "capacity", f"budget[{i}]")
        _count(row, "demand", f"budget[{i}]")
        if not isinstance(row.get("ok"), bool):
            raise EngineReportError(f"budget[{i}].ok={row.get('ok')!r}")
    for i, row in enumerate(report["occupancy"]):
        if not isinstance(row.get("buffer"), str):
            raise EngineReportError(f"occupancy[{i}].buffer={row.get('buffer')!r}")
        for key in ("capacity", "peak", "window_s"):
            _count(row, key, f"occupancy[{i}]")
    for key in ("capacity_tokens", "used_tokens"):
        _count(report.get("host_cache"), key, "host_cache")
    for key in WRITER_KEYS:
        _count(report.get("writer"), key, "writer")
    undelivered = report["writer"].get("undelivered")  # per-reason counts; absent in older plugins' files
    if undelivered is not None:
        if not isinstance(undelivered, dict):
            raise EngineReportError(f"writer.undelivered={undelivered!r} (an object of counts by reason)")
        for key in undelivered:
            _count(undelivered, key, "writer.undelivered")
    return report


def _writer_part(writer: dict[str, Any]) -> dict[str, Any]:
    """The writer counters as JSON integers (`undelivered` stays an object of counts by reason)."""
    out: dict[str, Any] = {}
    for key, value in writer.items():
        out[key] = {k: int(v) for k, v in value.items()} if isinstance(value, dict) else int(value)
    return out


@dataclass
class Sources:
    """Where each part of the report comes from; every callable runs on the telemetry thread."""

    budget: Callable[[], list[dict[str, Any]]] = list
    occupancy: Callable[[], list[dict[str, Any]]] = list
    host_cache: Callable[[], tuple[int, int]] = lambda: (0, 0)
    writer: Callable[[], dict[str, int]] = lambda: dict.fromkeys(WRITER_KEYS, 0)


@dataclass
class Telemetry:
    """Writes one engine process's file every `interval_s` from `sources`."""

    spool_dir: Path | str
    engine: str
    dp_rank: int | None
    sources: Sources
    interval_s: float = 1.0
    sglang: str = ""
    delivery: dict[str, Any] | None = None  # `frontdoors.delivery_report`: the mode in effect and why
    writes: int = 0
    _failed: set[str] = field(default_factory=set)
    _budget: list[dict[str, Any]] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _part(self, name: str, default: Any) -> Any:
        try:
            return getattr(self.sources, name)()
        except Exception as exc:  # a source's failure must not stop the file
            if name not in self._failed:
                self._failed.add(name)
                logger.warning("r3-sidecar telemetry: %s unavailable: %s", name, exc)
            return default

    def report(self) -> dict[str, Any]:
        if self._budget is None:  # the budget is fixed at launch: compute it once
            self._budget = self._part("budget", None)
        capacity, used = self._part("host_cache", (0, 0))
        return {
            "engine": self.engine,
            "dp_rank": self.dp_rank,
            "pid": os.getpid(),
            "sglang": self.sglang,
            "updated": time.time(),
            "budget": self._budget or [],
            "occupancy": self._part("occupancy", []),
            "host_cache": {"capacity_tokens": int(capacity), "used_tokens": int(used)},
            "writer": _writer_part(self._part("writer", dict.fromkeys(WRITER_KEYS, 0))),
        } | ({"delivery": self.delivery} if self.delivery is not None else {})

    def tick(self) -> dict[str, Any]:
        """Build and write one report (atomically replaced); returns it."""
        report = validate_engine_report(self.report())
        Spool(self.spool_dir).write_engine(report)
        self.writes += 1
        return report

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except (OSError, EngineReportError) as exc:
                if "tick" not in self._failed:
                    self._failed.add("tick")
                    logger.warning("r3-sidecar telemetry: engine file not written: %s", exc)
            self._stop.wait(self.interval_s)

    def start(self) -> Telemetry:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="r3-telemetry", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
