"""Child processes of the real-engine harness (SGLang and vLLM servers, the sidecar): each in its own session
with its output in a log file, stopped as a whole process group (a server's tokenizer manager, scheduler and
detokenizer go with it), and the free loopback ports they are told to bind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # the shared waiting helper, also outside pytest
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from waiting import WaitTimeout, wait_until

_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port this process has not handed out before.

    The children bind their ports late: two plain bind-and-close picks in a row can return the same port
    before the first child has bound it (seen: SGLang's warmup then talked to the sidecar).
    """
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# What uvicorn logs when the port it was told to bind is taken (SGLang's and vLLM's HTTP servers): the server then
# waits for its shutdown and never answers, so a readiness wait that only polls would wait out its whole deadline.
BIND_FAILED = "error while attempting to bind on address"


class PortTaken(WaitTimeout):
    """The child logged that another process holds a port it was given: started again on new ports, it may bind.

    Why it happens: `free_port` picks by bind-and-close, and until the child binds, the kernel may give that port to
    any outgoing connection (the same ephemeral range). A CI-like run of 2026-11-30 lost 600 s so: 0.5.12's
    upstream server logged this 33 s after its start, and the harness polled `/health` until its deadline."""


# How long one readiness request may take. SGLang's `/health` runs a one-token generation and answers no sooner
# than 1 s after it starts, and up to its `HEALTH_CHECK_TIMEOUT` (20 s) on a busy machine: a client that gives up
# after 2 s there never sees it answer, however long it polls.
HEALTH_S = 30.0


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM the process group led by `proc` (its own session), then SIGKILL whatever of it is left.

    The leader gets `grace_s` to exit, but a leader that had workers is killed once it is all that is left of
    them (multiprocessing's resource tracker aside): SGLang's leader then only sleeps 5 s "before crash
    diagnostics" of children that SIGTERM ended, which summed to minutes of idle workers over a run. The tracker
    is spared until the leader is gone, so that it still unlinks the shared memory the server leaves."""
    had_workers = not _leader_alone(proc.pid)  # a process that never had any (a sidecar) gets its whole grace

    def ended() -> bool:
        return proc.poll() is not None or (had_workers and _leader_alone(proc.pid))

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(WaitTimeout):
        wait_until(ended, grace_s, "the leader exits or is left alone", interval=0.05)
    if proc.poll() is None and had_workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(WaitTimeout):  # the tracker unlinks what the server left once the leader is gone
        wait_until(lambda: proc.poll() is not None and not _group(proc.pid), 2.0, "the group ends", interval=0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _group(pgid: int) -> dict[int, str]:
    """The running processes of group `pgid` (a zombie, which no signal moves, does not count): pid → cmdline."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
    return found


def _leader_alone(pgid: int) -> bool:
    """Whether the leader is all that runs of its group, but for multiprocessing's resource tracker."""
    rest = {pid for pid, cmd in _group(pgid).items() if pid != pgid and "multiprocessing.resource_tracker" not in cmd}
    return not rest


def _log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Process:
    """A child process in its own session, with its output in a log file."""

    proc: subprocess.Popen[bytes]
    log: Path
    url: str

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        _stop_group(self.proc)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        """The log's last `lines` lines, for a failure message that says what the process was doing."""
        return _log_tail(self.log, lines)

    def wait_http(self, path: str, timeout: float, what: str) -> None:
        with httpx.Client(timeout=HEALTH_S) as client:  # one per wait: each client's TLS context is ~40 ms of CPU

            def answers() -> bool:
                if not self.alive():
                    raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{_log_tail(self.log)}")
                if BIND_FAILED in self.log_text():
                    raise PortTaken(f"{what} could not bind a port it was given:\n{_log_tail(self.log)}")
                return client.get(self.url + path).status_code == 200

            wait_until(
                answers,
                timeout,
                lambda: f"{what} ready:\n{_log_tail(self.log)}",
                interval=0.25,
                ignore=(httpx.HTTPError,),
            )

    def wait_log(self, text: str, count: int, timeout: float, what: str) -> None:
        """Until the log holds `text` `count` times (a line each of several worker processes)."""

        def said() -> bool:
            if not self.alive():
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{_log_tail(self.log)}")
            return self.log_text().count(text) >= count

        wait_until(said, timeout, lambda: f"{what}: {text!r} {count} times:\n{_log_tail(self.log)}", interval=0.25)


def spawn(cmd: list[str], env: dict[str, str], log: Path, url: str) -> Process:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    return Process(proc, log, url)
