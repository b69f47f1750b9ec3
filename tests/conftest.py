"""Shared fixtures: a temporary spool, sidecar settings over it, and a live sidecar on 127.0.0.1."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import live_server

from service.server.settings import Settings
from service.spool import Spool

# CI's 2 cores also run engine servers: input generation is timed against wall-clock time there, which measures the
# machine's load, not the property (a 16-integer list took 13 s once). Examples still run; only the timing is off.
settings.register_profile("shared-cores", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cores")


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

