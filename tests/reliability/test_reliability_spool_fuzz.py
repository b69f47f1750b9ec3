"""Item 5 (spool half): the spool reader under damaged metadata and truncated or oversized `.bin` files.

Property (spool_cases.check_read): never an exception other than `SpoolFormatError`, never a byte past
`rows * row_bytes`, never a byte that differs from the file's. The fast test runs 300 cases; the `slow` twin
runs 5,000 with hypothesis and an atheris (libFuzzer, coverage-guided) run over the same property.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from spool_cases import check_read, damaged_record

from service.spool import Spool

HERE = Path(__file__).resolve().parent
OUTCOMES: collections.Counter[str] = collections.Counter()


def _run(tmp_path_factory, examples: int):
    spool = Spool(tmp_path_factory.mktemp("spool"))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(damaged_record())
    def prop(case):
        OUTCOMES[check_read(spool, *case)] += 1

    OUTCOMES.clear()
    prop()
    assert sum(OUTCOMES.values()) >= examples
    assert not os.listdir(spool.records_dir), "the check leaves no files behind"
    return OUTCOMES


def test_spool_reader_survives_damage(tmp_path_factory):
    outcomes = _run(tmp_path_factory, 300)
    print("spool fuzz outcomes (300 cases):", dict(outcomes))
    assert outcomes["ok"] > 0 and outcomes["truncated_bin"] > 0, "the generator reaches both read paths"
    assert sum(v for k, v in outcomes.items() if k not in ("ok", "truncated_bin")) > 0, "and rejected metadata"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_spool_reader_survives_damage_long(tmp_path_factory):
    """5,000 cases: 32 s of CPU, most of it hypothesis's generation. Its wall time is that over the process's share
    of 2 cores: 47 s at load 3, 75 s at load 10-13, past the suite's 300 s at load 10-14 plus two busy loops.
    1200 s is a hang guard for the load `make reliability` meets, not a speed limit."""
    outcomes = _run(tmp_path_factory, 5000)
    print("spool fuzz outcomes (5000 cases):", dict(outcomes))


ATHERIS_RUNS = 200_000
ATHERIS_FUZZ_S = 150
"""libFuzzer's own bounds: it stops at whichever comes first. 200,000 runs took 138 s at load 9-12 on 2 cores, so
under more load the time ends the run. Its clock starts when the fuzzing does: the interpreter's start and the
imports come on top, and the subprocess's 300 s leave them 150. `-timeout=60` (one input's limit) makes a hung read
a finding libFuzzer reports with its input, not a subprocess killed without a word."""
ATHERIS_MIN_RUNS = 20_000
"""Fewer runs than this is no fuzzing to speak of (libFuzzer did 1,400-2,000 a second at load 9-12)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spool_reader_atheris(tmp_path):
    pytest.importorskip("atheris")
    args = [f"-runs={ATHERIS_RUNS}", f"-max_total_time={ATHERIS_FUZZ_S}", "-timeout=60", "-rss_limit_mb=4096"]
    proc = subprocess.run(
        [sys.executable, str(HERE / "fuzz_spool_atheris.py"), str(tmp_path / "corpus"), *args],
        capture_output=True,
        text=True,
        timeout=ATHERIS_FUZZ_S + 150,
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1])},
    )
    tail = proc.stderr[-3000:]
    print(tail)
    assert proc.returncode == 0, tail
    done = re.search(r"^Done (\d+) runs in (\d+) second", tail, re.MULTILINE)
    assert done, tail
    runs, seconds = int(done[1]), int(done[2])
    print(f"atheris: {runs} runs in {seconds} s (bounds: {ATHERIS_RUNS} runs, {ATHERIS_FUZZ_S} s)")
    assert runs >= ATHERIS_MIN_RUNS, f"only {runs} runs in {seconds} s"
