"""Process-level harness for the reliability suite: a real sidecar and real writer processes on a temp spool.

Everything here runs the code as deployed (a separate sidecar process on loopback, writers in their own
processes writing through `service.spool`), so a SIGKILL is a real SIGKILL and RSS/fds are the server's own.
Record contents are a pure function of the rid (`expected_rows`), so any process can check any record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
if str(REPO / "tests") not in sys.path:  # the shared waiting helper, also in the writer and trainer processes
    sys.path.append(str(REPO / "tests"))
from r3_shape import LAYERS, NUM_EXPERTS, NUM_HIDDEN_LAYERS, TOPK  # noqa: E402, F401  # the records' shape
from waiting import wait_until  # noqa: E402

PYTHON = sys.executable
CLI = Path(PYTHON).with_name("r3-sidecar")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_rows(
    rid: str,
    rows: int,
    layers: tuple[int, ...] = LAYERS,
    topk: int = TOPK,
    num_experts: int = NUM_EXPERTS,
    dtype: str = "uint8",
) -> np.ndarray:
    """The rows a harness writer writes for `rid`: seeded by the rid, so any reader can recompute them; true
    routes (distinct ids per token and layer), which the engine writer's row check passes."""
    seed = int.from_bytes(hashlib.sha256(rid.encode("utf-8", "surrogatepass")).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    first = rng.integers(0, num_experts, size=(rows, len(layers), 1), dtype=np.int64)
    return ((first + np.arange(topk) * max(num_experts // topk, 1)) % num_experts).astype(dtype)


def checksum(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective uid
    raise RuntimeError(f"no Uid for pid {pid}")


def proc_cap_eff(pid: int) -> int:
    """The process's effective capability mask (0: no privilege beyond its uid's file permissions)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    raise RuntimeError(f"no CapEff for pid {pid}")


def accepted_connections(port: int) -> list[tuple[str, int]]:
    """(TCP state, bytes in its send queue) of each connection a server on 127.0.0.1:`port` has accepted and not
    yet closed (`/proc/net/tcp`: state 01 established, 08 the peer closed, we have not)."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):
            out.append((fields[3], int(fields[4].split(":")[0], 16)))
    return out


def loadavg() -> str:
    """The 1/5/15-minute load averages, for reports: the machine is shared."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@dataclass
class Sidecar:
    """One sidecar process (`r3-sidecar serve`) on a free loopback port; restartable on the same port and spool."""

    spool: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    cwd: Path | None = None
    user: int | None = None
    group: int | None = None
    wrap: list[str] = field(default_factory=list)  # e.g. setpriv, to drop capabilities
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The deployed entry point; `python -m service.server.cli` when the console script is not installed."""
        entry = [str(CLI)] if CLI.exists() else [PYTHON, "-m", "service.server.cli"]
        return [*entry, "serve", "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, ready_timeout: float = 30.0) -> Sidecar:
        self.proc = self.launch([*self.wrap, *self.command()])
        self.wait_ready(ready_timeout)
        return self

    def launch(self, cmd: list[str], stdin: int | None = None) -> subprocess.Popen:
        """`cmd` in the sidecar's environment (its spool, `env`), logging to `log_path`, in its own session."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("R3_")}
        env.update({"PYTHONPATH": str(REPO), "R3_SPOOL_DIR": str(self.spool), **self.env})
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            return subprocess.Popen(
                cmd,
                env=env,
                cwd=self.cwd or REPO,
                stdin=stdin,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.group,
                extra_groups=[] if self.user is not None else None,
                start_new_session=True,
            )
        finally:
            if self.log_path:
                log.close()

    def wait_ready(self, timeout: float) -> None:
        # One client for the whole wait: each `httpx.get` builds a TLS context (0.1 s of CPU) even for http.
        with httpx.Client(timeout=1.0) as http:

            def ready() -> bool:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"sidecar exited with {self.proc.returncode}; log: {self.log_tail()}")
                return http.get(self.url + "/readyz").status_code == 200

            wait_until(ready, timeout, lambda: f"sidecar ready; log: {self.log_tail()}", ignore=(httpx.HTTPError,))

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        return "(no log)"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@dataclass
class Writer:
    """A writer process (like one DP rank's writer thread) running `r3_writer.py`; see that file for arguments."""

    spool: Path
    ledger: Path
    args: list[str]
    proc: subprocess.Popen | None = None

    def start(self) -> Writer:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [PYTHON, str(HERE / "r3_writer.py"), "--spool", str(self.spool), "--ledger", str(self.ledger), *self.args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        _, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode:
            raise RuntimeError(f"writer exited {self.proc.returncode}: {err.decode(errors='replace')[-2000:]}")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def read_ledger(path: Path) -> list[dict]:
    """Entries a writer appended, one JSON line each (`{"rid", "rows", "final"}`); a torn last line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def fetch_raw(client: httpx.Client, rid: str, **params) -> tuple[int, bytes, httpx.Headers]:
    r = client.get(f"/routed_experts/{quote_rid(rid)}", params={"format": "raw", **params})
    return r.status_code, r.content, r.headers


def quote_rid(rid: str) -> str:
    from urllib.parse import quote

    return quote(rid, safe="")


def check_record(client: httpx.Client, rid: str, rows: int, **params) -> tuple[bool, str]:
    """Fetch `rid` as raw bytes and compare with `expected_rows`; returns (ok, reason)."""
    code, body, _ = fetch_raw(client, rid, **params)
    if code != 200:
        return False, f"{rid}: HTTP {code} {body[:200]!r}"
    want = expected_rows(rid, rows)
    lo = int(params.get("start", 0))
    hi = int(params.get("end", rows))
    want = want[lo:hi]
    if "layers" in params:
        idx = [LAYERS.index(int(x)) for x in str(params["layers"]).split(",")]
        want = want[:, idx, :]
    if body != np.ascontiguousarray(want).tobytes():
        return False, f"{rid}: {len(body)} bytes, checksum {hashlib.sha256(body).hexdigest()[:16]} != {checksum(want)}"
    return True, ""
