"""The processes that keep a spool's sidecar: a pid file each in `<spool>/sidecar.d/`.

An engine process that starts or finds the node's sidecar (`engine_ext/core/node_sidecar.py`) registers here;
the sidecar counts the ones still alive before it exits for want of engines (`service/server/lifetime.py`).
"""

from __future__ import annotations

from pathlib import Path

CLIENTS_DIR = "sidecar.d"


def register_client(spool_root: Path, pid: int) -> None:
    """Keep the spool's sidecar while process `pid` lives (an engine process that starts or finds it)."""
    directory = spool_root / CLIENTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(pid)).touch()
