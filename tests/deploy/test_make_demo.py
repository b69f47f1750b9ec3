"""`make demo`'s venv: refused before anything is made when `PY` is older than 3.11, and a venv an older Python
made is replaced, not reused. Runs the Makefile's own recipe (`make env-demo`) with its variables pointed at a
temporary directory; `UV` and `DEMO_BIN` point the install steps at stand-ins (`true`) so no package is downloaded
here (what the demo installs is `tests/deploy/test_pip_story.py`'s to check).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_python(path: Path, version: str) -> Path:
    """An executable that says it is Python `version` and fails every other call (as 3.10 fails our check)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-V" ]; then echo "Python {version}"; exit 0; fi\nexit 1\n')
    path.chmod(0o755)
    return path


def noop_python(bindir: Path) -> Path:
    """`python -m pip install …` that does nothing: the recipe's pip steps, without a download."""
    script = bindir / "python"
    bindir.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    return bindir


def make(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    variables = {"UV": shutil.which("true") or "/bin/true", **variables}  # uv's install step: a stand-in
    args = [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(
        ["make", "-C", str(REPO), "env-demo", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_an_old_python_is_refused_before_the_venv_is_made(tmp_path: Path) -> None:
    old = fake_python(tmp_path / "py310", "3.10.12")
    venv = tmp_path / "venv"
    done = make(tmp_path, PY=str(old), DEMO=str(venv), DEMO_BIN=str(noop_python(tmp_path / "bin")))
    assert done.returncode != 0
    assert "needs Python >= 3.11" in done.stdout and "Python 3.10.12" in done.stdout, done.stdout
    assert "PY=python3.11" in done.stdout  # the fix, in the message
    assert not venv.exists()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the good Python must be 3.11+")
def test_a_venv_made_by_an_old_python_is_replaced(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    fake_python(venv / "bin" / "python", "3.10.12")  # what `make demo` on 3.10 left behind
    done = make(tmp_path, PY=sys.executable, DEMO=str(venv), DEMO_BIN=str(noop_python(tmp_path / "bin")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "was made by Python 3.10.12" in done.stdout and "removing it" in done.stdout
    version = "import sys; print(sys.version_info[:2])"
    made = subprocess.run([venv / "bin" / "python", "-c", version], capture_output=True, text=True)
    assert made.stdout.strip() == str(tuple(sys.version_info[:2]))
    assert (venv / ".demo-stamp").exists()
    again = make(tmp_path, PY=sys.executable, DEMO=str(venv), DEMO_BIN=str(noop_python(tmp_path / "bin")))
    assert again.returncode == 0 and "removing it" not in again.stdout  # a good venv is kept
