"""SGLang's own plugin discovery finds r3-sidecar and applies its capture hooks; another sglang gets none."""

from __future__ import annotations

import json
import textwrap
from importlib.metadata import distributions, entry_points
from pathlib import Path

import pytest
from sglang_env import REPO, run_sglang

CAPTURE_TARGETS = [
    "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.create",
    "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer._get_local_slice",
    "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.on_forward_end",
    "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
    "sglang.srt.state_capturer.base.BaseDeviceCache.capture",
    "sglang.srt.runtime_context.cutedsl_moe_max_num_tokens",
    "sglang.srt.layers.attention.triton_backend.TritonMultiStepDraftBackend.common_template",
]


def test_editable_install_declares_the_entry_point() -> None:
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "r3_sidecar"]
    assert ep.value == "engine_ext.sglang:register"
    assert ep.dist is not None and ep.dist.name == "r3-sidecar"
    installed = [d.read_text("direct_url.json") for d in distributions(name="r3-sidecar")]  # pip's record
    (direct_url,) = [json.loads(text) for text in installed if text]
    assert direct_url.get("dir_info", {}).get("editable") is True
    assert Path(direct_url["url"].removeprefix("file://")).resolve() == REPO


def _load_plugins_child(targets: list[str]) -> str:
    return f"""
import logging
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("r3_sidecar").addHandler(handler)
load_plugins()
targets = {targets!r}
ours = {{t: [s.plugin_name for _, _, s in HookRegistry._hooks.get(t, []) if s is not None] for t in targets}}

def resolve(target):
    import pkgutil
    owner, name = target.rsplit(".", 1)
    obj = pkgutil.resolve_name(owner)
    raw = obj.__dict__.get(name, getattr(obj, name)) if isinstance(obj, type) else getattr(obj, name)
    return getattr(raw, "__func__", raw)

emit({{
    "patched": sorted(t for t in targets if t in HookRegistry._patched),
    "sources": ours,
    "wrapped": sorted(t for t in targets if hasattr(resolve(t), "__wrapped__")),
    "r3_hooks": sum(1 for hooks in HookRegistry._hooks.values() for _, _, s in hooks
                    if s is not None and s.plugin_name == "r3_sidecar"),
    "log": [(r.levelname, r.getMessage()) for r in records],
    "service": sorted(m for m in _sys.modules if m == "service" or m.startswith("service.")),
}})
"""


@pytest.mark.sglang
def test_load_plugins_discovers_and_applies_capture_hooks(tmp_path) -> None:
    (result,) = run_sglang(_load_plugins_child(CAPTURE_TARGETS), env={"R3_SPOOL_DIR": str(tmp_path / "spool")})
    assert result["patched"] == sorted(CAPTURE_TARGETS)
    assert result["wrapped"] == sorted(CAPTURE_TARGETS)
    # one hook per target (two AROUND hooks on one target made SGLang warn at every start)
    assert all(sources.count("r3_sidecar") == 1 for sources in result["sources"].values()), result["sources"]
    # the engine process loads the spool contract and nothing else of the sidecar (test_plugin_imports.py)
    assert "service.spool.directory" in result["service"], result["service"]
    contract = ("service", "service.spool")
    outside = [m for m in result["service"] if m not in contract and not m.startswith("service.spool.")]
    assert outside == []


def _pretend(version: str) -> str:
    return f"""
import importlib.metadata as md
_real = md.version
md.version = lambda name: {version!r} if name == "sglang" else _real(name)
"""


@pytest.mark.sglang
def test_a_build_before_the_plugin_mechanism_registers_nothing_and_says_so_once(tmp_path) -> None:
    (result,) = run_sglang(
        _pretend("0.5.10.post1") + _load_plugins_child(CAPTURE_TARGETS), env={"R3_SPOOL_DIR": str(tmp_path)}
    )
    assert result["r3_hooks"] == 0
    assert result["patched"] == [] and result["wrapped"] == []
    (line,) = result["log"]
    assert line[0] == "ERROR" and "0.5.10.post1" in line[1] and "sglang>=0.5.12" in line[1] and "no hooks" in line[1]


@pytest.mark.sglang
def test_an_unproven_build_that_fits_registers_every_hook_and_says_so_once(tmp_path) -> None:
    """0.5.23's code under a dev build's version string: the layout its code fits, and one WARNING naming both."""
    build = "0.5.24.dev1+g5ee1f00"
    (result,) = run_sglang(_pretend(build) + _load_plugins_child(CAPTURE_TARGETS), env={"R3_SPOOL_DIR": str(tmp_path)})
    assert result["patched"] == sorted(CAPTURE_TARGETS)
    (line,) = [entry for entry in result["log"] if "layout" in entry[1]]
    assert line[0] == "WARNING" and f"sglang=={build}: layout 0.5.23 applied (fits, but no test ran" in line[1]


@pytest.mark.sglang
def test_the_hook_table_has_one_row_per_target_each_naming_a_hook_of_this_module() -> None:
    (rows,) = run_sglang(
        "from engine_ext.sglang.hooks import table\n"
        "emit([[h.target, h.function, list(h.groups), callable(table.body(h.function))]\n"
        "      for h in table.HOOKS])"
    )
    targets = [target for target, *_ in rows]
    assert len(targets) == len(set(targets))
    for target, function, groups, found in rows:
        allowed = {"capture", "hip", "delivery", "inline", "pointer"}
        assert found and groups and set(groups) <= allowed, (target, function)


INLINE_TARGETS = [
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
    "sglang.srt.beam_search.output.try_build_beam_search_out_dict",
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._generate_completion_stream",
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream",
]
APP_ENV = "SGLANG_HTTP_SERVER_APP_PATH"


@pytest.mark.sglang
def test_sglangs_tokenizer_workers_import_the_app_that_applies_the_inline_hooks(tmp_path) -> None:
    """SGLang loads no plugins in its tokenizer workers (`--tokenizer-worker-num > 1`) and imports their app from
    `SGLANG_HTTP_SERVER_APP_PATH`: loading the plugin points that at `http_worker`, whose import (in a fresh
    process, as a worker's) applies the inline hooks, and only those, and serves SGLang's own app object. No
    pointer there, even with a sidecar URL set. A launch's own app path is kept, and said."""
    env = {"R3_SPOOL_DIR": str(tmp_path), "R3_MODE": "sidecar", "R3_SIDECAR_URL": "http://sc:1"}
    main = f"import os\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\nemit(os.environ.get({APP_ENV!r}))"
    assert run_sglang(main, env=env) == ["engine_ext.sglang.http_worker:app"]
    own_app = _load_plugins_child([]) + f"\nimport os\nemit(os.environ[{APP_ENV!r}])"
    loaded, kept = run_sglang(own_app, env=env, read_late={APP_ENV: "mine:app"})  # read when asked (`envs`)
    assert kept == "mine:app" and any(level == "WARNING" and "mine:app" in text for level, text in loaded["log"])
    worker = """
        import importlib
        from sglang.srt.plugins.hook_registry import HookRegistry
        from engine_ext.core.degraded import DEGRADED
        from engine_ext.sglang.hooks import table
        from engine_ext.sglang.delivery import PROCESS
        if FAIL:  # the plugin's own code fails in the worker: SGLang's app, no hook, loudly
            table.install_worker_hooks = lambda settings: 1 / 0
        worker = importlib.import_module("engine_ext.sglang.http_worker")
        from sglang.srt.entrypoints import http_server
        emit({
            "same_app": worker.app is http_server.app,
            "patched": sorted(t for t in HookRegistry._patched if t in TARGETS),
            "sidecar_url": PROCESS.settings and PROCESS.settings.sidecar_url,
            "degraded": bool(DEGRADED.snapshot()),
        })
        """
    targets = f"TARGETS = {INLINE_TARGETS + CAPTURE_TARGETS!r}\n"
    (ok,) = run_sglang(targets + "FAIL = False\n" + textwrap.dedent(worker), env=env)
    assert ok == {"same_app": True, "patched": sorted(INLINE_TARGETS), "sidecar_url": None, "degraded": False}
    (failed,) = run_sglang(targets + "FAIL = True\n" + textwrap.dedent(worker), env=env)
    assert failed["same_app"] and failed["patched"] == [] and failed["degraded"], failed
