"""`make test-matrix-releases-1` and `-2` together run every release the release-server module has, each once."""

from __future__ import annotations

import pytest
from tiers import part

RELEASES = [f"0.5.{n}" for n in range(11)]


@pytest.mark.parametrize("n", [1, 2, 3, 11])
def test_the_parts_cover_every_release_once_in_order(n: int) -> None:
    parts = [part(RELEASES, f"{k}/{n}") for k in range(1, n + 1)]
    assert [v for p in parts for v in p] == RELEASES
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_no_part_asked_is_every_release() -> None:
    assert part(RELEASES, None) == part(RELEASES, "") == RELEASES


@pytest.mark.parametrize("spec", ["0/2", "3/2", "x/2"])
def test_a_part_that_is_not_one_says_so(spec: str) -> None:
    with pytest.raises(ValueError):
        part(RELEASES, spec)
