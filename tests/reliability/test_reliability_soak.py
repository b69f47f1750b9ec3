"""Item 7: soak. Mixed write / fetch / stream / delete for `R3_SOAK_S` seconds (default 600) as fast as it goes.

Writer processes write as fast as the trainers acknowledge (backpressure: at most `MAX_RECORDS` in the spool);
one trainer process per writer (`r3_trainer.py`) follows its records in order as they appear (`wait`), checks each
byte-exact (whole record, and a range with a layer subset) or streams it block by block, and DELETEs it. Every
party is its own process, so the sidecar, not the test's interpreter, is what the machine's cores are shared
with. The sidecar's RSS, open fds and CPU are sampled throughout. Pass: zero errors, zero lost records, RSS and
fds flat after warm-up. `-s` prints the rates held; `R3_SOAK_OUT=file.json` also writes the timeline.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from r3_harness import HERE, REPO, loadavg, proc_fds, proc_rss_bytes, read_ledger

pytestmark = pytest.mark.slow

DURATION = float(os.environ.get("R3_SOAK_S", "600"))
FETCH_WRITERS = {"sf0": 1024, "sf1": 256, "sf2": 16384}  # prefix -> rows per record (16k rows: a long rollout)
STREAM_WRITERS = {"ss0": 128, "ss1": 128}  # paced: rows arrive in blocks while trainers stream them
ENGINE_WRITERS = {"sf1", "ss1"}  # through engine_ext.core.writer.SpoolWriter's thread; the others RecordWriter
MAX_RECORDS = 64
SAMPLE_S = 5.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _results(path: Path) -> list[dict]:
    return read_ledger(path)


@pytest.fixture
def shm_spool(tmp_path):
    """The spool on tmpfs, as deployed (`/dev/shm` or an in-memory emptyDir), when the machine has one."""
    base = Path(tempfile.mkdtemp(prefix="r3-soak-", dir="/dev/shm")) if os.path.isdir("/dev/shm") else tmp_path
    yield base / "spool"
    if base != tmp_path:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(int(DURATION) + 600)
def test_soak(make_sidecar, make_writer, tmp_path, shm_spool):
    side = make_sidecar(shm_spool, env={"R3_TTL_S": "900", "R3_STALE_S": "60"})
    writers, trainers, ledgers, outs = {}, [], {}, {}
    plan = [(p, r, "fetch", "256", []) for p, r in FETCH_WRITERS.items()]
    plan += [(p, r, "stream", "16", ["--pace", "0.01"]) for p, r in STREAM_WRITERS.items()]
    for prefix, rows, mode, chunk, extra in plan:
        ledgers[prefix], outs[prefix] = tmp_path / f"{prefix}.jsonl", tmp_path / f"{prefix}.out.jsonl"
        writers[prefix] = make_writer(
            shm_spool,
            ledgers[prefix],
            [
                "--prefix",
                prefix,
                "--count",
                "0",
                "--duration",
                str(DURATION),
                "--rows",
                str(rows),
                "--chunk",
                chunk,
                "--max-records",
                str(MAX_RECORDS),
                *extra,
                *(["--engine-writer"] if prefix in ENGINE_WRITERS else []),
            ],
        )
        trainers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "r3_trainer.py"),
                    "--url",
                    side.url,
                    "--prefix",
                    prefix,
                    "--rows",
                    str(rows),
                    "--mode",
                    mode,
                    "--ledger",
                    str(ledgers[prefix]),
                    "--out",
                    str(outs[prefix]),
                ],
                env={**os.environ, "PYTHONPATH": str(REPO)},
                cwd=REPO,
                stderr=subprocess.PIPE,
            )
        )
    t0, cpu0 = time.monotonic(), _cpu_seconds(side.pid)
    samples = []
    try:
        while time.monotonic() - t0 < DURATION + 5 and any(t.poll() is None for t in trainers):
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 1),
                    "rss_mib": round(proc_rss_bytes(side.pid) / 2**20, 1),
                    "fds": proc_fds(side.pid),
                    "cpu_s": round(_cpu_seconds(side.pid) - cpu0, 1),
                    "loadavg": loadavg(),
                }
            )
            time.sleep(SAMPLE_S)  # not a wait: the sampling period of the soak's measurements
        for w in writers.values():
            w.wait(timeout=120)
        trainer_errors = []
        for t in trainers:
            _, err = t.communicate(timeout=120)
            if t.returncode:
                trainer_errors.append(err.decode(errors="replace")[-1000:])
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
    elapsed = time.monotonic() - t0
    sidecar_cores = (_cpu_seconds(side.pid) - cpu0) / elapsed

    final = {e["rid"] for p in ledgers for e in read_ledger(ledgers[p]) if e.get("final")}
    results = [r for p in outs for r in _results(outs[p])]
    errors = [r for r in results if "error" in r] + [{"error": e} for e in trainer_errors]
    verified = {r["rid"] for r in results if "error" not in r}
    lost = sorted(final - verified)
    kinds = collections.Counter(r.get("kind") for r in results if "error" not in r)
    nbytes = sum(r.get("bytes", 0) for r in results)
    blocks = sum(r.get("blocks", 0) for r in results)
    warm = [s for s in samples if s["t"] >= min(60.0, DURATION / 5)] or samples
    first, last = warm[: max(1, len(warm) // 5)], warm[-max(1, len(warm) // 5) :]
    rss_first = float(np.median([s["rss_mib"] for s in first]))
    rss_last = float(np.median([s["rss_mib"] for s in last]))
    fds = [s["fds"] for s in warm]
    report = {
        "duration_s": round(elapsed, 1),
        "records_written": len(final),
        "records_verified": len(verified),
        "lost": len(lost),
        "errors": len(errors),
        "rates": {
            "records_per_s": round(len(final) / elapsed, 1),
            "fetches_per_s": round(kinds["fetch"] / elapsed, 1),
            "http_requests_per_s": round((3 * kinds["fetch"] + 2 * kinds["stream"]) / elapsed, 1),
            "streams_per_s": round(kinds["stream"] / elapsed, 1),
            "stream_blocks_per_s": round(blocks / elapsed, 1),
            "deletes_per_s": round(len(verified) / elapsed, 1),
            "verified_mib_per_s": round(nbytes / elapsed / 2**20, 2),
        },
        "rss_mib": {"warm_median": rss_first, "end_median": rss_last, "max": max(s["rss_mib"] for s in samples)},
        "fds": {"warm_min": min(fds), "warm_max": max(fds)},
        "sidecar_cpu_cores": round(sidecar_cores, 2),
        "loadavg_start": samples[0]["loadavg"],
        "loadavg_end": loadavg(),
        "samples": samples,
    }
    if os.environ.get("R3_SOAK_OUT"):
        with open(os.environ["R3_SOAK_OUT"], "w") as f:
            json.dump(report, f, indent=1)
    print("soak:", json.dumps({k: v for k, v in report.items() if k != "samples"}))
    assert not errors, errors[:10]
    assert not lost, lost[:10]
    assert len(final) > 0
    assert rss_last - rss_first < 32, f"RSS grew from {rss_first} to {rss_last} MiB"
    assert max(fds) - min(fds) <= 24, f"open fds ranged {min(fds)}..{max(fds)}"
