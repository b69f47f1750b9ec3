"""Hook timers: each hook books its own time (not the SGLang code it wraps, not a timed hook nested inside it)
under the forward kind in effect; the engine file carries them and the sidecar exports them (Contract 3)."""

from __future__ import annotations

import pytest
from helpers import engine_report

from engine_ext.sglang import timers
from service.server.metrics import engine_families
from service.spool.engine_report import EngineReport, EngineReportError


class StepClock:
    """`perf_counter_ns` stand-in: each reading advances by `step` ns, plus what `spend` adds."""

    def __init__(self, step: int = 1) -> None:
        self.now, self.step = 0, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now

    def spend(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    fake = StepClock(step=0)
    monkeypatch.setattr(timers, "clock", fake)
    timers.TIMERS.reset()
    timers.configure(True)
    yield fake
    timers.TIMERS.reset()
    timers.configure(True)


def test_an_around_hook_books_its_own_time_not_the_originals(clock: StepClock) -> None:
    def original(x: int) -> int:
        clock.spend(1000)  # SGLang's code
        return x + 1

    @timers.timed(timers.FORWARD_END)
    def hook(orig, x: int) -> int:
        clock.spend(30)
        out = orig(x)
        clock.spend(20)
        return out

    timers.TIMERS.kind = timers.DECODE
    assert hook(original, 1) == 2
    assert hook(original, 2) == 3
    assert timers.TIMERS.snapshot() == {"forward_end": {"decode": {"calls": 2, "seconds": 100e-9}}}


def test_a_timed_hook_nested_in_another_is_not_booked_twice(clock: StepClock) -> None:
    @timers.timed(timers.COLLECT)
    def collect(orig) -> None:
        clock.spend(7)
        orig()

    def process_result() -> None:  # SGLang's code, which calls the collect hook inside
        clock.spend(500)
        collect(lambda: clock.spend(300))

    @timers.timed(timers.LIVE_STEP, around=False)
    def live_step() -> None:
        clock.spend(40)

    @timers.timed(timers.BATCH_RESULT)
    def batch_result(orig) -> None:
        timers.TIMERS.kind = timers.EXTEND
        clock.spend(5)
        orig()
        live_step()
        clock.spend(6)

    batch_result(process_result)
    snap = timers.TIMERS.snapshot()
    assert snap["batch_result"]["extend"]["seconds"] == pytest.approx(11e-9)
    assert snap["collect"]["extend"]["seconds"] == pytest.approx(7e-9)
    assert snap["live_step"]["extend"]["seconds"] == pytest.approx(40e-9)
    assert timers.TIMERS.child_ns == 5 + 500 + 7 + 300 + 40 + 6  # the level above sees the region as child time


def test_switched_off_nothing_is_booked_and_install_registers_the_bare_hook(clock: StepClock) -> None:
    def bare(orig) -> int:
        clock.spend(10)
        return orig()

    hook = timers.timed(timers.FORWARD_EXTENT)(bare)
    timers.configure(False)
    assert timers.untimed(hook) is bare
    assert hook(lambda: 3) == 3
    assert timers.TIMERS.snapshot() == {}
    timers.configure(True)
    assert timers.untimed(hook) is hook


def test_no_hook_inside_the_model_forward_is_timed() -> None:
    """The per-layer capture check runs where Dynamo traces (piecewise CUDA graphs, torch.compile): no timer
    slot, and the registered hook is the bare function (`test_capture_compiled.py` compiles it)."""
    from engine_ext.sglang.hooks import capture as capture_hooks

    assert "device_capture" not in timers.HOOKS
    assert not hasattr(capture_hooks._checked_device_capture, "__r3_untimed__")
    assert timers.untimed(capture_hooks._checked_device_capture) is capture_hooks._checked_device_capture


def _report(hooks: object | None) -> dict:
    report = engine_report("e/dp0", updated=1e9)
    return report if hooks is None else report | {"hooks": hooks}


def test_engine_report_round_trips_hooks_and_names_a_bad_field() -> None:
    hooks = {"device_capture": {"decode": {"calls": 96, "seconds": 0.002}}}
    assert EngineReport.from_dict(_report(hooks)).to_dict()["hooks"] == hooks
    assert "hooks" not in EngineReport.from_dict(_report(None)).to_dict()
    with pytest.raises(EngineReportError, match=r"hooks\.device_capture\.decode\.seconds"):
        EngineReport.from_dict(_report({"device_capture": {"decode": {"calls": 1, "seconds": -1}}}))
    with pytest.raises(EngineReportError, match="an object of forward kinds"):
        EngineReport.from_dict(_report({"device_capture": [1]}))


def test_metrics_export_hook_seconds_and_calls_by_engine_hook_and_kind() -> None:
    hooks = {"forward_end": {"decode": {"calls": 12, "seconds": 0.5}, "extend": {"calls": 2, "seconds": 0.25}}}
    families = {f.name: f for f in engine_families([_report(hooks)], stale_after_s=1e12, now=1e9)}
    seconds = {tuple(s.labels.values()): s.value for s in families["r3_engine_hook_seconds"].samples}
    calls = {tuple(s.labels.values()): s.value for s in families["r3_engine_hook_calls"].samples}
    assert seconds[("e/dp0", "forward_end", "decode")] == 0.5
    assert calls[("e/dp0", "forward_end", "extend")] == 2
    off = {f.name: f for f in engine_families([_report(None)], stale_after_s=1e12, now=1e9)}
    assert off["r3_engine_hook_seconds"].samples == []
