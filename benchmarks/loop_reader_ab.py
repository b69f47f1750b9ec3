"""A/B of the asyncio client's two plain-http body readers (BENCHMARKS.md §7): reader threads (`http.client` on
a pool of 8 threads, as shipped before) against the loop reading itself (`service.aconnections`), interleaved
in one process against one sidecar, with the probe-alone control and the load average at every repetition.

`PYTHONPATH=. .venv/bin/python -m benchmarks.loop_reader_ab [--stall-reps 5] [--reps 21]`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import service.aconnections as loop_reader
from benchmarks.servers import serve
from benchmarks.trainer_api import CONTROL, Stall, stall_during, write
from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient, RoutedExpertsRef, afetch_many
from service.connections import Connections
from service.refs import AsyncSidecarPool
from service.requests import Call, ClientConfig
from service.results import Frame, Reply
from service.spool import Spool
from service.transport import AsyncTransport, _direct_frames, _direct_send


class ThreadReader(AsyncTransport):
    """The reader-thread transport as shipped before the loop reader: whole bodies through `Connections` on threads."""

    def __init__(self, cfg: ClientConfig, threads: int = 8) -> None:
        super().__init__(cfg)
        self.conns = Connections(cfg.base_url, cfg.headers, cfg.connect_timeout)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="r3-client")

    async def send(self, call: Call) -> Reply:
        return await asyncio.get_running_loop().run_in_executor(self.pool, _direct_send, self.conns, self.cfg, call)

    async def frames(self, call: Call) -> list[Frame]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, _direct_frames, self.conns, self.cfg, call)


def threaded(client: AsyncRoutedExpertsClient) -> AsyncRoutedExpertsClient:
    client._io = ThreadReader(client._config)
    return client


async def with_turn(turn_bytes: int, work: Awaitable[object]) -> object:
    """`work` with the loop reader's per-turn copy budget set to `turn_bytes`."""
    loop_reader.TURN_BYTES = turn_bytes
    try:
        return await work
    finally:
        loop_reader.TURN_BYTES = 4 << 20


async def compare(url: str, rids: list[str], nbytes: int, reps: int, stall_reps: int) -> None:
    refs = [RoutedExpertsRef(rid=r, url=f"{url}/routed_experts/{r}") for r in rids]
    times: dict[str, list[float]] = {"fetch": [], "afetch threads": [], "afetch loop": []}
    stalls: dict[str, list[Stall]] = {}
    loads: list[float] = []
    async with (
        AsyncRoutedExpertsClient(url) as new,
        threaded(AsyncRoutedExpertsClient(url)) as old,
        AsyncSidecarPool() as pool_new,
        AsyncSidecarPool() as pool_old,
    ):
        threaded(pool_old.client(url))
        one = {"fetch": None, "afetch threads": old, "afetch loop": new}
        with RoutedExpertsClient(url) as blocking:
            for client in one.values():
                for _ in range(3):
                    await client.get(rids[0]) if client else blocking.get(rids[0])
            before = os.getloadavg()[0]
            for _ in range(reps):
                for name, client in one.items():
                    t = time.perf_counter()
                    await client.get(rids[0]) if client else blocking.get(rids[0])
                    times[name].append(time.perf_counter() - t)
        gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        print(f"one record ({nbytes / 1e6:.1f} MB), median of {reps} alternating, load {before:.2f}:")
        print("  " + "; ".join(f"{k} {v:.2f} GB/s ({v / gbs['fetch']:.2f})" for k, v in gbs.items()), flush=True)
        for client in (old, new):
            await asyncio.gather(*(client.get(r) for r in rids[:8]))
        for pool in (pool_old, pool_new):
            await afetch_many(refs[:2], pool=pool)
        kinds: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            (CONTROL, lambda: asyncio.sleep(1.0)),
            ("get x64, threads", lambda: asyncio.gather(*(old.get(r) for r in rids))),
            ("get x64, loop", lambda: asyncio.gather(*(new.get(r) for r in rids))),
            ("afetch_many, threads", lambda: afetch_many(refs, pool=pool_old)),
            ("afetch_many, loop", lambda: afetch_many(refs, pool=pool_new)),
            ("get x64, loop, 1 MB turn", lambda: with_turn(1 << 20, asyncio.gather(*(new.get(r) for r in rids)))),
        ]
        for rep in range(stall_reps):
            loads.append(os.getloadavg()[0])
            order = kinds if rep % 2 == 0 else [kinds[0], kinds[5], kinds[2], kinds[1], kinds[4], kinds[3]]
            line = []
            for name, work in order:
                stall = await stall_during(work)
                stalls.setdefault(name, []).append(stall)
                line.append(f"{name.split(':')[0]} {stall.ms:.0f}")
            print(f"  rep {rep}, load {loads[-1]:.2f}: " + ", ".join(line), flush=True)
    print(f"longest loop stall, {len(rids)} records, {stall_reps} reps, load {min(loads):.2f}-{max(loads):.2f}:")
    for name, runs in stalls.items():
        each = sorted(r.ms for r in runs)
        worst = max(runs, key=lambda r: r.ms)
        print(
            f"  {name}: median {statistics.median(each):.1f} ms ({', '.join(f'{x:.0f}' for x in each)}); "
            f"{statistics.median(r.took_s for r in runs):.2f} s; longest: {worst.cpu_ms:.1f} ms on CPU, "
            f"{worst.runq_ms:.1f} ms waiting for one"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--stall-reps", type=int, default=5)
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
