"""Waiting in tests: on a condition, with a deadline, never for a fixed time.

A test that sleeps a fixed time guesses how long something takes: too short on a loaded 2-core CI machine (a
flake), too long everywhere else (a slow suite). `wait_until` looks at a condition until it holds and fails,
naming what it waited for, once its deadline passes; the deadline is a hang guard, never what a test asserts.
`await_until` is the same for a coroutine on the event loop.

A sleep that is itself under test (a fake engine's step, a TTL or idle period that must elapse, a producer's
pace, a window in which something must not happen) is not a wait: it says so on its line, `# not a wait: why`
(`tests/test_no_fixed_waits.py` holds every other sleep in `tests/` to this module).

Standard library only: the harness modules that import it also run outside pytest (benchmarks, the GPU run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The awaited condition did not hold by the deadline (an `AssertionError`: the test fails, it does not err)."""


def _describe(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    interval: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `condition()` until it returns something truthy, and return that; raise `WaitTimeout` naming `what`
    (a string, or a function that describes the state at the deadline) after `timeout` seconds.

    Exceptions of the `ignore` types count as "not yet" (a server not listening yet); any other propagates at
    once, so a condition can fail fast (`assert proc.poll() is None, "exited"`). The condition is looked at once
    more after the deadline, so a slow look never turns a met condition into a failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        last_look = time.monotonic() >= deadline
        try:
            if result := condition():
                return result
        except ignore:
            pass
        if last_look:
            raise WaitTimeout(f"not within {timeout:g} s: {_describe(what)}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


async def await_until(
    condition: Callable[[], T], timeout: float, what: str | Callable[[], str], *, interval: float = 0.01
) -> T:
    """`wait_until` on the running event loop: the loop keeps running between two looks at `condition()`."""
    deadline = time.monotonic() + timeout
    while True:
        last_look = time.monotonic() >= deadline
        if result := condition():
            return result
        if last_look:
            raise WaitTimeout(f"not within {timeout:g} s: {_describe(what)}")
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
