"""The trainer API's two async claims and the size of a ref (BENCHMARKS.md, "Trainer API").

1. `afetch` ÷ `fetch` GB/s for one 32k-token record (Qwen3-30B-A3B shape: 48 MoE layers, top-8, uint8),
   alternating the two, median of `--reps` each; and the latency of a lone `get` of a 256-token record, where
   any delay that coalescing adds before sending would show: the async client with and without it,
   alternating which goes first, and the blocking one.
2. The longest event-loop stall while 64 such records are fetched concurrently: a probe task sleeps 1 ms in a
   loop and records how late it wakes. Measured for `AsyncRoutedExpertsClient.get` ×64 (gather: coalesced
   into one batch after the first, and with `coalesce=False` as 64 requests),
   `afetch_many` (one batch), and, as the baseline a trainer has without it, the blocking client called
   from the loop; `--stall-reps` times each, interleaved with a control (the probe alone). The fetched arrays
   are freed after the probe stops (unmapping 800 MB is the trainer's cost whenever it drops them, not the
   fetch's). For the longest stall, the loop thread's own CPU time and run-queue wait in it
   (`/proc/thread-self/schedstat`): what is neither is time blocked (on the GIL, or a lock in the kernel).
3. `pickle.dumps` of a pointer ref at 8k and 32k tokens, against the rows it stands for.

`python -m benchmarks.trainer_api [--reps N]`: the sidecar runs in its own process (benchmarks.servers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.servers import serve
from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient, RoutedExpertsRef, afetch_many
from service.client.refs import AsyncSidecarPool
from service.spool import Spool

LAYERS, TOPK, EXPERTS = 48, 8, 128


def write(spool: Spool, rid: str, tokens: int, seed: int) -> int:
    rows = np.random.default_rng(seed).integers(0, EXPERTS, (tokens - 1, LAYERS, TOPK), dtype=np.uint8)
    w = spool.writer(
        rid, num_experts=EXPERTS, topk=TOPK, layers=list(range(LAYERS)), prompt_len=tokens // 2, num_hidden_layers=48
    )
    w.append(rows)
    w.finalize()
    return rows.nbytes


def schedstat_ms() -> tuple[float, float]:
    """This thread's CPU time and time runnable but waiting for a CPU, in ms (zeros where Linux does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, runq, _ = f.read().split()
    except OSError:
        return 0.0, 0.0
    return int(cpu) / 1e6, int(runq) / 1e6


@dataclass(frozen=True, slots=True)
class Stall:
    """The longest wake-up delay of the probe (ms), the loop thread's CPU and run-queue ms inside it, wall s."""

    ms: float
    cpu_ms: float
    runq_ms: float
    took_s: float


def stall_summary(name: str, runs: list[Stall]) -> str:
    """One line per kind of work: the median and longest stall, each repetition, and what the longest was."""
    each = sorted(r.ms for r in runs)
    worst = max(runs, key=lambda r: r.ms)
    return (
        f"  {name}: median {statistics.median(each):.1f} ms, max {each[-1]:.1f} ms "
        f"({', '.join(f'{x:.0f}' for x in each)}); {statistics.median(r.took_s for r in runs):.2f} s; "
        f"longest: {worst.cpu_ms:.1f} ms on CPU, {worst.runq_ms:.1f} ms waiting for one"
    )


async def lag_probe(stop: asyncio.Event, out: list[tuple[float, float, float]], period: float = 0.001) -> None:
    """How late the loop wakes a 1 ms sleeper: the longest value is the longest stall."""
    while not stop.is_set():
        t, (cpu, runq) = time.perf_counter(), schedstat_ms()
        await asyncio.sleep(period)
        cpu2, runq2 = schedstat_ms()
        out.append(((time.perf_counter() - t - period) * 1e3, cpu2 - cpu, runq2 - runq))


async def stall_during(work: Callable[[], Awaitable[object]]) -> Stall:
    lags: list[tuple[float, float, float]] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(lag_probe(stop, lags))
    await asyncio.sleep(0.05)
    t = time.perf_counter()
    result = await work()
    took = time.perf_counter() - t
    stop.set()
    await probe
    del result  # freed after the probe stopped
    worst = max(lags)
    return Stall(worst[0], worst[1], worst[2], took)


def lone_latency_us(url: str, reps: int = 200) -> tuple[float, float, float]:
    """Median µs of a lone `get` of the small record: blocking, async, async with `coalesce=False`."""
    times: dict[str, list[float]] = {"sync": [], "on": [], "off": []}

    async def main() -> None:
        async with (
            AsyncRoutedExpertsClient(url, local_reads=False) as on,
            AsyncRoutedExpertsClient(url, coalesce=False, local_reads=False) as off,
        ):
            with RoutedExpertsClient(url, local_reads=False) as sc:
                for i in range(reps + 10):
                    t = time.perf_counter()
                    sc.get("small")
                    took = {"sync": time.perf_counter() - t}
                    for name, c in (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on)):
                        t = time.perf_counter()
                        await c.get("small")
                        took[name] = time.perf_counter() - t
                    if i >= 10:
                        for name, v in took.items():
                            times[name].append(v)

    asyncio.run(main())
    sync_us, on_us, off_us = (statistics.median(times[k]) * 1e6 for k in ("sync", "on", "off"))
    return sync_us, on_us, off_us


def throughput(url: str, nbytes: int, reps: int) -> tuple[float, float]:
    sync_s, async_s = [], []

    async def arun(c: AsyncRoutedExpertsClient) -> float:
        t = time.perf_counter()
        await c.get("big-0")
        return time.perf_counter() - t

    async def main() -> None:
        async with AsyncRoutedExpertsClient(url, local_reads=False) as ac:
            with RoutedExpertsClient(url, local_reads=False) as sc:
                for _ in range(3):
                    sc.get("big-0")
                    await ac.get("big-0")
                for _ in range(reps):
                    t = time.perf_counter()
                    sc.get("big-0")
                    sync_s.append(time.perf_counter() - t)
                    async_s.append(await arun(ac))

    asyncio.run(main())
    return nbytes / statistics.median(sync_s) / 1e9, nbytes / statistics.median(async_s) / 1e9


CONTROL = "control: the probe alone, no fetch (this machine's own scheduling noise)"


def stalls(url: str, n: int, threads: int | None, reps: int) -> dict[str, list[Stall]]:
    rids = [f"big-{i}" for i in range(n)]
    refs = [RoutedExpertsRef(rid=r, url=f"{url}/routed_experts/{r}") for r in rids]
    out: dict[str, list[Stall]] = {}

    async def main() -> None:
        kwargs = {"threads": threads, "local_reads": False} if threads else {"local_reads": False}
        async with (
            AsyncRoutedExpertsClient(url, **kwargs) as ac,
            AsyncRoutedExpertsClient(url, coalesce=False, **kwargs) as apart,
            AsyncSidecarPool(**kwargs) as pool,
        ):
            await asyncio.gather(*(ac.get(r) for r in rids[:8]))  # warm connections
            await asyncio.gather(*(apart.get(r) for r in rids[:8]))
            await afetch_many(refs[:2], pool=pool)
            for _ in range(reps):
                out.setdefault(CONTROL, []).append(await stall_during(lambda: asyncio.sleep(1.0)))
                out.setdefault(f"AsyncRoutedExpertsClient.get x{n} (gather)", []).append(
                    await stall_during(lambda: asyncio.gather(*(ac.get(r) for r in rids)))
                )
                out.setdefault(f"AsyncRoutedExpertsClient(coalesce=False).get x{n} (gather): {n} requests", []).append(
                    await stall_during(lambda: asyncio.gather(*(apart.get(r) for r in rids)))
                )
                out.setdefault(f"afetch_many({n} refs): one batch", []).append(
                    await stall_during(lambda: afetch_many(refs, pool=pool))
                )
        with RoutedExpertsClient(url, local_reads=False) as sc:
            sc.get(rids[0])

            async def blocking() -> list[object]:
                return [sc.get(r) for r in rids]

            out[f"baseline: blocking client.get x{n} on the loop"] = [await stall_during(blocking)]

    asyncio.run(main())
    return out


def pickle_sizes() -> list[tuple[int, int, int]]:
    sizes = []
    for tokens in (8192, 32768):
        rid = "3f2a1b9c0d8e4f6a8b7c6d5e4f3a2b1c"
        meta = {
            "id": rid,
            "prompt_tokens": tokens // 2,
            "completion_tokens": tokens // 2,
            "routed_experts_url": f"http://pod-17.r3-sidecar.inference.svc:8000/routed_experts/{rid}",
        }
        (ref,) = RoutedExpertsRef.from_response({"meta_info": meta}, num_hidden_layers=48, topk=8)
        sizes.append((tokens, len(pickle.dumps(ref)), (tokens - 1) * LAYERS * TOPK))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=None, help="AsyncRoutedExpertsClient(threads=) (default: its own)")
    ap.add_argument("--stall-reps", type=int, default=5, help="stall measurements of each kind, interleaved")
    ap.add_argument("--only-stalls", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        spool = Spool(Path(d))
        nbytes = 0
        for i in range(args.records):
            nbytes = write(spool, f"big-{i}", args.tokens, i)
        write(spool, "small", 256, 0)
        with serve("sidecar", Path(d)) as server:
            if not args.only_stalls:
                sync_gbs, async_gbs = throughput(server.url, nbytes, args.reps)
                print(f"one record of {args.tokens} tokens ({nbytes / 1e6:.1f} MB), median of {args.reps}:")
                print(f"  fetch {sync_gbs:.2f} GB/s, afetch {async_gbs:.2f} GB/s, ratio {async_gbs / sync_gbs:.2f}")
                sync_us, on_us, off_us = lone_latency_us(server.url)
                print(
                    f"a lone get of a 256-token record, median of 200: blocking {sync_us:.0f} µs, "
                    f"async {on_us:.0f} µs, async coalesce=False {off_us:.0f} µs"
                )
            load = os.getloadavg()[0]
            print(f"{args.records} records of {args.tokens} tokens concurrently, {args.stall_reps} reps each:")
            print("  longest event-loop stall (median, max, each), wall time; the longest's loop CPU / run-queue ms")
            for name, runs in stalls(server.url, args.records, args.threads, args.stall_reps).items():
                print(stall_summary(name, runs))
            print(f"load average (1 min) before the stalls {load:.2f}, after {os.getloadavg()[0]:.2f}")
    for tokens, size, rows in pickle_sizes():
        print(f"pointer ref at {tokens} tokens: pickle {size} B; its rows {rows / 1e6:.1f} MB uint8")


if __name__ == "__main__":
    main()
