"""Docs that run: every ```python block of README.md, docs/trainers.md and docs/vllm.md, executed as written
against a real `r3-sidecar demo` (a subprocess on a free 127.0.0.1 port, as `make demo` runs it).

Blocks fenced ```python no-run show a framework's own code (names that exist only inside verl, slime, …);
they are listed, not run. The docs say `http://127.0.0.1:8000` (the demo's default); the test's demo listens on a
free port, so that one string is replaced by its URL. Nothing else in a block changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import bound_socket

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/trainers.md", "docs/vllm.md")
DOC_URL = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(\w[\w-]*)?(?: ([\w-]+))?\n(.*?)^```$", re.S | re.M)


def blocks(doc: str) -> list[tuple[str, int, str, str]]:
    """(doc, line, fence info, code) of every Python block in `doc`."""
    text = (REPO / doc).read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            line = text.count("\n", 0, m.start()) + 2
            out.append((doc, line, m.group(2) or "", m.group(3)))
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b[2] != "no-run"]


def test_every_python_block_is_run_or_says_why_not() -> None:
    unknown = [(doc, line, info) for doc, line, info, _ in ALL if info not in ("", "no-run")]
    assert not unknown, f"a python fence is `python` (run in CI) or `python no-run` (a framework's code): {unknown}"
    assert {doc for doc, *_ in RUNNABLE} == set(DOCS), "each doc has at least one block that runs"


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    script = Path(sys.executable).with_name("r3-sidecar")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    env = {**os.environ, "R3_SPOOL_DIR": str(tmp_path_factory.mktemp("docs") / "spool")}
    proc = subprocess.Popen(
        [*cmd, "demo", "--host", "127.0.0.1", "--port", str(port), "--step-ms", "5"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "the demo exited"
            assert time.monotonic() < deadline, "demo sidecar not ready in 30 s"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("doc", "line", "info", "code"), RUNNABLE, ids=[f"{d}:{n}" for d, n, _, _ in RUNNABLE])
def test_block_runs_as_written(demo_url: str, doc: str, line: int, info: str, code: str) -> None:
    source = code.replace(DOC_URL, demo_url)
    exec(compile(source, f"{doc}:{line}", "exec"), {"__name__": "__docs__"})
