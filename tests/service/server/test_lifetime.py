"""When the per-node sidecar exits by itself (`service.server.lifetime`): the decision, and the client pid files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service.server.lifetime import exit_reason, live_clients
from service.spool.sidecar_clients import register_client


def test_exit_reasons() -> None:
    assert exit_reason(now=100, last_report=90, records=0, idle_exit_s=5, watched_alive=None)
    assert exit_reason(now=100, last_report=90, records=1, idle_exit_s=5, watched_alive=None) is None  # a record waits
    assert exit_reason(now=100, last_report=97, records=0, idle_exit_s=5, watched_alive=None) is None  # reported lately
    assert exit_reason(now=100, last_report=90, records=0, idle_exit_s=0, watched_alive=True) is None  # 0: never idle
    assert exit_reason(now=100, last_report=100, records=3, idle_exit_s=0, watched_alive=False)  # the raylet went


def test_clients_count_while_their_process_lives(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    register_client(tmp_path, proc.pid)
    assert live_clients(tmp_path) == 1
    proc.stdin.close()
    proc.wait()
    assert live_clients(tmp_path) == 0
    assert not list((tmp_path / "sidecar.d").iterdir())  # the dead one's file is gone
