"""Whether the installed SGLang's Python files are its release's own, byte for byte, as its wheel's RECORD says.

Why: a test proves a *release* (`versions.PROVEN`), but a version string does not say the code is that release's.
slime's image reports `0.5.15.post1` with slime's patches applied on top; an editable install from a source tree
reports whatever its tree says. Such a build may fit the release's layout and still differ where no hook looks
(the router, the capturer's callers), so it runs as unproven and checks itself (`build_check`). A wheel install
lists every file with its sha256 in `RECORD`; an editable install lists none of its sources, and is unverifiable,
which counts as changed. Hashing the package's ~4,700 `.py` files (68 MB) takes about 0.3 s, so the answer is
kept per build (`source_cache`: keyed by each file's size and modification time).
"""

from __future__ import annotations

import base64
import hashlib
from importlib.metadata import Distribution, PackageNotFoundError, distribution

from engine_ext.sglang import source_cache

EDITABLE = "no .py file of the package is in its RECORD (an editable or source install)"


def changed(dist: Distribution, package: str = "sglang") -> list[str]:
    """The files of `package` whose bytes differ from `dist`'s RECORD (first few; `[EDITABLE]` when RECORD lists
    none of its `.py` files). Empty: every listed `.py` file is the release's own."""
    listed = [f for f in dist.files or () if f.hash and f.parts[0] == package and f.name.endswith(".py")]
    if not listed:
        return [EDITABLE]
    out = []
    for record in listed:
        try:
            data = record.locate().read_bytes()
        except OSError:
            out.append(f"{record} (missing)")
            continue
        try:
            digest = hashlib.new(record.hash.mode, data).digest()
        except ValueError:  # a hash this Python lacks: unverifiable, so unproven, never a failed start
            out.append(f"{record} (hash {record.hash.mode!r} unknown)")
            continue
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != record.hash.value:
            out.append(str(record))
    return out


def installed_changes() -> list[str]:
    """`changed` for this process's `sglang` distribution, once per build on this machine (`source_cache`: the
    package's files and this RECORD's own digest key it, so another dist-info over the same files asks again)."""
    try:
        dist = distribution("sglang")
    except PackageNotFoundError:
        return [EDITABLE]
    record = hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()
    return source_cache.cached("release-files", (record,), lambda: changed(dist))
