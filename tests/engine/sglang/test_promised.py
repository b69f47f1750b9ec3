"""`sglang.promised`: at an offline engine's shutdown, wait (bounded) for the records responses promised."""

from __future__ import annotations

import threading
import time

import numpy as np

from engine_ext.core.bounded_rids import BoundedRids
from engine_ext.core.records import RecordSpec
from engine_ext.core.writer import Op, SpoolWriter
from engine_ext.sglang.promised import Promised


def _spec(rid: str) -> RecordSpec:
    return RecordSpec(rid, 8, 2, (0, 1), 0, 3, "uint8", "t/dp0")


def test_settle_waits_for_records_finalized_after_the_call(tmp_path):
    writer = SpoolWriter(tmp_path, engine="t/dp0").start()
    pointed = Promised()
    try:
        writer.submit(Op("a", spec=_spec("a")))  # open, not final: the response went out before the rows
        assert writer.flush()
        pointed.add("a")
        pointed.add("b")  # not even opened yet
        late = threading.Timer(
            0.3,
            lambda: [
                writer.submit(
                    Op(r, spec=_spec(r) if r == "b" else None, rows=np.ones((4, 2, 2), np.uint8), status="ok")
                )
                for r in ("a", "b")
            ],
        )
        late.start()
        assert pointed.settle(tmp_path, timeout_s=20) == []
        late.join()
    finally:
        writer.close()


def test_settle_gives_up_after_its_timeout_and_names_what_stayed_open(tmp_path, caplog):
    writer = SpoolWriter(tmp_path, engine="t/dp0").start()
    pointed = Promised()
    try:
        writer.submit(Op("open", spec=_spec("open")))
        writer.submit(Op("done", spec=_spec("done"), rows=np.ones((1, 2, 2), np.uint8), status="ok"))
        assert writer.flush()
        pointed.add("open")
        pointed.add("done")
        assert pointed.settle(tmp_path, timeout_s=0.2) == ["open"]
        assert "not final after 0.2 s at shutdown" in caplog.text and "'open'" in caplog.text
        assert pointed.settle(tmp_path, timeout_s=0) == ["open"]  # the final one is forgotten, the open one kept
    finally:
        writer.close()


def test_only_the_newest_pointers_are_remembered(tmp_path):
    pointed = Promised(limit=3)
    for rid in "abcde":
        pointed.add(rid)
    assert pointed.settle(tmp_path, timeout_s=0) == ["c", "d", "e"]


def test_bounded_rids_take_once_and_forget_the_oldest() -> None:
    """vLLM's pointer set: a rid's pointer is taken once; a re-added rid becomes the newest."""
    rids = BoundedRids(limit=2)
    rids.add("a")
    rids.add("b")
    rids.add("a")  # newest again
    rids.add("c")  # forgets b, not a
    assert rids.snapshot() == ["a", "c"]
    assert rids.take("a") and not rids.take("a") and not rids.take("b")


def test_settle_gives_up_at_once_where_no_record_can_be_written(tmp_path):
    """No spool directory to write to: the writer refuses every record, so the shutdown does not wait for one."""
    promised = Promised()
    promised.add("refused")
    started = time.monotonic()
    assert promised.settle(tmp_path / "never-created", timeout_s=5) == ["refused"]
    assert time.monotonic() - started < 1
