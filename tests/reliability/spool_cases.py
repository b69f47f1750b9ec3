"""Hypothesis strategies for damaged spool records, and the one property every reader must keep.

Shared by the hypothesis test (fast suite and its long `slow` twin) and the atheris target, so both fuzzers
check the same thing: reading a damaged record raises `SpoolFormatError` (or returns metadata), and no read
ever returns a byte past `rows * row_bytes` or a byte that is not the file's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st

from service.spool import Spool
from service.spool.record.meta import MAX_META_BYTES, RecordMeta, SpoolFormatError, safe_name

RIDS = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,30}", fullmatch=True),
    st.sampled_from(["../etc/passwd", "a/b", "x\x00y", "é🙂", "~" + "0" * 40, ".hidden", "a" * 300, "..", "/"]),
    st.text(min_size=1, max_size=40),
)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def valid_meta(draw) -> dict[str, Any]:
    dtype = draw(st.sampled_from(["uint8", "uint16", "int16", "int32"]))
    layers = draw(st.lists(st.integers(0, 200), min_size=1, max_size=8, unique=True))
    return {
        "v": 1,
        "rid": draw(RIDS),
        "dtype": dtype,
        "num_experts": draw(st.integers(1, 128)),
        "topk": draw(st.integers(1, 8)),
        "layers": layers,
        "start": draw(st.integers(0, 1000)),
        "rows": draw(st.integers(0, 64)),
        "prompt_len": draw(st.integers(0, 1000)),
        "final": draw(st.booleans()),
        "status": draw(st.sampled_from(["ok", "aborted", "error"])),
        "engine": "fuzz/dp0",
        "weight_version": None,
        "created": 1.0,
        "updated": 2.0,
    }


@st.composite
def damaged_record(draw) -> tuple[str, bytes, bytes]:
    """(file stem, metadata bytes, .bin bytes): a valid record with zero or more kinds of damage."""
    meta = draw(valid_meta())
    stem = safe_name(meta["rid"])
    damage = draw(
        st.sets(
            st.sampled_from(
                ["drop", "retype", "extra", "bytes", "truncate_json", "oversize", "rename", "huge_rows", "neg"]
            ),
            max_size=3,
        )
    )
    if "drop" in damage:
        meta.pop(draw(st.sampled_from(sorted(meta))), None)
    if "retype" in damage:
        meta[draw(st.sampled_from(sorted(meta) or ["v"]))] = draw(JSON_VALUES)
    if "extra" in damage:
        meta[draw(st.text(max_size=6))] = draw(JSON_VALUES)
    if "huge_rows" in damage:
        meta["rows"] = draw(st.sampled_from([2**31, 2**40, 2**63 - 1]))
    if "neg" in damage:
        meta[draw(st.sampled_from(["rows", "start", "topk", "num_experts", "prompt_len"]))] = -draw(st.integers(1, 9))
    if "rename" in damage:
        stem = draw(st.sampled_from(["other", "~" + "f" * 40]))
    data = orjson.dumps(meta)
    if "bytes" in damage and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    if "truncate_json" in damage:
        data = data[: draw(st.integers(0, len(data)))]
    if "oversize" in damage:
        data = data + b" " * (MAX_META_BYTES + 1 - len(data))
    nbytes = _nbytes(meta)
    bin_len = max(0, draw(st.sampled_from([nbytes, nbytes - 1, nbytes + 1, 0, nbytes + 4096, nbytes // 2])))
    bin_len = min(bin_len, 1 << 20)
    pattern = bytes(range(251))
    bin_data = (pattern * (bin_len // 251 + 1))[:bin_len]
    return stem, data, bin_data


def _nbytes(meta: dict[str, Any]) -> int:
    try:
        return (
            int(meta["rows"])
            * len(meta["layers"])
            * int(meta["topk"])
            * {"uint8": 1, "uint16": 2, "int16": 2, "int32": 4}[meta["dtype"]]
        )
    except Exception:
        return 0


def check_read(spool: Spool, stem: str, meta_bytes: bytes, bin_data: bytes) -> str:
    """Write one record's files, read them back every way a server does; return the outcome's label.

    Raises AssertionError when a read breaks the contract; any exception other than `SpoolFormatError` escapes.
    """
    meta_path = spool.records_dir / f"{stem}.json"
    meta_path.write_bytes(meta_bytes)
    try:
        meta = spool.read_meta_file(meta_path)
    except SpoolFormatError as exc:
        return exc.reason
    finally:
        meta_path.unlink()
    assert isinstance(meta, RecordMeta)
    assert safe_name(meta.rid) == stem
    bin_path = spool.bin_path(meta.rid)
    bin_path.write_bytes(bin_data)
    try:
        return _check_rows(spool, meta, bin_data)
    finally:
        bin_path.unlink()


def _check_rows(spool: Spool, meta: RecordMeta, bin_data: bytes) -> str:
    nbytes = meta.nbytes
    try:
        got = b"".join(spool.iter_rows(meta, chunk_bytes=4096))
    except SpoolFormatError as exc:
        assert exc.reason == "truncated_bin", exc
        assert len(bin_data) < nbytes, f"truncated_bin with {len(bin_data)} >= {nbytes} bytes"
        return "truncated_bin"
    assert len(got) == nbytes, f"{len(got)} bytes served for rows={meta.rows} (want {nbytes})"
    assert got == bin_data[:nbytes], "served bytes differ from the file's"
    if meta.rows:
        arr = spool.read_array(meta)
        assert arr.shape == meta.shape and arr.dtype.name == meta.dtype
        lo, hi = meta.rows // 3, max(meta.rows // 3, meta.rows - 1)
        part = b"".join(spool.iter_rows(meta, lo, hi, chunk_bytes=1))
        assert part == bin_data[lo * meta.row_bytes : hi * meta.row_bytes]
    for lo, hi in ((-1, 0), (0, meta.rows + 1), (meta.rows, meta.rows - 1)):
        try:
            list(spool.iter_rows(meta, lo, hi))
        except ValueError:
            continue
        raise AssertionError(f"iter_rows accepted [{lo}, {hi}) with rows={meta.rows}")
    return "ok"


def seed_corpus(path: Path) -> None:
    """A few valid records for the atheris corpus (metadata, then a NUL, then the `.bin`)."""
    path.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate((0, 1, 5)):
        meta = {
            "v": 1,
            "rid": f"r{i}",
            "dtype": "uint8",
            "num_experts": 8,
            "topk": 2,
            "layers": [0, 3],
            "start": 0,
            "rows": rows,
            "prompt_len": 1,
            "final": True,
            "status": "ok",
            "engine": "e",
            "weight_version": None,
            "created": 1.0,
            "updated": 2.0,
        }
        (path / f"seed{i}").write_bytes(orjson.dumps(meta) + b"\x00" + bytes(rows * 4))
