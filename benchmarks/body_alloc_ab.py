"""A/B of how the client's reader threads allocate body buffers (BENCHMARKS.md §7): `np.empty` (holds the GIL
through glibc's `mmap`) against `service.wire.buffers.uninitialized` (the same `malloc` through ctypes, GIL released),
interleaved in one process against one sidecar, with the probe-alone control and the load at every repetition.

`PYTHONPATH=. .venv/bin/python -m benchmarks.body_alloc_ab [--stall-reps 7] [--reps 15]`; its `get` ×64 are
64 requests (`coalesce=False`), as when its figures were taken.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

import service.client.connections
import service.wire.frames
from benchmarks.servers import serve
from benchmarks.trainer_api import CONTROL, Stall, stall_during, stall_summary, write
from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient, RoutedExpertsRef, afetch_many
from service.client.refs import AsyncSidecarPool
from service.spool import Spool
from service.wire.buffers import uninitialized


def numpy_empty(n: int) -> memoryview:
    return np.empty(n, dtype=np.uint8).data


Kind = tuple[str, Callable[[], Awaitable[object]]]
ALLOCATORS: dict[str, Callable[[int], memoryview]] = {"np.empty": numpy_empty, "off-GIL malloc": uninitialized}


def use(name: str) -> None:
    service.client.connections.uninitialized = ALLOCATORS[name]
    service.wire.frames.uninitialized = ALLOCATORS[name]


async def compare(url: str, rids: list[str], nbytes: int, reps: int, stall_reps: int) -> None:
    refs = [RoutedExpertsRef(rid=r, url=f"{url}/routed_experts/{r}") for r in rids]
    times: dict[str, list[float]] = {}
    stalls: dict[str, list[Stall]] = {}
    loads: list[float] = []
    async with (
        AsyncRoutedExpertsClient(url, coalesce=False, local_reads=False) as client,
        AsyncSidecarPool(local_reads=False) as pool,
    ):
        with RoutedExpertsClient(url, local_reads=False) as blocking:
            for _ in range(3):
                blocking.get(rids[0])
                await client.get(rids[0])
            before = os.getloadavg()[0]
            for _ in range(reps):
                for name in ALLOCATORS:
                    use(name)
                    t = time.perf_counter()
                    blocking.get(rids[0])
                    times.setdefault(f"fetch, {name}", []).append(time.perf_counter() - t)
                    t = time.perf_counter()
                    await client.get(rids[0])
                    times.setdefault(f"afetch, {name}", []).append(time.perf_counter() - t)
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        print(f"one record ({nbytes / 1e6:.1f} MB), median of {reps} alternating, load {before:.2f}:")
        for name in ALLOCATORS:
            f, a = gbs[f"fetch, {name}"], gbs[f"afetch, {name}"]
            print(f"  {name}: fetch {f:.2f} GB/s, afetch {a:.2f} GB/s, ratio {a / f:.2f}", flush=True)
        await asyncio.gather(*(client.get(r) for r in rids[:8]))
        await afetch_many(refs[:2], pool=pool)

        def kind(label: str, allocator: str, work: Callable[[], Awaitable[object]]) -> Kind:
            async def run() -> object:
                use(allocator)
                return await work()

            return f"{label}, {allocator}", run

        def gets() -> Awaitable[object]:
            return asyncio.gather(*(client.get(r) for r in rids))

        def batch() -> Awaitable[object]:
            return afetch_many(refs, pool=pool)

        kinds: list[Kind] = [(CONTROL, lambda: asyncio.sleep(1.0))]
        kinds += [kind(f"get x{len(rids)}", a, gets) for a in ALLOCATORS]
        kinds += [kind("afetch_many", a, batch) for a in ALLOCATORS]
        for rep in range(stall_reps):
            loads.append(os.getloadavg()[0])
            order = kinds if rep % 2 == 0 else [kinds[0], kinds[2], kinds[1], kinds[4], kinds[3]]
            line = []
            for name, work in order:
                stall = await stall_during(work)
                stalls.setdefault(name, []).append(stall)
                line.append(f"{name.split(':')[0]} {stall.ms:.0f}")
            print(f"  rep {rep}, load {loads[-1]:.2f}: " + ", ".join(line), flush=True)
    print(f"longest loop stall, {len(rids)} records, {stall_reps} reps, load {min(loads):.2f}-{max(loads):.2f}:")
    for name, runs in stalls.items():
        print(stall_summary(name, runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--stall-reps", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        spool = Spool(Path(d))
        nbytes = 0
        for i in range(args.records):
            nbytes = write(spool, f"big-{i}", args.tokens, i)
        with serve("sidecar", Path(d)) as server:
            rids = [f"big-{i}" for i in range(args.records)]
            asyncio.run(compare(server.url, rids, nbytes, args.reps, args.stall_reps))


if __name__ == "__main__":
    main()
