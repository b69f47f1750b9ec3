"""The spool model's real processes: writer agents (`r3_spool_agent.py`) and the sidecar (`r3-sidecar serve`).

Why they outlive one run of the state machine: starting a sidecar takes seconds and a writer process half of
one, while a run of the machine is a few hundred steps; `Procs` keeps them between runs, and each run uses its
own rid prefix and starts from an emptied spool (`reset`), so runs stay independent and shrinkable. A killed
process is replaced by the rule that killed it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from r3_harness import HERE, PYTHON, REPO, Sidecar
from spool_model_records import MAX_ROWS
from waiting import wait_until

STALE_S = 600.0
"""Longer than any run: a live record is never aborted as stale while the model expects it live (staleness is
wall-clock time, and hypothesis needs the model's state to follow from its steps alone). Crash leftovers are
made old by setting their mtime back instead."""
TTL_S = 4.0
RESCAN_S = 0.25
CAP_RECORDS = 24
"""The capped engine writer holds about this many burst records before it refuses (the spool fills up); the
other records in the spool (tens of KiB) count against its cap too."""
BURST_ROWS = 64
ROW_BYTES = 24  # 6 layers x top-4, uint8 (r3_harness's shape)
CAP = CAP_RECORDS * (BURST_ROWS * ROW_BYTES + 1024)
"""Bytes the engine writer may hold: the records' rows plus its 1 KiB estimate of each record's metadata."""
AGENTS = 2


class AgentDied(RuntimeError):
    pass


@dataclass
class Agent:
    """One writer process and its command pipe.

    Started in two halves: `spawn` starts the process, which imports and then waits, touching nothing;
    `begin` makes it open the spool and its engine writer. `Procs` keeps one spawned spare per writer, so a
    respawn after a SIGKILL costs a pipe round trip, not a Python start (0.6 s, most of a writer kill's time)."""

    spool: Path
    name: str
    proc: subprocess.Popen | None = None

    def spawn(self) -> Agent:
        cmd = [PYTHON, str(HERE / "r3_spool_agent.py"), "--spool", str(self.spool), "--cap", str(CAP)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [*cmd, "--name", self.name, "--warm"],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def begin(self) -> Agent:
        self.send("begin")
        self.read()  # {"ready": pid}
        return self

    def start(self) -> Agent:
        return self.spawn().begin()

    def read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AgentDied(f"writer {self.name} exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, op: str, **args) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **args) -> dict:
        self.send(op, **args)
        answer = self.read()
        if not answer.get("ok"):
            raise AssertionError(f"writer {self.name}: {op} {args} failed: {answer.get('error')}")
        return answer

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()


@dataclass
class WarmSidecar(Sidecar):
    """The sidecar, each start from a spare process that imported it ahead (`r3_warm_sidecar.py`): the model
    restarts it once a run, and a start was then mostly Python's imports (1.4 s); the spare for the next
    start is spawned as soon as one is ready, and imports while the machine steps."""

    spare: subprocess.Popen | None = None

    def command(self) -> list[str]:
        return [PYTHON, str(HERE / "r3_warm_sidecar.py"), "serve", "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self, ready_timeout: float = 30.0) -> WarmSidecar:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()  # the last one's, exited
        if self.spare is None or self.spare.poll() is not None:
            self.spare = self.launch(self.command(), stdin=subprocess.PIPE)
        self.proc, self.spare = self.spare, None
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        self.wait_ready(ready_timeout)
        self.spare = self.launch(self.command(), stdin=subprocess.PIPE)
        return self

    def close(self) -> None:
        self.stop()
        if self.spare is not None:
            self.spare.kill()
            self.spare.wait(timeout=30)
        for p in (self.proc, self.spare):
            if p is not None and p.stdin is not None:
                p.stdin.close()


@dataclass
class Procs:
    """The sidecar and the writer agents over one spool, kept across runs of the machine."""

    root: Path
    sidecar: WarmSidecar = field(init=False)
    agents: list[Agent] = field(default_factory=list)
    spares: dict[str, Agent] = field(default_factory=dict)  # by name: spawned, not begun (`Agent`)
    started: float = 0.0
    http: httpx.Client | None = None

    def __post_init__(self) -> None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.root  # tmpfs: the spool's real medium
        self.spool = Path(tempfile.mkdtemp(prefix="r3-model-", dir=base))
        self.tmpfs = base == shm  # inode numbers only grow: a file's identity is never another's (`check_disk`)
        env = {
            "R3_TTL_S": str(TTL_S),
            "R3_STALE_S": str(STALE_S),
            "R3_RESCAN_S": str(RESCAN_S),
            "R3_SPOOL_MAX_BYTES": str(CAP * 4),
        }
        self.sidecar = WarmSidecar(spool=self.spool, env=env, log_path=self.root / "sidecar.log")
        self.records = self.spool / "v1" / "records"
        assert MAX_ROWS >= BURST_ROWS

    def ensure(self) -> None:
        """Start whatever is not running (the writers import while the sidecar starts), and a spare per writer."""
        while len(self.agents) < AGENTS:
            self.agents.append(Agent(self.spool, f"a{len(self.agents)}"))
        down = [i for i, a in enumerate(self.agents) if a.proc is None or a.proc.poll() is not None]
        for i in down:
            name = self.agents[i].name
            self.agents[i].kill()
            self.agents[i] = self.spares.pop(name, None) or Agent(self.spool, name).spawn()
        if self.sidecar.proc is None or self.sidecar.proc.poll() is not None:
            self.sidecar.start()
        for i in down:
            self.agents[i].begin()
        for a in self.agents:
            if a.name not in self.spares:
                self.spares[a.name] = Agent(self.spool, a.name).spawn()

    def respawn(self, i: int) -> None:
        """SIGKILL writer `i` and put its spare in its place (then spawn the next spare: it imports meanwhile)."""
        name = self.agents[i].name
        self.agents[i].kill()
        spare = self.spares.pop(name, None) or Agent(self.spool, name).spawn()
        self.agents[i] = spare.begin()
        self.spares[name] = Agent(self.spool, name).spawn()

    def restart_sidecar(self, sig: int) -> None:
        self.sidecar.kill(sig) if sig == signal.SIGKILL else self.sidecar.stop()
        self.sidecar.start()

    def reset(self) -> None:
        """Empty the spool between runs: every record file goes, the sidecar's index follows, and each engine
        writer re-measures the spool (its probe), so a run starts from nothing the last one left."""
        for a in self.agents:
            a.call("forget")
        for entry in os.scandir(self.records):
            Path(entry.path).unlink(missing_ok=True)
        wait_until(lambda: not self.index_count(), 10, "the sidecar's index emptied with the spool", ignore=(OSError,))
        for a in self.agents:
            a.call("probe")

    def metrics(self) -> str:
        """The sidecar's `/metrics`, through one client kept for the whole test: a new `httpx.get` builds a TLS
        context each time (0.1 s of CPU, a third of a sweep)."""
        if self.http is None:
            self.http = httpx.Client(timeout=10)
        return self.http.get(self.sidecar.url + "/metrics").text

    def index_count(self) -> int:
        text = self.metrics()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("r3_records{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def close(self) -> None:
        for a in [*self.agents, *self.spares.values()]:
            a.kill()
        self.sidecar.close()
        if self.http is not None:
            self.http.close()
        shutil.rmtree(self.spool, ignore_errors=True)
