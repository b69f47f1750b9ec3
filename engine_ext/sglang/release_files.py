"""Whether the installed SGLang's Python files are its release's own, byte for byte, as its wheel's RECORD says.

Why: a test proves a *release* (`versions.PROVEN`), but a version string does not say the code is that release's
(`engine_ext.core.release_files` compares, shared with vLLM's plugin). slime's image reports `0.5.15.post1`
with slime's patches applied on top; an editable install from a source tree reports whatever its tree says.
Such a build may fit the release's layout and still differ where no hook looks (the router, the capturer's
callers), so it runs as unproven and checks itself (`build_check`). A wheel install lists every file with its
sha256 in `RECORD`; an editable install lists none of its sources, and is unverifiable, which counts as changed.
Hashing the package's ~4,700 `.py` files (68 MB) takes about 0.3 s, so the answer is kept per build
(`source_cache`: keyed by each file's size and modification time).
"""

from __future__ import annotations

import hashlib
from importlib.metadata import Distribution, PackageNotFoundError, distribution

from engine_ext.core import release_files
from engine_ext.core.release_files import EDITABLE
from engine_ext.sglang import source_cache


def changed(dist: Distribution, package: str = "sglang") -> list[str]:
    """The files of `package` whose bytes differ from `dist`'s RECORD, every `.py` file of it (`release_files`)."""
    return release_files.changed(dist, package)


def installed_changes() -> list[str]:
    """`changed` for this process's `sglang` distribution, once per build on this machine (`source_cache`: the
    package's files and this RECORD's own digest key it, so another dist-info over the same files asks again)."""
    try:
        dist = distribution("sglang")
    except PackageNotFoundError:
        return [EDITABLE]
    record = hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()
    return source_cache.cached("release-files", (record,), lambda: changed(dist))
