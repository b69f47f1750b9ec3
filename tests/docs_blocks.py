"""The ```python blocks of README.md and docs/, as the docs-run tests read them.

A block fenced ```python runs as written against `make demo` (`tests/service/test_docs_run.py`). A block fenced
```python no-run cannot (a framework's own code, names that exist only inside verl, slime, …): its first line is a
`#` comment saying why. A *recipe* is a runnable block that hands an SGLang `/generate` response to
`RoutedExpertsRef.from_response(resp …)`: its `resp = {"meta_info": …}` line is a stand-in, which the tests
replace by real responses of every delivery mode (pointer only, rows only, both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))
DOC_URL = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(\w[\w-]*)?(?: ([\w-]+))?\n(.*?)^```$", re.S | re.M)
STAND_IN = re.compile(r'^resp = (\{"meta_info": .*\})$', re.M)
MODES = ("pointer", "inline", "both")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the block's first line in `doc`
    info: str  # "" (runs) or "no-run"
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def is_recipe(self) -> bool:
        return self.info == "" and STAND_IN.search(self.code) is not None and "from_response(resp" in self.code

    def stand_in(self) -> str:
        """The source of the recipe's stand-in response (a dict literal)."""
        found = STAND_IN.search(self.code)
        assert found is not None, self.id
        return found.group(1)

    def with_response(self, name: str) -> str:
        """The recipe with its stand-in replaced by the variable `name`."""
        return STAND_IN.sub(f"resp = {name}", self.code, count=1)


def blocks(doc: str) -> list[Block]:
    """Every Python block of `doc`, in order."""
    text = (REPO / doc).read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            out.append(Block(doc, text.count("\n", 0, m.start()) + 2, m.group(2) or "", m.group(3)))
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b.info != "no-run"]
RECIPES = [b for b in RUNNABLE if b.is_recipe]
