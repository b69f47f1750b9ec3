"""Every SGLang release from 0.5.12 to 0.5.23, its own code against the layout it gets (`make test-matrix`).

Each release is installed `--no-deps` in a venv of its own over the test venv (`make env-sglang-releases`:
`.venv-sglang-<release>`), and its own python runs `resolve_targets.py`, which decides the layout by `fit` from
that release's modules and source. The answer must be `versions.RELEASES`' row: the layout the docs and the
plugin's users are told that release gets (None: it fits none, and the plugin registers nothing there). A venv
that is missing fails the test, naming the make target. CI asks the same of each release's wheel without
importing it (`tests/engine/sglang/test_release_wheels.py`); this is its run-time cross-check: what `fit` finds
each layout lacks in the imported release is what `wheel_fit` reads from its wheel, word for word.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import release_wheels
import wheel_fit
from sglang_server import REPO

from engine_ext.sglang import attributes, compat
from engine_ext.sglang.versions import RELEASES

pytestmark = [pytest.mark.sglang, pytest.mark.matrix, pytest.mark.timeout(900)]


@pytest.mark.parametrize("release", list(RELEASES))
def test_each_release_gets_the_layout_its_row_says(release):
    venv = ".venv" if release == "0.5.23" else f".venv-sglang-{release}"
    python = REPO / venv / "bin" / "python"
    assert python.exists(), f"{venv} is missing: make env-sglang-releases"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "R3_TEST_SGLANG_CPU": "1",
    }
    done = subprocess.run(
        [str(python), str(REPO / "tests" / "e2e" / "resolve_targets.py")],
        capture_output=True,
        text=True,
        timeout=840,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["sglang"] == release
    assert found["fit"]["layout"] == RELEASES[release], found["fit"]
    source, rows = release_wheels.SGLANG.source(release), wheel_fit.hook_rows()
    try:
        read = {layout: wheel_fit.lacks(source, layout, rows) for layout in found["lacking"]}
    finally:
        attributes.forget()
        compat.use(compat.NEWEST)
    assert {v: sorted(gaps) for v, gaps in read.items()} == {v: sorted(g) for v, g in found["lacking"].items()}
