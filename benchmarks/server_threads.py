"""Where a real SGLang server's CPU goes, thread by thread, with and without the plugin.

The real-server benchmark (`benchmarks.real_server`) counts CPU per process; this splits the scheduler
process into its main thread (SGLang's scheduling and the forward) and its other threads (SGLang's gloo and
ZMQ threads; with the plugin also the spool writer, the collect ticker and telemetry), so a difference
between modes can be placed. Modes run one after another in the order given, each on a fresh server:
run them in both orders to see the order effect.

    python -m benchmarks.server_threads upstream sidecar live     # ~2 minutes a mode
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
os.environ.setdefault("R3_TEST_SGLANG_CPU", "1")

from sglang_server import running

from benchmarks.real_server.workloads import Bench, throughput
from benchmarks.stats import proc_stat


def thread_cpu_s(session: int) -> dict[tuple[str, bool], float]:
    """CPU seconds of every thread of the session's processes, keyed by (process name, is its main thread)."""
    out: dict[tuple[str, bool], float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if proc_stat(stat)[0] != session:
                continue
            proc = stat.parent
            name = (proc / "comm").read_text().strip()
            for task in (proc / "task").iterdir():
                with contextlib.suppress(OSError):
                    key = (name, task.name == proc.name)
                    out[key] = out.get(key, 0.0) + proc_stat(task / "stat")[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modes", nargs="+", choices=("upstream", "sidecar", "live"))
    ap.add_argument("--batches", type=int, default=2, help="throughput batches measured per mode (after one warm-up)")
    args = ap.parse_args()
    bench = Bench()
    print("| mode (in run order) | process | thread | CPU ms per output token |")
    print("|---|---|---|---|")
    for mode in args.modes:
        with (
            tempfile.TemporaryDirectory(prefix="r3-threads-", dir="/dev/shm") as tmp,
            running(bench.server_config(mode), Path(tmp)) as stack,
        ):
            throughput(stack, bench, "warm")
            before = thread_cpu_s(stack.server.proc.pid)
            tokens = sum(throughput(stack, bench, f"m{i}")["tokens"] for i in range(args.batches))
            after = thread_cpu_s(stack.server.proc.pid)
        for (name, main_thread), cpu in sorted(after.items(), key=lambda kv: -kv[1]):
            spent = cpu - before.get((name, main_thread), 0.0)
            if spent > 0:
                thread = "main" if main_thread else "all others"
                print(f"| {mode} | {name} | {thread} | {1e3 * spent / tokens:.3f} |")


if __name__ == "__main__":
    main()
