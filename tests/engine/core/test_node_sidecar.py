"""`R3_SIDECAR=auto`: one detached sidecar per spool, found by every engine process, gone when nothing is left.

Real processes and sockets: engine processes are Python subprocesses calling the plugin's entry (`ensure`), in
their own process group (as a Ray worker's children are) that the test kills; the sidecar is `r3-sidecar
serve` on the socket the first caller bound.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from helpers import REPO, wait_sidecar_ready
from waiting import wait_until

from engine_ext.core.node_sidecar import INFO_NAME, routable_host
from service.spool import Spool

ENSURE = (
    "import os, sys, json; from pathlib import Path; from engine_ext.core.node_sidecar import ensure; "
    "s = ensure(Path(sys.argv[1]), idle_s=float(sys.argv[2])); "
    "os.write(1, (json.dumps([s.pid, s.url]) + '\\n').encode())  # one write: lines of concurrent engines never mix"
)


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "RAY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env | extra


WORKER = (
    "import subprocess, sys, time; n = int(sys.argv[1]); "
    "procs = [subprocess.Popen([sys.executable, '-c', sys.argv[2], *sys.argv[3:]]) for _ in range(n)]; "
    "[p.wait() for p in procs]; sys.stdout.flush(); time.sleep(600)"  # not a wait: the worker lives until killed
)


class Engines:
    """A worker process in its own session and group (as a Ray worker) whose `n` children call `ensure` at once."""

    def __init__(self, spool: Path, n: int, idle_s: float = 60, **env: str) -> None:
        self.n = n
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(n), ENSURE, str(spool), str(idle_s)],
            env=engine_env(**env),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def answers(self) -> list[tuple[int, str]]:
        return [tuple(json.loads(self.proc.stdout.readline())) for _ in range(self.n)]

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def engines() -> Iterator[list[Engines]]:
    started: list[Engines] = []
    yield started
    for e in started:
        e.kill_group()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_gone(pid: int, timeout: float) -> bool:
    return wait_until(lambda: not alive(pid), timeout, f"process {pid} exits", interval=0.1)


def ready(url: str, timeout: float = 30) -> None:
    wait_sidecar_ready(url, timeout)


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[int]]:
    """Pids of the sidecars a test started: killed at the end if they did not exit by themselves."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run(engines: list[Engines], spool: Path, n: int = 1, **kwargs) -> tuple[Engines, list[tuple[int, str]]]:
    e = Engines(spool, n, **kwargs)
    engines.append(e)
    return e, e.answers()


def test_one_detached_sidecar_for_all_engines_and_it_outlives_their_group(tmp_path: Path, sidecars, engines) -> None:
    spool = tmp_path / "spool"
    first, found = run(engines, spool, 3)
    pid, url = found[0]
    sidecars.append(pid)
    assert all(f == (pid, url) for f in found), found  # one sidecar, found by all
    host = urlsplit(url).hostname
    assert host == routable_host() and not ipaddress.ip_address(host).is_loopback
    assert json.loads((spool / INFO_NAME).read_text())["url"] == url
    assert os.getsid(pid) != os.getsid(first.proc.pid) and os.getpgid(pid) != first.proc.pid
    ppid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
    assert ppid != first.proc.pid and ppid != os.getpid()
    ready(url)
    rows = np.arange(24, dtype=np.uint8).reshape(3, 2, 4)
    writer = Spool(spool).writer("r", num_experts=32, topk=4, layers=[0, 1], prompt_len=1)
    writer.append(rows)
    writer.finalize()
    first.kill_group()  # the engines' worker and group die (Ray's kill): the sidecar does not
    time.sleep(0.5)  # not a wait: a window in which the sidecar must not die with the group
    assert alive(pid)
    _, again = run(engines, spool)  # an engine restart finds the same sidecar
    assert again == [(pid, url)]
    got = httpx.get(f"{url}/routed_experts/r", params={"format": "raw"}, timeout=10)
    assert got.status_code == 200 and got.content == rows.tobytes()


def test_killed_sidecar_is_restarted_by_the_next_engine_with_nothing_lost(tmp_path: Path, sidecars, engines) -> None:
    spool = tmp_path / "spool"
    _, ((pid, url),) = run(engines, spool)
    sidecars.append(pid)
    rows = np.arange(16, dtype=np.uint8).reshape(2, 2, 4)
    writer = Spool(spool).writer("kept", num_experts=32, topk=4, layers=[0, 1], prompt_len=1)
    writer.append(rows)
    writer.finalize()
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 10)
    _, ((pid2, url2),) = run(engines, spool)
    sidecars.append(pid2)
    assert pid2 != pid and url2 == url  # the same port again: pointers already handed out stay valid
    ready(url2)
    assert httpx.get(f"{url2}/routed_experts/kept", params={"format": "raw"}).content == rows.tobytes()


def test_exits_once_idle_and_every_record_is_acknowledged(tmp_path: Path, sidecars, engines) -> None:
    spool = tmp_path / "spool"
    # The record is there before the sidecar starts: written after, it raced the 1 s idle time on a loaded machine.
    writer = Spool(spool).writer("pending", num_experts=32, topk=4, layers=[0], prompt_len=1)
    writer.append(np.zeros((1, 1, 4), np.uint8))
    writer.finalize()
    _, ((pid, url),) = run(engines, spool, idle_s=1)
    sidecars.append(pid)
    ready(url)
    time.sleep(3)  # not a wait: idle_s elapses three times over, but a record waits for its trainer
    assert alive(pid)
    assert httpx.request("DELETE", f"{url}/routed_experts/pending").status_code == 204
    assert wait_gone(pid, 15)


def test_exits_with_the_raylet_it_was_started_under(tmp_path: Path, sidecars, engines) -> None:
    spool = tmp_path / "spool"
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # not a wait: a stand-in raylet
    try:
        _, ((pid, url),) = run(engines, spool, RAY_RAYLET_PID=str(raylet.pid))
        sidecars.append(pid)
        ready(url)
        time.sleep(1)  # not a wait: a window in which the sidecar stays up while its raylet lives
        assert alive(pid)
    finally:
        raylet.kill()
        raylet.wait()
    assert wait_gone(pid, 15)
