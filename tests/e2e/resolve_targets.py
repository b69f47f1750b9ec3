"""Print, as JSON, which of the plugin's hook targets and `MATRIX` names the running SGLang lacks, and, where
`compat` has a layout for it, what of that layout does not import (`after_layout`: must be empty) and which
attributes the registered hooks read off SGLang's run-time objects its source lacks (`attributes`, read by
`engine_ext.sglang.attributes` from this version's installed files), and which calls in its `http_server.py`
hand SGLang's literal app path to several workers (`literal_app_calls`: what `worker_app` retargets), and which
layout the plugin applies to this build from its code alone (`fit`: the layout, what each candidate tried lacks),
and what every layout lacks here (`lacking`: `fit.what_layout_lacks` for each, which CI reads from the wheel).

Run by the version tests with each SGLang venv's own python, so the answer is that version's real modules.
Targets of the `hip` group import only on ROCm and are left out.
"""

from __future__ import annotations

import ast
import json
import sys
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path


def main() -> None:
    from engine_ext.sglang import attributes, compat
    from engine_ext.sglang.hooks import HOOKS
    from engine_ext.sglang.versions import MATRIX

    names = sorted({n for row in MATRIX.values() if row.plugin_mechanism for n in row.missing_names})
    targets = [hook.target for hook in HOOKS if "hip" not in hook.groups]
    found = version("sglang")
    result = {"sglang": found, "targets": compat.missing(targets), "names": compat.missing(names), "after_layout": None}
    if found in compat.LAYOUTS:
        compat.use(found)
        result["after_layout"] = compat.unresolved(targets)
        here = [compat.hook(hook.target, hook.function) for hook in HOOKS if "hip" not in hook.groups]
        result["attributes"] = attributes.missing({where[1] for where in here if where is not None})
    from engine_ext.sglang import fit

    fitted = fit.fit(found, HOOKS)
    result["fit"] = {"layout": fitted.layout, "lacking": fitted.lacking}
    rows = [hook for hook in HOOKS if "hip" not in hook.groups]
    result["lacking"] = {layout: fit.what_layout_lacks(layout, rows) for layout in compat.LAYOUTS}
    compat.use(compat.NEWEST)
    result["literal_app_calls"] = literal_app_calls()
    result["granian"] = granian_server()
    json.dump(result, sys.stdout)


def literal_app_calls() -> list[str]:
    """The dotted callees in this SGLang's `http_server.py` given `worker_app.SGLANG_APP` as their first argument
    and a `workers=` keyword: read from the source, nothing imported."""
    from engine_ext.sglang.worker_app import SGLANG_APP

    tree = ast.parse(Path(find_spec("sglang.srt.entrypoints.http_server").origin).read_text())
    return sorted(
        ast.unparse(node.func)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == SGLANG_APP
        and any(k.arg == "workers" for k in node.keywords)
    )


def granian_server() -> dict[str, bool]:
    """What this SGLang's `_run_granian_server` (its `--enable-http2` server) holds, read from the source:
    `literal`, SGLang's app path as a string constant (the target its spawned workers import); `embeds`, Granian's
    embedded server (`granian.server.embed`), which serves one worker in the main process."""
    from engine_ext.sglang.worker_app import SGLANG_APP

    tree = ast.parse(Path(find_spec("sglang.srt.entrypoints.http_server").origin).read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_run_granian_server"]
    constants = [n.value for n in ast.walk(fn) if isinstance(n, ast.Constant)]
    modules = [n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)]
    return {"literal": SGLANG_APP in constants, "embeds": "granian.server.embed" in modules}


if __name__ == "__main__":
    main()
