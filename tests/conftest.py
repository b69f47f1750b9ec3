"""Shared fixtures: a temporary spool, sidecar settings over it, and a live sidecar on 127.0.0.1; and the hooks
that fail a skip in CI (`tests/skips.py`) and sum up every run's skips by reason."""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduling
import skips
from helpers import live_server
from timeouts import past_hypothesis

from service.server.settings import Settings
from service.spool import Spool

# Bytecode is cached, also where the machine says not to (PYTHONDONTWRITEBYTECODE=1): otherwise every engine
# server and SGLang child the tests start compiles SGLang and torch from source (docs/testing.md, "Bytecode").
# `make` unsets it before pytest starts; this covers a direct `pytest` and every child the tests spawn.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# CI's 2 cores also run engine servers: input generation is timed against wall-clock time there, which measures the
# machine's load, not the property (a 16-integer list took 13 s once). Examples still run; only the timing is off.
settings.register_profile("shared-cores", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cores")

# The garbage collector tuned as for a long-lived server (docs/testing.md, "The garbage collector"): a worker that
# has imported torch and SGLang holds millions of objects, and at Python's default thresholds (700, 10, 10) the
# collector walked them again and again while the tests allocated (`ast.parse` of a release's sources spent two
# thirds of its time in it). Fewer young collections, and what collection imported frozen out of every later one.
gc.set_threshold(50_000, 20, 20)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freezes what collection built; records the engines it imported (`test_collection_imports_no_engine`)."""
    scheduling.ENGINES_AT_COLLECTION[:] = [name for name in scheduling.ENGINES if name in sys.modules]
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Frozen objects back to the collector before the interpreter ends, so extension modules that count their
    live objects at exit (nanobind) find them freed."""
    gc.unfreeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A test's skip (a `skipif` mark, a fixture's or the test's own `pytest.skip`) fails in CI."""
    report = yield
    skips.fail_if_required(report)
    return report


_skipped_modules: list[pytest.CollectReport] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module's skip (a module-level `importorskip`: Ray, SGLang, torch) fails the run in CI, at its end."""
    if skips.should_fail(report):
        _skipped_modules.append(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every run says why it skipped what it skipped: one line per reason, with its count; in CI, the modules
    whose skip failed the run."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
        for line in skips.summary_lines(skipped):
            terminalreporter.write_line(line)
    if _skipped_modules:
        terminalreporter.write_sep("=", f"FAILED: modules skipped in CI: {len(_skipped_modules)}", red=True)
        for report in _skipped_modules:
            terminalreporter.write_line(skips.failure_text(report))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`scheduling.ORDER`'s modules first, in that order; every other test keeps its place (a stable sort)."""
    items.sort(key=lambda item: scheduling.collection_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under `--dist loadscope`, `scheduling.GroupedScopeScheduling`: grouped modules, handed out longest first."""
    if config.getoption("dist") == "loadscope":
        return scheduling.GroupedScopeScheduling(config, log)
    return None


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer() -> Iterator[object]:
    """pytest-timeout's alarm ends a hypothesis run as a time-out, never as a flaky example (`tests/timeouts.py`)."""
    installed = yield
    alarm = signal.getsignal(signal.SIGALRM)
    if callable(alarm):  # the signal method; the thread method ends the whole process, hypothesis or not
        signal.signal(signal.SIGALRM, past_hypothesis(alarm))
    return installed


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Each test leaves `os.environ` as it found it. Code under test may set variables on purpose (loading the
    SGLang plugin points `SGLANG_HTTP_SERVER_APP_PATH` at our worker app); left set, one changes every later
    test of the process, and the SGLang zygote then refuses to fork (`sglang_zygote.unserved`): CI failed so
    once, on a worker where `test_guard` had installed the hooks in the test process."""
    before = dict(os.environ)
    yield
    for key in os.environ.keys() - before.keys():
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture
def gc_off() -> Iterator[None]:
    """The garbage collector off for the test: what must happen promptly may not wait for a collection."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def spool(spool_dir: Path) -> Spool:
    return Spool(spool_dir)


@pytest.fixture
def make_settings(spool_dir: Path) -> Callable[..., Settings]:
    """`make_settings(ttl_s=1, ...)`: settings over the test spool (no `R3_*` from the environment leaks in)."""

    def make(**overrides: object) -> Settings:
        return Settings.model_validate({"spool_dir": spool_dir, **overrides})

    return make


@pytest.fixture
def serve(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., str]]:
    """`base_url = serve(auth_token="t", ...)`: start a sidecar (threaded uvicorn); stopped after the test.
    `serve(deadline_clock=FakeClock(), ...)` times its waits on a clock the test moves."""
    with ExitStack() as stack:

        def start(deadline_clock: Callable[[], float] | None = None, **overrides: object) -> str:
            return stack.enter_context(live_server(make_settings(**overrides), deadline_clock=deadline_clock))

        yield start


@pytest.fixture
def base_url(serve: Callable[..., str]) -> str:
    """A sidecar with default settings over the test spool."""
    return serve()
