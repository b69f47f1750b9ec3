"""What the row check costs the engine's writer thread per record, beside the record's write.

Per record of `rows` tokens (Qwen3-30B-A3B's shape: 48 MoE layers, top-8 of 128 experts, uint8 as the spool
stores them): thread CPU of `service.spool.row_check.first_bad_row` on true rows (the common case: one pass, no
search), on rows with one layer zeroed from the middle on (the search for the first bad row), and of the write
the writer thread makes anyway (`RecordWriter`: create, append, finalize, on tmpfs). Medians over repetitions;
the check runs on the writer thread, never the scheduler's (`engine_ext/core/row_audit.py`).

Then a thread doing GIL-holding Python steps (a stand-in for the scheduler's) alone and beside a thread that
checks 32k-token records back to back: its steps per second and its slowest step, each way.

    python -m benchmarks.row_check                    # prints two markdown tables
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.spool import Spool
from service.spool.row_check import SGLANG_SENTINELS, first_bad_row

LAYERS, TOPK, EXPERTS = 48, 8, 128


def true_rows(n: int, seed: int = 0) -> np.ndarray:
    """Distinct ids per token and layer, as a router makes them."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, EXPERTS, size=(n, LAYERS, 1))
    return ((first + np.arange(TOPK) * (EXPERTS // TOPK)) % EXPERTS).astype(np.uint8)


def cpu_ms(call: Callable[[], object], reps: int) -> float:
    """Median thread-CPU milliseconds of `call` over `reps` runs (after one warm-up)."""
    call()
    times = []
    for _ in range(reps):
        started = time.thread_time()
        call()
        times.append((time.thread_time() - started) * 1e3)
    return statistics.median(times)


def write_ms(spool_dir: Path, rows: np.ndarray, reps: int) -> float:
    spool = Spool(spool_dir)
    counter = iter(range(1 << 30))

    def write() -> None:
        rid = f"bench-{next(counter)}"
        writer = spool.writer(rid, num_experts=EXPERTS, topk=TOPK, layers=tuple(range(LAYERS)), start=0, prompt_len=0)
        writer.append(rows, publish=False)
        writer.finalize()
        spool.bin_path(rid).unlink()

    return cpu_ms(write, reps)


def python_step(n: int = 2000) -> int:
    """A stand-in for the scheduler's own Python work in a step: bytecode that holds the GIL throughout."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def _steps_per_s(seconds: float) -> float:
    steps, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        python_step()
        steps += 1
    return steps / seconds


def scheduler_beside_checks(rows: np.ndarray, seconds: float, cpus: tuple[int, int]) -> tuple[float, float]:
    """Steps of `python_step` per second on CPU `cpus[0]`, alone and while a thread on CPU `cpus[1]` checks `rows`
    back to back: what the writer thread's check takes from the scheduler's thread, through the GIL (numpy releases
    it inside each comparison) when the two have cores of their own, through the core too when they share one."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})  # this thread only (Linux: pid 0 is the calling thread)
    stop = threading.Event()

    def checker() -> None:
        os.sched_setaffinity(0, {cpus[1]})
        while not stop.is_set():
            first_bad_row(rows, EXPERTS, sentinels=SGLANG_SENTINELS)

    try:
        alone = _steps_per_s(seconds)
        thread = threading.Thread(target=checker, daemon=True)
        thread.start()
        beside = _steps_per_s(seconds)
        stop.set()
        thread.join()
    finally:
        os.sched_setaffinity(0, before)
    return alone, beside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--spool", default="/dev/shm", help="a tmpfs directory, as the spool is")
    ap.add_argument("--seconds", type=float, default=5.0, help="each arm of the scheduler-beside run")
    ap.add_argument("--rounds", type=int, default=3, help="alone / checking pairs")
    args = ap.parse_args()
    print("| tokens | record MB | check, true rows ms (CPU) | ns/row | check, a zeroed layer ms | write ms (CPU) |")
    print("|---|---|---|---|---|---|")
    for n in (8192, 32768):
        good = true_rows(n)
        bad = good.copy()
        bad[n // 2 :, LAYERS // 2] = 0
        assert first_bad_row(good, EXPERTS, sentinels=SGLANG_SENTINELS) is None
        assert first_bad_row(bad, EXPERTS).row == n // 2
        check = cpu_ms(lambda g=good: first_bad_row(g, EXPERTS, sentinels=SGLANG_SENTINELS), args.reps)
        failing = cpu_ms(lambda b=bad: first_bad_row(b, EXPERTS, sentinels=SGLANG_SENTINELS), args.reps)
        with tempfile.TemporaryDirectory(dir=args.spool) as tmp:
            write = write_ms(Path(tmp), good, args.reps)
        mb = good.nbytes / 1e6
        print(f"| {n} | {mb:.1f} | {check:.2f} | {check * 1e6 / n:.0f} | {failing:.2f} | {write:.2f} |")
    print("\n| where the check runs | round | scheduler-like steps/s alone | while 32k records are checked nonstop |")
    print("|---|---|---|---|")
    rows = true_rows(32768)
    for label, cpus in (("a core of its own", (0, 1)), ("the scheduler's core", (0, 0))):
        for round_ in range(args.rounds):
            alone, beside = scheduler_beside_checks(rows, args.seconds, cpus)
            print(f"| {label} | {round_} | {alone:.0f} | {beside:.0f} ({beside / alone:.3f}) |")


if __name__ == "__main__":
    main()
