"""Fixtures for the reliability suite: sidecar and writer processes that are always cleaned up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from r3_harness import Sidecar, Writer

import service.server.api  # noqa: F401  # the sidecar processes run it: an import error fails the suite, never skips it


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


@pytest.fixture
def make_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    """`make_sidecar(spool, env={...})` starts a sidecar process and waits for `/readyz`; all are stopped after."""
    started: list[Sidecar] = []

    def make(spool: Path, **kwargs) -> Sidecar:
        kwargs.setdefault("log_path", tmp_path / f"sidecar-{len(started)}.log")
        s = Sidecar(spool=spool, **kwargs)
        started.append(s)
        return s.start()

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def make_writer(tmp_path: Path) -> Iterator[Callable[..., Writer]]:
    """`make_writer(spool, ledger, args)` starts an `r3_writer.py` process; all are killed after."""
    started: list[Writer] = []

    def make(spool: Path, ledger: Path, args: list[str]) -> Writer:
        w = Writer(spool=spool, ledger=ledger, args=args)
        started.append(w)
        return w.start()

    yield make
    for w in started:
        w.kill()
