"""The paired A/B's statistics (`benchmarks/paired.py`): what its intervals are over, on numbers made here."""

from __future__ import annotations

import math

import pytest

from benchmarks.paired import by_rotation, interval


def test_a_rotation_cancels_a_cost_of_running_second() -> None:
    """AB then BA: the plugin ÷ upstream reads 0.8 when the plugin runs second and 1.25 when first; each rotation
    is 1.0, and the interval over rotations is that, where the one over rounds is wide."""
    rounds = [0.8, 1.25] * 6
    rotations = by_rotation(rounds, 2)
    assert rotations == pytest.approx([1.0] * 6)
    assert interval(rotations)["t95"] == pytest.approx([1.0, 1.0])
    low, high = interval(rounds)["t95"]
    assert low < 0.9 and high > 1.1


def test_an_unfinished_rotation_is_left_out() -> None:
    assert by_rotation([1.0, 1.0, 1.0, 2.0, 0.5], 3) == [1.0]
    assert by_rotation([0.9, 1.1], 3) == []
    (only,) = by_rotation([0.5, 2.0, 4.0], 3)
    assert math.isclose(only, (0.5 * 2.0 * 4.0) ** (1 / 3))
