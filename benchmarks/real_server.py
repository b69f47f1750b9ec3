"""`make bench-sglang`: the plugin inside a real SGLang 0.5.23 server, against upstream, on this CPU machine.

    .venv/bin/python -m benchmarks.real_server              # about 8-10 minutes on 2 shared cores
    .venv/bin/python -m benchmarks.real_server --reps 1 --no-write   # a harness check

Three servers of the real-engine suite's harness (`tests/e2e/sglang_server.py`) run side by side: `upstream`
(plugin not loaded, SGLang's inline payload), `sidecar` (plugin, `R3_MODE=sidecar`) and `live` (the same with
`R3_LIVE_ROWS=1`). Every repetition runs each workload on each server, one server at a time, in a rotated
order (ABC, BCA, CAB, …), so drifts in the machine's load hit every mode alike; ratios are taken within a
repetition and summarised by their median and range.

- (a) throughput: 8 concurrent non-streaming requests, greedy, `ignore_eos`, fixed lengths; output tokens/s.
- (b) inter-token latency: 8 streaming requests decode while long requests (thousands of tokens of context)
  finish one after another; the gaps between the streams' chunks are the ITL. Upstream's O(sequence) work at
  finish (host gather, ZMQ payload, base64; SGLang #24851) should show as a tail there, the plugin's not.
- (c) finish → final: the spool record's `updated` (written when the writer finalises it) minus SGLang's
  `response_sent_to_client_ts` of the same request: both server-side wall clocks on the same host.

Why the servers are set up as they are (the same for all three modes):
- `OMP_NUM_THREADS=1`: torch's two-thread OpenMP pool on 2 cores shared with other jobs turned decode steps
  into scheduling waits (a probe at load ~10 decoded 8 streams at ~2 tok/s with it, ~60 tok/s without).
- `--sleep-on-idle`: the two idle servers must not spin while the third is measured.
- torch_native attention (SGLang's CPU fallback) prefills in O(context²), so long contexts are prefilled
  before the ITL window opens, in one chunk each, and the window only holds decode steps and finishes.

Results: `benchmarks/out/real_server.json` (raw), `benchmarks/real_server.md` (the section), spliced into
BENCHMARKS.md between markers that `benchmarks/report.py` keeps when it regenerates the file.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from sglang_server import Config, Stack, start  # noqa: E402

from benchmarks.report import REAL_SERVER_BEGIN as BEGIN  # noqa: E402
from benchmarks.report import REAL_SERVER_END as END  # noqa: E402
from benchmarks.stats import proc_stat  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "real_server.json"
FRAGMENT = ROOT / "benchmarks" / "real_server.md"
COMMAND = ".venv/bin/python -m benchmarks.real_server"
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


def _log(msg: str) -> None:
    print(f"[bench-sglang {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


# ---- one run -----------------------------------------------------------------------------------------


def _start_all(bench: Bench, workdir: Path) -> dict[str, Stack]:
    """Start the three servers in parallel (a start is mostly imports and waiting); stop all on failure."""
    with concurrent.futures.ThreadPoolExecutor(len(MODES)) as pool:
        futures = {m: pool.submit(start, bench.server_config(m), workdir / m) for m in MODES}
        stacks, errors = {}, []
        for mode, fut in futures.items():
            try:
                stacks[mode] = fut.result()
            except Exception as exc:  # reported once the others are stopped
                errors.append(f"{mode}: {exc}")
    if errors:
        for stack in stacks.values():
            stack.stop()
        raise RuntimeError("\n".join(errors))
    return stacks


def _warm(stack: Stack, bench: Bench) -> None:
    """First requests pay one-off costs (allocations, first shapes): run a small batch before measuring."""
    throughput(stack, Bench(streams=bench.streams, output=16, prompt=bench.prompt), f"warm-{stack.config.name}")


def run(bench: Bench, workdir: Path) -> dict[str, Any]:
    from benchmarks.run import environment

    results: dict[str, Any] = {"bench": asdict(bench), "environment": environment(), "reps": []}
    t0 = time.perf_counter()
    stacks = _start_all(bench, workdir)
    results["start_s"] = time.perf_counter() - t0
    _log(f"three servers up after {results['start_s']:.0f} s")
    try:
        for stack in stacks.values():
            _warm(stack, bench)
        for rep in range(bench.reps):
            order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            row: dict[str, Any] = {"order": order, "throughput": {}, "itl": {}, "lags": {}}
            rounds: dict[str, list] = {m: [] for m in MODES}
            for k, mode in enumerate(order + order[::-1]):  # ABC CBA: a linear drift cancels within the rep
                rounds[mode].append(throughput(stacks[mode], bench, f"r{rep}-{mode}-{k}"))
            for mode in order:
                row["throughput"][mode] = combine(rounds[mode])
                t = row["throughput"][mode]
                _log(
                    f"rep {rep} {mode}: {t['tok_s']:.1f} tok/s, {t['tok_per_cpu_s']:.1f} tok per CPU s "
                    f"(sidecar process {t['sidecar_cpu_ms_per_token']:.2f} ms per token)"
                )
            for mode in order:
                row["itl"][mode] = itl(stacks[mode], bench, f"r{rep}-{mode}")
                gaps = [g["s"] for g in row["itl"][mode]["gaps"]]
                _log(
                    f"rep {rep} {mode}: ITL p50 {np.median(gaps) * 1e3:.0f} ms, p99 "
                    f"{np.percentile(gaps, 99) * 1e3:.0f} ms over {len(gaps)} gaps"
                )
            for mode in ("sidecar", "live"):
                row["lags"][mode] = finish_lags(stacks[mode], row["throughput"][mode]["finished"])
            results["reps"].append(row)
    finally:
        for stack in stacks.values():
            stack.stop()
    results["environment_after"] = {
        "loadavg": list(os.getloadavg()),
        "date_utc": time.strftime("%H:%M:%S", time.gmtime()),
    }
    results["wall_s"] = time.perf_counter() - t0
    return results


# ---- summary -----------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of per-repetition figures (or percentiles of pooled samples when asked for)."""
    arr = np.asarray(values, dtype=float)
    return {"median": float(np.median(arr)), "min": float(arr.min()), "max": float(arr.max()), "n": len(arr)}


def percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}
    return out | {"min": float(arr.min()), "max": float(arr.max()), "n": len(arr)}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per-mode figures: throughput ratios within each repetition; ITL and lags pooled over repetitions."""
    reps = results["reps"]
    summary: dict[str, Any] = {
        "tok_s": {},
        "tok_per_cpu_s": {},
        "throughput_ratio": {},
        "cpu_ratio": {},
        "itl": {},
        "lag_s": {},
    }
    for mode in MODES:
        summary["tok_s"][mode] = spread([r["throughput"][mode]["tok_s"] for r in reps])
        summary["tok_per_cpu_s"][mode] = spread([r["throughput"][mode]["tok_per_cpu_s"] for r in reps])
        for key in ("server_cpu_ms_per_token", "sidecar_cpu_ms_per_token"):
            summary.setdefault(key, {})[mode] = spread([r["throughput"][mode][key] for r in reps])
        gaps = [g for r in reps for g in r["itl"][mode]["gaps"]]
        pooled = percentiles([g["s"] for g in gaps])
        per_rep = []
        for r in reps:
            s = [g["s"] for g in r["itl"][mode]["gaps"]]
            per_rep.append(float(np.percentile(s, 99) / np.median(s)))
        at = [g["s"] for g in gaps if g["at_finish"]]
        other = [g["s"] for g in gaps if not g["at_finish"]]
        summary["itl"][mode] = {
            "pooled": pooled,
            "p99_over_p50": pooled["p99"] / pooled["p50"],
            "p99_over_p50_per_rep": spread(per_rep),
            "at_finish": percentiles(at) if at else None,
            "elsewhere": percentiles(other) if other else None,
            "finishes": sum(len(r["itl"][mode]["finishes"]) for r in reps),
        }
    for mode in ("sidecar", "live"):
        summary["throughput_ratio"][mode] = spread(
            [r["throughput"][mode]["tok_s"] / r["throughput"]["upstream"]["tok_s"] for r in reps]
        )
        summary["cpu_ratio"][mode] = spread(
            [r["throughput"][mode]["tok_per_cpu_s"] / r["throughput"]["upstream"]["tok_per_cpu_s"] for r in reps]
        )
        summary["lag_s"][mode] = percentiles([lag for r in reps for lag in r["lags"][mode]])
    longs = [f for r in reps for f in r["itl"]["upstream"]["long_finished"]]
    summary["long_tokens"] = spread([f["tokens"] for f in longs])
    summary["long_inline_b64_bytes"] = spread([f["inline_b64_bytes"] for f in longs])
    return summary


# ---- the BENCHMARKS.md section -----------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _range(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _status(ok: bool) -> str:
    return "met" if ok else "**missed**"


def targets(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode, label in (("sidecar", "sidecar mode"), ("live", "sidecar mode + live rows")):
        r = s["throughput_ratio"][mode]
        rows.append(
            [
                f"output tokens/s, {label} ÷ upstream ≥ 0.99",
                f"median {r['median']:.3f}, range {r['min']:.3f}–{r['max']:.3f} over {r['n']} reps",
                f"{r['median'] - 0.99:+.3f}",
                _status(r["median"] >= 0.99),
            ]
        )
        c = s["cpu_ratio"][mode]
        rows.append(
            [
                f"output tokens per server CPU second, {label} ÷ upstream ≥ 0.99",
                f"median {c['median']:.3f}, range {c['min']:.3f}–{c['max']:.3f} over {c['n']} reps",
                f"{c['median'] - 0.99:+.3f}",
                _status(c["median"] >= 0.99),
            ]
        )
    itl = s["itl"]["sidecar"]
    rows.append(
        [
            "ITL p99/p50 ≤ 1.2 in sidecar mode while long requests finish",
            f"{itl['p99_over_p50']:.2f} pooled; per rep {_range(itl['p99_over_p50_per_rep'], '{:.2f}')}",
            f"{1.2 - itl['p99_over_p50']:+.2f} below 1.2",
            _status(itl["p99_over_p50"] <= 1.2),
        ]
    )
    return rows


def itl_rows(s: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode in MODES:
        i = s["itl"][mode]
        at, other = i["at_finish"], i["elsewhere"]
        rows.append(
            [
                mode,
                _ms(i["pooled"]["p50"]),
                _ms(i["pooled"]["p99"]),
                f"{i['p99_over_p50']:.2f}",
                _range(i["p99_over_p50_per_rep"], "{:.2f}"),
                _ms(i["pooled"]["max"]),
                f"{_ms(at['p50'])} / {_ms(at['max'])} ({at['n']})" if at else "n/a",
                f"{_ms(other['p50'])} / {_ms(other['p99'])} ({other['n']})" if other else "n/a",
                str(i["finishes"]),
            ]
        )
    return rows


def render_section(results: dict[str, Any]) -> str:
    """The "Real SGLang server" section: numbers from `results` only, read against the targets."""
    s, b, env = results["summary"], results["bench"], results["environment"]
    after = results["environment_after"]
    load = " / ".join(f"{x:.2f}" for x in env["loadavg"])
    load_after = " / ".join(f"{x:.2f}" for x in after["loadavg"])
    tp = [
        [
            m,
            _range(s["tok_s"][m], "{:.1f}"),
            _range(s["tok_per_cpu_s"][m], "{:.1f}"),
            _range(s["server_cpu_ms_per_token"][m], "{:.2f}"),
            _range(s["sidecar_cpu_ms_per_token"][m], "{:.2f}"),
        ]
        for m in MODES
    ]
    lag = [
        [m, *(_ms(s["lag_s"][m][k]) for k in ("min", "p50", "p90", "p99", "max")), str(s["lag_s"][m]["n"])]
        for m in ("sidecar", "live")
    ]
    return "\n".join(
        [
            "## Real SGLang server",
            "",
            "The plugin inside a real SGLang 0.5.23 server on this CPU machine (`benchmarks/real_server.py`, the "
            "real-engine suite's harness). Reproduce with:",
            "",
            "```bash",
            f"make bench-sglang   # = {COMMAND}   (writes this section; `make bench` keeps it)",
            "```",
            "",
            f"Run at {env['date_utc']} UTC on commit `{env['commit']}`, {results['wall_s']:.0f} s wall "
            f"({results['start_s']:.0f} s of it starting the three servers). Machine: {env['cpus']} CPUs shared "
            f"with other jobs; load average (1/5/15 min) before: {load}, after: {load_after}.",
            "",
            f"Model: tiny random-weight Qwen3-MoE, {b['layers']} MoE layers, {b['experts']} experts, top-{b['topk']}, "
            f"hidden 64, one attention head (`--load-format dummy`, torch_native attention, `OMP_NUM_THREADS=1`, "
            "`--sleep-on-idle`). Three servers run side by side: `upstream` (plugin not loaded: SGLang's inline "
            '`meta_info["routed_experts"]`), `sidecar` (plugin, `R3_MODE=sidecar`), `live` (plugin, '
            f"`R3_LIVE_ROWS=1`). Each of {b['reps']} repetitions runs every workload on every server, one server at "
            "a time, in a rotated order (ABC, BCA, CAB); every request asks for routed experts. Ratios are taken "
            "within a repetition; the figures are medians with the range over repetitions in parentheses.",
            "",
            "### Targets",
            "",
            _table(["target", "measured", "gap", "status"], targets(s)),
            "",
            f"### (a) Throughput: {b['streams']} concurrent requests, {b['prompt']} prompt + {b['output']} output "
            "tokens, greedy, `ignore_eos`",
            "",
            "Each repetition runs the batch twice per mode, in the order ABC CBA; a mode's figure is its tokens "
            "over its summed time. *Per server CPU second*: tokens over the CPU time (user + system, from "
            "`/proc`) of every process of the stack, the sidecar's included, during the batch: on a machine "
            "shared with other jobs this is the steadier measure of what the plugin costs.",
            "",
            _table(
                [
                    "mode",
                    "output tokens/s (wall)",
                    "output tokens per CPU second (server + sidecar)",
                    "SGLang processes CPU ms per token",
                    "sidecar process CPU ms per token",
                ],
                tp,
            ),
            "",
            f"### (b) Inter-token latency of {b['streams']} streams while {b['long_requests']} long requests finish",
            "",
            f"Long requests: {b['long_context']}-token prompts (about {s['long_tokens']['median']:.0f} tokens "
            f"when they finish; upstream's inline payload {s['long_inline_b64_bytes']['median'] / 1e6:.2f} MB of "
            f"base64 each), {b['long_first']} + k·{b['long_stagger']} output tokens, so they finish one after "
            "another. They are prefilled before the window opens (torch_native prefill is O(context²) on CPU and "
            "would otherwise dominate every tail); the window holds only decode steps and the finishes, and ends "
            "0.5 s after the last one. ITL = time between consecutive `stream=true` chunks of a stream, measured "
            "by the client. A gap is *at a finish* when a long request's last chunk arrived within it or within "
            "one median gap of it.",
            "",
            _table(
                [
                    "mode",
                    "p50 ms",
                    "p99 ms",
                    "p99/p50 pooled",
                    "p99/p50 per rep",
                    "max ms",
                    "at a finish: p50 / max ms (gaps)",
                    "elsewhere: p50 / p99 ms (gaps)",
                    "finishes",
                ],
                itl_rows(s),
            ),
            "",
            "### (c) Finish → record final in the spool",
            "",
            "Spool record `updated` (set when the writer thread finalises it) minus SGLang's "
            "`response_sent_to_client_ts` for the same request; both are server-side wall clocks on one host. "
            "Negative: the record was final before SGLang sent the response. The requests of (a) "
            "(SGLang stamps a streamed response's first chunk, not its last, so (b)'s are left out).",
            "",
            _table(["mode", "min ms", "p50 ms", "p90 ms", "p99 ms", "max ms", "requests"], lag),
            "",
            *reading(results),
        ]
    )


def reading(results: dict[str, Any]) -> list[str]:
    """What this run's numbers say, computed from them (no figure here comes from anywhere else)."""
    s = results["summary"]
    out = ["### Reading (computed from this run)", ""]
    b = results["bench"]
    out.append(
        f"- Context: {b['long_context']} tokens per long request, the low end of the 2k–16k asked for. SGLang's "
        "CPU attention (torch_native) prefills in O(context²): a probe with 16k-token prompts on this machine "
        "(load 5–8) took minutes per prompt, which does not fit a 10-minute benchmark."
    )
    for mode in ("sidecar", "live"):
        w, c = s["throughput_ratio"][mode], s["cpu_ratio"][mode]
        out.append(
            f"- Throughput, {mode} ÷ upstream: {w['median']:.3f} by wall time (range {w['min']:.3f}–{w['max']:.3f}), "
            f"{c['median']:.3f} per server CPU second (range {c['min']:.3f}–{c['max']:.3f})."
        )
    for mode in MODES:
        i = s["itl"][mode]
        at, other = i["at_finish"], i["elsewhere"]
        if not (at and other):
            continue
        tail = (
            "at finishes"
            if at["max"] >= other["p99"]
            else "away from finishes (the machine's load, not the finish path)"
        )
        out.append(
            f"- ITL, {mode}: gaps at a finish have median {_ms(at['p50'])} ms against {_ms(other['p50'])} ms elsewhere "
            f"({at['p50'] / other['p50'] - 1:+.0%}); the largest gap at a finish is {_ms(at['max'])} ms, the p99 "
            f"elsewhere {_ms(other['p99'])} ms, so the pooled p99 ({_ms(i['pooled']['p99'])} ms) is set {tail}."
        )
    for mode in ("sidecar", "live"):
        lag = s["lag_s"][mode]
        out.append(
            f"- Finish → final, {mode}: p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms "
            f"after SGLang sent the response ({lag['n']} requests)."
        )
    return out


def splice(document: str, section: str) -> str:
    """Put `section` between the markers in `document`: replace the old block, else insert it before the
    findings (or at the end). `benchmarks/report.py` includes the same fragment, so either writer keeps it."""
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    anchor = "## Findings"
    if anchor in document:
        head, tail = document.split(anchor, 1)
        return f"{head}{block}\n\n{anchor}{tail}"
    return document.rstrip("\n") + "\n\n" + block + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=Bench.reps)
    ap.add_argument("--long-context", type=int, default=Bench.long_context)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true", help="leave benchmarks/real_server.md and BENCHMARKS.md")
    ap.add_argument("--render", type=Path, help="no run: re-render the section from a saved results file")
    args = ap.parse_args()
    if args.render:
        results = orjson.loads(args.render.read_bytes())
    else:
        bench = Bench(reps=args.reps, long_context=args.long_context)
        with tempfile.TemporaryDirectory(prefix="r3-bench-sglang-", dir="/dev/shm") as tmp:
            results = run(bench, Path(tmp))
        results["summary"] = summarize(results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    section = render_section(results)
    print(section)
    if not args.no_write:
        FRAGMENT.write_text(section + "\n")
        md = ROOT / "BENCHMARKS.md"
        md.write_text(splice(md.read_text(), section))
        _log(f"{FRAGMENT.relative_to(ROOT)} and BENCHMARKS.md written")
    _log(f"results in {args.render or args.out} ({results['wall_s']:.0f} s of measuring)")


if __name__ == "__main__":
    main()
