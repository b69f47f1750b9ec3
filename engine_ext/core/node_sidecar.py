"""One sidecar per node and spool, started by the first engine process that needs it (`R3_SIDECAR=auto`).

Why: RL trainers (verl, slime, miles, AReaL) launch SGLang from Ray actors or their subprocesses, with no pod
around it and no place for a second container; the only thing they pass to engines is the environment. So
the plugin, in each SGLang process, makes sure the node's sidecar runs and learns its address:

- under an exclusive lock on `<spool>/sidecar.lock` (fcntl), `<spool>/sidecar.json` names the running
  sidecar (pid, url); a live one is reused, otherwise this process binds the listening socket (so the URL is
  known at once and connections queue until the server accepts) and starts `r3-sidecar serve --fd`;
- the sidecar leaves the engine's process tree and group (a new session, then a fork whose parent exits), so
  Ray's kill of the actor, its worker's children and its process group do not reach it: it outlives an engine
  restart and keeps serving records;
- it exits by itself (`service/server/lifetime.py`): when no engine has reported for `R3_SIDECAR_IDLE_S` and no
  record is left, or at once when Ray's raylet of this node (`RAY_RAYLET_PID`) is gone;
- pointers name an address other nodes can reach: `R3_ADVERTISE_HOST`, else the address of the interface of
  the default route (what Ray itself reports as the node IP), never a loopback address unless asked.

It inherits the engine's environment, so `R3_SPOOL_DIR`, `R3_AUTH_TOKEN`, `R3_TTL_S`, … travel as they do.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from engine_ext.core.settings import EngineSettings
from service.spool.files import atomic_write
from service.spool.sidecar_clients import register_client

log = logging.getLogger("r3_sidecar")

LOCK_NAME = "sidecar.lock"
INFO_NAME = "sidecar.json"
_PROBE_ADDRESS = ("192.0.2.1", 9)  # TEST-NET-1: a UDP connect picks the default route's source, sends nothing


@dataclass(frozen=True, slots=True)
class NodeSidecar:
    """The sidecar serving one spool: its pid and the URL trainers use."""

    pid: int
    url: str


def routable_host() -> str:
    """The address of the default route's interface, else the host name's address when not loopback."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(_PROBE_ADDRESS)
        address = probe.getsockname()[0]
        if not ipaddress.ip_address(address).is_loopback and address != "0.0.0.0":
            return address
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback:
            return address
    raise RuntimeError(
        "no routable address found for this node (no default route, and the host name resolves to loopback): "
        "set R3_ADVERTISE_HOST to the address trainer nodes reach this node at"
    )


def advertised_host(advertise: str | None) -> str:
    """`R3_ADVERTISE_HOST` as given (a loopback address only when asked), else the node's routable address."""
    return advertise if advertise else routable_host()


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None when gone or a
    zombie. With the pid it names one process for good: a reused pid starts at another time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _alive_sidecar(spool: Path) -> NodeSidecar | None:
    """The sidecar `sidecar.json` names, when that very process (pid and start time) still runs."""
    try:
        info = json.loads((spool / INFO_NAME).read_bytes())
        pid, url, started = int(info["pid"]), str(info["url"]), int(info["start_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return NodeSidecar(pid, url) if _start_time(pid) == started else None


def ensure(
    spool: Path,
    *,
    advertise: str | None = None,
    port: int = 0,
    idle_s: float = 60.0,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
) -> NodeSidecar:
    """The node's sidecar for `spool`: the running one, or one started now (detached). Safe to call from every
    process of every engine at once: the lock admits one starter, the others find what it started."""
    spool = Path(spool).resolve()
    spool.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    with open(spool / LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while starting: a few ms (the server starts after we return)
        register_client(spool, os.getpid())  # the sidecar stays while this process lives (service/server/lifetime.py)
        found = _alive_sidecar(spool)
        if found is not None:
            return found
        host = advertised_host(advertise)
        listener = _listen(port or _previous_port(spool))
        try:
            url = f"http://{_url_host(host)}:{listener.getsockname()[1]}"
            pid = _spawn_detached(listener.fileno(), spool, idle_s, env, log_path or spool / "sidecar.log")
        finally:
            listener.close()
        info = {"pid": pid, "url": url, "start_time": _start_time(pid), "started": time.time()}
        atomic_write(spool / INFO_NAME, json.dumps(info).encode())
        log.warning("r3-sidecar: started this node's sidecar (pid %d) at %s for spool %s", pid, url, spool)
        return NodeSidecar(pid, url)


def _previous_port(spool: Path) -> int:
    """The port of the sidecar this spool had: a restarted sidecar takes it again, so pointers already handed
    out (refs in flight through Ray's object store) stay valid."""
    try:
        return int(urlsplit(json.loads((spool / INFO_NAME).read_bytes())["url"]).port or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _listen(port: int) -> socket.socket:
    """A listening socket on every interface (the URL names the advertised host): `port`, else a free one."""
    try:
        return socket.create_server(("", port), backlog=1024)
    except OSError:
        if port == 0:
            raise
        log.warning("r3-sidecar: port %d is taken; the node's sidecar takes a free one", port)
        return socket.create_server(("", 0), backlog=1024)


def _url_host(host: str) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host


def _spawn_detached(fd: int, spool: Path, idle_s: float, env: dict[str, str], log_path: Path) -> int:
    """Start `r3-sidecar serve --fd` outside this process's tree, session and group; return its pid."""
    env = {k: v for k, v in env.items() if k not in ("R3_HOST", "R3_PORT")}
    env.update({"R3_SPOOL_DIR": str(spool), "R3_IDLE_EXIT_S": str(idle_s)})
    if raylet := env.get("RAY_RAYLET_PID"):  # under Ray: end with this node's raylet (the cluster went away)
        env.setdefault("R3_EXIT_WITH_PID", raylet)
    cmd = [sys.executable, "-m", "engine_ext.core.node_sidecar", str(fd), str(log_path), sys.executable]
    cmd += ["-m", "service.server.cli", "serve", "--fd", str(fd), "--spool-dir", str(spool)]
    out = subprocess.run(cmd, env=env, pass_fds=(fd,), capture_output=True, start_new_session=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"could not start the node sidecar: {out.stderr.decode(errors='replace')[-2000:]}")
    return int(out.stdout.split()[-1])


def _detach_main(argv: list[str]) -> None:
    """The intermediate process: fork the sidecar, print its pid, exit, so that it is nobody's child."""
    fd, log_path, command = int(argv[0]), argv[1], argv[2:]
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.setsid()  # its own session and group, apart from the intermediate's
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.set_inheritable(fd, True)
    os.execv(command[0], command)


if __name__ == "__main__":
    _detach_main(sys.argv[1:])


def with_node_sidecar(settings: EngineSettings) -> EngineSettings:
    """`R3_SIDECAR=auto`: the node's sidecar started or found, and its URL as `R3_SIDECAR_URL` (unless set)."""
    if settings.sidecar != "auto" or settings.sidecar_url:
        return settings
    try:
        found = ensure(
            settings.spool_dir,
            advertise=settings.advertise_host,
            port=settings.sidecar_port,
            idle_s=settings.sidecar_idle_s,
        )
    except (OSError, RuntimeError) as exc:  # delivery goes on: records reach the spool, responses keep rows inline
        log.error("r3-sidecar: R3_SIDECAR=auto could not start or find the node's sidecar: %s", exc)
        return settings
    return settings.model_copy(update={"sidecar_url": found.url})
