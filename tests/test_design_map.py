"""docs/design.md's module map names every module of the two packages, so a newcomer can find each one."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_module_map() -> None:
    design = (REPO / "docs/design.md").read_text()
    tracked = subprocess.run(
        ["git", "ls-files", "service", "engine_ext"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    modules = [path for path in tracked if path.endswith(".py") and not path.endswith("__init__.py")]
    missing = [path for path in modules if f"`{path}`" not in design]
    assert modules and not missing, f"docs/design.md's module map lacks {missing}"
