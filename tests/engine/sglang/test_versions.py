"""The support matrix: `versions.support()` per version, and docs/versions.md's table against `MATRIX`."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from engine_ext.sglang.versions import GROUPS, MATRIX, NEWEST, Seed, Upstream, support, supported

DOC = Path(__file__).resolve().parents[3] / "docs" / "versions.md"


def test_the_newest_is_proven_and_registers_every_group():
    plan = support(NEWEST)
    assert plan.full and plan.groups == GROUPS


def test_the_proven_versions_register_every_group():
    for version in [v for v, row in MATRIX.items() if row.proven]:
        plan = support(version)
        assert plan.full and plan.groups == GROUPS and plan.version == version


@pytest.mark.parametrize("version", ["0.5.20", "0.5.16", "0.5.12"])
def test_an_unproven_version_registers_nothing_and_names_what_is_missing(version, monkeypatch):
    """A row before its real-server suite passes (each older version was one): loud and inert, never half."""
    monkeypatch.setitem(MATRIX, version, replace(MATRIX[version], proven=False))
    plan = support(version)
    assert plan.groups == () and not plan.full
    assert f"sglang=={version}" in plan.reason and "registering no hooks" in plan.reason
    for name in MATRIX[version].missing_names:
        assert name in plan.reason


@pytest.mark.parametrize("found", ["0.5.22", "0.6.0", None])
def test_a_version_outside_the_matrix_registers_nothing(found):
    plan = support(found)
    assert plan.groups == () and "outside the support matrix" in plan.reason


def test_areal_pin_has_no_plugin_mechanism_and_the_message_says_the_floor():
    assert "needs sglang>=0.5.12" in support("0.5.10.post1").reason


def test_supported_lists_the_plugin_capable_versions_newest_first():
    assert supported() == ["0.5.23", "0.5.20", "0.5.16", "0.5.12"]


def _applies(version: str) -> str:
    row = MATRIX[version]
    if not row.plugin_mechanism:
        return "cannot load: needs ≥ 0.5.12"
    if row.proven:
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


def test_every_version_with_a_plugin_mechanism_states_every_seed():
    for row in MATRIX.values():
        if row.plugin_mechanism:
            assert set(row.seeds) == set(Seed) and all(isinstance(v, Upstream) for v in row.seeds.values())
            assert re.fullmatch(r"\d+\.\d+\.\d+", row.version)
