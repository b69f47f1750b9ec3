"""How the real-engine harness stops a server's process group (`tests/e2e/child_process.py`).

A leader with workers is killed as soon as SIGTERM has ended them, instead of being waited for: SGLang's leader
only sleeps 5 s before its crash diagnostics then, which summed to minutes of idle workers over a run. A process
that never had workers (the sidecar) still gets its grace and exits by itself.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from e2e.child_process import PortTaken, Process, _group, spawn
from waiting import WaitTimeout, wait_until

# A leader like SGLang's: a worker that SIGTERM ends, and a 5 s pause of its own before it exits
LEADER = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(5), sys.exit(0)))  # not a wait: SGLang's pause, under test
print("ready", flush=True)
signal.pause()
"""

# A single process that cleans up on SIGTERM and exits with its own status
ALONE = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
print("ready", flush=True)
signal.pause()
"""


def _started(code: str, tmp_path: Path) -> Process:
    process = spawn([sys.executable, "-c", code], dict(os.environ), tmp_path / "out.log", "")
    wait_until(lambda: "ready" in process.log_text(), 60, "the process says ready")
    return process


def test_a_leader_left_alone_by_its_workers_is_killed_not_waited_for(tmp_path: Path) -> None:
    process = _started(LEADER, tmp_path)
    wait_until(lambda: len(_group(process.proc.pid)) == 2, 60, "the leader and its worker run")
    process.stop()
    assert process.proc.returncode == -signal.SIGKILL  # not its own exit, 5 s after SIGTERM
    assert not _group(process.proc.pid)


def test_a_process_without_workers_gets_its_grace_and_exits_itself(tmp_path: Path) -> None:
    process = _started(ALONE, tmp_path)
    process.stop()
    assert process.proc.returncode == 3
    assert not _group(process.proc.pid)


# What a server whose HTTP port was taken does: uvicorn logs it, then the process waits, never answering
PORT_TAKEN = """
import signal
print("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use",
      flush=True)
signal.pause()
"""


def test_a_server_that_could_not_bind_its_port_is_given_up_at_once(tmp_path):
    """Not at the readiness deadline (600 s for an SGLang start): the harness starts it again on new ports."""
    process = spawn([sys.executable, "-c", PORT_TAKEN], dict(os.environ), tmp_path / "out.log", "http://127.0.0.1:1")
    try:
        with pytest.raises(PortTaken, match="could not bind a port it was given"):
            process.wait_http("/health", 600, "the server")  # pytest-timeout's limit ends it if it waits the 600 s
    finally:
        process.stop()


# Two workers that each log their warmup line once the test says so (it writes to a FIFO), then wait
WARMUPS = """
import signal, sys
print("ready", flush=True)
open(sys.argv[1]).read()
for worker in (1, 2):
    print(f"worker {worker}: The server is fired up and ready to roll!", flush=True)
signal.pause()
"""


def test_the_wait_for_every_workers_line_ends_only_when_each_has_said_it(tmp_path):
    """`wait_log`: a line per tokenizer worker (SGLang's warmup done), counted; a process that ends fails it."""
    go = tmp_path / "go"
    os.mkfifo(go)
    process = spawn([sys.executable, "-c", WARMUPS, str(go)], dict(os.environ), tmp_path / "out.log", "")
    try:
        wait_until(lambda: "ready" in process.log_text(), 60, "the stand-in says ready")
        with pytest.raises(WaitTimeout):  # no worker has said it yet
            process.wait_log("fired up and ready to roll", 2, 0.5, "warmups")
        go.write_text("go")
        process.wait_log("fired up and ready to roll", 2, 60, "warmups")
        assert process.log_text().count("fired up and ready to roll") == 2
    finally:
        process.stop()
    with pytest.raises(RuntimeError, match="exited"):
        process.wait_log("a third worker", 1, 60, "warmups")
