"""`engine_ext/vllm/build_check.py`: an unproven vLLM build's first records, as the spool stores them, against
vLLM's own inline rows; and what the Spooler and the completion hook make of it (no vLLM needed).

A real server whose build is made to disagree is `tests/e2e/test_vllm_build_check.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine_ext.core.build_check import AGREED, PENDING, BuildMismatch
from engine_ext.core.degraded import DEGRADED
from engine_ext.core.records import Finished, ModelShape
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.vllm import hooks
from engine_ext.vllm.build_check import BuildCheck, as_served
from engine_ext.vllm.spooler import Spooler
from service.spool import Spool
from service.spool.engine_report import EngineReport

SHAPE = ModelShape(num_experts=16, topk=2, num_hidden_layers=4, layers=(1, 3))  # layers 0 and 2 dense


def vllm_rows(n: int, seed: int = 0) -> np.ndarray:
    """vLLM's array of a request: every layer's slot, dense ones zero, 2 distinct ids of 16 per routing layer."""
    out = np.zeros((n, 4, 2), dtype=np.uint8)
    ids = np.argsort(np.random.default_rng(seed).random((n, 2, 16)), axis=-1)[..., :2]
    out[:, [1, 3]] = ids
    return out


def test_a_record_as_served_is_vllms_array_back():
    rows = vllm_rows(5)
    assert np.array_equal(as_served(rows[:, [1, 3]], (1, 3), 4), rows)


def test_records_that_agree_take_the_check_to_agreed_a_wider_dtype_too():
    check = BuildCheck("vLLM x", needed=2, layers=(1, 3), num_hidden_layers=4)
    assert check.state == PENDING and check.report() == {"state": PENDING, "agreed": 0, "needed": 2}
    check.compare("a", vllm_rows(5)[:, [1, 3]], vllm_rows(5))
    check.compare("b", vllm_rows(3, 1)[:, [1, 3]].astype(np.uint16), vllm_rows(3, 1))  # R3_DTYPE=uint16
    assert check.state == AGREED and check.report() == {"state": AGREED, "agreed": 2, "needed": 2}


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda r: r[[1, 0, 2, 3, 4]], "row 0, layer slot 1: "),  # rows shifted
        (lambda r: r[:, ::-1], "row 0, layer slot 1: "),  # layers swapped
        (lambda r: r[:4], "shape (4, 4, 2) where vLLM's is (5, 4, 2)"),  # a row lost
    ],
)
def test_the_first_difference_raises_naming_the_build_record_row_and_layer(change, where):
    check = BuildCheck("vLLM 0.32.0 (matrix row 0.32.0, no test ran this build)", 3, (1, 3), 4)
    record = np.ascontiguousarray(change(vllm_rows(5)[:, [1, 3]]))
    with pytest.raises(BuildMismatch) as raised:
        check.compare("cmpl-r-0", record, vllm_rows(5))
    text = str(raised.value)
    assert text.startswith("vLLM 0.32.0 (matrix row 0.32.0, no test ran this build): record 'cmpl-r-0' as the spool")
    assert where in text and check.state == PENDING, text


def test_a_dense_slot_vllm_filled_is_a_difference():
    theirs = vllm_rows(2)
    theirs[1, 2] = [5, 6]  # a layer the model config calls dense routes in this build's array
    with pytest.raises(BuildMismatch, match=r"row 1, layer slot 2: \[0, 0\] where vLLM's is \[5, 6\]"):
        BuildCheck("b", 1, (1, 3), 4).compare("r", theirs[:, [1, 3]], theirs)


def spooler(tmp_path: Path, mode: Mode = Mode.SIDECAR, *, proven: bool = False) -> Spooler:
    settings = EngineSettings(
        spool_dir=tmp_path, mode=mode, engine_id="t", sidecar_url="http://side:1", build_check_records=2
    )
    return Spooler(settings, SHAPE, engine="t/api0", vllm="0.32.0", row="0.32.0", proven=proven)


def report(made: Spooler) -> EngineReport:
    return EngineReport.from_dict(made.telemetry.tick())


def test_sidecar_mode_keeps_vllms_rows_until_the_check_agrees_then_drops_them(tmp_path):
    made = spooler(tmp_path)
    try:
        first = report(made)
        assert first.build.to_dict()["check"] == {"state": PENDING, "agreed": 0, "needed": 2}
        assert first.delivery.mode == "mirror" and first.delivery.configured_mode == "sidecar"
        assert first.delivery.inline_kept.endswith("until its first 2 records agree with vLLM's own (build.check)")
        assert made.finish(Finished("gone", None, 0, 3, "aborted")) is True  # no rows: nothing compared
        assert made.finish(Finished("a", vllm_rows(5), 0, 3)) is True  # checked: inline rows and pointer
        assert made.finish(Finished("b", vllm_rows(4, 1), 0, 3)) is True  # the second agrees: still both
        assert made.finish(Finished("c", vllm_rows(4, 2), 0, 3)) is False  # then sidecar: the record only
        after = report(made)
        assert made.writer.flush() and {made.pointer(rid) is not None for rid in "abc"} == {True}
    finally:
        made.close()
    assert after.build.to_dict()["check"] == {"state": AGREED, "agreed": 2, "needed": 2}
    assert after.delivery.mode == "sidecar" and after.delivery.inline_kept is None
    spool = Spool(tmp_path)
    assert np.array_equal(spool.read_array(spool.read_meta("a")), vllm_rows(5)[:, [1, 3]])


def test_a_proven_build_is_not_checked(tmp_path):
    made = spooler(tmp_path, proven=True)
    try:
        assert made.finish(Finished("a", vllm_rows(5), 0, 3)) is False
        assert report(made).build.to_dict() == {"found": "0.32.0", "layout": "0.32.0", "proven": True, "check": None}
    finally:
        made.close()


@pytest.fixture
def shifting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Spooler]:
    """A Spooler in the hooks' place whose conversion shifts the first two rows, as a build it misreads would."""
    made = spooler(tmp_path)
    real = made.spool_rows
    monkeypatch.setattr(made, "spool_rows", lambda rows: real(rows)[[1, 0, *range(2, len(rows))]])
    monkeypatch.setattr(hooks, "SPOOLER", made)
    DEGRADED.clear()
    yield made
    DEGRADED.clear()
    made.close()


def completion(rid: str, rows: np.ndarray) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A finished `RequestState` and the `CompletionOutput` vLLM builds for it, as far as the hook reads them."""
    state = SimpleNamespace(parent_req=None, external_req_id=rid, prompt_len=3, _r3_start=0)
    return state, SimpleNamespace(finish_reason="length", routed_experts=rows)


def test_a_disagreement_leaves_vllms_path_in_charge_loudly(shifting, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="r3_sidecar.vllm"):
        for rid, seed in (("cmpl-a-0", 0), ("cmpl-b-0", 1)):
            state, output = completion(rid, vllm_rows(5, seed))
            assert hooks._around_completion_output(lambda s, o=output: o, state) is output
            assert np.array_equal(output.routed_experts, vllm_rows(5, seed))  # vLLM's own rows, untouched
    (line,) = caplog.messages  # once, at the first record
    assert "failed: BuildMismatch: " in line and "steps aside in this process" in line, line
    assert caplog.records[0].exc_info is not None  # the traceback the R3EngineDegraded alert points readers to
    (fault,) = DEGRADED.snapshot()
    assert fault["hook"] == "_around_completion_output" and fault["target"].endswith("._new_completion_output")
    assert "record 'cmpl-a-0' as the spool stores it differs from vLLM's own: row 0, layer slot 1" in fault["error"]
    assert shifting.writer.flush() and Spool(tmp_path).read_meta("cmpl-a-0") is None  # nothing of it written
    assert Spool(tmp_path).read_meta("cmpl-b-0") is None and shifting.pointer("cmpl-a-0") is None
    engine = report(shifting)
    assert engine.delivery.mode == "off" and engine.delivery.inline_kept.startswith("r3-sidecar stepped aside: ")
    assert [f.hook for f in engine.degraded] == ["_around_completion_output"]


def test_an_unexpected_failure_of_the_check_keeps_vllms_rows(tmp_path, monkeypatch, caplog):
    """Not a disagreement but a bug in the check itself: the hook's containment keeps vLLM's output as it is."""
    made = spooler(tmp_path)
    monkeypatch.setattr(hooks, "SPOOLER", made)
    monkeypatch.setattr(made.check, "compare", lambda *args: [][0])
    monkeypatch.setattr(hooks, "_failed", set())  # each place logs once per process: this test's own
    try:
        state, output = completion("cmpl-x-0", vllm_rows(3))
        with caplog.at_level(logging.ERROR, logger="r3_sidecar.vllm"):
            assert hooks._around_completion_output(lambda s: output, state) is output
        assert np.array_equal(output.routed_experts, vllm_rows(3)) and "IndexError" in caplog.text
        assert made.writer.flush() and Spool(tmp_path).read_meta("cmpl-x-0") is None
    finally:
        made.close()
