"""What a dotted SGLang (or vLLM) name is in a build's source, read with `ast` from files, nothing imported.

Why: `fit` decides a build's layout by importing names (`pkgutil.resolve_name`) and reading live signatures; a
release that is not installed (a wheel in `build/release-wheels/`) can be checked for the same facts only from
its source. `Source.resolve` follows a dotted name as `pkgutil.resolve_name` would: the longest importable module
prefix (a file, a package's `__init__.py`, or a folder: a namespace package), then members: a module's top-level
definitions, assignments and imports (a re-export is followed to where it is defined), a class's body and its
bases inside SGLang, an instance's class (a name bound to `Cls(...)`, at module or class level, or assigned
`self.x = …` by a constructor: `attributes.class_facts`). Where the source cannot say what a value is (a name
bound to any other expression, a module `__getattr__`, a `*` import of something that is not SGLang's), the
answer is `OPAQUE`: present, its members unknown. A member inherited from a base outside SGLang is not seen
(none of the names the hooks need is). "SGLang" above is the package `Source` reads: `sglang` unless told, `vllm`
for vLLM's release wheels (`vllm_wheel_fit`), read by the same rules.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from importlib.resources.abc import Traversable

from engine_ext.sglang import attributes

MODULE, CLASS, FUNCTION, INSTANCE, OPAQUE = "module", "class", "function", "instance", "opaque"
_CONSTRUCTION = ("__init__", "__post_init__", "__new__")


@dataclass(frozen=True)
class Found:
    """A resolved name: its kind, the dotted module or class it is (or is an instance of), and its node."""

    kind: str
    dotted: str
    node: ast.AST | None = None  # the FunctionDef of a function, the ClassDef of a class
    method_of: str | None = None  # a function defined in a class body: "method", "staticmethod", "classmethod"


@dataclass(frozen=True)
class Missing:
    """Why a name does not resolve: the first part that is not there, and what was looked in."""

    name: str
    where: str


class Source:
    """One build's `sglang` package (or `top`: `vllm`), read by module from `root` (a wheel's `zipfile.Path`, or a
    folder)."""

    def __init__(self, root: Traversable, top: str = "sglang"):
        self.root = root
        self.top = top
        self._trees: dict[str, ast.Module | None] = {}
        self.consulted: set[str] = set()  # the modules whose members were looked up: where the answers came from

    def tree(self, module: str) -> ast.Module | None:
        """The parsed module (an empty one for a namespace package's folder); None: no such module."""
        if module not in self._trees:
            parsed = attributes.tree(module, self.root)
            if parsed is not None:
                self._trees[module] = parsed
            else:
                folder = self.root.joinpath(*module.split(".")[1:])
                self._trees[module] = ast.Module(body=[], type_ignores=[]) if folder.is_dir() else None
        return self._trees[module]

    def package(self, module: str) -> str:
        """The package a module's relative imports start from: itself for a package, else its parent."""
        path = attributes.source_path(module, self.root)
        return module if path is None or path.name == "__init__.py" else module.rpartition(".")[0]

    def ours(self, module: str) -> bool:
        """Whether `module` is this package's (read from the source) rather than another dependency's."""
        return module == self.top or module.startswith(f"{self.top}.")

    def text(self, module: str) -> str:
        path = attributes.source_path(module, self.root)
        return "" if path is None else path.read_text(encoding="utf-8")

    def resolve(self, dotted: str) -> Found | Missing:
        """`dotted` as `pkgutil.resolve_name` would find it, read from the source."""
        parts = dotted.split(".")
        if parts[0] != self.top:
            return Missing(dotted, f"not {self.top}'s")
        at = 1
        while at < len(parts) and self.tree(".".join(parts[: at + 1])) is not None:
            at += 1
        found: Found | Missing = Found(MODULE, ".".join(parts[:at]))
        for name in parts[at:]:
            if isinstance(found, Missing) or found.kind in (FUNCTION, OPAQUE):
                return found if isinstance(found, Missing) else Found(OPAQUE, f"{found.dotted}.{name}")
            found = self.member(found, name)
        return found

    def member(self, owner: Found, name: str) -> Found | Missing:
        """`name` on a module, a class, or an instance of a class."""
        if owner.kind == MODULE:
            return self.module_member(owner.dotted, name)
        return self.class_member(owner.dotted, name, instance=owner.kind == INSTANCE)

    def module_member(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> Found | Missing:
        """A module's top-level `name` (a re-export followed), else its submodule `name`."""
        tree = self.tree(module)
        if tree is None or module in seen:
            return Missing(name, module)
        self.consulted.add(module)
        package = self.package(module)
        for node in _top_level(tree.body):
            bound = self._binding(node, name, module, package, seen | {module})
            if bound is not None:
                return bound
        if self.tree(f"{module}.{name}") is not None:
            return Found(MODULE, f"{module}.{name}")
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            return Found(OPAQUE, f"{module}.{name}")  # a module `__getattr__` (PEP 562) answers any name
        return Missing(name, module)

    def _binding(self, node: ast.stmt, name: str, module: str, package: str, seen) -> Found | Missing | None:
        """What statement `node` binds to `name` in `module` (None: it binds no `name`)."""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return Found(FUNCTION, f"{module}.{name}", node)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return Found(CLASS, f"{module}.{name}", node)
        if isinstance(node, ast.Assign | ast.AnnAssign) and name in _assigned_names(node):
            return self._value(node.value, module, f"{module}.{name}")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.partition(".")[0]) == name:
                    return Found(MODULE, alias.name if alias.asname else name)
        if isinstance(node, ast.ImportFrom):
            origin = attributes.absolute_module(package, node.module, node.level)
            for alias in node.names:
                if alias.name == "*" and self.ours(origin):
                    found = self.module_member(origin, name, seen)
                    if not isinstance(found, Missing):
                        return found
                elif (alias.asname or alias.name) == name:
                    if not self.ours(origin):
                        return Found(OPAQUE, f"{origin}.{alias.name}")
                    return self.module_member(origin, alias.name, seen)
        return None

    def _value(self, value: ast.expr | None, module: str, dotted: str) -> Found:
        """What `dotted = value` (in `module`) binds: an instance where `value` calls an SGLang class, else opaque
        (also a field with no value)."""
        if isinstance(value, ast.Call):
            cls = self.expression(value.func, module)
            if isinstance(cls, Found) and cls.kind == CLASS:
                return Found(INSTANCE, cls.dotted)
        return Found(OPAQUE, dotted)

    def expression(self, node: ast.expr, module: str) -> Found | Missing:
        """A `Name` or dotted `Attribute` expression as the module `module` sees it."""
        if isinstance(node, ast.Name):
            return self.module_member(module, node.id)
        if isinstance(node, ast.Attribute):
            owner = self.expression(node.value, module)
            if isinstance(owner, Missing) or owner.kind in (FUNCTION, OPAQUE):
                return owner if isinstance(owner, Missing) else Found(OPAQUE, owner.dotted)
            return self.member(owner, node.attr)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
            try:
                return self.expression(ast.parse(node.value, mode="eval").body, module)
            except SyntaxError:
                return Found(OPAQUE, node.value)
        return Found(OPAQUE, ast.unparse(node))

    def class_member(self, cls: str, name: str, instance: bool = False) -> Found | Missing:
        """`name` in class `cls`'s body or its SGLang bases' (on an instance: also set by its constructor)."""
        node = self._class_node(cls)
        if node is None:
            return Found(OPAQUE, f"{cls}.{name}")
        module = cls.rpartition(".")[0]
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                return Found(FUNCTION, f"{cls}.{name}", item, _method_kind(item))
            if isinstance(item, ast.ClassDef) and item.name == name:
                return Found(CLASS, f"{cls}.{name}", item)
            if isinstance(item, ast.Assign | ast.AnnAssign) and name in _assigned_names(item):
                return self._value(item.value, module, f"{cls}.{name}")
        for base in node.bases:
            origin = self.expression(base, module)
            if isinstance(origin, Found) and origin.kind == CLASS:
                found = self.class_member(origin.dotted, name, instance)
                if not isinstance(found, Missing):
                    return found
        facts = attributes.class_facts(cls, self.root) if instance else None
        if facts is not None and name in facts.set_by(_CONSTRUCTION):
            return Found(OPAQUE, f"{cls}.{name}")
        return Missing(name, cls)

    def _class_node(self, cls: str) -> ast.ClassDef | None:
        found = self.resolve(cls)
        return found.node if isinstance(found, Found) and isinstance(found.node, ast.ClassDef) else None


def signature(found: Found) -> inspect.Signature | None:
    """The parameters of a resolved function as `inspect.signature` gives them on the live object reached the
    same way (a method through its class: `self` included; a classmethod: bound). None: not a function here.
    Read from the `def` itself: a decorator that replaces the signature without `functools.wraps` is not seen."""
    if found.kind != FUNCTION or not isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    args = found.node.args
    kinds = inspect.Parameter
    params = [kinds(a.arg, kinds.POSITIONAL_ONLY) for a in args.posonlyargs]
    params += [kinds(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in args.args]
    params += [kinds(args.vararg.arg, kinds.VAR_POSITIONAL)] if args.vararg else []
    params += [kinds(a.arg, kinds.KEYWORD_ONLY) for a in args.kwonlyargs]
    params += [kinds(args.kwarg.arg, kinds.VAR_KEYWORD)] if args.kwarg else []
    if found.method_of == "classmethod":
        params = params[1:]
    return inspect.Signature(params)


def returned(source: Source, found: Found) -> str | None:
    """The SGLang class a resolved function is annotated to return, as `typing.get_type_hints` would resolve it
    at run time: a plain class name, not one its module imports only for type checkers (None: no such class)."""
    if found.kind != FUNCTION or not isinstance(found.node, ast.FunctionDef) or found.node.returns is None:
        return None
    module = found.dotted.rpartition(".")[0]
    tree = source.tree(module)
    node = found.node.returns
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    if not isinstance(node, ast.Name | ast.Attribute) or tree is None:
        return None
    cls = source.expression(node, module)  # a name bound only for type checkers is missing: get_type_hints fails
    return cls.dotted if isinstance(cls, Found) and cls.kind == CLASS else None


def _method_kind(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    names = {ast.unparse(d) for d in node.decorator_list}
    return "staticmethod" if "staticmethod" in names else "classmethod" if "classmethod" in names else "method"


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _top_level(body: list[ast.stmt]):
    """A module's statements as they run: into `if`/`try` blocks (version branches, optional imports), not into
    functions, nor into `if TYPE_CHECKING:` (what is bound there only is not there at run time)."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            checking = isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            blocks = [node.orelse] if checking else [node.body, node.orelse]
            for block in (*blocks, *(h.body for h in getattr(node, "handlers", ()))):
                yield from _top_level(block)
