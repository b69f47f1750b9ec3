"""Tests wait on conditions with deadlines (`tests/waiting.py`), never for a fixed time.

A sleep elsewhere in `tests/` says on its line why it is not a wait (`# not a wait: ...`): the sleep itself is
under test (a fake engine's step, a TTL that must elapse, a producer's pace, a window in which something must not
happen). Any other sleep guesses how long something takes: a flake on a loaded machine, time lost on a fast one.
A delayed call (`threading.Timer(`, `loop.call_later(`) is the same sleep on another thread or on the event loop:
"write the record 0.3 s from now" guesses when the reader will be waiting (`helpers.when_waited` knows).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLEEP = re.compile(r"\b(?:time\.|asyncio\.)?sleep\(|\bTimer\(|\bcall_later\(")
MARK = "# not a wait:"


def test_every_sleep_or_delayed_call_in_the_tests_is_a_condition_wait_or_says_why_not() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "tests"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    unmarked = [
        f"{path}:{n}: {line.strip()}"
        for path in tracked
        if path.endswith(".py") and path not in ("tests/waiting.py", "tests/test_no_fixed_waits.py")
        for n, line in enumerate((REPO / path).read_text().splitlines(), 1)
        if SLEEP.search(line) and MARK not in line
    ]
    how = "wait with tests/waiting.py's wait_until (a delayed action: helpers.when_waited), or say `# not a wait: why`"
    assert not unmarked, how + ":\n" + "\n".join(unmarked)
