"""`make bench-ab`: plugin (sidecar mode) ÷ upstream throughput on real SGLang servers, with a 95% interval.

    .venv/bin/python -m benchmarks.paired --minutes 12      # writes benchmarks/out/paired.json
    .venv/bin/python -m benchmarks.paired --rounds 4 --no-pin   # a harness check

Why paired: on a machine shared with other jobs the load drifts by more than the 1% to be judged, so one
number per mode says nothing. Two servers of the real-server benchmark (`benchmarks/real_server/runner.py`'s
`upstream` and `sidecar`, same model, same launch) run side by side, idle ones asleep (`--sleep-on-idle`);
each round runs the same batch (8 concurrent requests, 64 prompt + 128 output tokens, greedy) on both,
back to back, in the order AB, BA, AB, … (a linear drift cancels within two rounds), and its figure is
the ratio within the round. The interval is over rounds: a t-interval on the log ratios (the geometric
mean's) and a paired bootstrap of the mean ratio, both reported.

Pinning (default on): every process and thread of both stacks (SGLang's tokenizer manager, scheduler,
detokenizer; the sidecar) on CPU 1, this client on CPU 0: the two servers then meet the same neighbours on
the same core, and the client's HTTP work does not share the scheduler's core.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from benchmarks.environment import environment
from benchmarks.real_server.runner import Stack, _log, _warm
from benchmarks.real_server.workloads import Bench, throughput

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "paired.json"
MODES = ("upstream", "sidecar")
# The GPU recipe's three arms (issue 38): routed experts off, SGLang's inline path, sidecar mode; each round runs
# them in a rotated order (ABC, BCA, CAB, …), and both capture paths are also given as ratios to `off`.
THREE_WAY = ("off", "upstream", "sidecar")
# What the row check costs (issue 40): the plugin in sidecar mode with its row check off (`R3_ROW_CHECK=0`), then on.
ROW_CHECK = ("nocheck", "sidecar")
# Two-sided 95% Student t quantiles; a df between two rows takes the smaller df's (wider) value.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 8: 2.306, 10: 2.228, 15: 2.131, 20: 2.086}
T975 |= {25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    return T975[max(k for k in T975 if k <= df)]


def interval(ratios: list[float], *, resamples: int = 20000, seed: int = 0) -> dict[str, Any]:
    """95% intervals of the per-round ratios: t on logs (geometric mean) and a paired bootstrap of the mean."""
    r = np.asarray(ratios, dtype=float)
    n = len(r)
    logs = np.log(r)
    mean, sd = float(logs.mean()), float(logs.std(ddof=1)) if n > 1 else float("nan")
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    boot = np.random.default_rng(seed).choice(r, size=(resamples, n), replace=True).mean(axis=1)
    return {
        "n": n,
        "geomean": math.exp(mean),
        "t95": [math.exp(mean - half), math.exp(mean + half)],
        "mean": float(r.mean()),
        "bootstrap95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "sd_log": sd,
        "min": float(r.min()),
        "max": float(r.max()),
    }


def by_rotation(ratios: list[float], size: int) -> list[float]:
    """The geometric mean of each full rotation of `size` rounds (AB then BA, or ABC, BCA, CAB): a rotation runs
    every order once, so a cost of running second (seen here: about ±15% by order alone on 2 shared cores) cancels
    within it instead of widening the interval. An unfinished last rotation is left out."""
    whole = len(ratios) // size * size
    logs = np.log(np.asarray(ratios[:whole], dtype=float)).reshape(-1, size)
    return [float(x) for x in np.exp(logs.mean(axis=1))]


def pin_session(session: int, cpus: set[int]) -> int:
    """Pin every thread of every process in `session` to `cpus`; returns how many threads were pinned."""
    pinned = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # field 6 of stat: the session id
                continue
            for task in (stat.parent / "task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cpus)
                    pinned += 1
    return pinned


def run(
    bench: Bench, workdir: Path, *, rounds: int, minutes: float, pin: bool, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """Start the servers of `modes` one after the other, measure them (`measure`), stop them."""
    from benchmarks.real_server.runner import start

    t0 = time.perf_counter()
    stacks = {mode: start(bench.server_config(mode), workdir / mode) for mode in modes}
    try:
        return measure(stacks, bench, rounds=rounds, minutes=minutes, pin=pin, started=t0, modes=modes)
    finally:
        for stack in stacks.values():
            stack.stop()


def _ratios(row: dict[str, Any], modes: tuple[str, ...]) -> None:
    """A round's ratios, in place: the last mode ÷ the one before it (tok/s, tok per CPU s: sidecar ÷ upstream, or
    ÷ nocheck); with `off`, each path ÷ off."""

    def rate(mode: str, per: str) -> float:
        return row[mode]["tokens"] / row[mode][per]

    base, arm = modes[-2], modes[-1]
    row["ratio"] = rate(arm, "wall_s") / rate(base, "wall_s")
    row["cpu_ratio"] = rate(arm, "cpu_s") / rate(base, "cpu_s")
    if "off" in modes:
        row["inline_vs_off"] = rate("upstream", "wall_s") / rate("off", "wall_s")
        row["sidecar_vs_off"] = rate("sidecar", "wall_s") / rate("off", "wall_s")


def measure(
    stacks: dict[str, Stack],
    bench: Bench,
    *,
    rounds: int,
    minutes: float,
    pin: bool,
    started: float,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    """The paired rounds on the running servers of `modes` (same model and launch): per-round ratios, intervals.

    `started` is when their start began (`time.perf_counter()`), for `start_s` and `wall_s`; the caller stops them.
    """
    results: dict[str, Any] = {
        "bench": {"streams": bench.streams, "prompt": bench.prompt, "output": bench.output, "layers": bench.layers},
        "environment": environment(),
        "pin": pin,
        "modes": list(modes),
        "rounds": [],
    }
    if pin:
        results["pinned_threads"] = {
            mode: pin_session(s.server.proc.pid, {1}) + (pin_session(s.sidecar.proc.pid, {1}) if s.sidecar else 0)
            for mode, s in stacks.items()
        }
        os.sched_setaffinity(0, {0})
    results["start_s"] = time.perf_counter() - started
    _log(f"{len(stacks)} servers up after {results['start_s']:.0f} s (pinned: {results.get('pinned_threads')})")
    for stack in stacks.values():
        _warm(stack, bench)
    deadline = time.perf_counter() + minutes * 60
    k = 0
    while k < rounds and time.perf_counter() < deadline:
        order = modes[k % len(modes) :] + modes[: k % len(modes)]  # two modes: AB, BA, AB, …
        row: dict[str, Any] = {"order": list(order), "load1": os.getloadavg()[0]}
        for mode in order:
            t = throughput(stacks[mode], bench, f"ab{k}-{mode}")
            row[mode] = {key: t[key] for key in ("tokens", "wall_s", "cpu_s", "sidecar_cpu_s")}
        _ratios(row, modes)
        results["rounds"].append(row)
        _log(f"round {k} {''.join(m[0] for m in order)}: ratio {row['ratio']:.3f}, CPU ratio {row['cpu_ratio']:.3f}")
        k += 1
    results["engine_files"] = httpx.get(f"{stacks['sidecar'].sidecar_url}/v1/engines", timeout=10).json()
    results["environment_after"] = {
        "loadavg": list(os.getloadavg()),
        "date_utc": time.strftime("%H:%M:%S", time.gmtime()),
    }
    results["wall_s"] = time.perf_counter() - started
    results["summary"] = {
        "tok_s": interval([r["ratio"] for r in results["rounds"]]),
        "tok_per_cpu_s": interval([r["cpu_ratio"] for r in results["rounds"]]),
    }
    rotations = by_rotation([r["ratio"] for r in results["rounds"]], len(modes))
    if rotations:
        results["summary"]["tok_s_by_rotation"] = interval(rotations)
    if "off" in modes:
        for key in ("inline_vs_off", "sidecar_vs_off"):
            results["summary"][key] = interval([r[key] for r in results["rounds"]])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1000, help="at most this many rounds")
    ap.add_argument("--minutes", type=float, default=12.0, help="stop starting rounds after this long")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument(
        "--against",
        choices=("upstream", "nocheck"),
        default="upstream",
        help="the base arm: SGLang's inline path, or the plugin with its row check off (what the check costs)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="r3-bench-ab-", dir="/dev/shm") as tmp:
        modes = MODES if args.against == "upstream" else ROW_CHECK
        results = run(Bench(), Path(tmp), rounds=args.rounds, minutes=args.minutes, pin=not args.no_pin, modes=modes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    for name, s in results["summary"].items():
        print(
            f"{name}: sidecar ÷ {args.against} geometric mean {s['geomean']:.4f}, 95% t-interval "
            f"{s['t95'][0]:.4f}–{s['t95'][1]:.4f}; mean {s['mean']:.4f}, bootstrap 95% "
            f"{s['bootstrap95'][0]:.4f}–{s['bootstrap95'][1]:.4f} over {s['n']} rounds"
        )
    _log(f"results in {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
