"""The row check (`service.spool.row_check`): each failure kind, sentinels, boundaries, the first bad row."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from service.spool.record.meta import RecordMeta, SpoolFormatError, Suspect
from service.spool.row_check import SGLANG_SENTINELS, allowed_sentinels, first_bad_row


def good_rows(n: int = 16, layers: int = 4, topk: int = 4, experts: int = 16, dtype: str = "uint8") -> np.ndarray:
    """Rows as a router makes them: distinct ids below `experts`, different per row and layer."""
    rng = np.random.default_rng(7)
    ids = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :topk]
    return ids.astype(dtype)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_true_rows_pass(dtype: str) -> None:
    assert first_bad_row(good_rows(dtype=dtype), 16) is None


def test_empty_and_top1_pass() -> None:
    assert first_bad_row(np.zeros((0, 4, 4), np.uint8), 16) is None
    assert first_bad_row(np.zeros((5, 4, 1), np.uint8), 16) is None  # top-1 zeros are possible routes


def test_a_zeroed_layer_is_named_at_its_first_row() -> None:
    rows = good_rows()
    rows[3:, 2] = 0
    found = first_bad_row(rows, 16, layers=(1, 3, 5, 7))
    assert found == Suspect(3, 5, "repeated", "ids [0, 0, 0, 0] repeat an expert")
    assert "row 3 (token position 13), layer 5: repeated" in found.describe(start=10)


def test_the_first_row_wins_then_the_first_layer() -> None:
    rows = good_rows()
    rows[9, 0, 0] = 200
    rows[4, 3, 1] = rows[4, 3, 0]
    rows[4, 1, 2] = 16
    found = first_bad_row(rows, 16)
    assert (found.row, found.layer, found.reason) == (4, 1, "out_of_range")


def test_range_boundaries() -> None:
    rows = good_rows(experts=16)
    assert first_bad_row(rows, 16) is None
    rows[0, 0, 0] = 15
    rows[0, 0, 1:] = [0, 1, 2]
    assert first_bad_row(rows, 16) is None
    rows[0, 0, 0] = 16
    assert first_bad_row(rows, 16).reason == "out_of_range"
    assert first_bad_row(rows, 17) is None


def test_negative_ids_in_signed_dtypes() -> None:
    rows = good_rows(dtype="int32")
    rows[2, 1, 3] = -5
    assert first_bad_row(rows, 16).to_dict()["reason"] == "out_of_range"
    assert first_bad_row(rows, 16, sentinels=SGLANG_SENTINELS).row == 2  # -5 is no sentinel


@pytest.mark.parametrize("dtype", ["uint8", "int32"])
def test_sglang_sentinel_is_allowed_and_may_repeat(dtype: str) -> None:
    rows = good_rows(dtype="int32")
    rows[5, 2, 2:] = -1  # padded columns, as SGLang pads with -1
    rows = rows.astype(dtype)  # uint8 stores -1 as 255
    assert first_bad_row(rows, 16, sentinels=SGLANG_SENTINELS) is None
    assert first_bad_row(rows, 16).reason == "out_of_range"


def test_a_sentinel_that_is_a_real_id_is_no_sentinel() -> None:
    assert allowed_sentinels(np.dtype("uint8"), (-1,), 256) == ()
    assert allowed_sentinels(np.dtype("uint8"), (-1,), 255) == (255,)
    assert allowed_sentinels(np.dtype("int16"), (-1,), 8) == (-1,)
    rows = good_rows(experts=256, topk=4).astype(np.uint8)
    rows[1, 1, :] = 255
    assert first_bad_row(rows, 256, sentinels=(-1,)).reason == "repeated"


def test_dense_slots_must_be_zero() -> None:
    rows = good_rows(layers=4)
    rows[:, 0] = 0  # layer 0 dense, as SGLang's inline payload holds it
    assert first_bad_row(rows, 16, dense=(0,)) is None
    rows[6, 0, 1] = 3
    found = first_bad_row(rows, 16, dense=(0,))
    assert (found.row, found.layer, found.reason) == (6, 0, "dense_not_zero")


def test_only_dense_slots() -> None:
    assert first_bad_row(np.zeros((3, 2, 4), np.int32), 16, dense=(0, 1)) is None


def meta(**extra: object) -> bytes:
    base = {"v": 1, "rid": "r", "dtype": "uint8", "num_experts": 16, "topk": 4, "layers": [0, 1], "start": 0,
            "prompt_len": 3, "rows": 5, "final": True, "status": "ok", "engine": "", "weight_version": None,
            "created": 1.0, "updated": 2.0}  # fmt: skip
    return orjson.dumps(base | extra)


def test_record_meta_carries_the_finding_and_older_records_parse() -> None:
    assert RecordMeta.from_json(meta()).suspect is None  # a record of an older writer
    found = {"row": 3, "layer": 1, "reason": "repeated", "detail": "ids [0, 0, 0, 0] repeat an expert"}
    parsed = RecordMeta.from_json(meta(status="suspect", suspect=found))
    assert parsed.suspect == Suspect(**found) and parsed.to_dict()["suspect"] == found
    assert RecordMeta.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize(
    "extra",
    [
        {"status": "suspect"},
        {"status": "ok", "suspect": {"row": 1, "layer": 0, "reason": "repeated"}},
        {"status": "suspect", "suspect": {"row": -1, "layer": 0, "reason": "repeated"}},
        {"status": "suspect", "suspect": {"row": 1, "layer": True, "reason": "repeated"}},
    ],
)
def test_suspect_without_a_finding_or_a_finding_without_suspect_is_malformed(extra: dict) -> None:
    with pytest.raises(SpoolFormatError):
        RecordMeta.from_json(meta(**extra))
