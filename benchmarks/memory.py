"""Sidecar memory against the spool bytes it indexes: RSS split into private (anon) and shared (tmpfs) pages.

Records live in tmpfs; pages the sidecar reads from them count in its RSS as shared memory (`RssShmem`)
but are the spool's own bytes, not a second copy. `RssAnon` is what the sidecar itself holds.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.concurrency import drain, write_batch
from benchmarks.servers import serve
from benchmarks.shapes import ModelShape

GIB = 1 << 30


def proc_memory(pid: int) -> dict[str, int]:
    """RSS and its parts (bytes) from /proc/<pid>/status, plus USS/PSS from smaps."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    full = psutil.Process(pid).memory_full_info()
    out["USS"], out["PSS"] = full.uss, full.pss
    return out


def available_bytes() -> int:
    return psutil.virtual_memory().available


def fitting_size(wanted: int, spool_root: Path, headroom: int = 5 * GIB) -> int:
    """The largest size up to `wanted` that leaves `headroom` of RAM and fits the spool's file system."""
    free_fs = shutil.disk_usage(spool_root).free
    return max(0, min(wanted, available_bytes() - headroom, free_fs - headroom))


def wait_indexed(url: str, records: int, timeout_s: float = 300.0) -> float:
    """Seconds until the sidecar's `r3_records` gauges add up to `records` (its start-up scan is done)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        text = httpx.get(url + "/metrics", timeout=30).text
        total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("r3_records{"))
        if total >= records:
            return time.perf_counter() - t0
        time.sleep(0.2)
    raise TimeoutError(f"sidecar indexed fewer than {records} records within {timeout_s} s")


def spool_bytes(root: Path) -> int:
    return sum(e.stat().st_size for e in os.scandir(root / "v1" / "records"))


def measure_size(root: Path, shape: ModelShape, bases: list, target_bytes: int, drain_concurrency: int) -> dict:
    """Fill a fresh spool with ~`target_bytes` of records, start a sidecar on it, read RSS before and after
    it serves every record once; the spool is deleted afterwards."""
    from service.spool import Spool

    record_bytes = bases[0].nbytes
    records = max(1, target_bytes // record_bytes)
    shutil.rmtree(root, ignore_errors=True)
    spool = Spool(root)
    try:
        with serve("sidecar", root) as empty:
            baseline = proc_memory(empty.pid)
        rids = write_batch(spool, shape, bases, records, "mem")
        held = spool_bytes(root)
        with serve("sidecar", root) as server:
            index_s = wait_indexed(server.url, records)
            indexed = proc_memory(server.pid)
            result = drain(server.url, rids, drain_concurrency, "get_many", 8, bases[0].shape)
            served = proc_memory(server.pid)
        return {
            "records": records,
            "spool_bytes": held,
            "baseline": baseline,
            "indexed": indexed,
            "served": served,
            "index_s": index_s,
            "drain_errors": result["errors"],
            "drain_gbps": result["gbps"],
            "anon_overhead_ratio": (served["RssAnon"] - baseline["RssAnon"]) / held,
            "rss_over_spool": served["VmRSS"] / held,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
