"""`build_check`: an unproven build's first records, gathered the plugin's way, against SGLang's own rows.

The collector's side (mirror while pending, the configured mode once agreed) is driven here with its real
`StepGather` and `SpoolWriter` on a temporary spool; a real server whose build is made to disagree is
`tests/e2e/test_sglang_build_check.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_ext.core.build_check import first_difference
from engine_ext.core.records import ModelShape
from engine_ext.core.settings import Mode
from engine_ext.core.writer import SpoolWriter
from engine_ext.sglang.build_check import AGREED, PENDING, BuildCheck, BuildMismatch
from engine_ext.sglang.collect import Collector, FinishedReq


def rows(seed: int, n: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, size=(n, 3, 2), dtype=np.uint8)


def test_first_difference_names_the_row_layer_and_both_values():
    ours, theirs = rows(1), rows(1).copy()
    assert first_difference(ours, theirs, engine="SGLang") is None
    theirs[3, 2, 1] += 1
    gap = first_difference(ours, theirs, engine="SGLang")
    assert gap.startswith("row 3, layer slot 2: ") and "where SGLang's is" in gap
    assert first_difference(ours[:4], theirs, engine="SGLang") == "shape (4, 3, 2) where SGLang's is (5, 3, 2)"


def test_records_that_agree_take_the_check_to_agreed_in_either_arrival_order():
    check = BuildCheck("sglang==x", needed=2)
    check.theirs("a", rows(1))
    check.ours("a", rows(1))
    assert check.state == PENDING and check.report() == {"state": PENDING, "agreed": 1, "needed": 2}
    check.ours("b", rows(2))
    check.theirs("b", rows(2))
    assert check.state == AGREED and not check.wants()


def test_the_first_difference_raises_naming_the_build_record_and_row():
    check = BuildCheck("sglang==0.5.15.post1 (layout 0.5.16)", needed=3)
    bad = rows(1).copy()
    bad[0, 1, 0] ^= 1
    check.theirs("r-1", rows(1))
    with pytest.raises(BuildMismatch, match=r"sglang==0\.5\.15\.post1 \(layout 0\.5\.16\): record 'r-1' .* row 0"):
        check.ours("r-1", bad)


def test_a_request_sglang_built_no_rows_for_is_not_compared():
    check = BuildCheck("b", needed=1)
    check.theirs("gone", None)
    check.ours("gone", rows(1))
    assert check.state == PENDING and check.report()["agreed"] == 0 and check.wants()


@pytest.fixture
def collector(tmp_path):
    writer = SpoolWriter(tmp_path, engine="e").start()
    shape = ModelShape(num_experts=64, topk=2, layers=(0, 1, 2), num_hidden_layers=3)
    made = Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="e")
    made.check = BuildCheck("b", needed=1)
    yield made
    writer.close()


def finished(rid: str, seqlen: int = 6) -> FinishedReq:
    return FinishedReq(rid, True, 0, 3, seqlen, pool_idx=0, aborted=False)


def test_the_collector_mirrors_while_pending_and_takes_over_once_agreed(collector):
    host = torch.from_numpy(rows(7, 16).astype(np.int32))
    req_to_token = torch.arange(16, dtype=torch.int64).reshape(1, 16)
    assert collector.mode is Mode.MIRROR  # sidecar mode acts as mirror until the check agrees
    assert collector.finish(finished("r"), publisher=True) == "both"
    collector.mirror("r", host[:5].clone())  # SGLang's own inline rows: its get_topk's
    collector.end_step(req_to_token, host)
    collector.drain(wait=True)
    assert collector.check.state == AGREED and collector.mode is Mode.SIDECAR
    assert collector.finish(finished("s"), publisher=True) == "spool"


def test_the_collector_raises_when_its_gather_differs_from_sglangs_rows(collector):
    host = torch.from_numpy(rows(7, 16).astype(np.int32))
    req_to_token = torch.arange(16, dtype=torch.int64).reshape(1, 16)
    collector.finish(finished("r"), publisher=True)
    shifted = host[1:6].clone()  # rows one position off: what a wrong slice would hand out
    collector.mirror("r", shifted)
    with pytest.raises(BuildMismatch, match="record 'r'"):
        collector.end_step(req_to_token, host)  # the step's read lands at once on the CPU, and is compared
    assert collector.mode is Mode.MIRROR
