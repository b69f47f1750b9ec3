"""The guard every r3-sidecar hook is registered behind (`engine_ext/sglang/guard.py`), on SGLang's real
`HookRegistry`: a failure in our hook ends that call as SGLang's own would and degrades every hook of the process,
once and loudly; SGLang's own exceptions pass through; a compiled caller traces the guard.

The targets are functions of a module each test makes (`Target`), so what "SGLang's original" did is counted
exactly; `HookRegistry.apply_hooks` patches them as it patches SGLang's. Guards and failures are process-wide:
each test starts from none.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import sys
import types

import pytest

from engine_ext.core.degraded import DEGRADED
from engine_ext.sglang import guard
from engine_ext.sglang.capturer import CaptureOverflowError

pytestmark = pytest.mark.sglang
_names = itertools.count()


class Target:
    """A module of four "SGLang originals" that record their calls: plain, failing, coroutine and stream."""

    def __init__(self, registry: types.ModuleType) -> None:
        self.registry = registry
        self.calls: list[tuple] = []
        self.name = f"r3_guard_target_{next(_names)}"
        module = types.ModuleType(self.name)
        calls = self.calls

        def plain(x, *, scale=1):
            calls.append(("plain", x, scale))
            return x * 10 * scale

        def failing(x):
            calls.append(("failing", x))
            raise ValueError(f"SGLang's own error {x}")

        async def coro(x):
            calls.append(("coro", x))
            return x + 100

        async def stream(n):
            for i in range(n):
                calls.append(("item", i))
                yield i

        module.plain, module.failing, module.coro, module.stream = plain, failing, coro, stream
        module.scale = lambda x: x * 2
        sys.modules[self.name] = self.module = module

    def hook(self, attr: str, fn, *, replace: bool = False, settle=None) -> None:
        target = f"{self.name}.{attr}"
        wrapped = guard.wrap(fn.__name__, target, fn, replace=replace, settle=settle)
        self.registry.HookRegistry.register(target, wrapped, self.registry.HookType.AROUND)

    def apply(self) -> types.ModuleType:
        self.registry.HookRegistry.apply_hooks()
        return self.module


@pytest.fixture(scope="module")
def registry() -> types.ModuleType:
    """SGLang's `hook_registry` module, imported when a test first needs it: at collection, every pytest-xdist
    worker would import SGLang (5 CPU-s here), not only the one that runs this module."""
    return pytest.importorskip("sglang.srt.plugins.hook_registry")


@pytest.fixture
def target(registry, monkeypatch, caplog):
    monkeypatch.setattr(guard.Guard, "all", [])
    monkeypatch.setattr(guard.Guard, "on_step_aside", [])
    monkeypatch.delenv(guard.FAULT_ENV, raising=False)
    DEGRADED.clear()
    caplog.set_level(logging.INFO, logger="r3_sidecar")
    yield Target(registry)
    DEGRADED.clear()


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failing_hook_runs_sglangs_original_once_and_degrades_every_hook_once(target, caplog) -> None:
    stepped = []
    guard.Guard.on_step_aside[:] = [lambda: stepped.append(1), lambda: 1 / 0]  # a failing callback is contained

    def broken(original, x, *, scale=1):
        raise KeyError("our bug")

    def other(original, x):
        target.calls.append(("other hook", x))
        return original(x)

    target.hook("plain", broken)
    target.hook("failing", other)
    m = target.apply()
    assert m.plain(3, scale=2) == 60  # our hook failed before calling the original: SGLang's own call
    assert m.plain(4) == 40  # degraded: the original only
    with pytest.raises(ValueError, match="SGLang's own error 5"):
        m.failing(5)  # the other hook is degraded too: our code is not run
    assert target.calls == [("plain", 3, 2), ("plain", 4, 1), ("failing", 5)]
    (line,) = errors(caplog)  # one ERROR line for the failed hook, none per later call
    assert line.startswith(f"r3-sidecar: hook broken ({target.name}.plain) failed: KeyError: 'our bug'"), line
    (fault,) = DEGRADED.snapshot()
    assert (fault["hook"], fault["target"], fault["error"]) == ("broken", f"{target.name}.plain", "KeyError: 'our bug'")
    assert [g.degraded for g in guard.Guard.all] == [True, True] and stepped == [1]


def test_sglangs_own_exception_passes_through_and_degrades_nothing(target, caplog) -> None:
    def passing(original, x):
        return original(x) + 1

    target.hook("failing", passing)
    m = target.apply()
    with pytest.raises(ValueError, match="SGLang's own error 7"):
        m.failing(7)
    assert errors(caplog) == [] and DEGRADED.snapshot() == [] and not guard.Guard.all[0].degraded


def test_an_engine_failure_named_on_purpose_passes_through_and_degrades_nothing(target, caplog) -> None:
    """A capture overflow the plugin names before the write is where SGLang itself fails: not our fault."""

    def checked(original, x, *, scale=1):
        raise CaptureOverflowError("this forward needs 17 rows but the buffer holds 16; lower --max-running-requests")

    target.hook("plain", checked)
    m = target.apply()
    for _ in range(2):  # every call still checked: nothing degraded
        with pytest.raises(CaptureOverflowError, match="17 rows"):
            m.plain(1)
    assert target.calls == [] and errors(caplog) == [] and DEGRADED.snapshot() == []
    assert not guard.Guard.all[0].degraded


def test_a_failure_after_the_original_keeps_its_result_and_never_calls_it_twice(target, monkeypatch) -> None:
    monkeypatch.setenv(guard.FAULT_ENV, "after:after@2")  # the second call, right after the original returns

    def after(original, x, *, scale=1):
        return original(x, scale=scale) + 1

    target.hook("plain", after)
    m = target.apply()
    assert m.plain(2) == 21  # our hook's result
    assert m.plain(3) == 30  # the original's own result, not ours (31)
    assert target.calls == [("plain", 2, 1), ("plain", 3, 1)]
    assert [f["hook"] for f in DEGRADED.snapshot()] == ["after"]


def test_a_hook_that_changed_the_originals_arguments_is_settled_by_its_row(target, monkeypatch) -> None:
    """Our hook asked the original for something else (on_forward_end without the host copy) and failed after it
    returned: the row's `settle` finishes SGLang's own call from that result, once."""
    monkeypatch.setenv(guard.FAULT_ENV, "other_args:after")

    def other_args(original, x, *, scale=1):
        return original(x, scale=0)  # the host copy skipped: ours would follow

    def settle(result, x, *, scale=1):
        target.calls.append(("settle", result, x, scale))
        return x * 10 * scale  # what SGLang's own call gives

    target.hook("plain", other_args, settle=settle)
    assert target.apply().plain(4, scale=3) == 120
    assert target.calls == [("plain", 4, 0), ("settle", 0, 4, 3)]


def test_a_replace_hook_falls_back_to_the_function_it_replaced(target) -> None:
    def replaced(x, *, scale=1):
        raise RuntimeError("our replacement failed")

    target.hook("plain", replaced, replace=True)
    assert target.apply().plain(5) == 50
    assert target.calls == [("plain", 5, 1)] and [f["hook"] for f in DEGRADED.snapshot()] == ["replaced"]


def test_coroutine_hooks_settle_as_sglangs_own_call(target, caplog) -> None:
    async def before(original, x):
        raise OSError("our async bug")

    target.hook("coro", before)
    m = target.apply()
    assert asyncio.run(m.coro(1)) == 101 and asyncio.run(m.coro(2)) == 102
    assert target.calls == [("coro", 1), ("coro", 2)] and len(errors(caplog)) == 1


def test_a_stream_hook_failing_mid_stream_passes_every_item_on_once_in_order(target, monkeypatch, caplog) -> None:
    monkeypatch.setenv(guard.FAULT_ENV, "tagged:after@3")  # after the hook pulled item 2, before it passed it on

    async def tagged(original, n):
        async for item in original(n):
            yield ("ours", item)

    target.hook("stream", tagged)
    m = target.apply()

    async def take(n):
        return [item async for item in m.stream(n)]

    assert asyncio.run(take(5)) == [("ours", 0), ("ours", 1), 2, 3, 4]
    assert asyncio.run(take(2)) == [0, 1]  # degraded: SGLang's stream as it is
    assert [c[1] for c in target.calls] == [0, 1, 2, 3, 4, 0, 1]  # no item produced twice
    assert len(errors(caplog)) == 1


def test_a_compiled_caller_traces_the_guard_plainly_on_and_degraded(target) -> None:
    """Dynamo (fullgraph, as SGLang's piecewise graphs compile each layer) traces through the guard: no
    try/except, logging or state in the compiled path; degraded, the compiled graph is the original's."""
    import torch

    def plus_one(original, x):
        return original(x) + 1

    target.hook("scale", plus_one)
    m = target.apply()
    compiled = torch.compile(lambda x: m.scale(x) * 3, fullgraph=True, backend="eager")
    x = torch.arange(4.0)
    assert compiled(x).tolist() == [3.0, 9.0, 15.0, 21.0]
    guard.Guard.all[0].degraded = True
    assert compiled(x).tolist() == [0.0, 6.0, 12.0, 18.0]


def test_install_registers_every_hook_behind_a_guard_as_around(target, registry, monkeypatch) -> None:
    from engine_ext.core.settings import EngineSettings
    from engine_ext.sglang.hooks import table

    HookRegistry, HookType = registry.HookRegistry, registry.HookType
    monkeypatch.setattr(table, "_registered", set())
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(table, "_budget_hook_registered", [True])
    table.install(EngineSettings(mode="mirror", sidecar_url="http://sc:1"))
    table.PROCESS.configure(None)  # install set the delivery settings of this (test) process
    ours = [(t, ht, getattr(h, "__r3_guard__", None)) for t, hs in HookRegistry._hooks.items() for ht, h, _ in hs]
    assert len(ours) == len({h.target for h in table.HOOKS if "hip" not in h.groups})
    assert all(kind is HookType.AROUND and g is not None and g.target == t for t, kind, g in ours), ours
    assert len(guard.Guard.on_step_aside) == 1


def test_a_failure_in_the_entry_point_leaves_every_hook_registered_so_far_on_sglangs_code(
    target, registry, monkeypatch, caplog
) -> None:
    """`register()` failing half way (after the capture hooks): SGLang's loader would carry on with those hooks;
    they call SGLang's originals only, and the failure is said once, as a failed hook's."""
    import engine_ext.sglang
    from engine_ext.sglang.hooks import table

    def broken(settings):
        raise RuntimeError("budget hook registration failed")

    monkeypatch.setattr(table, "_registered", set())
    monkeypatch.setattr(registry.HookRegistry, "_hooks", type(registry.HookRegistry._hooks)(list))
    monkeypatch.setattr(table, "install_budget_hooks", broken)
    monkeypatch.setattr(table.PROCESS, "step_aside", lambda report: None)  # no engine file from this test process
    engine_ext.sglang.register()
    assert len(guard.Guard.all) > 1 and all(g.degraded for g in guard.Guard.all)
    assert [f["hook"] for f in DEGRADED.snapshot()] == ["register"]
    (line,) = errors(caplog)
    assert line.startswith("r3-sidecar: hook register (engine_ext.sglang:register) failed: RuntimeError"), line


def test_a_plugin_thread_that_dies_degrades_every_hook_as_a_failed_hook_does(target, monkeypatch, caplog) -> None:
    """The daemon threads (spool writer, telemetry, collect ticker) take the hooks' records: when one dies of our
    code, SGLang's hooks step aside as `hooks.table.install` arranges (`guard.thread_failed`)."""
    import threading

    from engine_ext.core import degraded
    from engine_ext.sglang.hooks import table

    stepped = []
    guard.Guard.on_step_aside[:] = [lambda: stepped.append(1)]

    def passing(original, x, *, scale=1):
        return original(x, scale=scale) + 1

    target.hook("plain", passing)
    m = target.apply()
    assert m.plain(1) == 11
    monkeypatch.setattr(degraded, "ON_THREAD_FAILURE", [])
    registers = inspect.getsource(table._step_aside_on_failure)  # what a real engine process registers
    assert "guard.thread_failed" in registers
    degraded.ON_THREAD_FAILURE[:] = [guard.thread_failed]

    def body():
        raise KeyError("writer loop bug")

    thread = threading.Thread(target=degraded.guarded_thread("r3-spool-writer", body))
    thread.start()
    thread.join(10)
    assert m.plain(1) == 10 and stepped == [1]  # degraded: SGLang's own call only
    (fault,) = DEGRADED.snapshot()
    assert (fault["hook"], fault["error"]) == ("thread r3-spool-writer", "KeyError: 'writer loop bug'")
    (line,) = errors(caplog)
    assert line.startswith("r3-sidecar: hook thread r3-spool-writer (r3-spool-writer) failed: KeyError"), line
