"""What `fit` checks at run time, read from a release's source without installing it (`source_names.Source`).

Why: `fit.what_layout_lacks` decides a build's layout by importing it, and CI holds only four SGLang releases; a
wrong row in `versions.RELEASES` or `compat.LAYOUTS` for any other release would pass CI. `lacks` asks the same
questions of a wheel's files, in the same order, through the same tables (`compat.needed`, `compat.hook`,
`compat.READS`, `attributes.missing`) and the same signature rule (`fit.signature_gap`, handed a signature read
from the `def`), so `fit.fit(release, HOOKS, lacking=…)` picks the layout the release's code gets. Where a fact
is only known by importing, the closest one read from the source stands in (`source_names`): a decorated target's
own `def`; a getter's return annotation as `get_type_hints` resolves it; a class's attributes as `attributes`
reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from source_names import Found, Missing, Source, returned, signature

from engine_ext.sglang import attributes, compat, fit


def hook_rows() -> list:
    """The hook table's rows a CPU build is fit on, as `fit` reads them (hip targets import only on ROCm). The table
    imports SGLang: read when a test runs, not when its module is collected (every xdist worker would)."""
    from engine_ext.sglang.hooks.table import HOOKS

    return [hook for hook in HOOKS if "hip" not in hook.groups]


def lacks(source: Source, version: str, rows: list) -> list[str]:
    """What of layout `version` the release in `source` does not have (empty: it fits), as `fit` words it."""
    from engine_ext.sglang.hooks import table  # imports SGLang: here, not when a test module is collected

    layout = compat.use(version)
    out = missing(source, compat.needed([row.target for row in rows]))
    if out:  # fit reads the rest only where everything imports
        return out
    out += [f"{name}: {gap}" for name, gap in read_gaps(source, layout)]
    placed = []
    for row in rows:
        where = compat.hook(row.target, row.function)
        if where is None:
            continue
        placed.append(where[1])
        gap = fit.signature_gap(
            _stub(source.resolve(where[0])), table.body(where[1]), row.type is table.REPLACE, row.keywords
        )
        if gap:
            out.append(f"{where[0]}: {gap}")
    out += [f"{name} is still here (the layout replaces it)" for name in still_present(source, layout, rows)]
    return out + attributes.missing(set(placed), source.root)


def missing(source: Source, names: list[str]) -> list[str]:
    """`compat.missing` read from the source: SGLang's names from its files, the plugin's own (`compat_shims`)
    and its other dependencies' (uvicorn) from this process, as the release's environment would import them."""
    return [name for name in names if _gone(source, name)]


def _gone(source: Source, name: str) -> bool:
    if name.startswith("sglang."):
        return isinstance(source.resolve(name), Missing)
    return bool(compat.missing([name]))


def unsigned(source: Source, rows: list) -> list[str]:
    """The hook targets of the current layout whose parameters the source does not give (not a `def`): `lacks`
    compares nothing for them, as `fit` compares nothing for a builtin."""
    targets = [compat.target(row.target) for row in rows]
    return [t for t in targets if t is not None and signature(_found(source.resolve(t))) is None]


def read_gaps(source: Source, layout: compat.Layout) -> list[tuple[str, str]]:
    """`fit.read_gaps`: settings whose first attribute is not on the class their getter is annotated to return."""
    out = []
    for name in compat.READS:
        getter, attrs = compat.split_read(layout.read_spec(name))
        owner = getter_class(source, getter)
        if attrs and owner is not None and has_attribute(source, owner, attrs[0]) is False:
            out.append((name, f"{owner.rpartition('.')[2]} has no {attrs[0]!r}"))
    return out


def getter_class(source: Source, getter: str) -> str | None:
    """The SGLang class `getter` is annotated to return (None: not SGLang's, or nothing to check, as in fit)."""
    if not getter.startswith("sglang."):
        return None  # the plugin's shims return plain values
    found = source.resolve(getter)
    return returned(source, found) if isinstance(found, Found) else None


def has_attribute(source: Source, owner: str, name: str) -> bool | None:
    """`fit.has_attribute` from the source: a class-level name of `owner` or its SGLang bases, or one set by its
    constructor; a class answering names through `__getattr__` has those its module spells (None: cannot tell)."""
    facts = attributes.class_facts(owner, source.root)
    if facts is None:
        return None
    if name in facts.names:
        return True
    if "__getattr__" in facts.names:
        spelled = re.search(rf"\b{re.escape(name)}\b", source.text(owner.rpartition(".")[0]))
        return True if spelled else None
    return attributes.defines(facts, name, (), source.root)


def still_present(source: Source, layout: compat.Layout, rows: list) -> list[str]:
    """`fit.still_present` from the source: 0.5.23's spellings that `layout` replaces, found in this release."""
    newest = compat.LAYOUTS[compat.NEWEST]
    hooked = {row.target for row in rows}
    moved = [t for t, where in layout.targets.items() if where is not None and t in hooked]
    present = [t for t in moved if not missing(source, [t])]
    for name in layout.reads:
        getter, attrs = compat.split_read(newest.read_spec(name))
        if missing(source, [getter]):
            continue
        owner = getter_class(source, getter)
        if attrs and owner is not None and has_attribute(source, owner, attrs[0]) is True:
            present.append(f"{getter}().{attrs[0]}")
    renamed = [newest.function_path(n) for n in layout.functions]
    return present + [path for path in renamed if path.startswith("sglang.") and not missing(source, [path])]


def _found(found: Found | Missing) -> Found:
    return found if isinstance(found, Found) else Found("missing", found.name)


def _stub(found: Found | Missing) -> Callable:
    """A callable whose `inspect.signature` is the target's as read from its `def`; `max` (a builtin without a
    signature: `signature_gap` compares nothing) where the source gives none."""
    sig = signature(_found(found))
    if sig is None:
        return max

    def stub(*args, **kwargs): ...

    stub.__signature__ = sig  # type: ignore[attr-defined]
    return stub
