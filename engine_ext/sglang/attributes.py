"""Whether this SGLang's own source gives each run-time object every attribute the hooks read off it.

Why: an attribute the hooks read off an object SGLang builds while serving (a graph runner, a ForwardBatch, a
Req, a batch result...) resolves at no import; a missing one used to surface as an AttributeError at the first
forward (0.5.12's `CudaGraphRunner.bs`, which only `replay_prepare` assigns). `compat.ATTRIBUTES` lists every
such read (in 0.5.23's spelling, through the layout); `missing()` reads the installed SGLang's source with
`ast`, importing nothing, and names each read that no class of its role defines by the time the hook reads
it: a method, a class-level name (dataclass and struct fields), or `self.<name> = …` in the constructor
(or a `self.` method it calls), or in the method `set_in` names. A dotted read (`kv.req_pool_idx`) follows
the class the constructor assigns (`self.kv = ReqKvInfo()`). The plugin refuses a version where one is
missing at start, with the names (`engine_ext/sglang/__init__.py`); CI runs the same check in every venv, and on
every release's wheel without installing it (`root`: that wheel's `sglang` folder, a `zipfile.Path`).

    from engine_ext.sglang import attributes, compat
    compat.use("0.5.12"); attributes.missing()   # [] where the installed source has them all
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Collection
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path

from engine_ext.sglang import compat

_CONSTRUCTION = ("__init__", "__post_init__", "__new__")


@dataclass
class ClassFacts:
    """What one class (with its SGLang bases) defines: class-level names, and its methods (the bases' first, in
    order), read for `self.x` assignments only when a question needs them: a class like the scheduler has hundreds
    of methods, and a check asks about its constructor's few."""

    names: set[str] = field(default_factory=set)
    methods: list[_Method] = field(default_factory=list)

    def merge(self, base: ClassFacts) -> None:
        self.names |= base.names
        self.methods += base.methods

    def set_by(self, methods: tuple[str, ...]) -> set[str]:
        """Attributes assigned by `methods` or any `self.` method they call, transitively."""
        seen, todo, out = set(), list(methods), set()
        while todo:
            method = todo.pop()
            if method in seen:
                continue
            seen.add(method)
            for found in self.methods:
                if found.node.name == method:
                    out |= found.assigned
                    todo += found.calls
        return out

    def type_of(self, attribute: str) -> str | None:
        """The dotted class of the first `self.<attribute> = Cls(...)`, in method order (None: none)."""
        for found in self.methods:
            for name, cls in found.types:
                if name == attribute:
                    return cls
        return None


class _Method:
    """One method's `self.` assignments, `self.` calls and `self.x = Cls(...)` types, read on first use."""

    def __init__(self, node: ast.FunctionDef | ast.AsyncFunctionDef, resolve) -> None:
        self.node, self._resolve, self._read = node, resolve, False
        self._assigned: set[str] = set()
        self._calls: set[str] = set()
        self._types: list[tuple[str, str]] = []

    @property
    def assigned(self) -> set[str]:
        return self._facts()[0]

    @property
    def calls(self) -> set[str]:
        return self._facts()[1]

    @property
    def types(self) -> list[tuple[str, str]]:
        return self._facts()[2]

    def _facts(self) -> tuple[set[str], set[str], list[tuple[str, str]]]:
        if not self._read:
            _read_method(self.node, self._assigned, self._calls, self._types, self._resolve)
            self._read = True
        return self._assigned, self._calls, self._types


def source_path(module: str, root: Traversable | None = None) -> Traversable | None:
    """The file of a dotted SGLang module, found without importing it: under `root`, the `sglang` package folder
    of a build that is not installed (a wheel's, as `zipfile.Path`), else the installed package's."""
    if root is None:
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(next(iter(spec.submodule_search_locations)))
    parts = module.split(".")[1:]
    files = [root.joinpath(*parts[:-1], f"{parts[-1]}.py")] if parts else []
    for path in (*files, root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


@functools.cache
def tree(module: str, root: Traversable | None = None) -> ast.Module | None:
    """A module's parsed source (None: no such file), once per build: the attribute check and a reader of the same
    build's names (the tests' `source_names`) share it."""
    path = source_path(module, root)
    return None if path is None else ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@functools.cache
def _module(module: str, root: Traversable | None = None) -> tuple[dict[str, ast.ClassDef], dict[str, str]] | None:
    """A module's classes and what its imports bind (local name → dotted origin)."""
    path = source_path(module, root)
    if path is None:
        return None
    classes, imported = {}, {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _top_level(tree(module, root).body):
        if isinstance(node, ast.ClassDef) and node.name not in classes:
            classes[node.name] = node
        elif isinstance(node, ast.ImportFrom):
            origin = absolute_module(package, node.module, node.level)
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{origin}.{alias.name}"
    return classes, imported


def _top_level(body: list[ast.stmt]):
    """A module's statements, into `if`/`try` blocks (TYPE_CHECKING imports, optional imports), not functions."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ()))):
                yield from _top_level(block)


def absolute_module(package: str, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import …` written in `package`."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{module}" if module else base


@functools.cache
def class_facts(dotted: str, root: Traversable | None = None) -> ClassFacts | None:
    """What the class `dotted` (module.Class) and its bases inside SGLang define; None: no such class here
    (`root`: another build's source, `source_path`)."""
    module, _, name = dotted.rpartition(".")
    found = _module(module, root)
    if found is None or name not in found[0]:
        return None
    classes, imported = found
    node = classes[name]
    facts = ClassFacts()
    for base in node.bases:
        origin = _resolve(base, module, classes, imported)
        base_facts = class_facts(origin, root) if origin and origin != dotted else None
        if base_facts is not None:
            facts.merge(base_facts)
    for item in node.body:
        _class_level(item, facts)
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            facts.methods.append(_Method(item, lambda n: _resolve(n, module, classes, imported)))
    return facts


def _resolve(node: ast.expr, module: str, classes: dict, imported: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        if node.id in classes:
            return f"{module}.{node.id}"
        return imported.get(node.id)
    if isinstance(node, ast.Subscript):  # Generic[T] and the like
        return _resolve(node.value, module, classes, imported)
    return None


def _class_level(item: ast.stmt, facts: ClassFacts) -> None:
    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        facts.names.add(item.name)
    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        facts.names.add(item.target.id)
    elif isinstance(item, ast.Assign):
        for target in item.targets:
            facts.names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _read_method(method: ast.FunctionDef | ast.AsyncFunctionDef, assigned: set[str], calls: set[str], types, resolve):
    """Fill `assigned`, `calls` and `types` (attribute, dotted class) from one walk of `method`."""
    for node in ast.walk(method):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and _is_self_attr(node.func):
            calls.add(node.func.attr)
        for target in targets:
            for sub in ast.walk(target):
                if _is_self_attr(sub):
                    assigned.add(sub.attr)
                    value = getattr(node, "value", None)
                    if isinstance(value, ast.Call) and (cls := resolve(value.func)):
                        types.append((sub.attr, cls))


def _is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def defines(facts: ClassFacts, attribute: str, set_in: tuple[str, ...] = (), root: Traversable | None = None) -> bool:
    """Whether an object of this class has `attribute` when the hook reads it (dotted: followed by class)."""
    head, _, rest = attribute.partition(".")
    present = head in facts.names or head in facts.set_by(_CONSTRUCTION + set_in)
    if not present or not rest:
        return present
    inner = class_facts(facts.type_of(head) or "", root)
    return inner is not None and defines(inner, rest, (), root)


def missing(functions: Collection[str] | None = None, root: Traversable | None = None) -> list[str]:
    """Each read of `compat.ATTRIBUTES` (by the hook `functions` registered here; None: all) that this SGLang's
    source (or `root`'s, `source_path`) lacks, as `module.Class.attribute`, or the class where there is no such
    class."""
    out = []
    for read in compat.attribute_reads(functions):
        for cls in read.classes:
            facts = class_facts(cls, root)
            if facts is None:
                out.append(f"{cls} (no such class)")
            elif not defines(facts, read.attribute, read.set_in, root):
                where = f" (assigned by {' or '.join(read.set_in)})" if read.set_in else ""
                out.append(f"{cls}.{read.attribute}{where}")
    return sorted(set(out))


def forget() -> None:
    """Drop every parsed module: a process reading many builds' sources one after another (the release wheels'
    test) keeps one build's trees at a time, not all of them."""
    tree.cache_clear()
    _module.cache_clear()
    class_facts.cache_clear()
