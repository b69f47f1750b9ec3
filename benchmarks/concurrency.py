"""Throughput under concurrency: C trainer threads draining one rollout batch from the sidecar.

Each thread has its own `RoutedExpertsClient` (one kept-alive connection) and takes the next chunk of rids
from a shared queue until the batch is done: chunks of one rid through `get`, or of `batch_chunk` rids
through `get_many`. Latency is per HTTP request; GB/s counts payload bytes over the wall time of the batch.

Mode `lean_get` is a reference, not the project's client: the same GET read with the standard library's
`http.client` straight into a Content-Length-sized buffer (`readinto`) and parsed with the client's own
`parse_npy`. It separates what the sidecar can serve from what the client's HTTP stack costs.
"""

from __future__ import annotations

import http.client
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue
from urllib.parse import quote, urlsplit

import numpy as np

from benchmarks.shapes import ModelShape, relabel
from benchmarks.stats import summary
from service.client import R3Error, RoutedExpertsClient
from service.client.decoding import parse_npy
from service.spool import Spool


def write_batch(spool: Spool, shape: ModelShape, bases: list[np.ndarray], records: int, prefix: str) -> list[str]:
    """`records` final records: the base routings, relabeled so every record differs."""
    rids = []
    for i in range(records):
        rid = f"{prefix}-{i:05d}"
        rows = relabel(bases[i % len(bases)], shape, i // len(bases))
        writer = spool.writer(
            rid,
            num_experts=shape.num_experts,
            topk=shape.topk,
            layers=shape.moe_layers,
            start=0,
            prompt_len=rows.shape[0] // 2,
            dtype=shape.dtype,
        )
        writer.append(rows, publish=False)
        writer.finalize()
        rids.append(rid)
    return rids


MODES = ("get", "get_many", "lean_get")


class LeanClient:
    """GET `/routed_experts/<rid>` over one kept-alive `http.client` connection, body read with `readinto`."""

    def __init__(self, url: str, timeout: float = 300) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)

    def get(self, rid: str) -> np.ndarray:
        self.conn.request("GET", f"/routed_experts/{quote(rid, safe='')}?format=npy")
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise R3Error(resp.read().decode("utf-8", "replace"), rid=rid, status=resp.status)
        buf = bytearray(int(resp.getheader("Content-Length")))
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = resp.readinto(view[got:])
            if not n:
                raise ConnectionError(f"{rid}: body ended at {got} of {len(buf)} bytes")
            got += n
        return parse_npy(buf)

    def ping(self) -> None:
        self.conn.request("GET", "/healthz")
        self.conn.getresponse().read()

    def close(self) -> None:
        self.conn.close()


class _Lean:
    """Adapts a `LeanClient` array to the `.array` the drain loop reads."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def drain(
    url: str, rids: list[str], concurrency: int, mode: str, batch_chunk: int, expect_shape: tuple, warm: bool = True
) -> dict:
    """Fetch every rid once with `concurrency` threads; per-request latencies, errors, GB/s.

    `warm`: each thread opens its connection with one small request before the clock starts (a trainer's
    fetchers keep their connections); cold, the first wave also pays `concurrency` connection set-ups at once.
    """
    chunk = batch_chunk if mode == "get_many" else 1
    work: SimpleQueue[list[str]] = SimpleQueue()
    for i in range(0, len(rids), chunk):
        work.put(rids[i : i + chunk])
    local = threading.local()
    clients: list[RoutedExpertsClient | LeanClient] = []
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    payload = [0]

    def client() -> RoutedExpertsClient | LeanClient:
        if not hasattr(local, "client"):
            local.client = (
                LeanClient(url)
                if mode == "lean_get"
                else RoutedExpertsClient(url, timeout=300, retries=0, local_reads=False)
            )
            with lock:
                clients.append(local.client)
        return local.client

    started = [0.0]
    barrier = threading.Barrier(concurrency, action=lambda: started.__setitem__(0, time.perf_counter()))

    def worker() -> None:
        c = client()
        if warm and isinstance(c, LeanClient):
            c.ping()
        elif warm:
            c.engines()
        barrier.wait()
        while True:
            try:
                batch = work.get_nowait()
            except Empty:
                return
            t0 = time.perf_counter()
            try:
                if mode == "get_many":
                    results = c.get_many(batch)
                elif mode == "lean_get":
                    results = [_Lean(c.get(batch[0]))]
                else:
                    results = [c.get(batch[0])]
            except Exception as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            elapsed = time.perf_counter() - t0
            nbytes, bad = 0, []
            for r in results:
                if isinstance(r, R3Error) or r.array.shape != expect_shape:
                    bad.append(repr(r)[:200])
                else:
                    nbytes += r.array.nbytes
            with lock:
                latencies.append(elapsed)
                payload[0] += nbytes
                errors.extend(bad)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - started[0]
    for c in clients:
        c.close()
    lat = summary(latencies) if latencies else {"p50": float("nan"), "p99": float("nan"), "min": float("nan"), "n": 0}
    return {
        "mode": mode,
        "concurrency": concurrency,
        "warm": warm,
        "rids_per_request": chunk,
        "records": len(rids),
        "bytes": payload[0],
        "wall_s": wall,
        "gbps": payload[0] / wall / 1e9,
        "latency": lat,
        "p99_over_p50": lat["p99"] / lat["p50"] if latencies else float("nan"),
        "errors": len(errors),
        "error_samples": errors[:3],
    }
