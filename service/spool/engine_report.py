"""The engine file (Contract 1, `<root>/v1/engines/<engine>.json`): what one engine process reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.spool.record.meta import VERSION

# ---- the engine file (Contract 1) ------------------------------------------------------------------
UNDELIVERED_REASONS = ("spool_full", "queue_full", "spool_not_writable", "mirror_mismatch", "write_error")
"""Why a request's rows did not reach the spool: the keys of the engine file's `writer.undelivered`."""
WRITER_COUNTERS = ("queued_bytes", "records_written", "fallback_inline", "spool_full")
"""The writer counters Contract 1 names; every engine file has them."""
WRITER_EXTRA_COUNTERS = ("queue_full", "write_errors", "suspect_records")
"""Writer counters added since (absent in older plugins' files): refused for a full queue, failed writes, records
marked `suspect` by the row check."""


class EngineReportError(ValueError):
    """An engine report that does not follow Contract 1."""


def _count(obj: Any, key: str, where: str) -> int | float:
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise EngineReportError(f"{where}.{key}={value!r} (a non-negative number)")
    return value


def _text(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise EngineReportError(f"{where}.{key}={value!r}")
    return value


def _optional_text(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise EngineReportError(f"{key}={value!r} (a string or absent)")
    return value


@dataclass(frozen=True, slots=True)
class BudgetEntry:
    """One buffer's launch-time capacity against its worst-case demand (`budget[]`)."""

    buffer: str
    unit: str
    capacity: int | float
    demand: int | float
    ok: bool
    formula: str

    @classmethod
    def from_dict(cls, row: Any, where: str) -> BudgetEntry:
        if not isinstance(row, dict):
            raise EngineReportError(f"{where}={row!r} (an object)")
        buffer, unit, formula = (_text(row, key, where) for key in ("buffer", "unit", "formula"))
        capacity, demand = _count(row, "capacity", where), _count(row, "demand", where)
        if not isinstance(row.get("ok"), bool):
            raise EngineReportError(f"{where}.ok={row.get('ok')!r}")
        return cls(buffer, unit, capacity, demand, row["ok"], formula)


@dataclass(frozen=True, slots=True)
class OccupancyEntry:
    """One buffer's capacity and its peak use over the last window (`occupancy[]`)."""

    buffer: str
    capacity: int | float
    peak: int | float
    window_s: int | float

    @classmethod
    def from_dict(cls, row: Any, where: str) -> OccupancyEntry:
        if not isinstance(row, dict):
            raise EngineReportError(f"{where}={row!r} (an object)")
        buffer = _text(row, "buffer", where)
        return cls(buffer, *(_count(row, key, where) for key in ("capacity", "peak", "window_s")))


@dataclass(frozen=True, slots=True)
class WriterCounters:
    """The engine's spool writer, as counters (`writer`); the extra ones are None in older plugins' files."""

    queued_bytes: int | float = 0
    records_written: int | float = 0
    fallback_inline: int | float = 0
    spool_full: int | float = 0
    queue_full: int | float | None = 0
    write_errors: int | float | None = 0
    suspect_records: int | float | None = 0  # records the row check marked `suspect`; None in older files
    undelivered: dict[str, int | float] | None = field(default_factory=lambda: dict.fromkeys(UNDELIVERED_REASONS, 0))

    @classmethod
    def from_dict(cls, obj: Any) -> WriterCounters:
        counts = {key: _count(obj, key, "writer") for key in WRITER_COUNTERS}
        for key in WRITER_EXTRA_COUNTERS:
            counts[key] = None if obj.get(key) is None else _count(obj, key, "writer")
        undelivered = obj.get("undelivered")  # per-reason counts; absent in older plugins' files
        if undelivered is not None:
            if not isinstance(undelivered, dict):
                raise EngineReportError(f"writer.undelivered={undelivered!r} (an object of counts by reason)")
            undelivered = {str(key): _count(undelivered, key, "writer.undelivered") for key in undelivered}
        return cls(**counts, undelivered=undelivered)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: getattr(self, key) for key in WRITER_COUNTERS}
        out.update({key: getattr(self, key) for key in WRITER_EXTRA_COUNTERS if getattr(self, key) is not None})
        if self.undelivered is not None:
            out["undelivered"] = dict(self.undelivered)
        return out


@dataclass(frozen=True, slots=True)
class DeliveryMode:
    """How the engine delivers rows (`delivery`): the mode in effect, the one configured, and why they differ."""

    mode: str
    configured_mode: str
    inline_kept: str | None = None  # why SGLang's inline payload is kept although sidecar mode was asked for
    front_door: str | None = None  # a front end the hooks cannot reach (SGLANG_RUST_SERVER): what still works

    @classmethod
    def from_dict(cls, obj: Any) -> DeliveryMode:
        if not isinstance(obj, dict):
            raise EngineReportError(f"delivery={obj!r} (an object)")
        mode, configured = _text(obj, "mode", "delivery"), _text(obj, "configured_mode", "delivery")
        for key in ("inline_kept", "front_door"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise EngineReportError(f"delivery.{key}={obj[key]!r}")
        return cls(mode, configured, obj.get("inline_kept"), obj.get("front_door"))

    def to_dict(self) -> dict[str, str | None]:
        out = {"mode": self.mode, "configured_mode": self.configured_mode, "inline_kept": self.inline_kept}
        return out | ({"front_door": self.front_door} if self.front_door is not None else {})


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """The engine build the plugin found (`build`): the layout applied, whether a test proved that very build, and
    where it did not, how far its self-check got (`check`: state pending | agreed, records agreed of needed)."""

    found: str
    layout: str
    proven: bool
    check: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, obj: Any) -> BuildInfo:
        if not isinstance(obj, dict):
            raise EngineReportError(f"build={obj!r} (an object)")
        found, layout = _text(obj, "found", "build"), _text(obj, "layout", "build")
        if not isinstance(obj.get("proven"), bool):
            raise EngineReportError(f"build.proven={obj.get('proven')!r} (true or false)")
        check = obj.get("check")
        if check is not None:
            if not isinstance(check, dict) or check.get("state") not in ("pending", "agreed"):
                raise EngineReportError(f"build.check={check!r} (state pending or agreed, agreed, needed)")
            for key in ("agreed", "needed"):
                _count(check, key, "build.check")
        return cls(found, layout, obj["proven"], check)

    def to_dict(self) -> dict[str, Any]:
        return {"found": self.found, "layout": self.layout, "proven": self.proven, "check": self.check}


@dataclass(frozen=True, slots=True)
class HookTime:
    """One hook's own work on the scheduler thread under one forward kind, since the process started (`hooks`)."""

    calls: int | float
    seconds: int | float

    @classmethod
    def parse_all(cls, obj: Any) -> dict[str, dict[str, HookTime]]:
        """`{hook: {kind: {"calls", "seconds"}}}`, each count checked."""
        if not isinstance(obj, dict):
            raise EngineReportError(f"hooks={obj!r} (an object of hooks)")
        out: dict[str, dict[str, HookTime]] = {}
        for hook, kinds in obj.items():
            if not isinstance(kinds, dict):
                raise EngineReportError(f"hooks.{hook}={kinds!r} (an object of forward kinds)")
            out[str(hook)] = {
                str(kind): cls(*(_count(t, key, f"hooks.{hook}.{kind}") for key in ("calls", "seconds")))
                for kind, t in kinds.items()
            }
        return out

    @staticmethod
    def dump_all(hooks: dict[str, dict[str, HookTime]]) -> dict[str, dict[str, dict[str, int | float]]]:
        return {
            h: {k: {"calls": t.calls, "seconds": t.seconds} for k, t in kinds.items()} for h, kinds in hooks.items()
        }


@dataclass(frozen=True, slots=True)
class HookFault:
    """A hook whose plugin code failed (`degraded[]`): from then on the engine runs its own code at every hook of
    that process (SGLang's rows inline, nothing new from the plugin in the spool)."""

    hook: str
    target: str
    error: str
    since: float

    @classmethod
    def parse_all(cls, obj: Any) -> tuple[HookFault, ...]:
        if not isinstance(obj, list):
            raise EngineReportError(f"degraded={obj!r} (a list of failed hooks)")
        out = []
        for i, fault in enumerate(obj):
            where = f"degraded[{i}]"
            if not isinstance(fault, dict):
                raise EngineReportError(f"{where}={fault!r} (an object)")
            hook, target, error = (_text(fault, key, where) for key in ("hook", "target", "error"))
            out.append(cls(hook, target, error, float(_count(fault, "since", where))))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"hook": self.hook, "target": self.target, "error": self.error, "since": self.since}


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine process's file, `<root>/v1/engines/<engine>.json`: exactly the JSON of Contract 1.

    The engine builds it (`engine_ext.core.telemetry`, the demo engine), the sidecar parses it
    (`service.server.metrics`); `from_dict` is the one validation both sides run, so a file one side writes is a
    file the other reads.
    """

    engine: str
    dp_rank: int | None
    pid: int | float
    sglang: str
    updated: float
    budget: tuple[BudgetEntry, ...]
    occupancy: tuple[OccupancyEntry, ...]
    capacity_tokens: int | float
    used_tokens: int | float
    writer: WriterCounters
    delivery: DeliveryMode | None = None  # absent in older plugins' files and in the demo's
    vllm: str | None = None  # the vLLM version, in the vLLM plugin's files (`sglang` is "" there)
    hooks: dict[str, dict[str, HookTime]] | None = None  # absent when R3_HOOK_TIMERS=0, in older files, the demo's
    degraded: tuple[HookFault, ...] | None = None  # failed hooks ([] when none); absent in older files, the demo's
    build: BuildInfo | None = None  # absent in older plugins' files, the demo's and the vLLM plugin's
    v: int = VERSION

    @classmethod
    def from_dict(cls, report: dict[str, Any]) -> EngineReport:
        """Check every field Contract 1 names (types and presence); raises `EngineReportError` naming the field."""
        dp_rank, pid, updated = _identity(report)
        if not isinstance(report.get("budget"), list) or not isinstance(report.get("occupancy"), list):
            raise EngineReportError("budget and occupancy must be lists")
        budget = tuple(BudgetEntry.from_dict(row, f"budget[{i}]") for i, row in enumerate(report["budget"]))
        occupancy = tuple(OccupancyEntry.from_dict(row, f"occupancy[{i}]") for i, row in enumerate(report["occupancy"]))
        host = report.get("host_cache")
        capacity_tokens, used_tokens = (_count(host, key, "host_cache") for key in ("capacity_tokens", "used_tokens"))
        if not isinstance(report.get("writer"), dict):
            raise EngineReportError(f"writer={report.get('writer')!r} (an object of counters)")
        return cls(
            engine=report["engine"],
            dp_rank=dp_rank,
            pid=pid,
            sglang=report["sglang"],
            updated=float(updated),
            budget=budget,
            occupancy=occupancy,
            capacity_tokens=capacity_tokens,
            used_tokens=used_tokens,
            writer=WriterCounters.from_dict(report["writer"]),
            delivery=None if report.get("delivery") is None else DeliveryMode.from_dict(report["delivery"]),
            vllm=_optional_text(report, "vllm"),
            hooks=None if report.get("hooks") is None else HookTime.parse_all(report["hooks"]),
            degraded=None if report.get("degraded") is None else HookFault.parse_all(report["degraded"]),
            build=None if report.get("build") is None else BuildInfo.from_dict(report["build"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object (without `v`, which `Spool.write_engine` adds)."""
        out = {
            "engine": self.engine,
            "dp_rank": self.dp_rank,
            "pid": self.pid,
            "sglang": self.sglang,
            "updated": self.updated,
            "budget": [
                {
                    "buffer": b.buffer,
                    "unit": b.unit,
                    "capacity": b.capacity,
                    "demand": b.demand,
                    "ok": b.ok,
                    "formula": b.formula,
                }
                for b in self.budget
            ],
            "occupancy": [
                {"buffer": o.buffer, "capacity": o.capacity, "peak": o.peak, "window_s": o.window_s}
                for o in self.occupancy
            ],
            "host_cache": {"capacity_tokens": self.capacity_tokens, "used_tokens": self.used_tokens},
            "writer": self.writer.to_dict(),
        } | ({} if self.delivery is None else {"delivery": self.delivery.to_dict()})
        out |= {} if self.vllm is None else {"vllm": self.vllm}
        out |= {} if self.hooks is None else {"hooks": HookTime.dump_all(self.hooks)}
        out |= {} if self.build is None else {"build": self.build.to_dict()}
        return out | ({} if self.degraded is None else {"degraded": [fault.to_dict() for fault in self.degraded]})


def _identity(report: Any) -> tuple[int | None, int | float, int | float]:
    """Which process wrote the report, checked before its parts: a JSON object of this version naming its engine,
    dp rank, pid, update time and SGLang version. Returns `(dp_rank, pid, updated)`."""
    if not isinstance(report, dict):
        raise EngineReportError("an engine report is a JSON object")
    if report.get("v", VERSION) != VERSION:
        raise EngineReportError(f"v={report.get('v')!r}, this reader knows v={VERSION}")
    if not isinstance(report.get("engine"), str) or not report["engine"]:
        raise EngineReportError("engine must be a non-empty string")
    dp_rank = report.get("dp_rank")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise EngineReportError(f"dp_rank={dp_rank!r}")
    pid, updated = _count(report, "pid", "report"), _count(report, "updated", "report")
    if not isinstance(report.get("sglang"), str):
        raise EngineReportError("sglang must be the version string")
    return dp_rank, pid, updated


def validate_engine_report(report: dict[str, Any]) -> dict[str, Any]:
    """Check `report` against Contract 1 (`EngineReport.from_dict`); returns it unchanged."""
    EngineReport.from_dict(report)
    return report
