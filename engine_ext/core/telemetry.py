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

from engine_ext.core.degraded import DEGRADED, guarded_thread
from service.spool import Spool
from service.spool.engine_report import EngineReport, EngineReportError, WriterCounters

logger = logging.getLogger("r3_sidecar.telemetry")


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
    writer: Callable[[], dict[str, Any]] = lambda: WriterCounters().to_dict()
    hooks: Callable[[], dict[str, Any]] | None = None  # `timers.TIMERS.snapshot`; None: timers off, no `hooks`
    build: Callable[[], dict[str, Any]] | None = None  # the build, its layout, proven or checked; None: not said
    degraded: Callable[[], list[dict[str, Any]]] = DEGRADED.snapshot  # hooks that failed: the engine's own code runs


@dataclass
class Telemetry:
    """Writes one engine process's file every `interval_s` from `sources`."""

    spool_dir: Path | str
    engine: str
    dp_rank: int | None
    sources: Sources
    interval_s: float = 1.0
    sglang: str = ""
    vllm: str | None = None  # the vLLM plugin's engines name vLLM's version here (and leave `sglang` empty)
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
        """This tick's report as the file's JSON object (not yet validated: `tick` does)."""
        hooks = {} if self.sources.hooks is None else {"hooks": self._part("hooks", {})}
        build = {} if self.sources.build is None else {"build": self._part("build", None)}
        return self._contract_fields() | hooks | build

    def _contract_fields(self) -> dict[str, Any]:
        if self._budget is None:  # the budget is fixed at launch: compute it once
            self._budget = self._part("budget", None)
        capacity, used = self._part("host_cache", (0, 0))
        report = {
            "engine": self.engine,
            "dp_rank": self.dp_rank,
            "pid": os.getpid(),
            "sglang": self.sglang,
            "updated": time.time(),
            "budget": self._budget or [],
            "occupancy": self._part("occupancy", []),
            "host_cache": {"capacity_tokens": int(capacity), "used_tokens": int(used)},
            "writer": _writer_part(self._part("writer", WriterCounters().to_dict())),
            "degraded": self._part("degraded", []),
        } | ({"delivery": self.delivery} if self.delivery is not None else {})
        return report | ({"vllm": self.vllm} if self.vllm is not None else {})

    def build(self) -> EngineReport:
        """This tick's report, parsed and validated against Contract 1 (`EngineReportError` names a bad field)."""
        return EngineReport.from_dict(self.report())

    def tick(self) -> dict[str, Any]:
        """Build and write one report (atomically replaced); returns it."""
        report = self.build().to_dict()
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
            body = guarded_thread("r3-telemetry", self.run)
            self._thread = threading.Thread(target=body, name="r3-telemetry", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
