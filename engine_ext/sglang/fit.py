"""Which `compat` layout the installed SGLang build fits, decided from the build itself; its version is a hint.

Why: the builds trainers run are rarely a release string the plugin was tested on. slime's image reports
`0.5.15.post1`, miles installs its own branch as a dev build (`0.5.17.devN+g<sha>`), NeMo-RL pins
`0.5.12.post1`; keyed by exact strings, the plugin registered no hooks on any of them although their code fits a
layout it has. So a layout is applied where the build has what it needs, whatever the build calls itself:

- everything the layout names imports here (`compat.unresolved`: hook targets, settings' getters, helpers);
- each setting it reads has its first attribute on the object its getter is annotated to return;
- each hook it registers binds the target's parameters as the hook reads them (`signature_gap`);
- the attributes its hooks read off SGLang's run-time objects are in the build's source (`attributes.missing`,
  read once per build: `source_cache`);
- where it spells a target, setting or helper otherwise than 0.5.23 does, 0.5.23's spelling is absent here (that
  absence is why the layout exists: a build that still has 0.5.23's names runs 0.5.23's code paths, and a layout
  hooking the older names would hook code no longer called).

Candidates are tried nearest release first (at or below the build's, then above), so the hint decides only
between layouts that both fit. A build fitting none is refused, naming what the nearest candidate lacks. Whether
a build is *proven* (a test ran its real server) is a separate fact: its release is in `versions.PROVEN` and its
files are that release's own (`release_files`).
"""

from __future__ import annotations

import functools
import inspect
import pkgutil
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from engine_ext.sglang import compat, release_files
from engine_ext.sglang.versions import PROVEN, Support, lacks_plugins, support

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@dataclass(frozen=True)
class Fit:
    """The outcome for one build: the layout applied (None: none fits) and what each candidate lacked."""

    found: str | None
    layout: str | None
    lacking: dict[str, list[str]]  # candidate layout → what it lacks here (empty list: it fits)


def parse(found: str | None) -> Version | None:
    try:
        return Version(found) if found else None
    except InvalidVersion:
        return None


def candidates(found: str | None, layouts: Iterable[str]) -> list[str]:
    """`layouts` in the order to try for build `found`: at or below it nearest first, then above it nearest first
    (a dev build `0.5.17.dev3` sorts below 0.5.17, a post release `0.5.12.post1` above 0.5.12)."""
    at = parse(found)
    ordered = sorted(layouts, key=Version, reverse=True)
    if at is None:
        return ordered
    below = [v for v in ordered if Version(v) <= at]
    above = sorted((v for v in ordered if Version(v) > at), key=Version)
    return below + above


@functools.cache
def installed() -> Support:
    """The plan for this process's SGLang, once per process: its version string and the layout its code fits."""
    from importlib.metadata import PackageNotFoundError, version

    from engine_ext.sglang.hooks.table import HOOKS

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    if lacks_plugins(found):
        return support(found, None)
    fitted = fit(found, HOOKS)
    changed = release_files.installed_changes() if found in PROVEN else []  # a patched image under a proven name
    return support(found, fitted.layout, fitted.lacking, changed)


def fit(found: str | None, hooks: Iterable, lacking: Callable[[str, list], list[str]] | None = None) -> Fit:
    """The first candidate layout the installed build fits; `hooks` is the hook table (`hooks.table.HOOKS`)."""
    rows = [hook for hook in hooks if "hip" not in hook.groups]  # hip targets import only on ROCm
    check = lacking or what_layout_lacks
    seen: dict[str, list[str]] = {}
    try:
        for version in candidates(found, compat.LAYOUTS):
            seen[version] = check(version, rows)
            if not seen[version]:
                return Fit(found, version, seen)
        return Fit(found, None, seen)
    finally:
        compat.use(compat.NEWEST)  # the caller applies the chosen layout itself


def what_layout_lacks(version: str, rows: list) -> list[str]:
    """What of layout `version` the installed SGLang does not have (empty: it fits)."""
    from engine_ext.sglang import attributes, source_cache
    from engine_ext.sglang.hooks import table

    layout = compat.use(version)
    out = compat.unresolved([row.target for row in rows])
    if out:  # the rest reads what must import first
        return out
    out += [f"{name}: {gap}" for name, gap in read_gaps(layout)]
    placed = []
    for row in rows:
        where = compat.hook(row.target, row.function)
        if where is None:
            continue
        placed.append(where[1])
        replace = row.type is table.REPLACE
        gap = signature_gap(pkgutil.resolve_name(where[0]), table.body(where[1]), replace, row.keywords)
        if gap:
            out.append(f"{where[0]}: {gap}")
    out += [f"{name} is still here (the layout replaces it)" for name in still_present(layout, rows)]
    functions = set(placed)
    return out + source_cache.cached(version, functions, lambda: attributes.missing(functions))


def read_gaps(layout: compat.Layout) -> list[tuple[str, str]]:
    """Settings whose first attribute is not on the class their getter is annotated to return."""
    out = []
    for name in compat.READS:
        getter, attrs = compat.split_read(layout.read_spec(name))
        owner = _returned_class(pkgutil.resolve_name(getter))
        if attrs and owner is not None and has_attribute(owner, attrs[0]) is False:
            out.append((name, f"{owner.__qualname__} has no {attrs[0]!r}"))
    return out


def _returned_class(getter: Callable) -> type | None:
    """The class `getter` is annotated to return, where the annotation resolves (else None: nothing to check)."""
    try:
        returned = typing.get_type_hints(getter).get("return")
    except Exception:  # an annotation naming what its module imports only for type checkers
        return None
    return returned if isinstance(returned, type) and returned.__module__.startswith("sglang.") else None


def has_attribute(owner: type, name: str) -> bool | None:
    """Whether objects of `owner` have `name`: a class attribute, a field, or set by its constructor (read from
    its source, `attributes.class_facts`). None: cannot tell, as for a bag answering names through `__getattr__`
    (SGLang's runtime-context configs) whose module never spells the name (it may come from elsewhere)."""
    from engine_ext.sglang import attributes

    if hasattr(owner, name) or any(name in getattr(cls, "__annotations__", {}) for cls in owner.__mro__):
        return True
    if hasattr(owner, "__getattr__"):
        path = attributes.source_path(owner.__module__)
        spelled = path is not None and re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None
        return True if spelled else None
    facts = attributes.class_facts(f"{owner.__module__}.{owner.__qualname__}")
    return None if facts is None else attributes.defines(facts, name)


def signature_gap(target: Callable, body: Callable, replace: bool, keywords: tuple[str, ...] = ()) -> str | None:
    """Why hook `body` cannot bind `target`'s calls (None: it can). An AROUND body's first parameter is the
    original; the rest it names positionally must be the target's leading parameters, a body without `*args` or
    `**kwargs` must take every parameter the target has, and `keywords` (read from `kwargs` by name) must exist."""
    try:
        theirs = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        return None
    mine = list(inspect.signature(body).parameters.values())[0 if replace else 1 :]
    named = [p.name for p in mine if p.kind in _POSITIONAL]
    positional = [p.name for p in theirs if p.kind in _POSITIONAL]
    if len(positional) < len(named):
        return f"takes {len(positional)} positional parameters {positional}, the hook binds {named}"
    for i, (ours, their) in enumerate(zip(named, positional, strict=False)):
        if ours != their and not (i == 0 and their == "self"):
            return f"parameter {i} is {their!r} where the hook binds {ours!r}"
    if not any(p.kind in _VARIADIC for p in mine) and len(theirs) > len(named):
        return f"takes {[p.name for p in theirs]}, more than the hook passes on ({named})"
    absent = [k for k in keywords if k not in {p.name for p in theirs}]
    return f"has no parameter {absent}" if absent else None


def still_present(layout: compat.Layout, rows: list) -> list[str]:
    """0.5.23 names `layout` replaces that this build still has: targets it moves, settings' getters and the
    attribute they read, and SGLang helpers it renames (a target it merely leaves unhooked is not a claim, nor is
    a helper of the plugin's own, `compat_shims`, that another layout calls instead)."""
    newest = compat.LAYOUTS[compat.NEWEST]
    hooked = {row.target for row in rows}
    moved = [t for t, where in layout.targets.items() if where is not None and t in hooked]
    present = [t for t in moved if not compat.missing([t])]
    for name in layout.reads:
        getter, attrs = compat.split_read(newest.read_spec(name))
        if compat.missing([getter]):
            continue
        owner = _returned_class(pkgutil.resolve_name(getter))
        if attrs and owner is not None and has_attribute(owner, attrs[0]) is True:
            present.append(f"{getter}().{attrs[0]}")
    renamed = [newest.function_path(n) for n in layout.functions]
    present += [path for path in renamed if path.startswith("sglang.") and not compat.missing([path])]
    return present
