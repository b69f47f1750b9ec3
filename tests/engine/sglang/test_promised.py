"""`sglang.promised`: at an offline engine's shutdown, wait (bounded) for the records responses promised."""

from __future__ import annotations

import threading

import numpy as np

from engine_ext.core.bounded_rids import BoundedRids
from engine_ext.core.records import RecordSpec
from engine_ext.core.writer import Op, SpoolWriter
from engine_ext.sglang import promised as promised_module
from engine_ext.sglang.promised import Promised


def _spec(rid: str) -> RecordSpec:
    return RecordSpec(rid, 8, 2, (0, 1), 0, 3, "uint8", "t/dp0")


def test_settle_waits_for_records_finalized_after_the_call(tmp_path, monkeypatch):
    writer = SpoolWriter(tmp_path, engine="t/dp0").start()
    pointed = Promised()
    looked = threading.Event()  # settle found "a" not final: what is written from now on comes after the call
    real_final = promised_module._final

    def final(spool, rid):
        done = real_final(spool, rid)
        if rid == "a" and not done:
            looked.set()
        return done

    monkeypatch.setattr(promised_module, "_final", final)
    settled: list[list[str]] = []
    settling = threading.Thread(target=lambda: settled.append(pointed.settle(tmp_path, timeout_s=60)), daemon=True)
    try:
        writer.submit(Op("a", spec=_spec("a")))  # open, not final: the response went out before the rows
        assert writer.flush()
        pointed.add("a")
        pointed.add("b")  # not even opened yet
        settling.start()
        assert looked.wait(30), "settle never looked at the open record"
        for r in ("a", "b"):
            op = Op(r, spec=_spec(r) if r == "b" else None, rows=np.ones((4, 2, 2), np.uint8), status="ok")
            writer.submit(op)
        settling.join(60)
        assert settled == [[]]
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
    outcome: list[list[str]] = []
    settling = threading.Thread(
        target=lambda: outcome.append(promised.settle(tmp_path / "never-created", 3600)), daemon=True
    )
    settling.start()
    settling.join(60)  # a settle that waited would wait its hour: far past this guard, which the test fails at
    assert outcome == [["refused"]], "settle waited for a record no writer can write"
