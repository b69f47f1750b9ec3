"""The support matrix: `versions.support()` per version, and docs/versions.md's table against `MATRIX`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine_ext.sglang.versions import GROUPS, MATRIX, NEWEST, PROVEN, RELEASES, Seed, Upstream, support, supported

DOC = Path(__file__).resolve().parents[3] / "docs" / "versions.md"


def test_the_newest_is_proven_and_registers_every_group():
    plan = support(NEWEST, NEWEST)
    assert plan.full and plan.groups == GROUPS and plan.proven and plan.layout == NEWEST


def test_each_proven_release_on_the_layout_it_was_proven_with_is_proven():
    for version in PROVEN:
        plan = support(version, RELEASES[version])
        assert plan.full and plan.groups == GROUPS and plan.version == version and plan.proven
        assert "proven" in plan.describe() and f"layout {RELEASES[version]} applied" in plan.describe()


@pytest.mark.parametrize(
    ("found", "layout"),
    [("0.5.12.post1", "0.5.16"), ("0.5.24", "0.5.23"), ("0.5.17.dev3+g1a2b3c4", "0.5.16"), ("0.5.23", "0.5.20")],
)
def test_a_build_that_fits_a_layout_runs_every_group_but_is_not_proven(found, layout):
    """A release no test ran, a fork's dev build, or a proven release string whose code fits another layout (a
    patched image): the plugin runs, and says the build is unproven (its records are checked first: `build_check`)."""
    plan = support(found, layout)
    assert plan.full and plan.groups == GROUPS and plan.layout == layout and not plan.proven
    assert f"sglang=={found}: layout {layout} applied (fits, but no test ran this build" in plan.describe()


def test_a_build_that_fits_no_layout_registers_nothing_and_names_what_the_nearest_lacks():
    lacking = {"0.5.16": ["sglang.srt.a.b", "sglang.srt.c.d"], "0.5.12": ["x"]}
    plan = support("0.5.17", None, lacking)
    assert plan.groups == () and not plan.full and plan.layout is None
    assert "sglang==0.5.17 fits none of the plugin's layouts (the nearest, 0.5.16, lacks: sglang.srt.a.b" in plan.reason
    assert "registering no hooks" in plan.reason and plan.describe() == f"r3-sidecar: {plan.reason}"


@pytest.mark.parametrize("found", ["0.5.10.post1", "0.4.9", "0.5.11.post2"])
def test_a_build_before_the_plugin_mechanism_says_the_floor(found):
    plan = support(found, None)
    assert plan.groups == () and "needs sglang>=0.5.12" in plan.reason


def test_supported_lists_the_plugin_capable_versions_newest_first():
    assert supported() == ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]


def _applies(version: str) -> str:
    row = MATRIX[version]
    if not row.plugin_mechanism:
        return "cannot load: needs ≥ 0.5.12"
    if version in PROVEN:
        gaps = f"; not run: {'; '.join(row.not_run)}" if row.not_run else ""
        return f"all hooks (proven on a real CPU server){gaps}"
    return "none: logged at start; refused under enforce"


def test_docs_table_is_the_matrix():
    text = DOC.read_text()
    table = text[text.index("<!-- matrix:begin -->") : text.index("<!-- matrix:end -->")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert header[2:7] == [seed.value for seed in Seed]
    expected = []
    for version, row in MATRIX.items():
        seeds = [row.seeds[s].value if s in row.seeds else "-" for s in Seed]
        expected.append([version, "yes" if row.plugin_mechanism else "no", *seeds, _applies(version)])
    assert body == expected


def _release_row(release: str) -> list[str]:
    layout = RELEASES[release]
    if layout is None:
        return [release, "none", "nothing registered: the start-up line names what the nearest layout lacks"]
    how = "proven on a real CPU server" if release in PROVEN else "unproven"
    return [release, layout, how]


def test_docs_release_table_is_releases():
    text = DOC.read_text()
    table = text[text.index("<!-- releases:begin -->") : text.index("<!-- releases:end -->")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    assert rows[0] == ["SGLang", "layout its code fits", "how it runs", "last real-server run"]
    assert [row[:3] for row in rows[1:]] == [_release_row(release) for release in RELEASES]
    for row in rows[1:]:  # a proven release says when and at which commit its real server last ran
        if row[2] == "proven on a real CPU server":
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", row[3]) and re.search(r"\b[0-9a-f]{7}\b", row[3]), row


def test_every_proven_release_has_a_layout_and_every_matrix_row_with_plugins_is_proven():
    assert all(RELEASES.get(version) is not None for version in PROVEN)
    assert {v for v, row in MATRIX.items() if row.plugin_mechanism} <= PROVEN


def test_every_version_with_a_plugin_mechanism_states_every_seed():
    for row in MATRIX.values():
        if row.plugin_mechanism:
            assert set(row.seeds) == set(Seed) and all(isinstance(v, Upstream) for v in row.seeds.values())
            assert re.fullmatch(r"\d+\.\d+\.\d+", row.version)
