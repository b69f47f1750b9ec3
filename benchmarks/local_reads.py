"""Same-node reads against memcpy, and the HTTP path against raw loopback TCP, side by side in one run.

1. Same node: one record of 8k and of 32k tokens per model (Qwen3-30B-A3B, DeepSeek-V3 uint8; Kimi-K2 uint16),
   fetched with `RoutedExpertsClient.get` straight from the spool (the default on the sidecar's node), its
   asyncio twin, the read-only view (`local_view=True`), and over HTTP (`local_reads=False`, what another node
   gets), interleaved repetition by repetition; against `np.copyto` of the same bytes between two touched
   buffers (this machine's memcpy) and `ndarray.copy()` (memcpy into a fresh buffer, as a fetch must).
2. Across nodes: one 8k and one 32k Qwen3 record per `get` over HTTP against raw loopback TCP (one connection
   streaming, and one record per round trip), and `fetch_many` of 32 records over two sidecars.
3. `--decompose`: where a same-node read's time goes, each step alone in a tight loop (no other path between
   repetitions to evict the caches): memcpy of the same bytes between touched buffers, the kernel's `pread` out
   of the tmpfs spool into a reused and into a fresh buffer, a user-space copy out of an `mmap` of the file, and
   `LocalSpool.read` whole; against memcpy of 64 MB (the machine's memory bandwidth, no cache).

    PYTHONPATH=. .venv/bin/python -m benchmarks.local_reads [--reps N] [--quick] [--decompose]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.limits import loopback_gbps, loopback_round_trips_gbps, memcpy_gbps
from benchmarks.servers import serve
from benchmarks.shapes import SHAPES
from benchmarks.stats import summary
from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient, RoutedExpertsRef, fetch_many
from service.client.local.spool import LocalSpool, Selection
from service.client.refs import SidecarPool
from service.spool import Spool
from service.wire.buffers import uninitialized


def write(spool: Spool, rid: str, name: str, tokens: int, seed: int) -> int:
    shape = SHAPES[name]
    rows = np.random.default_rng(seed).integers(0, shape.num_experts, (tokens - 1, len(shape.moe_layers), shape.topk))
    w = spool.writer(
        rid,
        num_experts=shape.num_experts,
        topk=shape.topk,
        layers=shape.moe_layers,
        prompt_len=tokens // 2,
        num_hidden_layers=shape.num_hidden_layers,
    )
    w.append(rows.astype(shape.dtype))
    w.finalize()
    return rows.size * np.dtype(shape.dtype).itemsize


def interleaved(paths: dict, reps: int) -> dict[str, float]:
    """Median seconds of each path, the paths alternating repetition by repetition."""
    for call in paths.values():
        call()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(reps):
        for key, call in paths.items():
            t0 = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t0)
    return {k: summary(v)["p50"] for k, v in times.items()}


def same_node(url: str, spool: Spool, models: list[str], tokens: list[int], reps: int) -> list[str]:
    out = [
        "| model | tokens | MB | memcpy GB/s | memcpy to fresh GB/s | local get GB/s | of memcpy | local aget GB/s "
        "| aget ÷ get | view GB/s | HTTP get GB/s | local ÷ HTTP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    loop = asyncio.new_event_loop()
    local, http = RoutedExpertsClient(url), RoutedExpertsClient(url, local_reads=False)
    view = RoutedExpertsClient(url, local_view=True)
    aclient = loop.run_until_complete(_async_client(url))
    try:
        for name in models:
            for n in tokens:
                rid = f"{name}-{n}"
                nbytes = write(spool, rid, name, n, seed=n)
                time.sleep(0.2)
                src = np.ones(nbytes, dtype=np.uint8)
                dst = np.zeros(nbytes, dtype=np.uint8)
                assert local.get(rid).source == "spool" and http.get(rid).source == "http"
                assert loop.run_until_complete(aclient.get(rid)).source == "spool"
                t = interleaved(
                    {
                        "memcpy": lambda dst=dst, src=src: np.copyto(dst, src),
                        "fresh": lambda src=src: src.copy(),
                        "get": lambda rid=rid: local.get(rid),
                        "aget": lambda rid=rid: loop.run_until_complete(aclient.get(rid)),
                        "view": lambda rid=rid: view.get(rid),
                        "http": lambda rid=rid: http.get(rid),
                    },
                    reps,
                )
                g = {k: nbytes / v / 1e9 for k, v in t.items()}
                out.append(
                    f"| {name} | {n} | {nbytes / 1e6:.2f} | {g['memcpy']:.2f} | {g['fresh']:.2f} | {g['get']:.2f} "
                    f"| {g['get'] / g['memcpy']:.2f}× | {g['aget']:.2f} | {t['get'] / t['aget']:.2f} "
                    f"| {g['view']:.0f} | {g['http']:.2f} | {g['get'] / g['http']:.1f}× |"
                )
                print(out[-1], flush=True)
    finally:
        local.close()
        http.close()
        view.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()
    return out


async def _async_client(url: str) -> AsyncRoutedExpertsClient:
    return AsyncRoutedExpertsClient(url)


def across_nodes(urls: list[str], spools: list[Spool], reps: int) -> list[str]:
    """HTTP only (what a trainer on another node gets), against raw loopback TCP for the same bytes."""
    out = ["| path | MB per record | GB/s | of loopback streaming | of loopback, one record per round trip |"]
    out.append("|---|---|---|---|---|")
    http = RoutedExpertsClient(urls[0], local_reads=False)
    refs = []
    for i in range(32):
        rid = f"many-{i}"
        write(spools[i % 2], rid, "Qwen3-30B-A3B", 8192, seed=100 + i)
        refs.append(RoutedExpertsRef(rid, url=f"{urls[i % 2]}/routed_experts/{rid}"))
    try:
        for n in (8192, 32768):
            rid = f"wire-{n}"
            nbytes = write(spools[0], rid, "Qwen3-30B-A3B", n, seed=n)
            time.sleep(0.2)
            stream = loopback_gbps(nbytes, 16, max(3, reps // 4))["gbps"]
            trips = loopback_round_trips_gbps(nbytes, 16, max(3, reps // 4))["gbps"]
            got = nbytes / interleaved({"get": lambda rid=rid: http.get(rid)}, reps)["get"] / 1e9
            out.append(
                f"| `get`, one record, HTTP | {nbytes / 1e6:.2f} | {got:.2f} | {got / stream:.0%} | {got / trips:.0%} |"
            )
            print(out[-1], flush=True)
        per = refs_bytes = 0
        with SidecarPool(local_reads=False) as pool:
            fetch_many(refs, pool=pool)
            per = interleaved({"many": lambda: fetch_many(refs, pool=pool)}, max(3, reps // 2))["many"]
            refs_bytes = sum(r.array.nbytes for r in fetch_many(refs, pool=pool))
        stream = loopback_gbps(refs_bytes // len(refs), len(refs), max(3, reps // 4))["gbps"]
        got = refs_bytes / per / 1e9
        out.append(
            f"| `fetch_many`, 32 records over 2 sidecars, HTTP | {refs_bytes / len(refs) / 1e6:.2f} | {got:.2f} "
            f"| {got / stream:.0%} | |"
        )
        print(out[-1], flush=True)
    finally:
        http.close()
    return out


def tight(call: Any, reps: int) -> float:
    """Median seconds of `call` repeated back to back (after one warm-up call)."""
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return summary(times)["p50"]


def decompose(reps: int) -> list[str]:
    """Each step of a same-node read alone, in GB/s: what bounds the read (section 3 of the docstring)."""
    out = [
        "| model | tokens | MB | memcpy GB/s | pread, reused buffer | pread, fresh buffer | copy out of mmap "
        "| `LocalSpool.read` | read ÷ memcpy | read ÷ 64 MB memcpy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    dram = memcpy_gbps(64 << 20, 5)["gbps"]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        spool = Spool(Path(root))
        for name, n in [("Qwen3-30B-A3B", 8192), ("Qwen3-30B-A3B", 32768), ("Kimi-K2", 8192), ("Kimi-K2", 32768)]:
            rid = f"{name}-{n}"
            nbytes = write(spool, rid, name, n, seed=n)
            (path,) = glob.glob(f"{root}/**/{rid}.bin", recursive=True)
            t = _steps(path, rid, nbytes, reps)
            g = {k: nbytes / v / 1e9 for k, v in t.items()}
            out.append(
                f"| {name} | {n} | {nbytes / 1e6:.2f} | {g['memcpy']:.1f} | {g['reused']:.1f} | {g['fresh']:.1f} "
                f"| {g['mmap']:.1f} | {g['read']:.1f} | {g['read'] / g['memcpy']:.2f}× | {g['read'] / dram:.2f}× |"
            )
            print(out[-1], flush=True)
    out.append(f"memcpy of 64 MB (the machine's memory bandwidth): {dram:.2f} GB/s")
    return out


def _steps(path: str, rid: str, nbytes: int, reps: int) -> dict[str, float]:
    """Median seconds of each step of reading one record of `nbytes` at `path` (see `decompose`)."""
    local = LocalSpool(os.path.dirname(path), probe="", ttl_s=1e9)
    src, dst, reused = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8), uninitialized(nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        return {
            "memcpy": tight(lambda: np.copyto(dst, src), reps),
            "reused": tight(lambda: os.preadv(fd, [reused], 0), reps),
            "fresh": tight(lambda: os.preadv(fd, [uninitialized(nbytes)], 0), reps),
            "mmap": tight(lambda: _copy_mapped(fd, dst), reps),
            "read": tight(lambda: local.read(rid, Selection()), reps),
        }
    finally:
        os.close(fd)


def _copy_mapped(fd: int, dst: np.ndarray) -> None:
    with mmap.mmap(fd, dst.nbytes, prot=mmap.PROT_READ) as mm:
        src = np.frombuffer(mm, dtype=np.uint8)
        np.copyto(dst, src)
        del src


@contextlib.contextmanager
def two_sidecars() -> Iterator[tuple[Any, Any, list[Spool]]]:
    """Two sidecars, each on its own spool in /dev/shm (the node's shared memory, as deployed)."""
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm") as a,
        tempfile.TemporaryDirectory(dir="/dev/shm") as b,
        serve("sidecar", Path(a)) as one,
        serve("sidecar", Path(b)) as two,
    ):
        yield one, two, [Spool(Path(a)), Spool(Path(b))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decompose", action="store_true", help="each step of a same-node read alone (section 3)")
    args = ap.parse_args()
    if args.decompose:
        print(f"load average before: {os.getloadavg()}")
        print("\n".join(decompose(max(args.reps, 50))))
        print(f"load average after: {os.getloadavg()}")
        return
    models = ["Qwen3-30B-A3B"] if args.quick else ["Qwen3-30B-A3B", "DeepSeek-V3", "Kimi-K2"]
    tokens = [2048] if args.quick else [8192, 32768]
    reps = 3 if args.quick else args.reps
    print(f"load average before: {os.getloadavg()}; memcpy 64 MB: {memcpy_gbps(64 << 20, 5)['gbps']:.2f} GB/s")
    with two_sidecars() as (one, two, spools):
        print("\n".join(same_node(one.url, spools[0], models, tokens, reps)))
        if not args.quick:
            print("\n".join(across_nodes([one.url, two.url], spools, reps)))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
