"""When the per-node sidecar exits by itself (`service.server.lifetime`): the decision, and the client pid files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from waiting import wait_until

from service.server.lifetime import exit_reason, live_clients, watch
from service.spool import Spool
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


def test_idle_time_counts_from_the_store_being_ready(tmp_path: Path) -> None:
    """A start slower than the idle time (the index not built yet: its records unknown) does not end the sidecar;
    once ready with nothing to serve, it ends after its idle time."""
    store = SimpleNamespace(ready=False, records=list, spool=Spool(tmp_path))
    stops: list[str] = []
    watch(store, 0.2, 0, stops.append)
    time.sleep(1.0)  # not a wait: five idle times pass before the store is ready, in which it must not stop
    assert stops == []
    store.ready = True
    wait_until(lambda: stops, 30, "the idle sidecar stopped once ready")
    assert "no engine reported" in stops[0]
