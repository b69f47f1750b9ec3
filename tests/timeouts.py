"""pytest-timeout's alarm, raised so that hypothesis lets it through (`conftest.pytest_timeout_set_timer`).

The alarm's handler raises pytest's `Failed` in whatever frame runs. In a hypothesis example (the test's body or
its data generation) hypothesis takes that for the example failing: it shrinks and replays, the replay passes (the
alarm fires once), and the test fails with a `FlakyFailure` about a harmless example, or an "inconsistent data
generation". So `make reliability`'s long spool fuzz reported its 300 s time-out at load 10-14 on 2 cores.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

Handler = Callable[[int, FrameType | None], Any]


class TimedOut(BaseException):
    """pytest-timeout's time-out: neither an `Exception` nor pytest's `Failed`, so no example catches it and
    hypothesis ends its run at once, the failure saying what it is."""


def past_hypothesis(alarm: Handler) -> Handler:
    """`alarm`, pytest-timeout's SIGALRM handler, raising `TimedOut` where it raises `Failed`."""

    def timed_out(signum: int, frame: FrameType | None) -> None:
        try:
            alarm(signum, frame)
        except pytest.fail.Exception as exc:
            raise TimedOut(str(exc)) from None

    return timed_out
