"""What `engine_ext.vllm.fit.what_row_lacks` checks at run time, and what the hooks bind, read from a vLLM
release's source without installing it (`source_names.Source`, package `vllm`).

Why: `fit` decides a vLLM build's row by importing it, and CI holds only three vLLM releases; a wrong row in
`versions.MATRIX` for any other release, or a hook target whose parameters moved, would pass CI. `lacks` asks
`what_row_lacks`'s questions of a wheel's files, in its order and words: every hook target (`module:Class.attr`,
re-exports followed), the capture flag's field on `VllmConfig` and, on the class that field is annotated with
(looked up in `vllm.config`, as `fit._config_class` does), the flag itself; the row's expert and top-k getters.
`binding_gaps` asks what `fit` never does: whether each target takes the parameters its hook passes on or reads
(the leading names of the hook's own signature, and the names it reads from `inspect.signature(...).bind` or
`kwargs`: read from `engine_ext/vllm/hooks.py` itself, so a new hook is checked without a table here).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

from source_names import CLASS, Found, Missing, Source, signature

from engine_ext.sglang import attributes
from engine_ext.vllm import hooks
from engine_ext.vllm.versions import Release

VLLM_CONFIG = "vllm.config.VllmConfig"
_OP = "vllm.v1.engine.output_processor"
# What hooks.py reads off vLLM's objects, by the class each object is (its hooks' `self`, `request`, `state`,
# `output`, `parent`, `vllm_config.model_config`, `request.sampling_params`): a class-level name or one its
# constructor sets. A read added to hooks.py belongs here too.
READS: dict[str, tuple[str, ...]] = {
    "vllm.v1.engine.async_llm.AsyncLLM": ("vllm_config",),
    f"{_OP}.OutputProcessor": ("request_states",),
    f"{_OP}.RequestState": ("parent_req", "external_req_id", "request_index", "prompt_len", "routed_experts_chunks"),
    "vllm.v1.engine.parallel_sampling.ParentRequest": ("n",),
    "vllm.v1.engine.EngineCoreRequest": ("request_id", "sampling_params"),
    "vllm.sampling_params.SamplingParams": ("routed_experts_prompt_start",),
    "vllm.outputs.CompletionOutput": ("finish_reason", "routed_experts"),
    "vllm.config.model.ModelConfig": ("hf_text_config", "get_total_num_hidden_layers"),
}


def dotted(target: str) -> str:
    """`module:Class.attr` as one dotted name (`pkgutil.resolve_name`'s other spelling)."""
    return target.replace(":", ".")


def lacks(source: Source, row: Release) -> list[str]:
    """What of `row` the release in `source` does not have (empty: it fits), worded as `what_row_lacks` does."""
    out = [hook.target for hook in hooks.HOOKS if _gone(source, hook.target)]
    config, _, flag = row.capture_flag.partition(".")
    cls = config_class(source, config)
    if cls is None:
        out.append(f"VllmConfig.{config}")
    elif _gone(source, f"{cls}.{flag}"):
        out.append(f"{config}.{flag}")
    if row.shape_from == "model_config":
        shape = [f"vllm.config:ModelConfig.{n}" for n in ("get_num_experts", "get_num_experts_per_tok")]
    else:
        shape = [f"{row.shape_from}:{n}" for n in ("get_num_experts", "_get_num_experts_per_tok")]
    return out + [name for name in shape if _gone(source, name)]


def _gone(source: Source, target: str) -> bool:
    return isinstance(source.resolve(dotted(target)), Missing)


def config_class(source: Source, field: str) -> str | None:
    """The class `VllmConfig.<field>` is annotated with, as `vllm.config.<Name>` (None: no such field, or its
    annotation names no class `vllm.config` exports: `fit._config_class` would find none either)."""
    config = source.resolve(VLLM_CONFIG)
    if not isinstance(config, Found) or not isinstance(config.node, ast.ClassDef):
        return None
    for item in config.node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == field:
            name = _class_name(item.annotation)
            found = source.resolve(f"vllm.config.{name}") if name else None
            return found.dotted if isinstance(found, Found) and found.kind == CLASS else None
    return None


def _class_name(annotation: ast.expr) -> str | None:
    """The class name `dataclasses.Field.type` gives for this annotation: a name, or a quoted one."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value
    if isinstance(annotation, ast.Name | ast.Attribute):
        return annotation.id if isinstance(annotation, ast.Name) else annotation.attr
    return None


@dataclass(frozen=True)
class Binding:
    """What a hook function needs of its target's parameters, read from hooks.py."""

    leading: tuple[str, ...]  # passed on positionally, in this order, after `original`
    required: frozenset[str]  # read as `bound["name"]`: every target must have it
    optional: frozenset[str]  # read as `bound.get("name")` or `kwargs.get("name")`: some target has it


def binding(function: str) -> Binding:
    """The parameters hook `function` passes on or reads, from its signature and body (and the module functions it
    calls) in hooks.py."""
    tree = ast.parse(inspect.getsource(hooks))
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    node = defs[function]
    leading = tuple(a.arg for a in node.args.args[1:])  # after `original`
    required: set[str] = set()
    optional: set[str] = set()
    for body in _reached(node, defs):
        for sub in ast.walk(body):
            if isinstance(sub, ast.Subscript) and _is_name(sub.value, "bound") and _text(sub.slice):
                required.add(_text(sub.slice))
            if _is_get(sub, "bound") or _is_get(sub, "kwargs"):
                optional.add(_text(sub.args[0]) or "")
    return Binding(leading, frozenset(required), frozenset(optional - required - {""}))


def _reached(node: ast.AST, defs: dict[str, ast.AST]) -> list[ast.AST]:
    """`node` and the hooks.py functions it calls by name, transitively."""
    out, todo = [], [node]
    while todo:
        current = todo.pop()
        if current in out:
            continue
        out.append(current)
        calls = (n.func.id for n in ast.walk(current) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name))
        todo += [defs[name] for name in calls if name in defs]
    return out


def _is_get(node: ast.AST, name: str) -> bool:
    """`name.get("…", …)`."""
    func = getattr(node, "func", None)
    return (
        isinstance(node, ast.Call)
        and isinstance(func, ast.Attribute)
        and func.attr == "get"
        and bool(node.args)
        and _is_name(func.value, name)
    )


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _text(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def parameters(source: Source, target: str) -> list[str] | None:
    """The target's parameter names as `inspect.signature` gives them through its class (None: not a `def`)."""
    found = source.resolve(dotted(target))
    sig = signature(found) if isinstance(found, Found) else None
    return None if sig is None else list(sig.parameters)


AGEN, CORO, DEF = "async generator", "coroutine function", "plain function"


def kind(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """What `inspect` calls a `def`, which picks the wrapper `hooks._wrap` puts around it."""
    if isinstance(node, ast.FunctionDef):
        return DEF
    return AGEN if any(isinstance(n, ast.Yield | ast.YieldFrom) for n in _own_nodes(node)) else CORO


def _own_nodes(node: ast.AST):
    """The nodes of a function's body, not of the functions and lambdas defined in it."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            yield child
            yield from _own_nodes(child)


def hook_kind(function: str) -> str:
    """The kind of the hook function itself: `_wrap` awaits a coroutine target's hook, iterates an async
    generator's, and calls a plain one's, so the hook must be of its target's kind."""
    fn = getattr(hooks, function)
    return AGEN if inspect.isasyncgenfunction(fn) else CORO if inspect.iscoroutinefunction(fn) else DEF


def binding_gaps(source: Source) -> list[str]:
    """Each hook target that is not of its hook's kind or does not take what its hook passes on or reads (empty:
    every one does)."""
    out = []
    by_function: dict[str, list[str]] = {}
    for hook in hooks.HOOKS:
        by_function.setdefault(hook.function, []).append(hook.target)
    for function, targets in by_function.items():
        need = binding(function)
        seen: set[str] = set()
        for target in targets:
            names = parameters(source, target)
            if names is None:
                out.append(f"{target}: not a def (its parameters cannot be read)")
                continue
            found = source.resolve(dotted(target))
            if isinstance(found, Found) and kind(found.node) != hook_kind(function):
                out.append(f"{target}: kind {kind(found.node)!r}, {function} wraps kind {hook_kind(function)!r}")
            if tuple(names[: len(need.leading)]) != need.leading:
                out.append(f"{target}: starts {tuple(names[: len(need.leading)])}, {function} passes {need.leading}")
            out += [f"{target}: no parameter {n!r} ({function} reads it)" for n in sorted(need.required - set(names))]
            seen |= set(names)
        out += [f"{function}: no target has {n!r}" for n in sorted(need.optional - seen)]
    return out


def optional_absent(source: Source) -> dict[str, list[str]]:
    """Per hook target, the optional names its hook reads that it does not have (information: the hook's default
    stands in, e.g. chat streams have no `num_prompts`)."""
    out = {}
    for hook in hooks.HOOKS:
        names = parameters(source, hook.target) or []
        absent = sorted(binding(hook.function).optional - set(names))
        if absent:
            out[hook.target] = absent
    return out


def attribute_gaps(source: Source) -> list[str]:
    """Each attribute of `READS` the release's classes do not define (`attributes.class_facts`: the class body,
    its bases in vLLM, what its constructor sets), or the class where there is none."""
    out = []
    for cls, names in READS.items():
        facts = attributes.class_facts(cls, source.root)
        if facts is None:
            out.append(f"{cls} (no such class)")
            continue
        out += [f"{cls}.{name}" for name in names if not attributes.defines(facts, name, (), source.root)]
    return out
