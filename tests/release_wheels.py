"""Where each SGLang release's wheel is (`make release-wheels`: build/release-wheels/), checked to be PyPI's.

Why: CI reads every release's own source from its wheel (`tests/engine/sglang/test_release_wheels.py`, and
`make test-matrix`'s run-time cross-check, `tests/e2e/test_sglang_releases.py`). A wheel that is absent fails
the test that needs it, naming the make target (a skip would fail CI anyway: `tests/skips.py`); one whose bytes
are not the pinned ones (requirements/sglang-release-wheels.txt) fails too, since it is not that release.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from source_names import Source

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "build" / "release-wheels"
PINS = REPO / "requirements" / "sglang-release-wheels.txt"
MAKE = "make release-wheels"


def pins() -> dict[str, str]:
    """Release → the sha256 its wheel must have, in the file's order."""
    out = {}
    for line in PINS.read_text().splitlines():
        if line.startswith("sglang=="):
            requirement, _, digest = line.partition(" --hash=sha256:")
            out[requirement.removeprefix("sglang==")] = digest.strip()
    return out


def wheel(release: str) -> Path:
    """The release's wheel, whose bytes are the pinned ones (else an AssertionError saying what to run)."""
    found = sorted(WHEELS.glob(f"sglang-{release}-*.whl"))
    assert found, f"no sglang {release} wheel in {WHEELS.relative_to(REPO)}: run `{MAKE}` (make test does)"
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    assert digest == pins().get(release), f"{found[0].name} is not PyPI's (sha256 {digest}): delete it, `{MAKE}`"
    return found[0]


def source(release: str) -> Source:
    """The release's `sglang` package, read from its wheel."""
    return Source(zipfile.Path(wheel(release), "sglang/"))
