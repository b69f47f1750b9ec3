"""The real-engine suite's one shared resource: at most one SGLang server (and its sidecar) alive at a time.

A test module asks `sglang_stack(CONFIG)`; the pool keeps the running stack when the configuration is the
same and replaces it otherwise, so a configuration starts once per module that uses it (modules group their
tests by configuration) and two servers never compete for this machine's two cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from child_process import PortTaken
from sglang_server import Config, Stack, start


class _Pool:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: Stack | None = None

    def get(self, config: Config) -> Stack:
        if self.current is not None and self.current.config == config and self.current.server.alive():
            return self.current
        self.close()
        self.current = _start(config, self.root / config.name)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            stack, self.current = self.current, None
            stack.stop()


def _start(config: Config, workdir: Path) -> Stack:
    """`start`, once more on fresh ports where another process took the server's port between the harness's pick
    and SGLang's bind (`child_process.PortTaken`, raised as soon as the server logs it: seen on 0.5.12.post1's
    mirror server on 2026-11-28 and on 0.5.12's upstream server on 2026-11-30)."""
    try:
        return start(config, workdir)
    except PortTaken:
        pass
    return start(config, workdir.with_name(f"{workdir.name}-again"))


@pytest.fixture(scope="session")
def _sglang_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Pool]:
    pool = _Pool(tmp_path_factory.mktemp("sglang"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def sglang_stack(_sglang_pool: _Pool) -> Callable[[Config], Stack]:
    """`stack = sglang_stack(Config(...))`: that configuration's running server and sidecar."""
    return _sglang_pool.get


@pytest.fixture(scope="session")
def sglang_exclusive(_sglang_pool: _Pool) -> Callable[[], Path]:
    """`root = sglang_exclusive()`: stop the pool's stack, for a test that starts its own processes under `root`."""

    def take() -> Path:
        _sglang_pool.close()
        return _sglang_pool.root

    return take
