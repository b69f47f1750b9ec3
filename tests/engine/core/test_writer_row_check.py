"""The writer thread's row check (issue 40): a record with rows no true route has is kept, marked, counted."""

from __future__ import annotations

import numpy as np
from helpers import random_rows

from engine_ext.core.records import RecordSpec, compact
from engine_ext.core.writer import Op, SpoolWriter
from service.spool import Spool


def _spec(rid: str, *, num_experts: int = 8, start: int = 0) -> RecordSpec:
    return RecordSpec(rid, num_experts=num_experts, topk=2, layers=(0, 1, 3), start=start, prompt_len=5, dtype="uint8")


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return random_rows(n, 3, 2, 8, seed).astype(np.int32)


def test_a_record_with_a_zeroed_layer_is_kept_marked_and_counted(tmp_path, caplog):
    """Issue 40: a capture that writes zeros for one layer. The record is kept, `suspect` at its first bad row."""
    writer = SpoolWriter(tmp_path).start()
    rows = _rows(6)
    rows[2:, 1] = 0
    assert writer.submit(Op("z", spec=_spec("z", start=40), rows=compact(rows, "uint8"), status="ok"))
    assert writer.flush()
    meta = Spool(tmp_path).read_meta("z")
    assert meta.final and meta.status == "suspect" and meta.rows == 6
    assert (meta.suspect.row, meta.suspect.layer, meta.suspect.reason) == (2, 1, "repeated")
    np.testing.assert_array_equal(Spool(tmp_path).read_array(meta), rows)  # kept as written
    assert writer.snapshot()["suspect_records"] == 1 and writer.snapshot()["records_written"] == 1
    assert "token position 42" in caplog.text
    writer.close()


def test_live_appends_are_checked_as_they_come(tmp_path):
    """The row a finding names counts the rows appended before; the mark stays until the final, whatever it is."""
    writer = SpoolWriter(tmp_path, publish_interval_s=3600).start()
    spec = _spec("live", num_experts=8)
    bad = _rows(3)
    bad[1, 2] = [9, 1]  # expert 9 of 8
    assert writer.submit(Op("live", spec=spec, rows=compact(_rows(5), "uint8")))
    assert writer.submit(Op("live", rows=compact(bad, "uint8")))
    assert writer.submit(Op("live", rows=compact(_rows(2, seed=1), "uint8")))
    assert writer.flush()
    meta = Spool(tmp_path).read_meta("live")
    assert not meta.final and meta.status == "suspect" and meta.suspect.row == 6 and meta.suspect.layer == 3
    assert writer.submit(Op("live", status="aborted"))
    assert writer.flush()
    meta = Spool(tmp_path).read_meta("live")
    assert meta.final and meta.status == "suspect" and meta.suspect.reason == "out_of_range"
    assert writer.snapshot()["suspect_records"] == 1


def test_the_engines_sentinel_is_no_fault(tmp_path):
    """SGLang pads unused ids with -1 (255 once stored as uint8): allowed where the writer is told so."""
    rows = _rows(4)
    rows[1, 0] = -1
    for sentinels, status in (((-1,), "ok"), ((), "suspect")):
        writer = SpoolWriter(tmp_path / status, sentinels=sentinels).start()
        assert writer.submit(Op("s", spec=_spec("s"), rows=compact(rows, "uint8"), status="ok"))
        assert writer.flush()
        assert Spool(tmp_path / status).read_meta("s").status == status
        writer.close()


def test_the_check_turned_off_writes_rows_unchecked_and_says_so_at_start(tmp_path, caplog):
    """`R3_ROW_CHECK=0` (to measure what the check costs): the zeroed record is served `ok`, counted nowhere, and
    the writer said at its start that the check is off."""
    writer = SpoolWriter(tmp_path, row_check=False).start()
    assert "the row check is off" in caplog.text
    rows = _rows(6)
    rows[2:, 1] = 0
    assert writer.submit(Op("z", spec=_spec("z"), rows=compact(rows, "uint8"), status="ok"))
    assert writer.flush()
    assert Spool(tmp_path).read_meta("z").status == "ok" and writer.snapshot()["suspect_records"] == 0
    writer.close()
