"""The event loop's longest stall during the first `afetch_many` of a fresh process and loop, and during warm ones.

Each repetition is a fresh child process (a trainer's first fetch): it imports the client (as a trainer does at
the top of its module), starts an event loop with a 1 ms ticker, lets it settle, then awaits `afetch_many` of
64 refs (8k-token Qwen3 records, 32 on each of two sidecars): the ticker's longest late wake-up is the stall.
Then three warm calls in the same loop. Measured with same-node reads (the default here: both sidecars are on
this node) and over HTTP (`R3_LOCAL_READS=0`), alternating.

    PYTHONPATH=. .venv/bin/python -m benchmarks.cold_start [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.local_reads import two_sidecars, write

CHILD = r"""
import asyncio, json, sys, time
from service.client import RoutedExpertsRef, afetch_many

urls = sys.argv[1:3]
refs = [RoutedExpertsRef(f"cold-{i}", url=f"{urls[i % 2]}/routed_experts/cold-{i}") for i in range(64)]


async def main():
    worst = [0.0]

    async def ticker():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            worst[0] = max(worst[0], time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    worst[0] = 0.0
    await asyncio.sleep(0.3)  # control: the ticker alone, the machine's own noise
    control = worst[0]
    worst[0] = 0.0
    t0 = time.perf_counter()
    got = await afetch_many(refs)
    cold = (worst[0], time.perf_counter() - t0, got[0].source)
    del got
    await asyncio.sleep(0.02)
    warm = []
    for _ in range(3):
        worst[0] = 0.0
        got = await afetch_many(refs)
        warm.append(worst[0])
        del got
        await asyncio.sleep(0.02)
    tick.cancel()
    print(json.dumps({"cold_ms": cold[0] * 1e3, "cold_s": cold[1], "source": cold[2], "warm_ms": max(warm) * 1e3,
                      "control_ms": control * 1e3}))


asyncio.run(main())
"""


def child(urls: list[str], local: bool) -> dict:
    env = {**os.environ, "R3_LOCAL_READS": "1" if local else "0"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *urls], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({', '.join(f'{x:.0f}' for x in sorted(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with two_sidecars() as (one, two, spools):
        for i in range(64):
            write(spools[i % 2], f"cold-{i}", "Qwen3-30B-A3B", 8192, seed=i)
        time.sleep(0.5)
        runs: dict[str, list[dict]] = {"local": [], "http": []}
        for _ in range(args.reps):
            for kind in runs:
                runs[kind].append(child([one.url, two.url], kind == "local"))
    print(
        "| path | cold: worst tick, median (all) ms | warm: worst tick, median (all) ms "
        "| control: ticker alone 0.3 s, median (all) ms | first call s | reps |"
    )
    print("|---|---|---|---|---|---|")
    for kind, got in runs.items():
        assert {g["source"] for g in got} == {"spool" if kind == "local" else "http"}
        cells = [_cell([g[k] for g in got]) for k in ("cold_ms", "warm_ms", "control_ms")]
        print(f"| {kind} | {' | '.join(cells)} | {statistics.median(g['cold_s'] for g in got):.3f} | {len(got)} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
