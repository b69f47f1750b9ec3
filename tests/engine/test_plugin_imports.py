"""An engine process that loads the plugin loads the spool contract and nothing else of `service` (issue 32).

Each check is a fresh interpreter reading its own `sys.modules`: what a module imports at its top is what every
SGLang and vLLM process pays at load, and a server or client module there would tie the engine to the sidecar's
dependencies. SGLang's own loader, with its hooks applied, is checked in `test_plugin_entry.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

SERVER_DEPENDENCIES = ("fastapi", "starlette", "uvicorn", "prometheus_client", "httpx")
"""What the sidecar and the trainer client need and the engine plugin must not load."""


def _modules_after(code: str) -> dict[str, list[str]]:
    """Run `code` in a fresh interpreter; return the `service` modules and server dependencies it loaded."""
    child = f"""
import json, sys
{code}
print(json.dumps({{
    "service": sorted(m for m in sys.modules if m == "service" or m.startswith("service.")),
    "dependencies": sorted(m for m in {(*SERVER_DEPENDENCIES, "pydantic_settings")!r} if m in sys.modules),
}}))
"""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def _outside_the_contract(modules: list[str]) -> list[str]:
    return [m for m in modules if m not in ("service", "service.spool") and not m.startswith("service.spool.")]


def test_the_engines_entry_points_load_nothing_of_the_sidecar() -> None:
    """What SGLang's and vLLM's plugin loaders do first: find the entry point by its group and load it."""
    loaded = _modules_after(
        "from importlib.metadata import entry_points\n"
        "for group in ('sglang.srt.plugins', 'vllm.general_plugins'):\n"
        "    (ep,) = [ep for ep in entry_points(group=group) if ep.name == 'r3_sidecar']\n"
        "    assert callable(ep.load()), ep"
    )
    assert loaded == {"service": [], "dependencies": []}


def test_every_plugin_module_that_loads_no_engine_loads_only_the_spool_contract() -> None:
    """Everything `register()` may import that imports no engine at its top: the core and the vLLM adapter (vLLM's
    own modules are imported inside its hooks). The SGLang adapter's modules import SGLang, which loads FastAPI
    itself, so for them the `service` modules alone are checked, by SGLang's own loader."""
    loaded = _modules_after(
        "import importlib, pkgutil\n"
        "import engine_ext.core, engine_ext.vllm, service.spool\n"
        "for package in (engine_ext.core, engine_ext.vllm, service.spool):\n"
        "    for found in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(found.name)"
    )
    assert "service.spool.vllm_rids" in loaded["service"] and "service.spool.sidecar_clients" in loaded["service"]
    assert _outside_the_contract(loaded["service"]) == []
    # the plugin's own `R3_*` settings (engine_ext/core/settings.py) are pydantic-settings; no server dependency
    assert loaded["dependencies"] == ["pydantic_settings"]


def test_the_spool_contract_imports_neither_side() -> None:
    loaded = _modules_after(
        "import importlib, pkgutil, service.spool\n"
        "for found in pkgutil.walk_packages(service.spool.__path__, 'service.spool.'):\n"
        "    importlib.import_module(found.name)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('engine_ext', 'sglang', 'vllm', 'torch')]"
    )
    assert _outside_the_contract(loaded["service"]) == [] and loaded["dependencies"] == []
