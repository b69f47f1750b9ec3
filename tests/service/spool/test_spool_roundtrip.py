"""The spool contract under generated inputs: what a writer appends is exactly what a reader gets."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.spool import Spool
from service.spool.record.meta import DTYPES, RecordMeta, SpoolFormatError, safe_name

ODD_RIDS = ["../x", "../../etc/passwd", "a/b/c", "..", ".", "~abc", "ünïcødé-rid", "sp ace", "%2F", "a" * 300, "x\ny"]
rids = st.one_of(
    st.sampled_from(ODD_RIDS),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,40}", fullmatch=True),
)


@st.composite
def records(draw: st.DrawFn) -> tuple[str, str, int, list[int], int, list[np.ndarray]]:
    dtype = draw(st.sampled_from(DTYPES))
    num_experts = draw(st.integers(1, min(int(np.iinfo(dtype).max) + 1, 70000)))
    layers = draw(st.lists(st.integers(0, 200), min_size=1, max_size=6, unique=True))
    topk = draw(st.integers(1, 9))
    pieces = draw(st.lists(st.integers(0, 40), max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, num_experts, size=(n, len(layers), topk)) for n in pieces]
    return draw(rids), dtype, num_experts, layers, topk, arrays


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.integers(0, 10_000))
def test_roundtrip_exact_rows_any_rid(record: tuple, start: int) -> None:
    rid, dtype, num_experts, layers, topk, arrays = record
    with tempfile.TemporaryDirectory() as root:
        spool = Spool(root)
        writer = spool.writer(rid, num_experts=num_experts, topk=topk, layers=layers, start=start, dtype=dtype)
        for rows in arrays:
            writer.append(rows)
        meta = writer.finalize()
        expected = np.concatenate([np.zeros((0, len(layers), topk)), *arrays]).astype(dtype)

        read = spool.read_meta(rid)
        assert read == meta
        assert read.rid == rid and read.final and read.rows == len(expected) and read.end == start + len(expected)
        got = spool.read_array(read)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, expected)
        for path in (spool.bin_path(rid), spool.meta_path(rid)):
            assert path.parent == spool.records_dir  # no rid escapes the records directory
        assert [spool.meta_path(rid).stem] == spool.record_names()
        assert spool.delete(rid) and os.listdir(spool.records_dir) == []


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.integers(1, 20), st.binary(min_size=1, max_size=100))
def test_rows_in_flight_never_returned(published: int, unpublished: int, junk: bytes) -> None:
    """Bytes past `rows * row_bytes` (an unpublished append, stray bytes) are invisible to readers."""
    with tempfile.TemporaryDirectory() as root:
        spool = Spool(root)
        writer = spool.writer("r", num_experts=64, topk=2, layers=[3, 4])
        first = np.arange(published * 4).reshape(published, 2, 2) % 64
        writer.append(first)
        writer.append(np.ones((unpublished, 2, 2)), publish=False)
        with open(spool.bin_path("r"), "ab") as f:
            f.write(junk)
        meta = spool.read_meta("r")
        assert meta.rows == published
        assert sum(len(c) for c in spool.iter_rows(meta, chunk_bytes=7)) == published * meta.row_bytes
        np.testing.assert_array_equal(spool.read_array(meta), first)
        writer.publish()
        assert spool.read_meta("r").rows == published + unpublished


def test_chunks_are_whole_rows(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    writer = spool.writer("c", num_experts=256, topk=3, layers=[0, 1, 2])
    writer.append(np.arange(100 * 9).reshape(100, 3, 3) % 256)
    meta = writer.finalize()
    chunks = list(spool.iter_rows(meta, 10, 90, chunk_bytes=50))
    assert all(len(c) % meta.row_bytes == 0 for c in chunks)
    assert b"".join(chunks) == spool.read_array(meta)[10:90].tobytes()
    assert list(spool.iter_rows(meta, 5, 5)) == []
    with pytest.raises(ValueError):
        list(spool.iter_rows(meta, 0, 101))


def test_safe_name_rule() -> None:
    assert safe_name("req-1:a.b_c") == "req-1:a.b_c"
    for rid in ODD_RIDS:
        name = safe_name(rid)
        assert name.startswith("~") and len(name) == 41 and "/" not in name


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"not json", "bad_json"),
        (b"[1, 2]", "bad_json"),
        (b'{"v": 2, "rid": "m"}', "unknown_version"),
        (b'{"v": 1, "rid": "m"}', "bad_field"),
        (b"x" * (1 << 21), "oversized_meta"),
    ],
)
def test_malformed_metadata_raises_with_reason(tmp_path: Path, content: bytes, reason: str) -> None:
    spool = Spool(tmp_path)
    spool.meta_path("m").write_bytes(content)
    with pytest.raises(SpoolFormatError) as exc:
        spool.read_meta("m")
    assert exc.value.reason == reason


def test_name_mismatch_and_truncated_bin(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    writer = spool.writer("real", num_experts=8, topk=1, layers=[0])
    writer.append(np.zeros((10, 1, 1)))
    meta = writer.finalize()
    (spool.records_dir / "other.json").write_bytes(meta.to_json())
    with pytest.raises(SpoolFormatError) as exc:
        spool.read_meta("other")
    assert exc.value.reason == "name_mismatch"
    os.truncate(spool.bin_path("real"), 5)
    with pytest.raises(SpoolFormatError) as exc:
        list(spool.iter_rows(meta))
    assert exc.value.reason == "truncated_bin"
    spool.bin_path("real").unlink()
    with pytest.raises(SpoolFormatError) as exc:
        list(spool.iter_rows(meta))
    assert exc.value.reason == "missing_bin"


def test_meta_json_is_contract_shape(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    meta = spool.writer("k", num_experts=300, topk=2, layers=[1, 5], prompt_len=7).finalize("error")
    obj = RecordMeta.from_json(spool.meta_path("k").read_bytes()).to_dict()
    assert set(obj) == {
        "v",
        "rid",
        "dtype",
        "num_experts",
        "topk",
        "layers",
        "start",
        "rows",
        "prompt_len",
        "final",
        "status",
        "engine",
        "weight_version",
        "created",
        "updated",
    }
    assert obj["dtype"] == "uint16" and obj["status"] == "error" and meta.final


def test_reclaim_leftovers_takes_only_old_unnamed_files(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    w = spool.writer("kept", num_experts=128, topk=2, layers=[0, 1])
    w.append(np.zeros((3, 2, 2), np.uint8))
    w.finalize()
    records = spool.records_dir
    (records / "orphan.bin").write_bytes(b"\0" * 64)
    (records / ".orphan.json.1.2.tmp").write_bytes(b"{")
    (spool.engines_dir / ".e.json.1.3.tmp").write_bytes(b"{")
    (records / "fresh.bin").write_bytes(b"\0")
    for name in ("kept.bin", "kept.json", "orphan.bin", ".orphan.json.1.2.tmp"):
        os.utime(records / name, (1000.0, 1000.0))
    os.utime(spool.engines_dir / ".e.json.1.3.tmp", (1000.0, 1000.0))
    now = 1000.0 + 61
    assert spool.reclaim_leftovers(120, now=now) == []
    removed = spool.reclaim_leftovers(60, now=now)
    assert sorted(p.name for p in removed) == [".e.json.1.3.tmp", ".orphan.json.1.2.tmp", "orphan.bin"]
    assert sorted(os.listdir(records)) == ["fresh.bin", "kept.bin", "kept.json"]
    assert spool.read_array(spool.read_meta("kept")).shape == (3, 2, 2)


def test_a_reused_rid_leaves_readers_of_the_old_record_its_rows(tmp_path: Path) -> None:
    """A new request under a used rid (verl's resume) replaces the record; a reader mid-stream keeps the old rows."""
    spool = Spool(tmp_path)
    old_rows = np.arange(2 * 4 * 2, dtype=np.uint8).reshape(2, 4, 2)
    writer = spool.writer("r", num_experts=8, topk=2, layers=[0, 1, 2, 3], prompt_len=2)
    writer.append(old_rows)
    old = writer.finalize()
    fd = spool.open_rows(old)  # a stream of the old record has begun
    try:
        new = spool.writer("r", num_experts=8, topk=2, layers=[0, 1, 2, 3], prompt_len=3)
        assert spool.read_meta("r").rows == 0 and not spool.read_meta("r").final  # never the old rows under new meta
        new.append(np.full((5, 4, 2), 7, dtype=np.uint8))
        new.finalize()
        streamed = b"".join(spool.iter_rows(old, fd=fd))
    finally:
        os.close(fd)
    assert streamed == old_rows.tobytes()
    assert (
        spool.read_array(spool.read_meta("r")).shape == (5, 4, 2)
        and (spool.read_array(spool.read_meta("r")) == 7).all()
    )


class _RecreateAt:
    """`os` as a spool module sees it, except that the first `os.<step>` of `path` first lets a writer on another
    thread recreate the record (`write_record` of `fresh`) for up to `grace_s`, then does the step."""

    def __init__(self, step: str, path: Path, spool: Spool, fresh: np.ndarray, grace_s: float = 0.3) -> None:
        self.step, self.target, self.spool, self.fresh, self.grace_s = step, path, spool, fresh, grace_s
        self.writer: threading.Thread | None = None

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name != self.step:
            return real

        def step(path, *args, **kwargs):
            if self.writer is None and os.fspath(path) == os.fspath(self.target):
                from helpers import write_record

                self.writer = threading.Thread(target=write_record, args=(self.spool, "kept", self.fresh))
                self.writer.start()
                self.writer.join(self.grace_s)  # unguarded, the writer is done by now; guarded, it waits
            return real(path, *args, **kwargs)

        return step


@pytest.mark.parametrize(("module", "step"), [("files", "stat"), ("bin_unlink", "unlink")])
def test_a_delete_spares_the_bin_of_a_record_that_reused_its_rid_meanwhile(
    tmp_path: Path, monkeypatch, module: str, step: str
) -> None:
    """An ack's delete and a writer recreating the same rid interleave (the demo restores an acknowledged rid at
    once; an engine may reuse a rid): the new record's `.bin` survives, whole, so its final metadata never
    promises rows no file holds. The writer gets its chance just before the delete checks which file the name
    holds (`stat`) and between that check and the unlink (`unlink`: CI's failure, a 410 "corrupt" for as long as
    the record lived, before the delete and the writer took the file's lock across both)."""
    from helpers import random_rows, write_record

    import service.spool

    spool = Spool(tmp_path)
    write_record(spool, "kept", random_rows(5, layers=2, topk=2))
    fresh = random_rows(7, layers=2, topk=2, seed=1)
    racer = _RecreateAt(step, spool.bin_path("kept"), spool, fresh)
    monkeypatch.setattr(getattr(service.spool, module), "os", racer)
    assert spool.delete("kept")
    assert racer.writer is not None
    racer.writer.join(5)
    meta = spool.read_meta("kept")
    assert meta is not None and meta.final and meta.rows == 7
    np.testing.assert_array_equal(spool.read_array(meta).astype(fresh.dtype), fresh)
    monkeypatch.undo()
    assert spool.delete("kept") and spool.read_meta("kept") is None and not spool.bin_path("kept").exists()


def _written(spool: Spool, rows: int, value: int):
    writer = spool.writer("r", num_experts=8, topk=2, layers=[0, 1], prompt_len=2)
    writer.append(np.full((rows, 2, 2), value, dtype=np.uint8))
    return writer


def test_a_record_deleted_while_written_stays_deleted(tmp_path: Path) -> None:
    """D11: an ack of a record whose writer goes on (a reused rid's new request) removes it; the writer's later
    appends and its finalize publish nothing, so no metadata ever promises rows no file holds."""
    spool = Spool(tmp_path)
    writer = _written(spool, 3, 1)
    assert spool.delete("r", created=spool.read_meta("r").created)
    writer.append(np.full((2, 2, 2), 1, dtype=np.uint8))
    writer.finalize()
    assert spool.read_meta("r") is None and not spool.bin_path("r").exists()


def test_a_delete_of_the_old_record_leaves_the_new_one_whole(tmp_path: Path) -> None:
    """D11: a delete meant for the record the sidecar indexed (its `created`) after a writer reused the rid
    removes nothing; the new record ends final with every row it promises."""
    spool = Spool(tmp_path)
    old = _written(spool, 2, 1).finalize()
    new = _written(spool, 4, 2)
    assert not spool.delete("r", created=old.created)
    final = new.finalize()
    assert spool.read_meta("r") == final and (spool.read_array(final) == 2).all() and final.rows == 4
