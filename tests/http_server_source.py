"""What an SGLang's `http_server.py` hands its tokenizer workers and its HTTP/2 server, read from its source.

Why: where the workers' app path comes from is a layout's data (`compat.Layout.worker_app_env`, `worker_app_call`,
`granian_app_call`, `granian_spawns_one`: `worker_app` retargets that literal), and `fit` cannot see it: a wrong
value only shows as tokenizer workers whose inline rows lack their shape. So it is read from the source, with
`ast`: from an installed module by the version tests (`tests/e2e/resolve_targets.py`), and from each release's
wheel by CI (`tests/engine/sglang/test_release_wheels.py`).
"""

from __future__ import annotations

import ast

from engine_ext.sglang import compat
from engine_ext.sglang.worker_app import SGLANG_APP

MODULE = "sglang.srt.entrypoints.http_server"


def literal_app_calls(tree: ast.Module) -> list[str]:
    """The dotted callees given SGLang's app path as a string constant first and a `workers=` keyword."""
    return sorted(
        ast.unparse(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == SGLANG_APP
        and any(k.arg == "workers" for k in node.keywords)
    )


def granian_server(tree: ast.Module) -> dict[str, bool]:
    """What `_run_granian_server` (the `--enable-http2` server) holds: `literal`, SGLang's app path as a string
    constant (the target its spawned workers import); `embeds`, Granian's embedded server (`granian.server.embed`),
    which serves one worker in the main process."""
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_run_granian_server"]
    constants = [n.value for n in ast.walk(fn) if isinstance(n, ast.Constant)]
    modules = [n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)]
    return {"literal": SGLANG_APP in constants, "embeds": "granian.server.embed" in modules}


def reads_env(tree: ast.Module, name: str) -> bool:
    """Whether the module reads the setting `envs.<name>` (the workers' app path named in a setting)."""
    return any(isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(tree))


def disagreements(tree: ast.Module, layout: compat.Layout) -> list[str]:
    """Where `layout`'s worker-app fields say otherwise than this `http_server.py` does (empty: they agree)."""
    out = []
    calls, call = literal_app_calls(tree), layout.worker_app_call
    if calls != ([call] if call else []):
        out.append(f"the literal app path goes to {calls}, the layout hooks {call}")
    env = layout.worker_app_env or compat.LAYOUTS[compat.NEWEST].worker_app_env
    if env and reads_env(tree, env) != (layout.worker_app_env is not None):
        out.append(
            f"envs.{env} {'is' if reads_env(tree, env) else 'is not'} read; the layout says {layout.worker_app_env}"
        )
    granian = granian_server(tree)
    if granian["literal"] != (layout.granian_app_call is not None):
        out.append(f"Granian's target literal: {granian['literal']}, the layout hooks {layout.granian_app_call}")
    if granian["embeds"] == layout.granian_spawns_one:
        out.append(f"Granian embeds one worker: {granian['embeds']}, the layout: spawns {layout.granian_spawns_one}")
    return out
