"""A spool directory (docs/design.md, Contract 1): where every file of the contract lives, and how it is read.

The engine extension writes records through `RecordWriter` (`Spool.writer`); the sidecar reads them with `Spool`.
Both sides meet only in this package (`service.spool`), so a change to the contract is a change to it alone.

Invariants a reader relies on (and a writer keeps):
- `.bin` is appended before `.json` is replaced, so bytes below `rows * row_bytes` are always there;
- bytes past `rows * row_bytes` may be in flight and are never read;
- `.json` is replaced atomically (temporary file in the same directory, then `os.replace`);
- names starting with "." are temporary files and are never records.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from service.spool.bin_unlink import holding, unlink_if_held
from service.spool.engine_report import EngineReport
from service.spool.files import atomic_write
from service.spool.record.meta import MAX_META_BYTES, VERSION, RecordMeta, SpoolFormatError, default_dtype, safe_name
from service.spool.record.writer import RecordWriter

DEFAULT_SPOOL_DIR = Path("/dev/shm/r3-spool")
"""Where engines and the sidecar meet when neither is told otherwise (`R3_SPOOL_DIR`): a tmpfs directory."""


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

    def delete(self, rid: str, created: float | None = None) -> bool:
        """Remove both files of a record: metadata first, so readers stop trusting the rows, then its `.bin`.

        `created`: remove only the record created then, the one the caller indexed. A writer that reuses the rid
        (the demo restores an acknowledged rid at once; an engine may reuse one) publishes its new `.json` and
        swaps in its own `.bin` while holding the old `.bin`'s lock (`RecordWriter`); under that same lock this
        delete reads which record the name holds now, and a newer one stays whole: otherwise the delete could
        unlink the new `.bin` and the writer's final metadata would promise rows no file holds (D11). The `.bin`
        itself goes only if it is still the file held (`bin_unlink`). False when nothing was removed."""
        bin_path = self.bin_path(rid)
        with holding(bin_path) as held:
            if created is not None and self._replaced(rid, created):
                return False
            found = _unlink(self.meta_path(rid))
            if held is not None:
                found = unlink_if_held(held, bin_path) or found
        return found

    def _replaced(self, rid: str, created: float) -> bool:
        """Whether the name now holds another record of `rid` than the one created at `created`."""
        try:
            meta = self.read_meta(rid)
        except SpoolFormatError:
            return False  # a damaged `.json` is the caller's to remove
        return meta is not None and meta.created != created

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
                except FileNotFoundError:
                    continue
                gone = self._reclaim_orphan(folder, name) if orphan else _unlink(Path(entry.path))
                if gone:
                    removed.append(Path(entry.path))
        return removed

    @staticmethod
    def _reclaim_orphan(folder: str | Path, name: str) -> bool:
        """Unlink the `.bin` `name` unless a writer published its rid since the listing (checked under the lock
        a writer takes before it replaces that file)."""
        path = os.path.join(folder, name)
        with holding(path) as held:
            if held is None or os.path.exists(os.path.join(folder, f"{name[:-4]}.json")):
                return False
            return unlink_if_held(held, path)

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


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
