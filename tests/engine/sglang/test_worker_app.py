"""`worker_app`: the literal app path SGLang ≤ 0.5.20 hands to uvicorn's and Granian's workers, retargeted to
`http_worker`'s app, checked on the real classes: SGLang's `HookRegistry` patches Granian's own server
constructor (granian, SGLang's `http2` extra), which then stores the target its spawned workers import.

Granian's constructor stays patched for the process only within a test (`patched_granian` restores it).
"""

from __future__ import annotations

import pytest

from engine_ext.sglang import compat, guard, worker_app
from engine_ext.sglang.worker_app import SGLANG_APP, WORKER_APP, app_for_granian, app_for_workers

pytestmark = pytest.mark.sglang
granian = pytest.importorskip("granian")


def test_only_sglangs_literal_with_several_uvicorn_workers_is_retargeted():
    assert app_for_workers(SGLANG_APP, 2) == WORKER_APP
    assert app_for_workers(SGLANG_APP, 1) == SGLANG_APP  # one worker: SGLang serves its app object in-process
    assert app_for_workers("my.app:app", 4) == "my.app:app"  # a launch's own app is kept
    app = object()
    assert app_for_workers(app, 4) is app


def test_granians_literal_is_retargeted_whatever_the_worker_count():
    """Granian's multi-process server spawns even one worker, which imports the target by its path."""
    assert app_for_granian(SGLANG_APP) == WORKER_APP
    assert app_for_granian("my.app:app") == "my.app:app"
    app = object()
    assert app_for_granian(app) is app  # embedded Granian (0.5.16+, one worker) serves SGLang's app object


@pytest.fixture(params=[False])
def patched_granian(monkeypatch, request):
    """Granian's constructor as `worker_app.register` hooks it for a ≤ 0.5.20 layout, restored afterwards; with
    param True the hook fails as the plugin's own code would (`guard.FAULT_ENV`)."""
    from granian.server.common import AbstractServer

    # SGLang imported by the first test that needs it, not at collection (every xdist worker would: 5 CPU-s)
    HookRegistry = pytest.importorskip("sglang.srt.plugins.hook_registry").HookRegistry

    from engine_ext.core.degraded import DEGRADED

    monkeypatch.setattr(guard.Guard, "all", [])
    monkeypatch.setattr(guard.Guard, "on_step_aside", [])
    DEGRADED.clear()
    if request.param:
        monkeypatch.setenv(guard.FAULT_ENV, "retarget_granian_app")
    else:
        monkeypatch.delenv(guard.FAULT_ENV, raising=False)
    monkeypatch.setattr(AbstractServer, "__init__", AbstractServer.__init__)  # restored at teardown
    call = compat.LAYOUTS["0.5.12"].granian_app_call
    assert worker_app.register(None, call) == [call]
    HookRegistry.apply_hooks()
    yield
    HookRegistry._hooks.pop(call, None)
    HookRegistry._patched.discard(call)
    DEGRADED.clear()


def test_every_older_layout_names_granians_constructor_and_it_imports():
    calls = {v: compat.LAYOUTS[v].granian_app_call for v in ("0.5.12", "0.5.16", "0.5.20")}
    assert set(calls.values()) == {"granian.server.common.AbstractServer.__init__"}, calls
    assert compat.LAYOUTS["0.5.23"].granian_app_call is None  # names its workers' app in a setting
    assert compat.missing(list(calls.values())) == []
    assert sorted(v for v, layout in compat.LAYOUTS.items() if layout.granian_spawns_one) == ["0.5.12", "0.5.13"]


def test_the_real_granian_server_stores_http_workers_app_as_its_target(patched_granian):
    from granian.constants import Interfaces

    kwargs = {"address": "127.0.0.1", "port": 0, "interface": Interfaces.ASGI}
    assert granian.Granian(target=SGLANG_APP, workers=2, **kwargs).target == WORKER_APP
    assert granian.Granian(SGLANG_APP, **kwargs).target == WORKER_APP  # positional, one worker
    assert granian.Granian(target="my.app:app", **kwargs).target == "my.app:app"
    assert not any(g.degraded for g in guard.Guard.all)


@pytest.mark.parametrize("patched_granian", [True], indirect=True)
def test_a_failing_granian_retarget_builds_sglangs_own_server_loudly(patched_granian, caplog):
    """The guard's fallback: Granian gets SGLang's own arguments (its workers serve SGLang's app, rows without
    shape), the plugin's hooks step aside, and the failure is one ERROR line naming the hook."""
    from granian.constants import Interfaces

    from engine_ext.core.degraded import DEGRADED

    server = granian.Granian(target=SGLANG_APP, address="127.0.0.1", port=0, interface=Interfaces.ASGI)
    assert server.target == SGLANG_APP
    assert [g.degraded for g in guard.Guard.all] == [True]
    assert [f["hook"] for f in DEGRADED.snapshot()] == ["retarget_granian_app"]
    assert any("r3-sidecar: hook retarget_granian_app" in r.getMessage() for r in caplog.records)
