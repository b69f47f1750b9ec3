"""`conftest._environment_kept`: a variable one test sets in `os.environ` (as loading the SGLang plugin in the
test process does) is gone for the next test of the same process. Both tests run in one process, in this order:
`--dist loadscope` keeps a module on one worker."""

from __future__ import annotations

import os

LEAKED = "R3_TEST_LEAKED_BY_AN_EARLIER_TEST"
CHANGED = "PATH"


def test_a_test_that_sets_and_changes_variables() -> None:
    os.environ[LEAKED] = "1"
    os.environ[CHANGED] = "/nowhere"


def test_the_next_test_finds_the_environment_as_it_was() -> None:
    assert LEAKED not in os.environ
    assert os.environ[CHANGED] != "/nowhere"
