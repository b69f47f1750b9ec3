"""Whether an installed engine's Python files are its release's own, byte for byte, as its wheel's RECORD says.

Why: a test proves a *release*, but a version string does not say the code is that release's. A trainer's image
reports a release's version with its patches applied on top; an editable install from a source tree reports
whatever its tree says. Such a build may fit the release's row and still differ where no hook looks, so each
engine's plugin runs it as unproven (SGLang: `engine_ext/sglang/release_files.py`; vLLM:
`engine_ext/vllm/release_files.py`). A wheel install lists every file with its sha256 in `RECORD`; an editable
install lists none of its sources, and is unverifiable, which counts as changed. `only` limits the check to the
modules that matter (vLLM hashes the ~10 files its hooks and `fit` read, not its 2,600).
"""

from __future__ import annotations

import base64
import csv
import hashlib
from collections.abc import Collection
from importlib.metadata import Distribution

EDITABLE = "no .py file of the package is in its RECORD (an editable or source install)"


def changed(dist: Distribution, package: str, only: Collection[str] | None = None) -> list[str]:
    """The files of `package` whose bytes differ from `dist`'s RECORD (`[EDITABLE]` when RECORD lists none of its
    `.py` files). `only`: dotted module names; a module counts with its submodules, and one RECORD does not list
    is named too. Empty: every file checked is the release's own."""
    listed = [row for row in _record(dist) if row[0].startswith(f"{package}/") and row[0].endswith(".py")]
    if not listed:
        return [EDITABLE]
    out = []
    if only is not None:
        prefixes = sorted(name.replace(".", "/") for name in only)
        listed = [row for row in listed if any(_within(row[0], p) for p in prefixes)]
        out += [f"{p}.py (not in RECORD)" for p in prefixes if not any(_within(row[0], p) for row in listed)]
    for path, mode, value in listed:
        out += _differs(dist, path, mode, value)
    return sorted(out)


def _record(dist: Distribution) -> list[tuple[str, str, str]]:
    """RECORD's hashed files as (path, hash name, urlsafe base64 digest); read as text, since building
    `dist.files` (a path object per file: 3,300 for vLLM) costs more than hashing the few files checked."""
    rows = csv.reader((dist.read_text("RECORD") or "").splitlines())
    return [(row[0], *row[1].partition("=")[::2]) for row in rows if len(row) > 1 and "=" in row[1]]


def _within(path: str, module: str) -> bool:
    """`path` is module `module`'s file, or one of its submodules' (a package counts whole)."""
    return path == f"{module}.py" or path.startswith(f"{module}/")


def _differs(dist: Distribution, path: str, mode: str, value: str) -> list[str]:
    try:
        data = dist.locate_file(path).read_bytes()
    except OSError:
        return [f"{path} (missing)"]
    try:
        digest = hashlib.new(mode, data).digest()
    except ValueError:  # a hash this Python lacks: unverifiable, so unproven, never a failed start
        return [f"{path} (hash {mode!r} unknown)"]
    return [] if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == value else [path]


def shown(files: Collection[str], first: int = 3) -> str:
    """The changed files in a start-up line: the first few, then how many more."""
    names = list(files)
    more = len(names) - first
    return ", ".join(names[:first]) + (f" and {more} more" if more > 0 else "")
