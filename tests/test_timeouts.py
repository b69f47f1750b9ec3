"""`tests/timeouts.py`: pytest-timeout's alarm, landing in a hypothesis example, ends the run as a time-out.

The alarm is called by hand in the first example only, where a real one lands once: pytest-timeout's own handler
there (`pytest.fail`) makes hypothesis replay the example, see it pass and raise `FlakyFailure`, the report
`make reliability`'s long spool fuzz gave for its time-out.
"""

from __future__ import annotations

import re
import signal
from types import FrameType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure
from timeouts import Handler, TimedOut, past_hypothesis

MESSAGE = "Timeout (>1.0s) from pytest-timeout."


def plain_alarm(signum: int, frame: FrameType | None) -> None:
    """What pytest-timeout's SIGALRM handler raises, without its dump of every thread's stack."""
    pytest.fail(MESSAGE)


def _alarm_in_first_example(handler: Handler, seen: list[int]) -> None:
    """Run a hypothesis test whose first example takes the alarm; `seen` gets every example run."""

    @settings(max_examples=20, database=None)
    @given(st.integers())
    def example(n: int) -> None:
        seen.append(n)
        if len(seen) == 1:
            handler(signal.SIGALRM, None)

    example()


def test_a_time_out_in_an_example_ends_the_hypothesis_run_as_a_time_out() -> None:
    seen: list[int] = []
    with pytest.raises(TimedOut, match=re.escape(MESSAGE)):
        _alarm_in_first_example(past_hypothesis(plain_alarm), seen)
    assert len(seen) == 1, f"the run went on after its time-out: {len(seen)} examples"
    with pytest.raises(FlakyFailure):  # pytest-timeout's handler alone: a flaky example, no word of a time-out
        _alarm_in_first_example(plain_alarm, [])


@pytest.mark.timeout(60)
def test_conftest_wraps_pytest_timeouts_alarm() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    assert callable(handler) and handler.__qualname__ == "past_hypothesis.<locals>.timed_out", handler
