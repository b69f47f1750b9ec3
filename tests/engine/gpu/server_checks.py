"""The tiny servers' comparison: the same requests on upstream, mirror and sidecar; each record vs SGLang's payload.

`Checks` keeps every outcome, and a failed or raising check does not stop the others: one device call should
say everything that is wrong. What is compared is what SGLang itself returns (`meta_info.routed_experts`, base64
of int32 rows) with what the plugin wrote to the spool and what the sidecar serves at the response's pointer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from sglang_abort import abort_mid_decode
from sglang_server import Stack, sglang_version_string
from version_servers import engine_report, expected_rows, prompt

# A plugin line that says it stepped aside or failed (its lines start `r3-sidecar: `; SGLang's log prints no level)
PLUGIN_TROUBLE = re.compile(
    r"r3-sidecar: .*(registering no hooks|degraded|failed|keep SGLang's inline|Traceback)", re.I
)


class Checks:
    """Named outcomes, in order: `{"check", "ok", "detail"}` rows."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def expect(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def attempt(self, name: str, check: Callable[[], tuple[bool, str]]) -> bool:
        """`check()` → (ok, detail); an exception is a failure that names it."""
        try:
            ok, detail = check()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:2000]
        return self.expect(name, ok, detail)

    def failed(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if not row["ok"]]


def requests(plan: Any) -> dict[str, dict[str, Any]]:
    """name → /generate body (no rid): the same on every server, sent one at a time in this order."""
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def body(ids: list, tokens: int, **extra: Any) -> dict[str, Any]:
        return {"input_ids": ids, "sampling_params": greedy | {"max_new_tokens": tokens}} | extra

    return {
        "short": body(prompt(6, 1), 8),
        "batch3": body([prompt(n, n) for n in (20, 33, 46)], plan.decode_tokens),  # decodes at bs 3
        "long": body(prompt(plan.long_prompt, 3), 8),
        "start_len": body(prompt(40, 4), 8, routed_experts_start_len=17),
    }


def cases(bodies: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Each answer `send` returns → (its prompt's length, its routed_experts_start_len)."""
    out = {}
    for name, body in bodies.items():
        start = body.get("routed_experts_start_len", 0)
        if isinstance(body["input_ids"][0], list):
            out |= {f"{name}-{i}": (len(ids), start) for i, ids in enumerate(body["input_ids"])}
        else:
            out[name] = (len(body["input_ids"]), start)
    return out


def send(stack: Stack, bodies: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every body on `stack`, one after the other; a batch's answers come back as `name-i`."""
    out: dict[str, dict[str, Any]] = {}
    for name, body in bodies.items():
        batch = isinstance(body["input_ids"][0], list)
        tag = f"{stack.config.name}-{name}"
        rid = [f"{tag}-{i}" for i in range(len(body["input_ids"]))] if batch else tag
        response = httpx.post(
            f"{stack.url}/generate", json=body | {"rid": rid, "return_routed_experts": True}, timeout=300
        )
        response.raise_for_status()
        answer = response.json()
        out |= {f"{name}-{i}": a for i, a in enumerate(answer)} if batch else {name: answer}
    return out


def served(url: str) -> tuple[int, str]:
    response = httpx.get(url, params={"format": "sglang_b64", "wait": 10}, timeout=30)
    return response.status_code, response.text


def check_upstream(checks: Checks, stack: Stack, answers: dict, shapes: dict[str, tuple[int, int]]) -> None:
    for key, (_, start) in shapes.items():
        rows = stack.inline_rows(answers[key])
        want = (expected_rows(answers[key], start), stack.num_hidden_layers, stack.topk)
        checks.expect(f"upstream {key}: inline rows", rows is not None and rows.shape == want, f"{want}")
    sets = np.sort(stack.inline_rows(answers["long"]), axis=2)
    alike = max(float(np.all(sets[:, 0] == sets[:, b], axis=1).mean()) for b in range(1, sets.shape[1]))
    checks.expect("upstream long: routing differs per layer (seeded weights)", alike < 0.5, f"{alike:.2f} alike")


def check_record(checks: Checks, name: str, stack: Stack, answer: dict, reference: dict, shape: tuple) -> None:
    """One answer of a plugin server: its pointer's bytes and its spool record against `reference`'s payload."""
    payload, meta_info = reference["meta_info"]["routed_experts"], answer["meta_info"]
    url = meta_info.get("routed_experts_url") or ""
    checks.expect(f"{name}: pointer names the sidecar", url.startswith(stack.sidecar_url), url)
    checks.attempt(f"{name}: pointer fetch is the payload byte for byte", lambda: _same(served(url), payload))

    def record() -> tuple[bool, str]:
        meta, stored = stack.final_record(meta_info["id"])
        facts = (meta.status, meta.prompt_len, meta.start)
        rows = stack.inline_rows(reference)
        return facts == ("ok", *shape) and np.array_equal(stored.astype(np.int32), rows), f"{facts}"

    checks.attempt(f"{name}: spool record is the payload's rows", record)


def _same(got: tuple[int, str], payload: str) -> tuple[bool, str]:
    status, text = got
    return status == 200 and text == payload, f"HTTP {status}, {len(text)} vs {len(payload)} chars"


def check_plugin(checks: Checks, mode: str, stack: Stack, answers: dict, upstream: dict, shapes: dict) -> None:
    """Mirror: its own inline payload, equal to upstream's; sidecar: no inline rows, its records upstream's."""
    for key, shape in shapes.items():
        got, ref = answers[key], upstream[key]
        checks.expect(f"{mode} {key}: the tokens upstream returns", got["output_ids"] == ref["output_ids"])
        inline = got["meta_info"].get("routed_experts")
        if mode == "mirror":
            checks.expect(
                f"mirror {key}: the inline payload upstream returns", inline == ref["meta_info"]["routed_experts"]
            )
            check_record(checks, f"mirror {key}", stack, got, got, shape)
        else:
            checks.expect(f"sidecar {key}: no inline rows (the spool took them)", inline is None)
            check_record(checks, f"sidecar {key}", stack, got, ref, shape)


def check_abort(checks: Checks, stack: Stack, tokens: int) -> dict[str, Any]:
    """A long greedy decode aborted once SGLang logged a decode step of it (`sglang_abort`, as the CPU suites do):
    the rows so far, recorded and served as SGLang's."""
    answer = abort_mid_decode(stack, f"{stack.config.name}-abort", prompt(30, 7), tokens)
    meta_info = answer["meta_info"]
    done = meta_info["completion_tokens"]
    checks.expect(
        "mirror abort: aborted mid-decode",
        meta_info["finish_reason"]["type"] == "abort" and 0 < done < tokens,
        f"{done} tokens",
    )
    rows = stack.inline_rows(answer)
    checks.expect("mirror abort: inline rows so far", rows is not None and rows.shape[0] == expected_rows(answer))

    def record() -> tuple[bool, str]:
        meta, stored = stack.final_record(meta_info["id"])
        return (meta.final, meta.status) == (True, "aborted") and np.array_equal(
            stored.astype(np.int32), rows
        ), meta.status

    checks.attempt("mirror abort: spool record is the payload's rows", record)
    url = meta_info.get("routed_experts_url") or ""
    checks.attempt(
        "mirror abort: pointer fetch is the payload", lambda: _same(served(url), meta_info["routed_experts"])
    )
    return {"completion_tokens": done}


def check_plugin_ran(checks: Checks, mode: str, stack: Stack, version: str) -> None:
    trouble = [line for line in stack.server.log_text().splitlines() if PLUGIN_TROUBLE.search(line)]
    checks.expect(f"{mode}: no plugin error or stand-down in the log", not trouble, "\n".join(trouble[:5]))
    checks.attempt(f"{mode}: the engine file names SGLang {version}", lambda: _names(engine_report(stack), version))


def _names(report: dict, version: str) -> tuple[bool, str]:
    return report.get("sglang") == version, f"{report.get('sglang')}"


def compare(checks: Checks, stacks: dict[str, Stack], plan: Any) -> dict[str, Any]:
    """Send the requests to each server, then check; returns what the results file keeps of the answers."""
    bodies = requests(plan)
    t0 = time.perf_counter()
    answers = {mode: send(stack, bodies) for mode, stack in stacks.items()}
    shapes = cases(bodies)
    check_upstream(checks, stacks["upstream"], answers["upstream"], shapes)
    for mode in ("mirror", "sidecar"):
        check_plugin(checks, mode, stacks[mode], answers[mode], answers["upstream"], shapes)
    aborted = check_abort(checks, stacks["mirror"], plan.abort_tokens)
    version = sglang_version_string(plan.python)  # `0.5.15.post1`, as the engine file names it
    for mode in ("mirror", "sidecar"):
        check_plugin_ran(checks, mode, stacks[mode], version)
    return {
        "requests_s": round(time.perf_counter() - t0, 1),
        "answers": {
            mode: {key: {"completion_tokens": a["meta_info"]["completion_tokens"]} for key, a in got.items()}
            for mode, got in answers.items()
        },
        "abort": aborted,
    }
