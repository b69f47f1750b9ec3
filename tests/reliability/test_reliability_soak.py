"""Item 7: soak. Mixed write / fetch / stream / delete for `R3_SOAK_S` seconds (default 600) as fast as it goes.

Writer processes write as fast as the trainers acknowledge (backpressure: at most `MAX_RECORDS` in the spool);
one trainer per writer fetches each record in order as it appears (`wait`), checks it byte-exact (whole record,
a range with a layer subset), and DELETEs it; streamers follow paced writers row block by row block. The sidecar's
RSS and open fds are sampled throughout. Pass: zero errors, zero lost records, RSS and fds flat after warm-up.
`-s` prints the rates held and writes the timeline to `$R3_SOAK_OUT` (JSON) when set.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import httpx
import numpy as np
import pytest
from r3_harness import LAYERS, expected_rows, loadavg, proc_fds, proc_rss_bytes, read_ledger

from service.client import R3Error, RoutedExpertsClient

pytestmark = pytest.mark.slow

DURATION = float(os.environ.get("R3_SOAK_S", "600"))
FETCH_WRITERS = {"sf0": 1024, "sf1": 256, "sf2": 16384}  # prefix -> rows per record (16k rows: a long rollout)
STREAM_WRITERS = {"ss0": 128, "ss1": 128}  # paced: rows arrive in blocks while trainers stream them
ENGINE_WRITERS = {"sf1", "ss1"}  # through engine_ext.writer.SpoolWriter's thread; the others RecordWriter
MAX_RECORDS = 64
SAMPLE_S = 5.0


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.verified: set[str] = set()

    def ok(self, kind: str, rid: str, nbytes: int, blocks: int = 0) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.counts["bytes"] += nbytes
            self.counts["stream_blocks"] += blocks
            self.verified.add(rid)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)


def _done(ledger, writer) -> int | None:
    """Number of records the writer finished, once it has exited; None while it runs."""
    if writer.proc.poll() is None:
        return None
    return sum(1 for e in read_ledger(ledger) if e.get("final"))


def _fetcher(url: str, prefix: str, rows: int, ledger, writer, tally: Tally, stop: threading.Event) -> None:
    with RoutedExpertsClient(url, timeout=30, retries=5) as client:
        i = 0
        while not stop.is_set():
            total = _done(ledger, writer)
            if total is not None and i >= total:
                return
            rid = f"{prefix}-{i:06d}"
            try:
                got = client.get(rid, wait=5)
            except R3Error as exc:
                if type(exc).__name__ in ("RecordNotFound", "NotReady"):
                    total = _done(ledger, writer)
                    if total is None:
                        continue  # not written yet: the writer is behind (backpressure); ask again
                    if i >= total:
                        return  # the writer stopped before this rid
                tally.error(f"{rid}: {exc!r}")
                i += 1
                continue
            except httpx.HTTPError as exc:
                tally.error(f"{rid}: {exc!r}")
                i += 1
                continue
            want = expected_rows(rid, rows)
            if not np.array_equal(got.array, want):
                tally.error(f"{rid}: wrong rows")
            lo, hi = rows // 4, rows // 2
            part = client.get(rid, start=lo, end=hi, layers=[LAYERS[1], LAYERS[4]])
            if not np.array_equal(part.array, want[lo:hi][:, [1, 4], :]):
                tally.error(f"{rid}: wrong range/layers")
            client.ack(rid)
            tally.ok("fetch", rid, want.nbytes + part.array.nbytes)
            i += 1


def _streamer(url: str, prefix: str, rows: int, ledger, writer, tally: Tally, stop: threading.Event) -> None:
    with RoutedExpertsClient(url, timeout=30, retries=5) as client:
        i = 0
        while not stop.is_set():
            total = _done(ledger, writer)
            if total is not None and i >= total:
                return
            rid = f"{prefix}-{i:06d}"
            try:
                blocks = [b.array for b in client.stream(rid, wait=5)]
            except R3Error as exc:
                if type(exc).__name__ in ("RecordNotFound", "NotReady"):
                    total = _done(ledger, writer)
                    if total is None:
                        continue  # not written yet: the writer is behind (backpressure); ask again
                    if i >= total:
                        return  # the writer stopped before this rid
                tally.error(f"stream {rid}: {exc!r}")
                i += 1
                continue
            except httpx.HTTPError as exc:
                tally.error(f"stream {rid}: {exc!r}")
                i += 1
                continue
            got = np.concatenate(blocks) if blocks else None
            if got is None or not np.array_equal(got, expected_rows(rid, rows)):
                tally.error(f"stream {rid}: wrong rows ({len(blocks)} blocks)")
            client.ack(rid)
            tally.ok("stream", rid, got.nbytes if got is not None else 0, blocks=len(blocks))
            i += 1


def test_soak(make_sidecar, make_writer, tmp_path):
    spool_dir = tmp_path / "spool"
    side = make_sidecar(spool_dir, env={"R3_TTL_S": "900", "R3_STALE_S": "60"})
    writers, ledgers = {}, {}
    for prefix, rows in FETCH_WRITERS.items():
        ledgers[prefix] = tmp_path / f"{prefix}.jsonl"
        writers[prefix] = make_writer(spool_dir, ledgers[prefix],
                                      ["--prefix", prefix, "--count", "0", "--duration", str(DURATION), "--rows",
                                       str(rows), "--chunk", "256", "--max-records", str(MAX_RECORDS),
                                       *(["--engine-writer"] if prefix in ENGINE_WRITERS else [])])
    for prefix, rows in STREAM_WRITERS.items():
        ledgers[prefix] = tmp_path / f"{prefix}.jsonl"
        writers[prefix] = make_writer(spool_dir, ledgers[prefix],
                                      ["--prefix", prefix, "--count", "0", "--duration", str(DURATION), "--rows",
                                       str(rows), "--chunk", "16", "--pace", "0.01",
                                       "--max-records", str(MAX_RECORDS),
                                       *(["--engine-writer"] if prefix in ENGINE_WRITERS else [])])
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=_fetcher, args=(side.url, p, r, ledgers[p], writers[p], tally, stop))
               for p, r in FETCH_WRITERS.items()]
    threads += [threading.Thread(target=_streamer, args=(side.url, p, r, ledgers[p], writers[p], tally, stop))
                for p, r in STREAM_WRITERS.items()]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while time.monotonic() - t0 < DURATION + 5 and any(t.is_alive() for t in threads):
        with tally.lock:
            counts = dict(tally.counts)
        samples.append({"t": round(time.monotonic() - t0, 1), "rss_mib": round(proc_rss_bytes(side.pid) / 2**20, 1),
                        "fds": proc_fds(side.pid), "loadavg": loadavg(), **counts})
        time.sleep(SAMPLE_S)
    for w in writers.values():
        w.wait(timeout=60)
    for t in threads:
        t.join(timeout=120)
    stop.set()
    elapsed = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "a trainer hung"

    final = {e["rid"] for p in ledgers for e in read_ledger(ledgers[p]) if e.get("final")}
    lost = sorted(final - tally.verified)
    warm = [s for s in samples if s["t"] >= min(60.0, DURATION / 5)]
    first, last = warm[: max(1, len(warm) // 5)], warm[-max(1, len(warm) // 5):]
    rss_first = np.median([s["rss_mib"] for s in first])
    rss_last = np.median([s["rss_mib"] for s in last])
    fds = [s["fds"] for s in warm]
    c = tally.counts
    report = {
        "duration_s": round(elapsed, 1), "records_written": len(final), "records_verified": len(tally.verified),
        "lost": len(lost), "errors": len(tally.errors),
        "rates": {"records_per_s": round(len(final) / elapsed, 1), "fetches_per_s": round(c["fetch"] / elapsed, 1),
                  "streams_per_s": round(c["stream"] / elapsed, 1),
                  "stream_blocks_per_s": round(c["stream_blocks"] / elapsed, 1),
                  "deletes_per_s": round((c["fetch"] + c["stream"]) / elapsed, 1),
                  "verified_mib_per_s": round(c["bytes"] / elapsed / 2**20, 2)},
        "rss_mib": {"warm_median": rss_first, "end_median": rss_last, "max": max(s["rss_mib"] for s in samples)},
        "fds": {"warm_min": min(fds), "warm_max": max(fds)}, "loadavg_end": loadavg(), "samples": samples,
    }
    if os.environ.get("R3_SOAK_OUT"):
        with open(os.environ["R3_SOAK_OUT"], "w") as f:
            json.dump(report, f, indent=1)
    print("soak:", json.dumps({k: v for k, v in report.items() if k != "samples"}))
    assert not tally.errors, tally.errors[:10]
    assert not lost, lost[:10]
    assert len(final) > 0
    assert rss_last - rss_first < 32, f"RSS grew from {rss_first} to {rss_last} MiB"
    assert max(fds) - min(fds) <= 24, f"open fds ranged {min(fds)}..{max(fds)}"
