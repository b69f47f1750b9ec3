"""A skip in CI is a failure, unless CI cannot run the test by design.

A test skips when what it needs is absent: a venv, Ray, promtool, root. On a developer's machine that is a fair
answer; in CI, which builds every one of them (`.ci/run`, `make test`), it means the build silently lost
something, and a skip reads like a pass (whole runs once ended "40 skipped" without saying why). With `CI=true`
(as `.ci/run` runs) or `R3_REQUIRE_ALL=1`, every skip fails instead, naming the test and its reason, except
those whose reason `BY_DESIGN` lists: what no CI machine here can have (a CUDA device, SGLang's CPU engine on
Intel AMX) or a test that does not apply to one of its parameters (`NOT_APPLICABLE`). docs/testing.md lists them.

Every run, CI's or not, ends with one line per skip reason and its count, so a skip never passes unread.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

NOT_APPLICABLE = "not applicable:"  # a reason that starts so: the test does not apply to this parameter
BY_DESIGN = (
    re.compile(r"\bCUDA\b"),  # no accelerator on CI's machine (tests/engine/gpu/ runs them on one)
    re.compile(r"SGLang's CPU engine"),  # needs Intel AMX and sgl_kernel's CPU build, which PyPI lacks
    re.compile("^" + re.escape(NOT_APPLICABLE)),
)


def required() -> bool:
    """Whether a skip must fail: in CI (`CI=true`), or asked for (`R3_REQUIRE_ALL=1`)."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("R3_REQUIRE_ALL") == "1"


def reason_of(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The skip's reason as the user wrote it (pytest keeps `(path, line, "Skipped: reason")`)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def by_design(reason: str) -> bool:
    return any(pattern.search(reason) for pattern in BY_DESIGN)


def should_fail(report: pytest.TestReport | pytest.CollectReport) -> bool:
    """Whether `report` is a skip that CI could have run, and CI (or `R3_REQUIRE_ALL=1`) is asking."""
    return report.skipped and not hasattr(report, "wasxfail") and required() and not by_design(reason_of(report))


def failure_text(report: pytest.TestReport | pytest.CollectReport) -> str:
    return (
        f"{report.nodeid} skipped in CI (CI=true or R3_REQUIRE_ALL=1): {reason_of(report)}\n"
        "CI builds what this test needs; a skip here means the build lost it (tests/skips.py)."
    )


def fail_if_required(report: pytest.TestReport) -> None:
    """Turn a test's `report`, if it is a skip that CI could have run, into a failure naming it and its reason.

    A module's skip (a collection report) cannot become a failure the same way: pytest stops the whole run at a
    collection error. Its hook keeps the skip, and `failed_modules` fails the session at its end instead."""
    if should_fail(report):
        report.longrepr = failure_text(report)
        report.outcome = "failed"


def summary_lines(reports: list[pytest.TestReport | pytest.CollectReport]) -> list[str]:
    """One line per skip reason, most frequent first."""
    counts = Counter(reason_of(r) for r in reports if not hasattr(r, "wasxfail"))
    return [f"{n} × {reason}{'' if by_design(reason) else ' (not by design)'}" for reason, n in counts.most_common()]
