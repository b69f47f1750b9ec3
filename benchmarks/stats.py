"""Small timing helpers: repeated wall-clock samples and their summary; CPU time of a process or thread."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np


def proc_stat(path: str | os.PathLike[str]) -> tuple[int, float]:
    """(session id, user + system CPU seconds) from a `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[3]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def samples(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of `reps` calls of `fn`, after `warmup` unmeasured calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call: CPU time is what a busy machine cannot inflate."""
    c0, t0 = time.thread_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, p99, min and count: the median is what the tables quote (robust to a shared machine)."""
    arr = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "min": float(arr.min()),
        "n": len(arr),
    }


def reps_for(nbytes: int, budget_bytes: int, low: int = 3, high: int = 30) -> int:
    """Repetitions so that one measurement moves about `budget_bytes`, clamped to `[low, high]`."""
    return max(low, min(high, budget_bytes // max(nbytes, 1)))
