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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: http_server_source, shared with CI's test

import http_server_source


def main() -> None:
    from engine_ext.sglang import attributes, compat
    from engine_ext.sglang.hooks.table import HOOKS
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


def _http_server() -> ast.Module:
    return ast.parse(Path(find_spec(http_server_source.MODULE).origin).read_text())


def literal_app_calls() -> list[str]:
    """`http_server_source.literal_app_calls` of this SGLang's `http_server.py`, nothing imported."""
    return http_server_source.literal_app_calls(_http_server())


def granian_server() -> dict[str, bool]:
    """`http_server_source.granian_server` of this SGLang's `http_server.py`, nothing imported."""
    return http_server_source.granian_server(_http_server())


if __name__ == "__main__":
    main()
