"""A spool record's metadata (Contract 1): names, dtypes, and the `.json` every record carries."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

VERSION = 1
STATUSES = ("ok", "aborted", "error", "suspect")
"""`suspect`: rows a true route cannot have (`service.spool.row_check`); kept, served only on request."""
DTYPES = ("uint8", "uint16", "int16", "int32")
MAX_LAYERS = 4096
MAX_TOPK = 1024
MAX_META_BYTES = 1 << 20

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
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
class Suspect:
    """Why a record is `suspect`: its first bad row (index into its rows), that row's model layer, and why.

    `reason` is one of `service.spool.row_check.REASONS`; `detail` shows the ids. Only a record with status
    `suspect` carries it, so a reader that knows nothing of it still never takes such a record for `ok`."""

    row: int
    layer: int
    reason: str
    detail: str = ""

    def to_dict(self) -> dict[str, int | str]:
        return {"row": self.row, "layer": self.layer, "reason": self.reason, "detail": self.detail}

    def describe(self, start: int = 0) -> str:
        """`row R (token position P), layer L: reason (detail)`: what an error or a log line says."""
        where = f"row {self.row}" + (f" (token position {start + self.row})" if start else "")
        return f"{where}, layer {self.layer}: {self.reason} ({self.detail})"

    @classmethod
    def parse(cls, value: Any, status: str) -> Suspect | None:
        """A record's `suspect` object, required with status `suspect` and absent otherwise, or `SpoolFormatError`."""
        if value is None and status != "suspect":
            return None
        ok = isinstance(value, dict) and status == "suspect"
        row, layer, reason, detail = (value.get(k) for k in ("row", "layer", "reason", "detail")) if ok else (None,) * 4
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (row, layer))
        if not (ok and ints and isinstance(reason, str) and isinstance(detail, str | None)):
            raise SpoolFormatError("bad_field", f"suspect={value!r} with status {status!r}")
        return cls(row, layer, reason, detail or "")


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
    suspect: Suspect | None = None  # with status `suspect`: the first bad row (from `start`), its layer, why

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
            **({} if self.suspect is None else {"suspect": self.suspect.to_dict()}),
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
        layers = _checked_layers(need("layers", list))
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
            suspect=Suspect.parse(obj.get("suspect"), status),  # optional: older writers never mark a record
        )


def _checked_layers(layers: list[Any]) -> list[int]:
    """A record's `layers`: 1 to `MAX_LAYERS` distinct model-layer indices, or `SpoolFormatError`."""
    if not layers or len(layers) > MAX_LAYERS:
        raise SpoolFormatError("bad_field", f"{len(layers)} layers (1 … {MAX_LAYERS})")
    if set(map(type, layers)) != {int} or min(layers) < 0:  # in C: every read parses this (bool is not int)
        raise SpoolFormatError("bad_field", "layers must be non-negative integers")
    if len(set(layers)) != len(layers):
        raise SpoolFormatError("bad_field", "layers repeat")
    return layers


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
