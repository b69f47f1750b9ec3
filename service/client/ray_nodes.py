"""The explicit way on Ray: one sidecar actor per node (node-affinity placement), returning the URLs.

For trainers that would rather own the sidecars than let engines start them (`R3_SIDECAR=auto`): call
`start_node_sidecars(...)` once after `ray.init`; each actor runs `r3-sidecar serve` as its child on its node,
so killing the actors (or the job's end) stops them, and the engines get `R3_SIDECAR_URL` of their node:

    urls = start_node_sidecars("/dev/shm/r3-spool")          # {node_id: "http://10.0.0.7:8000"}
    env = {"R3_SIDECAR_URL": urls[node_id_of_the_engine]}     # in the engine's runtime_env / launch env

Needs `ray` (the `ray` extra); imported only when called.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx


class NodeSidecarProcess:
    """An actor's body: `r3-sidecar serve` on this node, advertised at the node's address Ray reports."""

    def __init__(self, spool_dir: str, port: int, env: dict[str, str]) -> None:
        import ray

        self.host = ray.util.get_node_ip_address()
        listener = socket.create_server(("", port), backlog=1024)
        self.url = f"http://{self.host}:{listener.getsockname()[1]}"
        cmd = [sys.executable, "-m", "service.server.cli", "serve", "--fd", str(listener.fileno())]
        cmd += ["--spool-dir", spool_dir]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, pass_fds=(listener.fileno(),))
        listener.close()
        self._wait_ready(deadline=time.monotonic() + 60)

    def _wait_ready(self, deadline: float) -> None:
        """Poll /readyz with one client (a client per poll would rebuild its TLS context every 0.1 s)."""
        with httpx.Client(timeout=2) as client:
            while True:
                try:
                    if client.get(f"{self.url}/readyz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"r3-sidecar on {self.host} did not start (exit {self.proc.poll()})")
                time.sleep(0.1)

    def address(self) -> tuple[str, str, int]:
        """(node id, URL, sidecar pid)."""
        import ray

        return ray.get_runtime_context().get_node_id(), self.url, self.proc.pid

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()


def start_node_sidecars(
    spool_dir: str, *, port: int = 0, env: dict[str, str] | None = None
) -> tuple[dict[str, str], list[Any]]:
    """One sidecar actor on every alive node: ({node id: URL}, the actors; keep them alive while serving).

    `spool_dir` may contain `{node_id}` (nodes sharing one machine's /dev/shm in tests); `env` adds `R3_*`
    settings (`R3_AUTH_TOKEN`, `R3_TTL_S`, …) to the actors' environment.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(num_cpus=0)(NodeSidecarProcess)
    actors = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        actors.append(
            actor_cls.options(scheduling_strategy=strategy).remote(spool_dir.format(node_id=node_id), port, env or {})
        )
    urls = {node_id: url for node_id, url, _ in ray.get([a.address.remote() for a in actors])}
    return urls, actors
