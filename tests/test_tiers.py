"""CI serves every SGLang layout in a real server: `tiers`' two tables cover `compat.LAYOUTS`, each release named
has that layout, and `make test` builds the venv of each release the layout smoke runs."""

from __future__ import annotations

import re
from pathlib import Path

from tiers import LAYOUT_SMOKE, LAYOUTS_SERVED_ELSEWHERE

from engine_ext.sglang import compat
from engine_ext.sglang.versions import RELEASES

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def test_every_layout_is_served_in_ci_once() -> None:
    assert not LAYOUT_SMOKE.keys() & LAYOUTS_SERVED_ELSEWHERE.keys()
    assert LAYOUT_SMOKE.keys() | LAYOUTS_SERVED_ELSEWHERE.keys() == compat.LAYOUTS.keys()


def test_each_smoke_release_has_the_layout_it_serves() -> None:
    assert all(RELEASES[release] == layout for layout, release in LAYOUT_SMOKE.items()), LAYOUT_SMOKE


def test_make_test_builds_each_smoke_releases_venv() -> None:
    text = MAKEFILE.read_text()
    (deps,) = re.findall(r"^test: (.*?)##", text, re.M)
    (listed,) = re.findall(r"^CI_LAYOUT_RELEASES := (.*)$", text, re.M)
    built = set(listed.split()) | {m for m in re.findall(r"env-sglang-([0-9.]+)", deps)}
    assert "$(CI_LAYOUT_RELEASES:%=.venv-sglang-%/.sglang-stamp)" in deps
    assert set(LAYOUT_SMOKE.values()) <= built, set(LAYOUT_SMOKE.values()) - built
