"""The spool contract, v1 (DESIGN.md, Contract 1): the one place that knows its names and formats.

The engine extension writes records through `RecordWriter`; the sidecar reads them with `Spool`.
Both sides meet only here, so a change to the contract is a change to this module alone.

Invariants a reader relies on (and a writer keeps):
- `.bin` is appended before `.json` is replaced, so bytes below `rows * row_bytes` are always there;
- bytes past `rows * row_bytes` may be in flight and are never read;
- `.json` is replaced atomically (temporary file in the same directory, then `os.replace`);
- names starting with "." are temporary files and are never records.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

VERSION = 1
STATUSES = ("ok", "aborted", "error")
DTYPES = ("uint8", "uint16", "int16", "int32")
MAX_LAYERS = 4096
MAX_TOPK = 1024
MAX_META_BYTES = 1 << 20

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_TMP_COUNTER = iter(range(1 << 62))


Weights = tuple[str | int | None, tuple[tuple[int, str | int], ...]]
"""A record's `(weight_version, weight_versions)`."""


class SpoolFormatError(ValueError):
    """A spool file that does not follow the contract; `reason` is a short label for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def safe_name(rid: str) -> str:
    """File stem for a rid or engine id: the id itself when safe, else `~` + 40 hex of its sha256."""
    if _SAFE_NAME.fullmatch(rid):
        return rid
    return "~" + hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def default_dtype(num_experts: int) -> str:
    """The smallest unsigned dtype that holds every expert id `0 … num_experts-1`."""
    if num_experts <= 1 << 8:
        return "uint8"
    if num_experts <= 1 << 16:
        return "uint16"
    return "int32"


def dtype_holds(dtype: str, num_experts: int) -> bool:
    """Whether `dtype` can store expert id `num_experts - 1` without wrapping."""
    return int(np.iinfo(np.dtype(dtype)).max) >= num_experts - 1


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """One record's metadata, exactly the JSON of Contract 1."""

    rid: str
    dtype: str
    num_experts: int
    topk: int
    layers: tuple[int, ...]
    start: int
    prompt_len: int
    rows: int = 0
    final: bool = False
    status: str = "ok"
    engine: str = ""
    weight_version: str | int | None = None  # the version of the last row's weights (SGLang's `weight_version`)
    # When the rows span a weight update: `(position, version)` pairs, the first at `start`; rows from a
    # position up to the next pair's were routed by its version. Empty when one version routed every row.
    weight_versions: tuple[tuple[int, str | int], ...] = ()
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    v: int = VERSION
    num_hidden_layers: int | None = None  # the model's layer count; None in records of older writers

    @property
    def sglang_layers(self) -> int | None:
        """Layer slots of SGLang's own payload (`num_hidden_layers`, dense layers as zeros), or None if unknown.

        Records of writers older than the field still know it when they hold every layer `0 … L-1` (an
        all-MoE model, the only layout those writers produced byte-identically); otherwise it is unknown.
        """
        if self.num_hidden_layers is not None:
            return self.num_hidden_layers
        return len(self.layers) if self.layers == tuple(range(len(self.layers))) else None

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def row_bytes(self) -> int:
        return len(self.layers) * self.topk * self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of `.bin` that readers may trust."""
        return self.rows * self.row_bytes

    @property
    def end(self) -> int:
        """One past the last token position held: rows cover `[start, end)`."""
        return self.start + self.rows

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.rows, len(self.layers), self.topk)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": self.v,
            "rid": self.rid,
            "dtype": self.dtype,
            "num_experts": self.num_experts,
            "topk": self.topk,
            "layers": list(self.layers),
            "start": self.start,
            "rows": self.rows,
            "prompt_len": self.prompt_len,
            "final": self.final,
            "status": self.status,
            "engine": self.engine,
            "weight_version": self.weight_version,
            "created": self.created,
            "updated": self.updated,
            **({} if self.num_hidden_layers is None else {"num_hidden_layers": self.num_hidden_layers}),
            **({"weight_versions": [list(p) for p in self.weight_versions]} if self.weight_versions else {}),
        }

    def version_at(self, position: int) -> str | int | None:
        """The weight version that routed the row of token `position` (the record's own when it never changed)."""
        found = self.weight_version
        for pos, version in self.weight_versions:
            if pos > position:
                break
            found = version
        return found

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes) -> RecordMeta:
        """Parse and validate; any departure from the contract raises `SpoolFormatError`."""
        if len(data) > MAX_META_BYTES:
            raise SpoolFormatError("oversized_meta", f"{len(data)} bytes")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise SpoolFormatError("bad_json", str(exc)) from None
        if not isinstance(obj, dict):
            raise SpoolFormatError("bad_json", "metadata is not a JSON object")
        if obj.get("v") != VERSION:
            raise SpoolFormatError("unknown_version", f"v={obj.get('v')!r}, this reader knows v={VERSION}")
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> RecordMeta:
        def need(key: str, kind: type | tuple[type, ...]) -> Any:
            value = obj.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise SpoolFormatError("bad_field", f"{key}={value!r}")
            return value

        def count(key: str, low: int = 0) -> int:
            value = need(key, int)
            if isinstance(value, bool) or value < low:
                raise SpoolFormatError("bad_field", f"{key}={value!r} (must be an integer >= {low})")
            return value

        rid = need("rid", str)
        if not rid:
            raise SpoolFormatError("bad_field", "rid is empty")
        dtype = need("dtype", str)
        if dtype not in DTYPES:
            raise SpoolFormatError("bad_field", f"dtype={dtype!r} (one of {', '.join(DTYPES)})")
        num_experts = count("num_experts", 1)
        if not dtype_holds(dtype, num_experts):
            raise SpoolFormatError("bad_field", f"dtype {dtype} cannot hold {num_experts} experts")
        topk = count("topk", 1)
        if topk > MAX_TOPK:
            raise SpoolFormatError("bad_field", f"topk={topk} > {MAX_TOPK}")
        layers = need("layers", list)
        if not layers or len(layers) > MAX_LAYERS:
            raise SpoolFormatError("bad_field", f"{len(layers)} layers (1 … {MAX_LAYERS})")
        if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers):
            raise SpoolFormatError("bad_field", "layers must be non-negative integers")
        if len(set(layers)) != len(layers):
            raise SpoolFormatError("bad_field", "layers repeat")
        status = need("status", str)
        if status not in STATUSES:
            raise SpoolFormatError("bad_field", f"status={status!r}")
        weight_version = obj.get("weight_version")
        if weight_version is not None and not isinstance(weight_version, str | int):
            raise SpoolFormatError("bad_field", f"weight_version={weight_version!r}")
        weight_versions = parse_weight_versions(obj.get("weight_versions"))  # optional: v1 addition
        num_hidden_layers = obj.get("num_hidden_layers")  # optional: older writers do not write it
        if num_hidden_layers is not None:
            num_hidden_layers = count("num_hidden_layers", max(layers) + 1)
            if num_hidden_layers > MAX_LAYERS:
                raise SpoolFormatError("bad_field", f"num_hidden_layers={num_hidden_layers} > {MAX_LAYERS}")
        return cls(
            rid=rid,
            dtype=dtype,
            num_experts=num_experts,
            topk=topk,
            layers=tuple(layers),
            start=count("start"),
            rows=count("rows"),
            prompt_len=count("prompt_len"),
            final=need("final", bool),
            status=status,
            engine=need("engine", str),
            weight_version=weight_version,
            weight_versions=weight_versions,
            created=float(need("created", int | float)),
            updated=float(need("updated", int | float)),
            num_hidden_layers=num_hidden_layers,
        )


def parse_weight_versions(value: Any) -> tuple[tuple[int, str | int], ...]:
    """A record's `weight_versions` (`[[position, version], ...]`, positions increasing), or `SpoolFormatError`."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LAYERS:
        raise SpoolFormatError("bad_field", f"weight_versions={value!r}")
    pairs: list[tuple[int, str | int]] = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and not isinstance(item[0], bool)
        if not ok or not isinstance(item[1], str | int) or item[0] < 0 or (pairs and item[0] <= pairs[-1][0]):
            raise SpoolFormatError(
                "bad_field", f"weight_versions entry {item!r} (want [position, version], increasing)"
            )
        pairs.append((item[0], item[1]))
    return tuple(pairs)


# ---- the engine file (Contract 1) ------------------------------------------------------------------
UNDELIVERED_REASONS = ("spool_full", "queue_full", "spool_not_writable", "mirror_mismatch", "write_error")
"""Why a request's rows did not reach the spool: the keys of the engine file's `writer.undelivered`."""
WRITER_COUNTERS = ("queued_bytes", "records_written", "fallback_inline", "spool_full")
"""The writer counters Contract 1 names; every engine file has them."""
WRITER_EXTRA_COUNTERS = ("queue_full", "write_errors")
"""Writer counters added since (absent in older plugins' files): refused for a full queue, failed writes."""


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
class Delivery:
    """How the engine delivers rows (`delivery`): the mode in effect, the one configured, and why they differ."""

    mode: str
    configured_mode: str
    inline_kept: str | None = None  # why SGLang's inline payload is kept although sidecar mode was asked for

    @classmethod
    def from_dict(cls, obj: Any) -> Delivery:
        if not isinstance(obj, dict):
            raise EngineReportError(f"delivery={obj!r} (an object)")
        mode, configured = _text(obj, "mode", "delivery"), _text(obj, "configured_mode", "delivery")
        inline_kept = obj.get("inline_kept")
        if inline_kept is not None and not isinstance(inline_kept, str):
            raise EngineReportError(f"delivery.inline_kept={inline_kept!r}")
        return cls(mode, configured, inline_kept)

    def to_dict(self) -> dict[str, str | None]:
        return {"mode": self.mode, "configured_mode": self.configured_mode, "inline_kept": self.inline_kept}


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
class EngineReport:
    """One engine process's file, `<root>/v1/engines/<engine>.json`: exactly the JSON of Contract 1.

    The engine builds it (`engine_ext.telemetry`, the demo engine), the sidecar parses it (`service.metrics`);
    `from_dict` is the one validation both sides run, so a file one side writes is a file the other reads.
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
    delivery: Delivery | None = None  # absent in older plugins' files and in the demo's
    vllm: str | None = None  # the vLLM version, in the vLLM plugin's files (`sglang` is "" there)
    hooks: dict[str, dict[str, HookTime]] | None = None  # absent when R3_HOOK_TIMERS=0, in older files, the demo's
    v: int = VERSION

    @classmethod
    def from_dict(cls, report: dict[str, Any]) -> EngineReport:
        """Check every field Contract 1 names (types and presence); raises `EngineReportError` naming the field."""
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
            delivery=None if report.get("delivery") is None else Delivery.from_dict(report["delivery"]),
            vllm=_optional_text(report, "vllm"),
            hooks=None if report.get("hooks") is None else HookTime.parse_all(report["hooks"]),
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
        return out | ({} if self.hooks is None else {"hooks": HookTime.dump_all(self.hooks)})


def validate_engine_report(report: dict[str, Any]) -> dict[str, Any]:
    """Check `report` against Contract 1 (`EngineReport.from_dict`); returns it unchanged."""
    EngineReport.from_dict(report)
    return report


def atomic_write(path: Path | str, data: bytes) -> None:
    """Replace `path` with `data` so a reader sees the old or the new file, never a mix.

    Plain `os.path` strings: a live record is republished many times a second, and pathlib's objects cost
    more than the system calls."""
    head, name = os.path.split(os.fspath(path))
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{next(_TMP_COUNTER)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    if view.nbytes == 0:
        return
    view = view.cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Spool:
    """A spool directory: record and engine files under `<root>/v1/`."""

    def __init__(self, root: Path | str, *, create: bool = True) -> None:
        self.root = Path(root)
        self.records_dir = self.root / f"v{VERSION}" / "records"
        self._records = os.fspath(self.records_dir)  # for the per-publish path, without pathlib's cost
        self.engines_dir = self.root / f"v{VERSION}" / "engines"
        if create:
            self.records_dir.mkdir(parents=True, exist_ok=True)
            self.engines_dir.mkdir(parents=True, exist_ok=True)

    # ---- names -------------------------------------------------------------------------------
    def bin_path(self, rid: str) -> Path:
        return self.records_dir / f"{safe_name(rid)}.bin"

    def meta_path(self, rid: str) -> Path:
        return self.records_dir / f"{safe_name(rid)}.json"

    def record_names(self) -> list[str]:
        """File stems of every record metadata file present (temporary files excluded)."""
        try:
            entries = os.listdir(self.records_dir)
        except FileNotFoundError:
            return []
        return [e[:-5] for e in entries if e.endswith(".json") and not e.startswith(".")]

    # ---- records -----------------------------------------------------------------------------
    def read_meta_file(self, path: Path) -> RecordMeta:
        """Read one `.json`; raises `SpoolFormatError` for a malformed or foreign file."""
        with open(path, "rb") as f:
            data = f.read(MAX_META_BYTES + 1)
        meta = RecordMeta.from_json(data)
        if path.stem != safe_name(meta.rid):
            raise SpoolFormatError("name_mismatch", f"{path.name} holds rid {meta.rid!r}")
        return meta

    def read_meta(self, rid: str) -> RecordMeta | None:
        """The record's metadata, or None when there is no such record."""
        try:
            meta = self.read_meta_file(self.meta_path(rid))
        except FileNotFoundError:
            return None
        if meta.rid != rid:
            raise SpoolFormatError("hash_collision", f"{rid!r} and {meta.rid!r} share a file name")
        return meta

    def write_meta(self, meta: RecordMeta) -> None:
        atomic_write(os.path.join(self._records, f"{safe_name(meta.rid)}.json"), meta.to_json())

    def open_rows(self, meta: RecordMeta, row_hi: int | None = None) -> int:
        """Open `.bin` and check it can serve rows `[0, row_hi)`; return the fd (the caller closes it).

        This is the check a server makes before it promises a body: after it, only an I/O error of the
        medium can stop the read. Raises `SpoolFormatError` `missing_bin` (gone) or `truncated_bin`
        (shorter than `meta` promises), and `OSError` when the file cannot be read at all (not a
        regular file, no permission): a fault of the spool, not of the record's contents.
        """
        hi = (meta.rows if row_hi is None else row_hi) * meta.row_bytes
        try:
            fd = os.open(self.bin_path(meta.rid), os.O_RDONLY)
        except FileNotFoundError:
            raise SpoolFormatError("missing_bin", f"{meta.rid!r}: {meta.rows} rows promised, no .bin") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file", str(self.bin_path(meta.rid)))
            if st.st_size < hi:
                raise SpoolFormatError("truncated_bin", f"{meta.rid!r}: .bin shorter than {hi} bytes")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def iter_rows(
        self,
        meta: RecordMeta,
        row_lo: int = 0,
        row_hi: int | None = None,
        chunk_bytes: int = 1 << 20,
        *,
        fd: int | None = None,
    ) -> Iterator[bytes]:
        """Yield the bytes of rows `[row_lo, row_hi)` in chunks of whole rows, never past `meta.rows`.

        With `fd` (from `open_rows`, still owned by the caller) the file is not opened again. Raises
        `SpoolFormatError("truncated_bin")` when `.bin` holds fewer bytes than `meta` promises.
        """
        row_hi = meta.rows if row_hi is None else row_hi
        if not 0 <= row_lo <= row_hi <= meta.rows:
            raise ValueError(f"rows [{row_lo}, {row_hi}) outside [0, {meta.rows})")
        row_bytes = meta.row_bytes
        lo, hi = row_lo * row_bytes, row_hi * row_bytes
        step = max(row_bytes, chunk_bytes - chunk_bytes % row_bytes)
        if lo == hi:
            return
        own = fd is None
        if fd is None:
            fd = self.open_rows(meta, row_hi)
        try:
            while lo < hi:
                chunk = os.pread(fd, min(step, hi - lo), lo)
                if not chunk:
                    raise SpoolFormatError("truncated_bin", f"{meta.rid!r}: .bin ends at {lo}")
                lo += len(chunk)
                yield chunk
        finally:
            if own:
                os.close(fd)

    def read_array(self, meta: RecordMeta, row_lo: int = 0, row_hi: int | None = None) -> np.ndarray:
        """Rows `[row_lo, row_hi)` as an array of shape `(rows, layers, topk)` in the record's dtype."""
        data = b"".join(self.iter_rows(meta, row_lo, row_hi, chunk_bytes=1 << 30))
        return np.frombuffer(data, dtype=meta.dtype).reshape(-1, len(meta.layers), meta.topk)

    def delete(self, rid: str) -> bool:
        """Remove both files of a record (metadata first, so readers stop trusting the rows)."""
        found = False
        for path in (self.meta_path(rid), self.bin_path(rid)):
            try:
                path.unlink()
                found = True
            except FileNotFoundError:
                pass
        return found

    def reclaim_leftovers(self, older_than_s: float, now: float | None = None) -> list[Path]:
        """Remove what a crash leaves behind once untouched for `older_than_s`; return what was removed.

        A `.bin` whose `.json` is gone (killed between a delete's two unlinks) and the temporary file of
        an interrupted `atomic_write` are never named by any metadata, so nothing else would free them.
        """
        cutoff = (time.time() if now is None else now) - older_than_s
        removed = []
        for folder in (self.records_dir, self.engines_dir):
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            names = {e.name for e in entries}
            for entry in entries:
                name = entry.name
                orphan = name.endswith(".bin") and f"{name[:-4]}.json" not in names
                leftover = name.startswith(".") and name.endswith(".tmp")
                if not (orphan or leftover):
                    continue
                try:
                    if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                        continue
                    if orphan and os.path.exists(os.path.join(folder, f"{name[:-4]}.json")):
                        continue  # a writer published it since the listing
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
                except FileNotFoundError:
                    continue
        return removed

    def writer(
        self,
        rid: str,
        *,
        num_experts: int,
        topk: int,
        layers: list[int] | tuple[int, ...],
        start: int = 0,
        prompt_len: int = 0,
        engine: str = "",
        dtype: str | None = None,
        weight_version: str | int | None = None,
        weight_versions: tuple[tuple[int, str | int], ...] = (),
        num_hidden_layers: int | None = None,
    ) -> RecordWriter:
        """Start a new record (replacing any old one with the same rid) and return its writer.

        `num_hidden_layers` is the model's layer count (dense layers included): pass it whenever known, so
        the sidecar can rebuild SGLang's own payload layout for models with dense layers.
        """
        meta = RecordMeta(
            rid=rid,
            dtype=dtype or default_dtype(num_experts),
            num_experts=num_experts,
            topk=topk,
            layers=tuple(layers),
            start=start,
            prompt_len=prompt_len,
            engine=engine,
            weight_version=weight_version,
            weight_versions=tuple(weight_versions),
            num_hidden_layers=num_hidden_layers,
        )
        RecordMeta.from_dict(meta.to_dict())
        return RecordWriter(self, meta)

    # ---- usage -------------------------------------------------------------------------------
    def usage_bytes(self) -> int:
        """Bytes held by record files (a directory scan: call it off any hot path)."""
        total = 0
        try:
            with os.scandir(self.records_dir) as it:
                for entry in it:
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        except FileNotFoundError:
            return 0
        return total

    def capacity_bytes(self, max_bytes: int = 0) -> int:
        """The configured cap, or the file system's size when none is set."""
        if max_bytes > 0:
            return max_bytes
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ---- engines -----------------------------------------------------------------------------
    def write_engine(self, report: EngineReport | dict[str, Any]) -> None:
        """Replace one engine process's budget/occupancy file (Contract 1, engine file)."""
        if isinstance(report, EngineReport):
            report = report.to_dict()
        engine = report.get("engine")
        if not isinstance(engine, str) or not engine:
            raise ValueError("engine report needs a non-empty 'engine' id")
        atomic_write(self.engines_dir / f"{safe_name(engine)}.json", orjson.dumps({"v": VERSION, **report}))

    def read_engine_file(self, path: Path) -> dict[str, Any]:
        with open(path, "rb") as f:
            data = f.read(MAX_META_BYTES + 1)
        if len(data) > MAX_META_BYTES:
            raise SpoolFormatError("oversized_meta", f"{path.name}: {len(data)} bytes")
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise SpoolFormatError("bad_json", f"{path.name}: {exc}") from None
        if not isinstance(obj, dict) or obj.get("v") != VERSION:
            raise SpoolFormatError("unknown_version", f"{path.name}: not a v{VERSION} engine file")
        if not isinstance(obj.get("engine"), str) or path.stem != safe_name(obj["engine"]):
            raise SpoolFormatError("name_mismatch", f"{path.name}: engine id does not match its name")
        return obj

    def engine_paths(self) -> list[Path]:
        try:
            return [
                self.engines_dir / e
                for e in os.listdir(self.engines_dir)
                if e.endswith(".json") and not e.startswith(".")
            ]
        except FileNotFoundError:
            return []


class RecordWriter:
    """Appends rows to one record. One writer per rid; not shared between threads.

    Creation publishes `rows=0` before replacing `.bin` with a new file, so a reader never trusts stale bytes
    of an older record with the same rid, and one that opened the older `.bin` still reads that record's rows.
    An append only counts its rows; `meta` is built when it is read
    (a publish), so a live record's per-step append costs a write, not a new `RecordMeta`.
    """

    def __init__(self, spool: Spool, meta: RecordMeta) -> None:
        self.spool = spool
        self._meta = meta
        self.rows = meta.rows  # rows in `.bin`; `meta` catches up when read
        self._updated = meta.updated
        self._shape = (len(meta.layers), meta.topk)
        self._dtype = np.dtype(meta.dtype)
        self._lock = threading.Lock()
        spool.write_meta(meta)
        path = spool.bin_path(meta.rid)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a new file, not a truncated one: a reader still streaming the old record keeps its rows
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)

    @property
    def meta(self) -> RecordMeta:
        """The record's metadata as of the last append (what `publish` writes)."""
        meta = self._meta
        if meta.rows != self.rows:
            meta = self._meta = replace(meta, rows=self.rows, updated=self._updated)
        return meta

    @property
    def nbytes(self) -> int:
        """Bytes of rows in `.bin`."""
        return self.rows * self._meta.row_bytes

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, rows: np.ndarray, *, publish: bool = True) -> None:
        """Append rows of shape `(n, layers, topk)`; cast to the record's dtype; publish the new count."""
        if rows.ndim != 3 or rows.shape[1:] != self._shape:
            raise ValueError(f"rows of shape {rows.shape}, record wants (n, {self._shape[0]}, {self._shape[1]})")
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"record {self._meta.rid!r} is already final")
            data = np.ascontiguousarray(rows, dtype=self._dtype)
            _write_all(self._fd, data.data)
            self.rows += rows.shape[0]
            self._updated = time.time()
            if publish:
                self.spool.write_meta(self.meta)

    def publish(self) -> None:
        """Make every appended row visible to readers (replace `.json`)."""
        with self._lock:
            self.spool.write_meta(self.meta)

    def finalize(self, status: str = "ok", *, weights: Weights | None = None) -> RecordMeta:
        """Close the record: no rows follow. `status` is one of `ok`, `aborted`, `error`; `weights`, when
        given, are the versions known at the end (a live record opened before a weight update)."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} not in {STATUSES}")
        versions = {} if weights is None else {"weight_version": weights[0], "weight_versions": tuple(weights[1])}
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            meta = self._meta = replace(self.meta, final=True, status=status, updated=time.time(), **versions)
            self.spool.write_meta(meta)
            return meta

    def abort(self) -> RecordMeta:
        return self.finalize("aborted")

    def close(self) -> None:
        """Close the file without publishing: for a record about to be replaced under the same rid."""
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                with contextlib.suppress(OSError):
                    os.close(fd)
