"""Aborting an SGLang request mid-decode: once SGLang has logged a decode step of it, not after a guessed time.

An abort sent 0.8-1.5 s after the request guessed how fast this machine decodes: on a loaded 2-core machine
the request may still be in its prefill (a plugin-off server then returns no rows), on a fast one finished.
SGLang's token counter (`sglang:generation_tokens_total`) only moves when a request finishes, so the condition
is its own log instead: `Decode batch, #running-req: …` lines, one every `--decode-log-interval` decode steps
(40 by default), in every supported version. The abort tests send their request alone, so a decode line that
appears after it was sent is a decode step of it: it has tokens, and at most one line's interval more.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
from sglang_server import Stack
from waiting import await_until, wait_until

DECODE_STEP = b"Decode batch"
TIMEOUT_S = 300.0  # a hang guard: a first decode step on a loaded machine takes seconds, not minutes


class DecodeSteps:
    """The decode-step lines SGLang has logged since this object was made (read from where the log then ended)."""

    def __init__(self, stack: Stack) -> None:
        self.log: Path = stack.server.log
        self.offset = self.log.stat().st_size
        self.stack = stack

    def __call__(self) -> int:
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return f.read().count(DECODE_STEP)

    def describe(self, rid: str) -> Callable[[], str]:
        return lambda: f"a decode step of {rid} in {self.stack.config.name}'s log:\n{self.stack.server.log_tail(20)}"


def abort_mid_decode(stack: Stack, rid: str, ids: list[int], max_new_tokens: int) -> dict:
    """A long greedy decode, aborted once SGLang logged a decode step of it: SGLang's response."""
    result: dict = {}
    steps = DecodeSteps(stack)

    def send() -> None:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        result["response"] = httpx.post(
            f"{stack.url}/generate",
            json={"input_ids": ids, "sampling_params": params, "return_routed_experts": True, "rid": rid},
            timeout=TIMEOUT_S,
        )

    thread = threading.Thread(target=send, daemon=True, name=f"r3-test-{rid}")
    thread.start()
    wait_until(lambda: steps() > 0 or not thread.is_alive(), TIMEOUT_S, steps.describe(rid), interval=0.05)
    httpx.post(f"{stack.url}/abort_request", json={"rid": rid}, timeout=30).raise_for_status()
    thread.join(TIMEOUT_S)
    assert "response" in result, f"no answer to {rid} within {TIMEOUT_S:g} s of its abort"
    return result["response"].json()


async def post_and_abort(http: httpx.AsyncClient, stack: Stack, body: dict) -> httpx.Response:
    """POST `/generate` with `body` on `http` and abort it (its `rid`) once SGLang logged a decode step of it."""
    steps = DecodeSteps(stack)
    request = asyncio.ensure_future(http.post("/generate", json=body))
    await await_until(lambda: steps() > 0 or request.done(), TIMEOUT_S, steps.describe(body["rid"]), interval=0.05)
    (await http.post("/abort_request", json={"rid": body["rid"]})).raise_for_status()
    return await request
