"""What live rows cost per output token, publishing an open record every step vs once per interval.

Each decode step hands one row per running request to the real `LiveRows` and `SpoolWriter` (the scheduler
thread's part and the writer thread's), at a fixed step period, while a real sidecar process watches the
spool. Measured per output token: the engine process's CPU (both threads), the sidecar's CPU (its file
events and metadata reads), and how many `.json` replaces the writer made. Intervals are interleaved within
each repetition; medians over repetitions.

    python -m benchmarks.live_publish                 # prints a markdown table
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.servers import serve
from benchmarks.stats import proc_stat
from engine_ext.core.records import ModelShape
from engine_ext.core.settings import Mode
from engine_ext.core.writer import SpoolWriter
from engine_ext.sglang.collect import Collector
from engine_ext.sglang.live import LiveRows, StepRequest, decode_layout
from service.spool import Spool

LAYERS, TOPK, EXPERTS, PROMPT = 8, 8, 64, 64  # the real-server benchmark's tiny Qwen3-MoE rows


def _cpu_s(pid: int) -> float:
    """User + system seconds of process `pid` (all its threads), from /proc."""
    return proc_stat(f"/proc/{pid}/stat")[1]


def one_run(spool_dir: Path, sidecar_pid: int, batch: int, steps: int, step_s: float, interval_s: float) -> dict:
    """`steps` decode steps of `batch` live requests; CPU per token of this process and of the sidecar."""
    writer = SpoolWriter(spool_dir, queue_bytes=1 << 28, engine="bench", publish_interval_s=interval_s).start()
    shape = ModelShape(EXPERTS, TOPK, tuple(range(LAYERS)), None, LAYERS)
    live = LiveRows(Collector(writer, shape, mode=Mode.SIDECAR, capture_all=False, dtype="uint8", engine="bench"))
    rids = [f"live-{interval_s}-{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        live.begin(rid, start=0, prompt_len=PROMPT, retractions=0, first_pos=0, pool_idx=i)
        live.feed(rid, 0, torch.zeros((PROMPT, LAYERS, TOPK), dtype=torch.int32), limit=1 << 30)
    writer.flush(60)
    publishes = 0
    write_meta = Spool.write_meta

    def counting(spool: Spool, meta) -> None:
        nonlocal publishes
        publishes += 1
        write_meta(spool, meta)

    Spool.write_meta = counting
    rows = torch.randint(0, EXPERTS, (batch, LAYERS, TOPK), dtype=torch.int32)
    seq_lens = [PROMPT + 1] * batch
    ours, theirs = time.process_time(), _cpu_s(sidecar_pid)
    next_step = time.monotonic()
    try:
        for _ in range(steps):
            reqs = [StepRequest(rid, False, False, 0, False, 0, PROMPT, 1 << 30, i) for i, rid in enumerate(rids)]
            layout, total = decode_layout(seq_lens)
            live.feed_step("DECODE", layout, total, reqs, rows, first_extend=False)
            seq_lens = [s + 1 for s in seq_lens]
            next_step += step_s
            time.sleep(max(0.0, next_step - time.monotonic()))
        writer.flush(60)
        time.sleep(0.3)  # the sidecar's last events (its watcher debounces 50 ms)
        ours, theirs = time.process_time() - ours, _cpu_s(sidecar_pid) - theirs
    finally:
        Spool.write_meta = write_meta
        for rid in rids:
            live.end(rid)
        writer.close()
    tokens = batch * steps
    return {"engine_us": 1e6 * ours / tokens, "sidecar_us": 1e6 * theirs / tokens, "publishes": publishes / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--intervals", default="0,0.1", help="publish intervals, seconds (0: every step)")
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    cases = [(8, 0.06), (8, 0.02), (64, 0.02), (256, 0.02)]
    print(f"load average before: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        "| running requests | step ms | publish interval s | engine CPU µs/token | sidecar CPU µs/token "
        "| .json replaces per token |"
    )
    print("|---|---|---|---|---|---|")
    with (
        tempfile.TemporaryDirectory(prefix="r3-bench-publish-", dir="/dev/shm") as tmp,
        serve("sidecar", Path(tmp)) as side,
    ):
        for batch, step_s in cases:
            runs: dict[float, list[dict]] = {iv: [] for iv in intervals}
            for _ in range(args.reps):
                for iv in intervals:
                    runs[iv].append(one_run(Path(tmp), side.pid, batch, args.steps, step_s, iv))
            for iv in intervals:
                med = {k: statistics.median(r[k] for r in runs[iv]) for k in runs[iv][0]}
                print(
                    f"| {batch} | {step_s * 1e3:.0f} | {iv:g} | {med['engine_us']:.0f} | {med['sidecar_us']:.0f} "
                    f"| {med['publishes']:.2f} |"
                )
    print(f"load average after: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
