"""The SGLang names the plugin's own modules import (`from sglang… import name`), read from their source.

Why: `fit` resolves the names the layouts list (`compat.needed`). The hook bodies also import SGLang helpers
themselves, inside functions (`from sglang.srt.layers.dp_attention import is_dp_attention_enabled`): no layout
lists them and `fit` never imports them, so a release without one would fail inside a hook, at its first call
(its guard then hands the process back to SGLang's own code). `needed_by(layout)` lists every such import of
`engine_ext/sglang`'s modules; a `compat_shims` function's imports count only where the layout calls that shim,
and an import inside a `try` that catches its ImportError is optional and left out.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import engine_ext.sglang
from engine_ext.sglang import compat
from engine_ext.sglang.layout import SHIMS

PACKAGE = Path(engine_ext.sglang.__file__).parent
_OPTIONAL = {"ImportError", "ModuleNotFoundError", "Exception"}


def needed_by(layout: compat.Layout) -> list[tuple[str, str, str]]:
    """(plugin module, SGLang module, name) for every SGLang name the plugin imports under `layout`; a plugin
    module is named within `engine_ext.sglang` (`compat_shims`, `hooks.table`)."""
    shims = {path.rpartition(".")[2] for path in _shim_paths(layout)}
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):  # the folders too (`hooks/`, `budget/`)
        plugin = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for function, module, name in _file_imports(path):
            if plugin == "compat_shims" and function not in shims:
                continue
            out.append((plugin, module, name))
    return out


@functools.cache
def _file_imports(path: Path) -> list[tuple[str | None, str, str]]:
    """`imports` of one plugin file, read once per process (each release's check asks for all of them)."""
    return imports(ast.parse(path.read_text(), filename=str(path)))


def imports(tree: ast.Module) -> list[tuple[str | None, str, str]]:
    """(enclosing top-level function or None, module, name) of each non-optional `from sglang… import`."""
    out = []
    for node in tree.body:
        function = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None
        for found in _walk(node, optional=False):
            out += [(function, found.module or "", alias.name) for alias in found.names]
    return out


def _walk(node: ast.AST, optional: bool):
    """The `from sglang… import` statements under `node` that are not inside an ImportError-catching `try`."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang") and not optional:
        yield node
    if isinstance(node, ast.Try):
        caught = {ast.unparse(h.type) if h.type else "Exception" for h in node.handlers}
        guarded = optional or bool(caught & _OPTIONAL)
        for child in node.body:
            yield from _walk(child, guarded)
        for child in (*node.orelse, *node.finalbody, *node.handlers):
            yield from _walk(child, optional)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, optional)


def _shim_paths(layout: compat.Layout) -> list[str]:
    """The `compat_shims` functions `layout` calls: its settings' getters and its helpers named there."""
    getters = [compat.split_read(layout.read_spec(name))[0] for name in compat.READS]
    paths = getters + [layout.function_path(name) for name in compat.FUNCTIONS]
    return [path for path in paths if path.startswith(f"{SHIMS}.")]
