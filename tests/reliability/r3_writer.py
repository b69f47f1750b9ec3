"""A writer process for the reliability suite: writes records through `service.spool`, like one engine rank.

Each record `<prefix>-<i>` holds `expected_rows(rid, rows)`, appended `--chunk` rows at a time with `--pace`
seconds between appends; a JSON line goes to `--ledger` once a record is final (and, with `--open`, each time an
open record publishes rows), so the test knows exactly what was written even when this process is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from r3_harness import LAYERS, NUM_EXPERTS, NUM_HIDDEN_LAYERS, TOPK, expected_rows

from service.spool import Spool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spool", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--prefix", default="w")
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--pace", type=float, default=0.0)
    ap.add_argument("--open", type=int, default=0, help="leave this many extra records open, then sleep")
    ap.add_argument("--duration", type=float, default=0.0, help="keep writing new records for this long")
    ap.add_argument("--max-records", type=int, default=0, help="backpressure: wait while the spool holds this many")
    ap.add_argument(
        "--engine-writer",
        action="store_true",
        help="hand rows to engine_ext.core.writer.SpoolWriter (the scheduler's path) instead of RecordWriter",
    )
    args = ap.parse_args(argv)

    spool = Spool(args.spool)
    ledger = open(args.ledger, "a", buffering=1)  # noqa: SIM115 - line-buffered for the life of the process

    def note(**entry) -> None:
        ledger.write(json.dumps(entry) + "\n")

    engine_writer = _engine_writer(args.spool) if args.engine_writer else None

    def write_one(rid: str, final: bool):
        rows = expected_rows(rid, args.rows)
        if engine_writer is not None:
            _via_engine_writer(engine_writer, rid, rows, args.chunk, args.pace)
            note(rid=rid, rows=args.rows, final=True)
            return None
        w = spool.writer(
            rid,
            num_experts=NUM_EXPERTS,
            topk=TOPK,
            layers=LAYERS,
            prompt_len=args.rows // 2,
            engine=f"rel/{os.getpid()}",
            num_hidden_layers=NUM_HIDDEN_LAYERS,
        )
        for lo in range(0, args.rows, args.chunk):
            w.append(rows[lo : lo + args.chunk])
            if not final:
                note(rid=rid, rows=w.meta.rows, final=False)
            if args.pace:
                time.sleep(args.pace)  # not a wait: the producer's pace
        if final:
            w.finalize()
            note(rid=rid, rows=args.rows, final=True)
        return w

    i = args.first
    deadline = time.monotonic() + args.duration
    while i < args.first + args.count or time.monotonic() < deadline:
        while args.max_records and len(spool.record_names()) >= args.max_records and time.monotonic() < deadline:
            time.sleep(0.005)  # not a wait: the producer's flow control, room in the spool or the run's end
        write_one(f"{args.prefix}-{i:06d}", final=True)
        i += 1
    if engine_writer is not None:
        engine_writer.close(timeout=60)
        assert engine_writer.stats.write_errors == 0, engine_writer.stats
    note(event="done", count=i - args.first)
    still_open = [write_one(f"{args.prefix}-open-{j:04d}", final=False) for j in range(args.open)]
    if args.open:
        note(event="open_done")
        _keep_alive(still_open)
    return 0


def _keep_alive(records: list) -> None:
    """A live engine that produces no row for a while: its open records stay fresh (an empty append publishes a
    new `updated`), so the sidecar's staleness sweep aborts them only once this process is killed. Without it, a
    1 s `R3_STALE_S` aborted them before a loaded test had its waiters connected."""
    nothing = np.empty((0, len(LAYERS), TOPK), dtype=np.int32)
    while True:
        for w in records:
            w.append(nothing)
        time.sleep(0.1)  # not a wait: the engine's liveness, until the test kills it


def _engine_writer(spool_dir: str):
    from engine_ext.core.writer import SpoolWriter

    return SpoolWriter(spool_dir, engine=f"rel/{os.getpid()}").start()


def _via_engine_writer(writer, rid: str, rows, chunk: int, pace: float) -> None:
    """The live-rows path of the engine: an open op, one op per block of rows, a final op; never blocking."""
    from engine_ext.core.records import RecordSpec
    from engine_ext.core.writer import Op

    spec = RecordSpec(
        rid=rid,
        num_experts=NUM_EXPERTS,
        topk=TOPK,
        layers=LAYERS,
        start=0,
        prompt_len=len(rows) // 2,
        dtype="uint8",
        engine=writer.engine,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
    )
    ops = [Op(rid, spec=spec)] + [Op(rid, rows=rows[lo : lo + chunk]) for lo in range(0, len(rows), chunk)]
    ops.append(Op(rid, status="ok"))
    for op in ops:
        while not writer.submit(op):  # refused (queue or spool full): the engine would fall back; here we retry
            time.sleep(0.001)  # not a wait: the producer retries, as an engine would fall back
        if pace and op.rows is not None:
            time.sleep(pace)  # not a wait: the producer's pace


if __name__ == "__main__":
    raise SystemExit(main())
