"""The house's bar: no tracked Python file over 450 lines (a module a newcomer reads in one sitting).

Split along a seam when a file grows past it (one idea per module), never by cramming lines.
"""

from __future__ import annotations

import subprocess

from helpers import REPO

LIMIT = 450


def test_no_python_file_is_over_the_limit() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    paths = [p for p in listed.split("\0") if p]
    assert len(paths) > 100, paths  # the listing worked: the project has a few hundred modules
    over = {p: n for p in paths if (n := len((REPO / p).read_text().splitlines())) > LIMIT}
    assert not over, f"over {LIMIT} lines (split along a seam): {over}"
