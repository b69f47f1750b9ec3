"""Shared test helpers: a real uvicorn sidecar on a free 127.0.0.1 port, and record writing shortcuts.

`live_server(settings)` runs the app in a thread of this process (fast to start, for API tests);
`live_server(settings, process=True)` runs it as a separate `uvicorn` process (its own GIL: for
benchmarks and restart tests). Both bind the socket here first, so there is no port race.
`FakeClock` is a deadline clock a test moves by hand (`live_server(settings, deadline_clock=clock)`), so a test
of a `wait` asserts that it ran out on the clock, never how many seconds it took.
Import as `from helpers import live_server` (pytest puts `tests/` on the path through `conftest.py`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import uvicorn
from waiting import wait_until

from service.server.api import create_app
from service.server.settings import Settings
from service.spool import Spool
from service.spool.record.meta import RecordMeta

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")
APPS: dict[str, Any] = {}  # base URL -> the app an in-process sidecar serves (`when_waited` looks at its store)


def bound_socket() -> socket.socket:
    """A listening-ready TCP socket on 127.0.0.1 with a free port.

    `IPPROTO_TCP` is named so asyncio sets TCP_NODELAY on accepted connections (it checks `proto`), and the
    listener carries TCP_NODELAY itself for `uvicorn --fd`, which wraps the fd as AF_UNIX and so never sets it.
    Without it, a small response (headers and body in two writes) waits ~40 ms on delayed ACKs.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_sidecar_ready(base_url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until `base_url`'s `/readyz` answers 200 (fails at once if `proc` exits)."""
    # One client for the whole wait: each `httpx.get` builds a client whose TLS context loads certifi's bundle
    # (about 40 ms of CPU), and this polls every 20 ms.
    with httpx.Client(timeout=1.0) as client:

        def ready() -> bool:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {proc.returncode}")
            return client.get(f"{base_url}/readyz").status_code == 200

        wait_until(ready, timeout, f"sidecar at {base_url} ready", interval=0.02, ignore=(httpx.HTTPError,))


class FakeClock:
    """A deadline clock that moves only when the test advances it: a wait ends because its deadline passed on
    this clock, whatever the machine's speed. Frozen, it never ends a wait: only a change of the record does.

    The server still sleeps for real between two looks at a record, for at most the wait's remaining seconds
    (read on this clock) or `rescan_s`; so a wait the test lets run out is short, and is seen to have run out
    at the waiter's next look. Reads are counted, so a test can tell that the server has set its deadline.
    """

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.reads = 0
        self.last_read: float | None = None
        self._read = threading.Condition()

    def __call__(self) -> float:
        with self._read:
            self.reads += 1
            self.last_read = self.now
            self._read.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._read:
            self.now += seconds

    def wait_reads(self, count: int, timeout: float = 30.0) -> None:
        """Block until the clock has been read `count` times in all (`timeout`: a hang guard)."""
        with self._read:
            if not self._read.wait_for(lambda: self.reads >= count, timeout):
                raise TimeoutError(f"the clock was read {self.reads} times, not {count}, in {timeout} s")

    def run_out(self, call: Callable[[], T], wait: float) -> T:
        """`call()`, a request that waits `wait` seconds on this clock, in a thread: once the server has read the
        clock (its deadline is set), the clock jumps past that deadline. Returns what `call` returned, after
        checking that the server's last look at the clock was past the deadline: the wait ran out, then it answered.
        """
        reads = self.reads
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call)
            self.wait_reads(reads + 1)
            deadline = self.now + wait
            assert not pending.done(), "answered before its deadline could pass"
            self.advance(wait + 1)
            result = pending.result()
        assert self.last_read is not None and self.last_read >= deadline, "answered before its deadline passed"
        return result


@contextlib.contextmanager
def live_server(
    settings: Settings,
    *,
    process: bool = False,
    timeout: float = 20.0,
    deadline_clock: Callable[[], float] | None = None,
) -> Iterator[str]:
    """Serve `create_app(settings)` on 127.0.0.1; yield its base URL; shut it down on exit.

    `deadline_clock` (e.g. a `FakeClock`) times the app's waits; threaded servers only."""
    if not process:
        clock = {} if deadline_clock is None else {"deadline_clock": deadline_clock}
        with live_app(create_app(settings, **clock), timeout=timeout) as base_url:
            yield base_url
        return
    if deadline_clock is not None:
        raise ValueError("a sidecar process reads its own clock")
    sock = bound_socket()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.listen(128)
    env = {**os.environ, **settings_env(settings)}
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "service.server.api:app_from_env",
        "--fd",
        str(sock.fileno()),
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, pass_fds=(sock.fileno(),))
    sock.close()
    try:
        wait_sidecar_ready(base_url, timeout, proc)
        yield base_url
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop one process a test started, by its pid: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def live_app(app: object, *, timeout: float = 20.0) -> Iterator[str]:
    """Serve an already built ASGI app (threaded uvicorn on a free 127.0.0.1 port); yield its base URL."""
    sock = bound_socket()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    APPS[base_url] = app
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="r3-test-uvicorn")
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start: its thread ended")
        return server.started

    try:
        wait_until(started, timeout, "uvicorn started", interval=0.01)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
        APPS.pop(base_url, None)


@contextlib.contextmanager
def when_waited(base_url: str, rid: str, action: Callable[[], object], timeout: float = 30.0) -> Iterator[None]:
    """Run `action` on a thread once a request to the in-process sidecar at `base_url` waits on `rid`: what a
    test writes "while the reader waits" then comes after the reader's first look, however loaded the machine
    (a `threading.Timer` guessed that moment). The thread's failure (no waiter by `timeout`) fails the block."""
    store = APPS[base_url].state.store
    failed: list[BaseException] = []

    def act() -> None:
        try:
            wait_until(lambda: store.is_waited(rid), timeout, f"a request waiting on {rid!r}", interval=0.005)
            action()
        except BaseException as exc:  # re-raised in the test's thread below
            failed.append(exc)

    thread = threading.Thread(target=act, daemon=True, name="r3-test-when-waited")
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout + 10)
    if failed:
        raise failed[0]


def settings_env(settings: Settings) -> dict[str, str]:
    """`R3_*` variables that reproduce `settings` in another process."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"R3_{name.upper()}"] = str(value)
    return env


def write_record(
    spool: Spool,
    rid: str,
    rows: np.ndarray,
    *,
    num_experts: int = 128,
    layers: list[int] | None = None,
    start: int = 0,
    prompt_len: int = 0,
    final: bool = True,
    status: str = "ok",
    dtype: str | None = None,
) -> RecordMeta:
    """Write a whole record through the spool writer; `rows` has shape `(n, layers, topk)`."""
    layers = list(range(rows.shape[1])) if layers is None else layers
    writer = spool.writer(
        rid,
        num_experts=num_experts,
        topk=rows.shape[2],
        layers=layers,
        start=start,
        prompt_len=prompt_len,
        dtype=dtype,
        engine="test/dp0",
    )
    if len(rows):
        writer.append(rows)
    return writer.finalize(status) if final else writer.meta


def random_rows(n: int, layers: int = 4, topk: int = 8, num_experts: int = 128, seed: int = 0) -> np.ndarray:
    """Rows a router could make (int64): per row and layer `topk` distinct ids below `num_experts`, so the row
    check (`service.spool.row_check`) passes them; a random first id, the rest spread from it."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, num_experts, size=(n, layers, 1))
    stride = max(num_experts // topk, 1)
    return ((first + np.arange(topk) * stride) % num_experts).astype(np.int64)


def engine_report(engine: str = "pod-a/dp0", *, updated: float | None = None) -> dict:
    """A complete engine file body (Contract 1) with one buffer in budget and occupancy."""
    return {
        "engine": engine,
        "dp_rank": 0,
        "pid": os.getpid(),
        "sglang": "0.5.23",
        "updated": time.time() if updated is None else updated,
        "budget": [
            {
                "buffer": "device_cache",
                "unit": "tokens",
                "capacity": 8192,
                "demand": 4096,
                "ok": True,
                "formula": "N*max(P, bs*w)",
            },
        ],
        "occupancy": [{"buffer": "device_cache", "capacity": 8192, "peak": 2048, "window_s": 60}],
        "host_cache": {"capacity_tokens": 100000, "used_tokens": 2500},
        "writer": {
            "queued_bytes": 1234,
            "records_written": 7,
            "fallback_inline": 2,
            "spool_full": 0,
            "suspect_records": 0,
            "undelivered": {"spool_full": 2, "queue_full": 0, "spool_not_writable": 1, "mirror_mismatch": 0},
        },
    }
