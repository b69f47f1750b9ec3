"""A writer process the spool model drives command by command: one engine rank, as seen from the spool.

Why a command loop and not a script: the state machine (`spool_model_machine.py`) decides each step, so it must
tell a real writer process what to do next and know when it is done. Commands arrive one JSON line at a time on
stdin; each answer is one JSON line on stdout. Two writers live here, as in an engine process:

- records written through `RecordWriter` (`Spool.writer`), the live-rows path: `open`, `append`, `finish`,
  `churn` (one rid reused many times in a row), `storm` (appends and publishes until this process is killed);
- `engine_ext.core.writer.SpoolWriter` under a byte cap, the finish-time path: `burst` reserves and hands over
  whole records, refused ones fall back (counted); `flush` and `probe` report its accounting.

The engine writer's own usage refresh is switched off (`USAGE_REFRESH_S`) so that its counters change only
through its own writes and an explicit `probe`: the model can then predict every reservation exactly.
Rows are `spool_model_records.rows_for(rid, gen, lo, hi)`: any reader can recompute them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from r3_shape import LAYERS, NUM_EXPERTS, NUM_HIDDEN_LAYERS, TOPK
from spool_model_records import MAX_ROWS, rows_for

import engine_ext.core.writer.spool_writer as engine_writer_module
from service.spool import Spool

engine_writer_module.USAGE_REFRESH_S = 1e9  # probes only on command: the model predicts every reservation


class Agent:
    """The writer state of one process: open records by rid, and the capped engine writer."""

    def __init__(self, spool_dir: str, cap: int, name: str) -> None:
        self.spool = Spool(spool_dir)
        self.name = name
        self.open: dict[str, tuple[object, int]] = {}  # rid -> (RecordWriter, generation)
        self.engine = engine_writer_module.SpoolWriter(spool_dir, max_bytes=cap, engine=f"model/{name}").start()
        self.free_at_probe = self._snapshot()["free"]

    def _new(self, rid: str, gen: int):
        return self.spool.writer(
            rid,
            num_experts=NUM_EXPERTS,
            topk=TOPK,
            layers=LAYERS,
            prompt_len=2,
            engine=f"model/{self.name}",
            num_hidden_layers=NUM_HIDDEN_LAYERS,
        )

    def cmd_open(self, rid: str, gen: int, rows: int) -> dict:
        old = self.open.pop(rid, None)
        if old is not None:
            old[0].close()
        w = self._new(rid, gen)
        if rows:
            w.append(rows_for(rid, gen, 0, rows))
        self.open[rid] = (w, gen)
        return {"rows": w.rows}

    def cmd_append(self, rid: str, n: int) -> dict:
        w, gen = self.open[rid]
        w.append(rows_for(rid, gen, w.rows, w.rows + n))
        return {"rows": w.rows}

    def cmd_finish(self, rid: str, status: str) -> dict:
        w, _ = self.open.pop(rid)
        meta = w.finalize(status)
        return {"rows": meta.rows, "updated": meta.updated}

    def cmd_churn(self, rid: str, gen0: int, times: int, rows: int) -> dict:
        """Reuse `rid` `times` times in a row, each generation written whole: the writer side of the race with a
        sidecar deleting the rid (0f9edea)."""
        for gen in range(gen0, gen0 + times):
            w = self._new(rid, gen)
            w.append(rows_for(rid, gen, 0, rows), publish=False)
            w.finalize("ok")
        return {"gen": gen0 + times - 1}

    def cmd_storm(self, rid: str, gen: int, report_after: int) -> dict:
        """Append one row and publish, again and again, until killed: the kill lands inside a metadata replace
        (a `.tmp` left behind) as often as not. Says so after `report_after` publishes, then never answers."""
        w = self._new(rid, gen)
        n = 0
        while True:
            if w.rows < MAX_ROWS:
                w.append(rows_for(rid, gen, w.rows, w.rows + 1))
            else:
                w.publish()
            n += 1
            if n == report_after:
                reply({"storming": n})

    def cmd_burst(self, records: list[list], split: int) -> dict:
        """The finish-time path: reserve each whole record and hand it over in one op; after the first `split`,
        the rest only once the writer thread is writing (a scheduler reserves while its writer writes); then
        flush. The writer's counters must come out the same whatever the interleaving."""
        from engine_ext.core.records import RecordSpec
        from engine_ext.core.writer import Op

        accepted = []
        for n, (rid, gen, rows) in enumerate(records):
            if n == split:
                self._until_writing()
            if n >= split:
                self._until_one_more_written()
            data = rows_for(rid, gen, 0, rows)
            if self.engine.reserve(data.nbytes) is not None:
                self.engine.note_fallback()
                accepted.append(False)
                continue
            spec = RecordSpec(
                rid=rid,
                num_experts=NUM_EXPERTS,
                topk=TOPK,
                layers=LAYERS,
                start=0,
                prompt_len=2,
                dtype="uint8",
                engine=self.engine.engine,
                num_hidden_layers=NUM_HIDDEN_LAYERS,
            )
            self.engine.submit(Op(rid, spec=spec, rows=data, status="ok"), reserved=True)
            accepted.append(True)
        self.engine.flush(timeout=30)
        return {"accepted": accepted, **self._snapshot()}

    def cmd_forget(self) -> dict:
        """A new run: close every open record (their files are about to go) and let the engine writer drain."""
        for w, _ in self.open.values():
            w.close()
        self.open.clear()
        return self.cmd_flush()

    def _until_writing(self) -> None:
        """Spin until the writer thread has taken the queued ops (it is writing them), or has none left."""
        e = self.engine
        while True:
            with e._lock:
                if e._busy or not e._ops:
                    return
            time.sleep(0)  # not a wait: hands the GIL to the writer thread at once, not after 5 ms

    def _until_one_more_written(self) -> None:
        """Spin until the writer thread has written one more op of its batch (its usage moved), or is idle: each
        later reservation then lands between two writes of one batch, where a double count would show."""
        e = self.engine
        with e._lock:
            seen = e._usage
        while True:
            with e._lock:
                if not e._busy or e._usage != seen:
                    return
            time.sleep(0)  # not a wait: hands the GIL to the writer thread at once, not after 5 ms

    def cmd_flush(self) -> dict:
        self.engine.flush(timeout=30)
        return self._snapshot()

    def cmd_probe(self) -> dict:
        """The writer's usage refresh, now (its thread is idle after the flush): re-measure the spool."""
        self.engine.flush(timeout=30)
        self.engine._probe(scan=True)
        self.free_at_probe = self._snapshot()["free"]
        return self._snapshot()

    def _snapshot(self) -> dict:
        e = self.engine
        with e._lock:
            return {
                "usage": e._usage,
                "reserved": e._reserved,
                "reserved_blocks": e._reserved_blocks,
                "queued": e.stats.queued_bytes,
                "free": e._free,
                "free_at_probe": getattr(self, "free_at_probe", e._free),
                "block": e._block,
                "write_errors": e.stats.write_errors,
                "records_written": e.stats.records_written,
            }


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spool", required=True)
    ap.add_argument("--cap", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--warm", action="store_true", help="wait for a `begin` line before opening the spool")
    args = ap.parse_args(argv)
    if args.warm and json.loads(sys.stdin.readline() or "{}").get("op") != "begin":
        return 0  # a spare never used: its test ended
    agent = Agent(args.spool, args.cap, args.name)
    reply({"ready": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply({"ok": True, **getattr(agent, f"cmd_{op}")(**cmd)})
        except Exception as exc:  # the model decides whether an error is a finding; it must see every one
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
