"""docs/trainers.md, "vLLM-based trainers": every `python` block of the section (those not marked `no-run`) runs
against `r3-sidecar demo` on a free port, as written but for the port."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_demo import demo  # noqa: F401  (the fixture: `r3-sidecar demo` on a free port)

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
SECTION = "## vLLM-based trainers"


def blocks() -> tuple[list[str], list[str]]:
    """(runnable blocks, `no-run` blocks) of the section."""
    text = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    fenced = re.findall(r"```python( no-run)?\n(.*?)```", text, re.S)
    return [b for flag, b in fenced if not flag], [b for flag, b in fenced if flag]


def test_section_blocks_run_against_the_demo_sidecar(demo):  # noqa: F811
    runnable, shown = blocks()
    assert len(runnable) == 1 and len(shown) == 4  # one call, and the four frameworks' own code
    _, url, _ = demo
    for block in runnable:
        exec(compile(block.replace("http://127.0.0.1:8000", url), str(DOC), "exec"), {})
    for block in shown:
        compile(block, str(DOC), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)  # valid Python (in an async def)
