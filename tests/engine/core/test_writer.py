"""The spool writer: records land through `service.spool`, refusals are counted, the hand-off never blocks."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from helpers import random_rows
from waiting import wait_until

from engine_ext.core.records import RecordSpec, compact, spool_dtype
from engine_ext.core.writer import NOT_WRITABLE, QUEUE_FULL, SPOOL_FULL, Op, SpoolWriter
from service.spool import Spool
from service.spool.engine_report import UNDELIVERED_REASONS


def _spec(rid: str, *, layers=(0, 1, 3), topk: int = 2, num_experts: int = 8, start: int = 0) -> RecordSpec:
    return RecordSpec(
        rid=rid,
        num_experts=num_experts,
        topk=topk,
        layers=tuple(layers),
        start=start,
        prompt_len=5,
        dtype=spool_dtype("auto", num_experts),
        engine="pod/dp0",
    )


def _rows(n: int, layers: int = 3, topk: int = 2, num_experts: int = 8, seed: int = 0) -> np.ndarray:
    return random_rows(n, layers, topk, num_experts, seed).astype(np.int32)


def test_dtype_choice():
    assert spool_dtype("auto", 8) == "uint8"
    assert spool_dtype("auto", 256) == "uint8"
    assert spool_dtype("auto", 257) == "uint16"
    assert spool_dtype("int32", 8) == "int32"
    with pytest.raises(ValueError, match="cannot hold"):
        spool_dtype("uint8", 300)


def test_finish_record_round_trip(tmp_path):
    writer = SpoolWriter(tmp_path, engine="pod/dp0").start()
    rows = _rows(7)
    spec = _spec("req-1")
    data = compact(rows, spec.dtype)
    assert data.dtype == np.uint8 and data.nbytes == 7 * spec.row_bytes
    assert writer.submit(Op("req-1", spec=spec, rows=data, status="ok"))
    assert writer.flush()
    meta = Spool(tmp_path).read_meta("req-1")
    assert meta is not None and meta.final and meta.status == "ok" and meta.rows == 7
    assert meta.layers == (0, 1, 3) and meta.engine == "pod/dp0"
    np.testing.assert_array_equal(Spool(tmp_path).read_array(meta).astype(np.int32), rows)
    assert writer.snapshot() == {
        "queued_bytes": 0,
        "records_written": 1,
        "fallback_inline": 0,
        "spool_full": 0,
        "queue_full": 0,
        "write_errors": 0,
        "suspect_records": 0,
        "undelivered": dict.fromkeys(UNDELIVERED_REASONS, 0),
    }
    writer.close()


def test_live_record_grows_and_restarts(tmp_path):
    writer = SpoolWriter(tmp_path).start()
    spec = _spec("live/1 ü")  # an unsafe rid: stored under its hash name
    rows = _rows(6)
    assert writer.submit(Op(spec.rid, spec=spec, rows=compact(rows[:4], spec.dtype)))
    assert writer.flush()
    spool = Spool(tmp_path)
    meta = spool.read_meta(spec.rid)
    assert meta is not None and meta.rows == 4 and not meta.final
    assert writer.submit(Op(spec.rid, rows=compact(rows[4:], spec.dtype)))
    assert writer.submit(Op(spec.rid, status="aborted"))
    assert writer.flush()
    meta = spool.read_meta(spec.rid)
    assert meta.final and meta.status == "aborted" and meta.rows == 6
    np.testing.assert_array_equal(spool.read_array(meta), rows)
    assert writer.snapshot()["records_written"] == 1
    writer.close()


def test_a_new_spec_starts_an_open_record_over_without_a_final_in_between(tmp_path):
    writer = SpoolWriter(tmp_path).start()
    spec = _spec("again")
    assert writer.submit(Op("again", spec=spec, rows=compact(_rows(5), spec.dtype)))
    assert writer.flush()
    seen = []
    original = Spool.write_meta

    def spy(self, meta):
        seen.append((meta.rows, meta.final, meta.status))
        original(self, meta)

    Spool.write_meta = spy
    try:
        rows = _rows(2, seed=3)
        assert writer.submit(Op("again", spec=spec, rows=compact(rows, spec.dtype)))
        assert writer.flush()
    finally:
        Spool.write_meta = original
    assert seen == [(0, False, "ok"), (2, False, "ok")]  # never final: a waiting reader sees 202 throughout
    meta = Spool(tmp_path).read_meta("again")
    np.testing.assert_array_equal(Spool(tmp_path).read_array(meta), rows)
    writer.close()


class _Publishes:
    """Every metadata replace, as (rows, final), while in use."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []
        self._original = Spool.write_meta

    def __enter__(self) -> _Publishes:
        def spy(spool, meta):
            self.seen.append((meta.rows, meta.final))
            self._original(spool, meta)

        Spool.write_meta = spy
        return self

    def __exit__(self, *exc) -> None:
        Spool.write_meta = self._original


def _until(check, what: str, timeout: float = 10.0) -> None:
    wait_until(check, timeout, what, interval=0.005)


def _bin_rows(tmp_path, spec: RecordSpec) -> int:
    path = Spool(tmp_path).bin_path(spec.rid)
    return path.stat().st_size // spec.row_bytes if path.exists() else 0


def test_an_open_record_publishes_its_first_rows_at_once_then_once_per_interval(tmp_path):
    writer = SpoolWriter(tmp_path, publish_interval_s=3600).start()
    spec = _spec("throttled")
    rows = _rows(6)
    with _Publishes() as publishes:
        assert writer.submit(Op(spec.rid, spec=spec, rows=compact(rows[:2], spec.dtype)))
        _until(lambda: publishes.seen == [(0, False), (2, False)], "the first rows published")
        for lo in (2, 4):
            assert writer.submit(Op(spec.rid, rows=compact(rows[lo : lo + 2], spec.dtype)))
            _until(lambda lo=lo: _bin_rows(tmp_path, spec) == lo + 2, "rows appended to .bin")
        assert Spool(tmp_path).read_meta(spec.rid).rows == 2  # appended, not yet published: the interval holds them
        assert writer.submit(Op(spec.rid, status="ok"))
        _until(lambda: publishes.seen[-1:] == [(6, True)], "the final published at once")
    assert publishes.seen == [(0, False), (2, False), (6, True)]  # one replace for the four held rows and the final
    np.testing.assert_array_equal(Spool(tmp_path).read_array(Spool(tmp_path).read_meta(spec.rid)), rows)
    writer.close()


def test_held_rows_are_published_when_the_interval_runs_out_or_on_flush(tmp_path):
    writer = SpoolWriter(tmp_path, publish_interval_s=0.2).start()
    spec = _spec("trailing")
    assert writer.submit(Op(spec.rid, spec=spec, rows=compact(_rows(2), spec.dtype)))
    assert writer.submit(Op(spec.rid, rows=compact(_rows(3, seed=1), spec.dtype)))
    _until(lambda: (m := Spool(tmp_path).read_meta(spec.rid)) is not None and m.rows == 5, "the held rows published")
    writer.close()

    writer = SpoolWriter(tmp_path, publish_interval_s=3600).start()
    spec = _spec("flushed")
    assert writer.submit(Op(spec.rid, spec=spec, rows=compact(_rows(2), spec.dtype)))
    assert writer.submit(Op(spec.rid, rows=compact(_rows(3, seed=1), spec.dtype)))
    assert writer.flush()
    assert Spool(tmp_path).read_meta(spec.rid).rows == 5
    writer.close()


def test_flush_returns_only_once_a_held_publish_is_on_disk(tmp_path, monkeypatch):
    """`flush` asked for a held publish; the writer thread took it as a batch without ops and was still writing the
    metadata when `flush` saw nothing queued, busy or dirty, and returned: a reader then saw the record before
    those rows (CI, 2026-11-29: a live record read back with 0 rows after its restart). A slow metadata write
    makes that window wide."""
    original = Spool.write_meta

    def slow(spool, meta):
        time.sleep(0.05)  # not a wait: a slow metadata write, which widens the race this test guards
        original(spool, meta)

    writer = SpoolWriter(tmp_path, publish_interval_s=3600).start()
    spec = _spec("held")
    assert writer.submit(Op(spec.rid, spec=spec, rows=compact(_rows(2), spec.dtype)))
    _until(lambda: (m := Spool(tmp_path).read_meta(spec.rid)) is not None and m.rows == 2, "the first rows published")
    assert writer.submit(Op(spec.rid, rows=compact(_rows(3, seed=1), spec.dtype)))  # held by the interval
    _until(lambda: _bin_rows(tmp_path, spec) == 5, "rows appended to .bin")
    monkeypatch.setattr(Spool, "write_meta", slow)
    assert writer.flush()
    assert Spool(tmp_path).read_meta(spec.rid).rows == 5
    writer.close()


def test_a_held_publish_never_brings_back_a_record_that_started_over(tmp_path):
    writer = SpoolWriter(tmp_path, publish_interval_s=3600).start()
    spec = _spec("restarted")
    with _Publishes() as publishes:
        assert writer.submit(Op(spec.rid, spec=spec, rows=compact(_rows(3), spec.dtype)))
        _until(lambda: publishes.seen == [(0, False), (3, False)], "the first rows published")
        assert writer.submit(Op(spec.rid, rows=compact(_rows(2, seed=1), spec.dtype)))  # held
        _until(lambda: _bin_rows(tmp_path, spec) == 5, "rows appended to .bin")
        again = _rows(1, seed=2)
        assert writer.submit(Op(spec.rid, spec=spec, rows=compact(again, spec.dtype)))
        assert writer.flush()
    assert (5, False) not in publishes.seen, publishes.seen
    meta = Spool(tmp_path).read_meta(spec.rid)
    assert meta.rows == 1
    np.testing.assert_array_equal(Spool(tmp_path).read_array(meta), again)
    writer.close()


def test_spool_full_is_refused_and_counted(tmp_path):
    writer = SpoolWriter(tmp_path, max_bytes=64).start()
    spec = _spec("big")
    data = compact(_rows(100), spec.dtype)
    assert writer.reserve(data.nbytes) == SPOOL_FULL
    assert not writer.submit(Op("big", spec=spec, rows=data, status="ok"))
    writer.note_fallback()
    snap = writer.snapshot()
    assert snap["spool_full"] == 2 and snap["fallback_inline"] == 1 and snap["queued_bytes"] == 0
    assert writer.flush()
    assert Spool(tmp_path).read_meta("big") is None
    writer.close()


def test_undelivered_requests_are_counted_by_reason_and_logged(tmp_path, caplog):
    writer = SpoolWriter(tmp_path, max_bytes=64)
    with caplog.at_level(logging.WARNING, logger="r3_sidecar.writer"):
        for i in range(5):
            writer.note_undelivered("spool_full", rid=f"r{i}", inline=i % 2 == 0)
        writer.note_undelivered("mirror_mismatch", rid="m", inline=True, detail="9 rows, 8 expected")
    snap = writer.snapshot()
    assert snap["undelivered"] == {**dict.fromkeys(UNDELIVERED_REASONS, 0), "spool_full": 5, "mirror_mismatch": 1}
    assert snap["fallback_inline"] == 4, "only requests that asked for routed experts keep an inline payload"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, "one line per reason per interval, not one per request"
    assert "'r0'" in lines[0] and "spool_full" in lines[0] and "inline payload kept" in lines[0]
    assert "(mirror_mismatch: 9 rows, 8 expected; SGLang's inline payload kept)" in lines[1]  # why, for the log


def test_a_failed_write_counts_its_request_once(tmp_path):
    writer = SpoolWriter(tmp_path).start()
    spec = _spec("doomed")
    assert writer.submit(Op("doomed", spec=spec, rows=compact(_rows(3), spec.dtype)))
    bad = np.zeros((2, 9, 9), dtype=spec.dtype)  # the wrong row shape: the append raises on the writer thread
    assert writer.submit(Op("doomed", rows=bad))
    assert writer.submit(Op("doomed", rows=compact(_rows(1), spec.dtype)))
    assert writer.submit(Op("doomed", status="ok"))
    assert writer.flush()
    assert writer.snapshot()["undelivered"]["write_error"] == 1
    meta = Spool(tmp_path).read_meta("doomed")
    assert meta.final and meta.status == "error", "the sidecar answers 410 for it"
    writer.close()


def test_unwritable_spool_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    writer = SpoolWriter(blocker / "spool")  # cannot be created: its parent is a file
    assert not writer.writable
    assert writer.reserve(10) == NOT_WRITABLE
    assert not writer.submit(Op("x", spec=_spec("x"), rows=compact(_rows(1), "uint8"), status="ok"))


class _StalledWriter(SpoolWriter):
    """A writer whose thread blocks on its first op until released: a disk that stopped answering."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.release_disk = threading.Event()

    def _apply(self, op: Op, touched) -> None:
        self.entered.set()
        self.release_disk.wait(30)
        super()._apply(op, touched)


def test_handoff_never_blocks_on_a_stalled_writer(tmp_path):
    writer = _StalledWriter(tmp_path, queue_bytes=1 << 20).start()
    spec = _spec("r0")
    chunk = compact(_rows(40_000, seed=1), spec.dtype)  # 240 kB
    assert writer.submit(Op("r0", spec=spec, rows=chunk, status="ok"))
    assert writer.entered.wait(10)
    accepted = 1
    results = []
    started = time.perf_counter()
    for i in range(1, 10):
        results.append(writer.submit(Op(f"r{i}", spec=_spec(f"r{i}"), rows=chunk, status="ok")))
    elapsed = time.perf_counter() - started
    accepted += sum(results)
    # The queue bound (1 MiB) admits four 240 kB records; the rest are refused at once, not waited for.
    assert accepted == 4 and results[-1] is False
    assert writer.stats.queue_full == 6
    assert writer.reserve(chunk.nbytes) == QUEUE_FULL
    assert writer.snapshot()["queued_bytes"] == 4 * chunk.nbytes
    print(f"9 hand-offs against a stalled writer: {elapsed * 1e6:.0f} us")
    writer.release_disk.set()
    assert writer.flush()
    assert writer.snapshot()["records_written"] == 4
    assert writer.snapshot()["queued_bytes"] == 0
    writer.close()


def test_usage_counts_written_bytes_until_rescan(tmp_path):
    spec = _spec("a")
    data = compact(_rows(1000), spec.dtype)  # 6000 bytes
    writer = SpoolWriter(tmp_path, max_bytes=data.nbytes * 2 + 5_000).start()
    assert writer.submit(Op("a", spec=spec, rows=data, status="ok"))
    assert writer.flush()
    assert writer.submit(Op("b", spec=_spec("b"), rows=data, status="ok"))
    assert writer.flush()
    # Two records and their metadata now fill the cap: a third is refused before any rescan.
    assert writer.reserve(data.nbytes) == SPOOL_FULL
    Spool(tmp_path).delete("a")
    Spool(tmp_path).delete("b")
    writer._probe()
    assert writer.reserve(data.nbytes) is None
    writer.release(data.nbytes)
    writer.close()


def test_a_written_op_is_counted_once_while_the_rest_of_its_batch_is_written(tmp_path, monkeypatch):
    """Room for three records, two submitted: while the writer thread is between the two (the first written, the
    second not yet), a third still fits. The first op's bytes were once counted as written and still reserved
    until the whole batch was done, and a spool with room refused requests (CI's spool-full test, two of nine)."""
    from engine_ext.core.writer.spool_writer import META_ESTIMATE_BYTES

    spec = _spec("a")
    data = compact(_rows(100), spec.dtype)
    writer = SpoolWriter(tmp_path, max_bytes=3 * (data.nbytes + META_ESTIMATE_BYTES))
    between, go = threading.Event(), threading.Event()
    real_append = SpoolWriter._append

    def append(self, record, op):
        if op.rid == "b":
            between.set()
            go.wait(10)
        return real_append(self, record, op)

    monkeypatch.setattr(SpoolWriter, "_append", append)
    for rid in ("a", "b"):
        assert writer.reserve(data.nbytes) is None
        assert writer.submit(Op(rid, spec=_spec(rid), rows=data, status="ok"), reserved=True)
    writer.start()  # one batch: both ops
    try:
        assert between.wait(10), "the writer thread never reached the second op"
        assert writer.reserve(data.nbytes) is None, (writer._usage, writer._reserved)
        writer.release(data.nbytes)
    finally:
        go.set()
    assert writer.flush()
    assert writer._reserved == 0 and writer._reserved_blocks == 0 and writer.snapshot()["queued_bytes"] == 0
    assert writer._usage == 2 * (data.nbytes + META_ESTIMATE_BYTES)
    writer.close()


def test_write_error_refuses_until_the_spool_is_usable_again(tmp_path, monkeypatch):
    import shutil

    from engine_ext.core.writer import spool_writer

    monkeypatch.setattr(spool_writer, "USAGE_REFRESH_S", 3600.0)  # probes only when this test says so
    writer = SpoolWriter(tmp_path / "spool").start()
    spec = _spec("x")
    shutil.rmtree(tmp_path / "spool")  # the spool vanished under the engine
    assert writer.submit(Op("x", spec=spec, rows=compact(_rows(3), spec.dtype), status="ok"))
    assert writer.flush()
    assert writer.stats.write_errors == 1 and writer.snapshot()["records_written"] == 0
    assert writer.reserve(10) == NOT_WRITABLE  # no more hand-offs into a broken spool
    writer._probe()  # the writer thread's periodic probe recreates the directories
    assert writer.writable
    assert writer.submit(Op("y", spec=_spec("y"), rows=compact(_rows(3), "uint8"), status="ok"))
    assert writer.flush()
    assert Spool(tmp_path / "spool").read_meta("y").final
    writer.close()


def test_metadata_and_pages_count_toward_the_reservation(tmp_path):
    from engine_ext.core.writer.spool_writer import META_ESTIMATE_BYTES

    writer = SpoolWriter(tmp_path, max_bytes=2 * (1000 + META_ESTIMATE_BYTES) - 1)
    assert writer.reserve(1000) is None  # the rows and the new record's metadata file
    assert writer.reserve(1000) == SPOOL_FULL  # a second one would pass the cap by its metadata
    assert writer.reserve(1000, opens=False) is None  # rows appended to an open record add no metadata
    writer.release(1000, opens=False)
    writer.release(1000)
    assert writer.snapshot()["queued_bytes"] == 0 and writer._reserved == 0 and writer._reserved_blocks == 0


def test_the_records_are_scanned_only_under_a_cap_and_no_more_often_than_their_cost_allows(tmp_path, monkeypatch):
    from engine_ext.core.writer.spool_writer import USAGE_SCAN_CPU_SHARE

    scans: list[float] = []

    def costly_scan(spool) -> int:  # a spool of many files: 20 ms of this thread's CPU per scan
        started = time.thread_time()
        while time.thread_time() - started < 0.02:
            pass
        scans.append(time.thread_time() - started)
        return 0

    monkeypatch.setattr(Spool, "usage_bytes", costly_scan)
    SpoolWriter(tmp_path)._probe()  # no cap: the file system's counts, no scan
    assert scans == []
    capped = SpoolWriter(tmp_path, max_bytes=1 << 30)
    assert len(scans) == 1
    assert capped._scan_every >= scans[0] / USAGE_SCAN_CPU_SHARE >= 2.0  # 20 ms at 1%: at most every 2 s


def test_a_writer_thread_killed_by_our_code_is_recorded_and_logged_once(tmp_path, monkeypatch, caplog):
    """Not one record's failure (those are contained per record) but the loop's own: the thread ends loudly, in
    the engine file's `degraded`, instead of leaving every later record unwritten without a word."""
    from engine_ext.core import degraded

    monkeypatch.setattr(degraded, "ON_THREAD_FAILURE", [])  # no adapter stepping aside: the core's own record
    degraded.DEGRADED.clear()
    caplog.set_level(logging.ERROR, logger="r3_sidecar")
    writer = SpoolWriter(tmp_path, engine="pod/dp0")
    monkeypatch.setattr(writer, "_publish_due", lambda now_anyway: 1 / 0)
    writer.start()
    assert writer.submit(Op("req-1", spec=_spec("req-1"), rows=compact(_rows(3), "uint8"), status="ok"))
    _until(lambda: not writer._thread.is_alive(), "the writer thread ends")
    (fault,) = degraded.DEGRADED.snapshot()
    assert (fault["hook"], fault["target"], fault["error"]) == (
        "thread r3-spool-writer",
        "r3-spool-writer",
        "ZeroDivisionError: division by zero",
    )
    assert [r.getMessage() for r in caplog.records] == [
        "r3-sidecar: thread r3-spool-writer failed: ZeroDivisionError: division by zero"
    ]
    degraded.DEGRADED.clear()
