"""When a sidecar with no one to serve exits by itself: beside engines that nothing else will stop.

Why: on a Ray node the per-node sidecar has left the engine's process tree (`engine_ext/core/node_sidecar.py`), so
no kill of the job reaches it. It ends itself when (a) the process it was told to outlive no longer exists
(`R3_EXIT_WITH_PID`: Ray's raylet, `RAY_RAYLET_PID`: the node left the cluster), or (b) no engine has
reported for `R3_IDLE_EXIT_S` seconds and every record was acknowledged or expired (nothing is left to fetch).
An engine counts as reporting while its processes that asked for this sidecar are alive (`register_client`,
`service/spool/sidecar_clients.py`: a pid file each in `<spool>/sidecar.d/`), so a model that loads for minutes
before its first engine file does not lose its sidecar; an engine restart within the idle time keeps it; records
not fetched keep it until their TTL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service.server.store import Store
from service.spool.sidecar_clients import CLIENTS_DIR

log = logging.getLogger("r3.lifetime")


def exit_reason(
    *, now: float, last_report: float, records: int, idle_exit_s: float, watched_alive: bool | None
) -> str | None:
    """Why the sidecar should exit now, or None. `last_report`: the newest engine file's time (or the start)."""
    if watched_alive is False:
        return "the process it outlives (R3_EXIT_WITH_PID) is gone"
    if idle_exit_s > 0 and now - last_report >= idle_exit_s and records == 0:
        return f"no engine reported for {now - last_report:.0f} s and no record is left"
    return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def live_clients(spool_root: Path) -> int:
    """How many registered client processes still run; the files of those gone are removed."""
    alive = 0
    with contextlib.suppress(FileNotFoundError):
        for path in (spool_root / CLIENTS_DIR).iterdir():
            if path.name.isdigit() and pid_alive(int(path.name)):
                alive += 1
            else:
                path.unlink(missing_ok=True)
    return alive


def last_report(store: Store, since: float) -> float:
    """Now while a client process lives; else the newest engine file's modification time (engines replace
    theirs every second), or `since`."""
    if live_clients(store.spool.root):
        return time.time()
    newest = since
    for path in store.spool.engine_paths():
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:
            continue
    return newest


def watch(store: Store, idle_exit_s: float, exit_with_pid: int, stop: Callable[[str], None]) -> threading.Thread:
    """A daemon thread that calls `stop(reason)` once the sidecar has no one left to serve.

    Idle time counts from when the store first became ready (its index built), not from the process start: before
    that its records are unknown, and a start slower than `idle_exit_s` (a loaded node, a large spool) once ended
    a sidecar that held records (a 1 s idle sidecar racing its own start, seen in tests/engine/core)."""
    period = max(0.2, min(2.0, idle_exit_s / 4 if idle_exit_s > 0 else 2.0))

    def run() -> None:
        ready_since: float | None = None
        while True:
            time.sleep(period)
            if ready_since is None and store.ready:
                ready_since = time.time()
            try:
                records = len(store.records())
            except RuntimeError:  # the index changed under the iteration: ask again next period
                continue
            reason = exit_reason(
                now=time.time(),
                last_report=last_report(store, ready_since or time.time()),
                records=records,
                idle_exit_s=idle_exit_s if ready_since is not None else 0.0,
                watched_alive=pid_alive(exit_with_pid) if exit_with_pid > 0 else None,
            )
            if reason is not None:
                log.warning("r3-sidecar exits: %s", reason)
                stop(reason)
                return

    thread = threading.Thread(target=run, name="r3-lifetime", daemon=True)
    thread.start()
    return thread
