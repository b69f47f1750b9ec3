"""Weight-version spans (SGLang's, over output tokens) as record positions: SGLang's own span function feeds them."""

from __future__ import annotations

import pytest

from engine_ext.sglang.weight_versions import record_weights


def spans(events: list[tuple[str, int]], current: str, outputs: int) -> tuple[tuple[str, int, int], ...]:
    """SGLang's spans for a request with `events` (old version, output tokens at the change). SGLang is imported
    here, when a test first runs, not at collection (every xdist worker would import it: 5 CPU-s)."""
    sglang_weights = pytest.importorskip("sglang.srt.utils.weight_versions")
    made = sglang_weights.compute_weight_version_spans(
        [sglang_weights.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events],
        current_version=current,
        num_output_tokens=outputs,
    )
    return tuple((s.version, s.start, s.end) for s in made)


def test_no_update_records_the_serving_version_only() -> None:
    assert record_weights((), "v0", prompt_len=10, lo=0, hi=17) == ("v0", ())
    assert record_weights(spans([], "v0", 8), "v0", prompt_len=10, lo=0, hi=17) == ("v0", ())


def test_an_update_after_three_outputs_changes_at_the_row_that_fed_the_third() -> None:
    # prompt 10, 8 outputs: rows of positions 0..16; outputs 0-2 came from v0, the forward fed output 2
    # (position 12) ran on v1.
    got = record_weights(spans([("v0", 3)], "v1", 8), "v1", prompt_len=10, lo=0, hi=17)
    assert got == ("v1", ((0, "v0"), (12, "v1")))


def test_start_len_past_the_change_keeps_one_version() -> None:
    assert record_weights(spans([("v0", 3)], "v1", 8), "v1", prompt_len=10, lo=13, hi=17) == ("v1", ())
    got = record_weights(spans([("v0", 3)], "v1", 8), "v1", prompt_len=10, lo=5, hi=17)
    assert got == ("v1", ((5, "v0"), (12, "v1")))


def test_two_updates_and_a_return_to_an_old_name() -> None:
    got = record_weights(spans([("a", 2), ("b", 5)], "a", 9), "a", prompt_len=4, lo=0, hi=12)
    assert got == ("a", ((0, "a"), (5, "b"), (8, "a")))
