"""What the real-server benchmark (`benchmarks/real_server/runner.py`, which says why) asks of each server: its launch
(`Bench`: the tiny Qwen3-MoE and SGLang's flags, per mode) and the three workloads measured on it, (a)
throughput, (b) inter-token latency while long requests finish, (c) finish → final, with the CPU time of the
server's and the sidecar's processes read from `/proc`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "e2e"))

from sglang_server import Config, Stack

from benchmarks.stats import proc_stat

MODES = ("upstream", "sidecar", "live")
ROUTED_FLAG = "enable-return-routed-experts"  # the server flag; `False` in a Config's args leaves it off


@dataclass(frozen=True)
class Bench:
    """What one run measures. Defaults keep the whole run near 10 minutes at load ~5-10 on 2 cores."""

    reps: int = 3
    layers: int = 8
    experts: int = 64
    topk: int = 8
    streams: int = 8  # concurrent requests in (a) and streaming requests in (b)
    prompt: int = 64
    output: int = 128  # (a): tokens per request
    long_context: int = 4096  # (b): prompt tokens of each long request
    long_requests: int = 4
    long_first: int = 24  # (b): output tokens of the first long request; the others finish `long_stagger` later
    long_stagger: int = 16
    seed: int = 20261122

    def model(self) -> dict[str, Any]:
        """The tiny Qwen3-MoE, deeper and wider in experts than the suite's, one small attention head."""
        return {
            "num_hidden_layers": self.layers,
            "num_experts": self.experts,
            "num_experts_per_tok": self.topk,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "max_position_embeddings": self.long_context + 4096,
        }

    def server_config(self, mode: str) -> Config:
        context = self.long_context + 4096
        args = {
            "context-length": context,
            "max-total-tokens": 4 * context + 16 * 1024,
            "chunked-prefill-size": self.long_context + 256,  # one chunk per long prompt (attention is O(n²))
            "max-running-requests": 16,
            "sleep-on-idle": True,
            "load-format": "dummy",  # the published figures' weights (real ones route alike at this cost)
        }
        env = {"OMP_NUM_THREADS": "1"}
        plugin = mode not in ("upstream", "off")
        if plugin:
            env |= {"R3_MODE": "sidecar", "R3_LIVE_ROWS": "1" if mode == "live" else "0"}
            env |= {"R3_ROW_CHECK": "0" if mode == "nocheck" else "1"}
        if mode == "off":  # routed experts off: SGLang without its capture, the floor both paths are measured from
            args[ROUTED_FLAG] = False
        return Config(
            f"bench-{mode}",
            plugin=plugin,
            sidecar=plugin,
            args=args,
            env=env,
            model=self.model(),
        )


def returns_routes(stack: Stack) -> bool:
    """Whether the server was launched with SGLang's routed-experts capture (every mode but `off`)."""
    return stack.config.args.get(ROUTED_FLAG) is not False


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


# ---- CPU accounting ----------------------------------------------------------------------------------


def session_cpu_s(session: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of one session.

    The harness starts the server and the sidecar each in its own session, so the session id finds the
    server's children (scheduler, detokenizer) too. On a machine shared with other jobs, wall time measures
    the neighbours as much as the code; CPU time per token does not."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            owner, cpu = proc_stat(stat)
            if owner == session:
                total += cpu
    return total


def stack_cpu_s(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of the SGLang server's processes and of the sidecar's (0 when it runs none)."""
    sidecar = session_cpu_s(stack.sidecar.proc.pid) if stack.sidecar is not None else 0.0
    return {"server": session_cpu_s(stack.server.proc.pid), "sidecar": sidecar}


# ---- (a) throughput ----------------------------------------------------------------------------------


def throughput(stack: Stack, bench: Bench, tag: str) -> dict[str, Any]:
    """`streams` concurrent non-streaming requests of fixed length; output tokens over the batch's wall time."""
    params = {"max_new_tokens": bench.output, "temperature": 0.0, "ignore_eos": True}

    def one(i: int) -> dict[str, Any]:
        rid = f"{tag}-tp{i}"
        body = {
            "input_ids": prompt(bench.prompt, bench.seed + i),
            "sampling_params": params,
            "return_routed_experts": returns_routes(stack),
            "rid": rid,
        }
        response = httpx.post(f"{stack.url}/generate", json=body, timeout=600)
        response.raise_for_status()
        meta = response.json()["meta_info"]
        return {"rid": rid, "tokens": meta["completion_tokens"], "sent": meta.get("response_sent_to_client_ts")}

    c0, t0 = stack_cpu_s(stack), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(bench.streams) as pool:
        done = list(pool.map(one, range(bench.streams)))
    wall, c1 = time.perf_counter() - t0, stack_cpu_s(stack)
    tokens = sum(d["tokens"] for d in done)
    cpu = {k: c1[k] - c0[k] for k in c0}
    return {
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s": sum(cpu.values()),
        "sidecar_cpu_s": cpu["sidecar"],
        "finished": done,
    }


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one mode in one repetition: tokens over summed wall and CPU time."""
    tokens = sum(r["tokens"] for r in rounds)
    wall, cpu = sum(r["wall_s"] for r in rounds), sum(r["cpu_s"] for r in rounds)
    sidecar_cpu = sum(r["sidecar_cpu_s"] for r in rounds)
    finished = [f for r in rounds for f in r["finished"]]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu,
        "server_cpu_ms_per_token": (cpu - sidecar_cpu) / tokens * 1e3,
        "sidecar_cpu_ms_per_token": sidecar_cpu / tokens * 1e3,
        "finished": finished,
    }


# ---- (b) inter-token latency while long requests finish ----------------------------------------------


def _body(input_ids: list[int], params: dict[str, Any], rid: str) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": params, "return_routed_experts": True, "rid": rid}


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], stamps: list[float]) -> dict | None:
    """POST a streaming /generate; append the arrival time of every chunk; return the last chunk's JSON."""
    last = None
    async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            last = line
    return None if last is None else orjson.loads(last[5:])


async def _itl(stack: Stack, bench: Bench, tag: str) -> dict[str, Any]:
    long_params = [
        {"max_new_tokens": bench.long_first + i * bench.long_stagger, "temperature": 0.0, "ignore_eos": True}
        for i in range(bench.long_requests)
    ]
    short_params = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}  # cut when the window closes
    long_stamps: list[list[float]] = [[] for _ in range(bench.long_requests)]
    short_stamps: list[list[float]] = [[] for _ in range(bench.streams)]
    short_rids = [f"{tag}-s{i}" for i in range(bench.streams)]
    long_prompts = [
        prompt(bench.long_context, bench.seed + zlib.crc32(tag.encode()) + i) for i in range(len(long_params))
    ]
    short_prompts = [prompt(bench.prompt, bench.seed + 500 + i) for i in range(bench.streams)]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        longs = [
            asyncio.create_task(_stream(client, stack.url, _body(ids, p, f"{tag}-long{i}"), long_stamps[i]))
            for i, (ids, p) in enumerate(zip(long_prompts, long_params, strict=True))
        ]
        shorts = [
            asyncio.create_task(_stream(client, stack.url, _body(ids, short_params, rid), short_stamps[i]))
            for i, (ids, rid) in enumerate(zip(short_prompts, short_rids, strict=True))
        ]
        finals = await asyncio.gather(*longs)
        await asyncio.sleep(0.5)  # a few more decode steps after the last finish
        for task in shorts:
            task.cancel()
        await asyncio.gather(*shorts, return_exceptions=True)
        for rid in short_rids:
            with contextlib.suppress(httpx.HTTPError):
                await client.post(f"{stack.url}/abort_request", json={"rid": rid})
    finishes = [s[-1] for s in long_stamps]
    window = (max(s[0] for s in long_stamps + short_stamps), max(finishes) + 0.5)
    return {
        "window": window,
        "finishes": finishes,
        "gaps": itl_gaps(short_stamps, window, finishes),
        "long_finished": [
            {
                "rid": f"{tag}-long{i}",
                "sent": f["meta_info"].get("response_sent_to_client_ts"),
                "tokens": bench.long_context + f["meta_info"]["completion_tokens"],
                "inline_b64_bytes": len(f["meta_info"].get("routed_experts") or ""),
            }
            for i, f in enumerate(finals)
        ],
    }


def itl_gaps(streams: list[list[float]], window: tuple[float, float], finishes: list[float]) -> list[dict]:
    """Every gap between consecutive chunks of a stream inside `window`; `at_finish` when a long request's
    last chunk arrived within the gap or within one median gap around it (the finish step's own output)."""
    raw = [(a, b) for s in streams for a, b in itertools.pairwise(s) if a >= window[0] and b <= window[1]]
    if not raw:
        return []
    slack = float(np.median([b - a for a, b in raw]))
    return [{"s": b - a, "at_finish": any(a - slack <= f <= b + slack for f in finishes)} for a, b in raw]


def itl(stack: Stack, bench: Bench, tag: str) -> dict[str, Any]:
    return asyncio.run(_itl(stack, bench, tag))


# ---- (c) finish → final -------------------------------------------------------------------------------


def finish_lags(stack: Stack, finished: list[dict]) -> list[float]:
    """Seconds from SGLang sending a request's response to the spool record being final (negative: before)."""
    lags = []
    for f in finished:
        if f["sent"] is None:
            continue
        meta, _ = stack.final_record(f["rid"], timeout=30)
        lags.append(meta.updated - f["sent"])
    return lags
