"""The spool contract, v1 (docs/design.md, Contract 1): what the engine plugin writes and the sidecar reads.

Both sides import this package and it imports neither: no server, no client, no engine, no FastAPI or
pydantic-settings, so an engine process that loads the plugin loads nothing of the sidecar.

- `directory`: `Spool`, a spool directory: its names, its records' reads, its engine files, its usage;
- `record`: one record: `record.meta`, its `.json` (`RecordMeta`), safe file names, dtypes, `SpoolFormatError`;
  `record.writer`, `RecordWriter`, its writing side (append rows, publish, finalize);
- `engine_report`: the engine file (`EngineReport`) one engine process replaces every second;
- `files`: atomic replacement and full writes, how every spool file is written;
- `sidecar_clients`: the engine processes that keep a spool's sidecar;
- `vllm_rids`: the names of vLLM requests' records, as the plugin and a client both compute them.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from service.spool.directory import DEFAULT_SPOOL_DIR, Spool
from service.spool.engine_report import EngineReport
from service.spool.record.meta import VERSION, RecordMeta, SpoolFormatError
from service.spool.record.writer import RecordWriter

__all__ = ["DEFAULT_SPOOL_DIR", "VERSION", "EngineReport", "RecordMeta", "RecordWriter", "Spool", "SpoolFormatError"]

_MOVED = {
    "MAX_META_BYTES": "service.spool.record.meta",
    "default_dtype": "service.spool.record.meta",
    "safe_name": "service.spool.record.meta",
    "atomic_write": "service.spool.files",
}
"""Names the former `service/spool.py` module held only as imports: still there, for one release."""


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"service.spool.{name} is deprecated: import it from {home}", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(importlib.import_module(home), name)  # one warning per name
    return value
