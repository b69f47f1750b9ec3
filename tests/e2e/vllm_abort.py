"""Aborting a vLLM request mid-decode through vLLM's own abort endpoint, and a timeline that explains a failure.

The abort waits on vLLM's own gauges, not on a clock: `vllm:num_requests_running` says the request is in the
engine (so vLLM's output processor holds its id: `OutputProcessor.abort_requests` silently drops an id it does
not hold yet), and `vllm:generation_tokens_total` says it has decoded a few tokens. The token counter alone was
not enough: it is global, and a streamed request's last counts can land after the abort's request was sent (in
CI an abort went at "14 tokens" and was dropped, 2026-11-28).

Aborts then go every 0.2 s from a pool of threads until the request ends: in CI one abort's POST came back
after 107 s, past its own 10 s timeout, while the request decoded to its length (2026-11-29, vLLM 0.27.1), and a
serial sender waited on it. What held that POST is not known (not reproduced here); the timeline therefore also
records the machine's load and pressure. A request that still ran to its length is tried once more under a new
id (so a late abort of the first cannot reach the second): what this module proves is what vLLM and the plugin
do with an abort, and an abort that arrived after the last token proves nothing either way. Both attempts
failing fails the test with both timelines.

Every wait is bounded well under the request's own client timeout, so a request that does not end fails with
this module's timeline, not with the client's bare `ReadTimeout` (CI, 2026-11-29).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_server import VllmServer
from waiting import WaitTimeout, wait_until

ABORT_AFTER = 8  # tokens vLLM reports decoded before the abort is sent
LONG_DECODE = 16000  # tokens: the abort lands mid-decode even where vLLM decodes this model 100x faster than here
CLIENT_TIMEOUT_S = 300.0  # the long request's own timeout: longer than every wait below together
WAIT_S = 90.0  # for the request to run and decode ABORT_AFTER tokens
ABORTING_S = 60.0  # sending aborts until the request ends
ENDING_S = 60.0  # for the response once the aborts stopped
ATTEMPTS = 2  # a request that ran to its length before any abort landed is tried once more
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", re.M)


def machine_state() -> str:
    """Load average and CPU/memory pressure (the kernel's PSI, where it has them): what else held the machine."""
    parts = []
    for name, path in (("load", "/proc/loadavg"), ("cpu", "/proc/pressure/cpu"), ("mem", "/proc/pressure/memory")):
        with contextlib.suppress(OSError):
            parts.append(f"{name} {Path(path).read_text().split(chr(10))[0]}")
    return "; ".join(parts) or "no /proc"


@dataclass
class Timeline:
    """What the test saw, with seconds since the request was sent: the failure message of a stuck abort."""

    started: float = field(default_factory=time.monotonic)
    looks: list[str] = field(default_factory=list)  # "t: tokens/running" or "t: the error"
    aborts: list[str] = field(default_factory=list)  # "t (+answer time): status", in the order answered
    seen: float = 0.0
    running: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def at(self) -> str:
        return f"{time.monotonic() - self.started:.1f} s"

    def describe(self, name: str) -> str:
        looks = self.looks if len(self.looks) <= 8 else [*self.looks[:4], "…", *self.looks[-4:]]
        with self.lock:
            answered = list(self.aborts)
        aborts = answered if len(answered) <= 6 else [*answered[:3], "…", *answered[-3:]]
        return (
            f"{name}: {len(self.looks)} looks at the gauges (tokens/running) {looks}; "
            f"{len(answered)} aborts answered {aborts}; now {self.at()}; {machine_state()}"
        )


def _gauges(client: httpx.Client, server: VllmServer) -> tuple[float, float]:
    text = client.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in GENERATED.findall(text)), sum(float(v) for v in RUNNING.findall(text))


def abort_mid_decode(server: VllmServer, route: str, prompt: str, rid: str) -> dict[str, Any]:
    """The response of a long request aborted mid-decode through `route`, with `seen_before_abort` (the tokens
    vLLM reported when the first abort went), `aborts_sent`, `abort_state` (the timelines) and `rids` (one per
    attempt: `rid`, then `rid-again`; the last is the response's) added."""
    states: list[str] = []
    rids: list[str] = []
    for attempt in range(1, ATTEMPTS + 1):
        rids.append(rid if attempt == 1 else f"{rid}-again")
        done = _attempt(server, route, prompt, rids[-1])
        states.append(f"attempt {attempt}: {done['abort_state']}")
        if done["choices"][0]["finish_reason"] != "length":
            break
    return done | {"rids": rids, "abort_state": " | ".join(states)}


def _attempt(server: VllmServer, route: str, prompt: str, rid: str) -> dict[str, Any]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    with httpx.Client() as client:
        before, _ = _gauges(client, server)
        line = Timeline()
        pending = pool.submit(server.completion, prompt, rid=rid, max_tokens=LONG_DECODE, timeout=CLIENT_TIMEOUT_S)

        def decoding() -> bool:
            try:
                generated, line.running = _gauges(client, server)
                line.seen = generated - before
                line.looks.append(f"{line.at()}: {line.seen:g}/{line.running:g}")
            except httpx.HTTPError as exc:  # "not yet": a kept-alive connection the server had just closed
                line.looks.append(f"{line.at()}: {exc!r}")
            return (line.running >= 1 and line.seen >= ABORT_AFTER) or pending.done()

        try:
            with contextlib.suppress(WaitTimeout):  # the abort goes at the deadline too; the caller judges it
                wait_until(decoding, WAIT_S, f"{ABORT_AFTER} tokens decoded", interval=0.05)
            seen = line.seen
        finally:
            sent = _abort_until_done(server, route, f"cmpl-{rid}-0", pending, line)
            pool.shutdown(wait=False)
        state = line.describe(server.name)
        try:
            done = pending.result(timeout=ENDING_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"the aborted request still runs {ENDING_S:g} s after the last abort ({state})")
        except httpx.HTTPError as exc:
            pytest.fail(f"the aborted request failed: {exc!r} ({state})")
    return done | {"seen_before_abort": seen, "aborts_sent": sent, "abort_state": line.describe(server.name)}


def _abort_until_done(
    server: VllmServer, route: str, request_id: str, pending: concurrent.futures.Future, line: Timeline
) -> int:
    """Send the abort every 0.2 s from a pool of 8 threads until the request ends (vLLM drops an abort naming
    an id it does not hold yet; a later one finds it; up to 8 slow answers hold no later abort back). Each answer
    goes on the timeline with its send time and how long it took; returns how many were handed to the pool."""

    def abort(at: str) -> None:
        sent = time.monotonic()
        try:
            status: Any = httpx.post(f"{server.url}{route}", json={"request_ids": [request_id]}, timeout=10).status_code
        except httpx.HTTPError as exc:
            status = repr(exc)
        with line.lock:
            line.aborts.append(f"{at} (+{time.monotonic() - sent:.2f} s): {status}")

    senders = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="abort")
    deadline, count = time.monotonic() + ABORTING_S, 0
    while not pending.done() and time.monotonic() < deadline:
        senders.submit(abort, line.at())
        count += 1
        with contextlib.suppress(concurrent.futures.TimeoutError):
            pending.exception(timeout=0.2)
    senders.shutdown(wait=False, cancel_futures=True)
    return count
