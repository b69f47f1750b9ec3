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
BENCHMARKS.md between markers that `benchmarks/report/document.py` keeps when it regenerates the file. This module runs
the servers and sums up; the launch and the workloads are `workloads.py`'s, the section `section.py`'s (this
folder's); `python -m benchmarks.real_server` runs `main` (`__main__.py`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from sglang_server import Stack, start  # noqa: E402

from benchmarks.environment import environment  # noqa: E402
from benchmarks.real_server.section import render_section, splice  # noqa: E402
from benchmarks.real_server.workloads import MODES, Bench, combine, finish_lags, itl, throughput  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "real_server.json"
FRAGMENT = ROOT / "benchmarks" / "real_server.md"


def _log(msg: str) -> None:
    print(f"[bench-sglang {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.real_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
