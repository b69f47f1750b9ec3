"""What the attribute check read from the installed SGLang's source, kept on disk keyed by those files' identity.

Why: `attributes.missing` parses SGLang's largest modules (scheduler, model runner, tokenizer manager) with `ast`:
seconds per process, and every SGLang process that loads plugins decides its layout (`fit`). The answer depends
only on the installed source files and on the plugin's own tables, so it is computed once per build and reused
by every process and every later start. The key covers each `.py` file of the installed `sglang` package (path,
size, modification time: an image patched after install changes it) and the plugin's own `layout`, `compat`
and `attributes` sources. The cache is an optimisation only: a directory that cannot be read or written means the
check runs, never that it is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

ENV = "R3_CACHE_DIR"


def cache_dir() -> Path:
    """`R3_CACHE_DIR`, else `$XDG_CACHE_HOME/r3-sidecar`, else `~/.cache/r3-sidecar`."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "r3-sidecar"


def source_key(*parts: str) -> str | None:
    """A digest of the installed `sglang` package's files and of the plugin's own tables (None: no SGLang)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    digest = hashlib.sha256("\0".join(parts).encode())
    root = Path(next(iter(spec.submodule_search_locations)))
    digest.update(str(root).encode())
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            stat = os.stat(os.path.join(folder, name))
            digest.update(f"{folder}/{name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    here = Path(__file__).parent
    for own in ("layout.py", "compat.py", "attributes.py"):
        digest.update((here / own).read_bytes())
    return digest.hexdigest()[:32]


def cached(name: str, functions: Collection[str], compute: Callable[[], list[str]]) -> list[str]:
    """`compute()` for `name` (a layout, or another question about the build) and hook `functions`, read from the
    cache when this build's answer is there."""
    key = source_key(name, *sorted(functions))
    path = None if key is None else cache_dir() / f"attributes-{key}.json"
    if path is not None:
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            value = None
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
    out = compute()
    if path is not None:
        _store(path, out)
    return out


def _store(path: Path, value: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".", delete=False) as tmp:
            json.dump(value, tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only home: the next process computes it again
