"""The spool protocol as a hypothesis state machine over real processes (issue 40, item 2).

Why a state machine: the spool's failures are interleavings (a delete against a writer reusing the rid, a
reservation while the writer thread writes, a stream opened ahead of its rows, a kill inside a metadata replace),
and a rule-based machine tries many of them, checks every answer against the model, prints the seed and shrinks a
failure to a short sequence. Rules drive two writer processes (`r3_spool_agent.py`), one sidecar process and the
real client; `spool_model_checks` holds what must stay true.

Checked after every step: every answer the step got (`judge`: exact rows, allowed status, no 5xx), the stream
threads that ended (`StreamWatch.judge`), every final `.json` on disk against its `.bin` (`check_disk`).
Every `SWEEP_EVERY` steps and at the end of a run (they cost a round trip per writer and a batch of all records):
every record the model knows, by one batch GET; each engine writer's accounting against the model and the files
(`check_writer`); the sidecar's `r3_spool_bytes` against the files.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from spool_model_checks import TALLY, Violation, check_disk, check_writer, disk_bytes, judge, leftovers, pages_of
from spool_model_procs import AGENTS, BURST_ROWS, CAP, RESCAN_S, STALE_S, TTL_S, Procs
from spool_model_records import MAX_ROWS, Model, Rec
from spool_model_trainers import StreamWatch, answer_of, item_answer
from waiting import WaitTimeout, wait_until

from service.client import RoutedExpertsClient
from service.spool.record.meta import safe_name

SWEEP_EVERY = 25
KILL_EVERY = 60  # steps between writer kills (a respawn costs a process start)
RESTARTS_PER_RUN = 1  # a sidecar restart costs its start (about a second): one per run
STREAMS_PER_RUN = 16  # by count, not by how many still run: rules must follow from the model, not from timing
PLANT_EVERY = 40
RECLAIM_S = 12 * RESCAN_S  # the sidecar rescans every RESCAN_S: a leftover older than R3_STALE_S goes at the next
RUNS = [0]  # runs so far in this process: each run's rids get their own prefix
W = st.integers(0, AGENTS - 1)
PICK = st.integers(0, 1 << 16)


class SpoolMachine(RuleBasedStateMachine):
    procs: Procs  # set by the test: the processes outlive one run
    delete_races = False  # the rule `delete_races_reuse` on: it finds an open race (D11), so its own test

    def __init__(self) -> None:
        super().__init__()
        RUNS[0] += 1
        self.model = Model(prefix=f"r{RUNS[0]}", stale_s=STALE_S, ttl_s=TTL_S)
        self.steps = 0
        self.last_kill = 0
        self.restarts = 0
        self.down: list[tuple[float, float]] = []  # when `restart_sidecar` had the sidecar down (monotonic)
        self.streams: list[StreamWatch] = []
        self.streams_started = 0
        self.planted: dict[str, float] = {}  # crash leftovers made an hour old, and when
        self.last_plant = 0
        self.charged = [0] * AGENTS  # each engine writer's usage, as the model predicts it
        self.since_probe: list[list[str]] = [[] for _ in range(AGENTS)]  # engine records since its probe
        self.seen_meta: dict[str, tuple] | None = {} if self.procs.tmpfs else None  # for `check_disk`

    # ---- set-up and helpers ---------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.procs.ensure()
        self.procs.reset()
        for w in range(AGENTS):
            self._probe(w)
        url = self.procs.sidecar.url
        self.http = RoutedExpertsClient(url, timeout=30, retries=20, local_reads=False)
        self.local = RoutedExpertsClient(url, timeout=30, retries=20, local_reads=True)

    def _agent(self, w: int):
        return self.procs.agents[w]

    def _pick(self, recs: list[Rec], i: int) -> Rec:
        return sorted(recs, key=lambda r: r.rid)[i % len(recs)]

    def _judge(self, rec: Rec, answer: tuple[int, bytes, str | None], how: str) -> None:
        judge(rec, *answer, ttl_s=TTL_S, stale_s=STALE_S, how=how)

    def _probe(self, w: int) -> None:
        snap = self._agent(w).call("probe")
        self.charged[w] = snap["usage"]
        self.since_probe[w] = []

    def _writable(self) -> list[Rec]:
        return [r for r in self.model.by_state("live") if r.rows < MAX_ROWS - 16]

    # ---- writers ----------------------------------------------------------------------------------
    @rule(w=W, rows=st.integers(0, 8))
    def open_record(self, w: int, rows: int) -> None:
        rec = Rec(self.model.new_rid("n"), w, self.model.gen())
        rec.rows = self._agent(w).call("open", rid=rec.rid, gen=rec.gen, rows=rows)["rows"]
        rec.touched = time.monotonic()
        self.model.recs[rec.rid] = rec

    @precondition(lambda self: self._writable())
    @rule(i=PICK, n=st.integers(1, 8))
    def append_rows(self, i: int, n: int) -> None:
        rec = self._pick(self._writable(), i)
        rec.rows = self._agent(rec.writer).call("append", rid=rec.rid, n=n)["rows"]
        rec.touched = time.monotonic()

    @precondition(lambda self: self.model.by_state("live"))
    @rule(i=PICK, aborted=st.booleans())
    def finish(self, i: int, aborted: bool) -> None:
        rec = self._pick(self.model.by_state("live"), i)
        rec.final_sent = time.monotonic()
        self._agent(rec.writer).call("finish", rid=rec.rid, status="aborted" if aborted else "ok")
        rec.state, rec.status, rec.touched = "final", "aborted" if aborted else "ok", time.monotonic()

    @precondition(lambda self: self.model.by_state("final", "acked", "orphan", "raced"))
    @rule(i=PICK, w=W, rows=st.integers(0, 8))
    def reuse_rid(self, i: int, w: int, rows: int) -> None:
        """A new request under a rid already used (a retried request, an engine restarted with the same ids)."""
        old = self._pick(self.model.by_state("final", "acked", "orphan", "raced"), i)
        rec = Rec(old.rid, w, self.model.gen())
        rec.rows = self._agent(w).call("open", rid=rec.rid, gen=rec.gen, rows=rows)["rows"]
        self.model.recs[rec.rid] = rec

    @precondition(lambda self: self.delete_races and self.model.by_state("final", "acked"))
    @rule(i=PICK, w=W, times=st.integers(50, 200))
    def delete_races_reuse(self, i: int, w: int, times: int) -> None:
        """Trainers acknowledge a rid while a writer writes it again and again (the race of 0f9edea): afterwards
        the rid is gone or holds its last generation whole, never metadata without its rows."""
        rec = self._pick(self.model.by_state("final", "acked"), i)
        gen0 = self.model.next_gen + 1
        self.model.next_gen += times
        stop = threading.Event()
        codes: list[int] = []

        def acker() -> None:
            with httpx.Client(base_url=self.procs.sidecar.url, timeout=30) as c:
                while not stop.is_set():
                    codes.append(c.delete(f"/routed_experts/{rec.rid}").status_code)

        t = threading.Thread(target=acker, daemon=True)
        t.start()
        try:
            gen = self._agent(w).call("churn", rid=rec.rid, gen0=gen0, times=times, rows=8)["gen"]
        finally:
            stop.set()
            t.join(30)
        if any(c >= 500 for c in codes):
            raise Violation(f"DELETE {rec.rid} during reuse answered {sorted(set(codes))}")
        self.model.recs[rec.rid] = Rec(rec.rid, w, gen, rows=8, state="raced", final_sent=time.monotonic())
        check_disk(self.procs.records, self.seen_meta)

    @rule(w=W, over=st.integers(1, 4), back=st.integers(0, 3))
    def burst(self, w: int, over: int, back: int) -> None:
        """The engine's finish-time path hands whole records to its capped writer, `over` more than the cap has
        room for: all but the last `back` of those that fit, then the rest one by one between two writes of the
        writer thread's batch (as a scheduler reserves while its writer writes). Each must be accepted exactly
        while the cap has room (the model's count), refused once it has none (697cdc5)."""
        self._probe(w)  # the writer's refresh (every second in an engine): acks and expiries give room back
        size = BURST_ROWS * 24 + 1024
        room = max(0, (CAP - self.charged[w]) // size)  # records the cap still holds, as the model counts
        k, split = room + over, max(1, room - back)  # the reservations that cross the cap come mid-batch
        recs = [Rec(self.model.new_rid("e"), w, self.model.gen(), rows=BURST_ROWS, state="final") for _ in range(k)]
        sent = time.monotonic()
        snap = self._agent(w).call("burst", records=[[r.rid, r.gen, r.rows] for r in recs], split=split)
        charge = self.charged[w]
        for rec, accepted in zip(recs, snap["accepted"], strict=True):
            room = charge + size <= CAP
            if accepted != room:
                why = "refused with room" if room else "accepted over the cap"
                raise Violation(f"writer {w}: {rec.rid} {why}: model counts {charge} of {CAP} bytes, record {size}")
            if accepted:
                charge += size
                rec.final_sent, rec.touched, rec.engine = sent, time.monotonic(), True
                self.model.recs[rec.rid] = rec
                self.since_probe[w].append(safe_name(rec.rid))
        self.charged[w] = charge
        self._check_writer(w, snap)

    @rule(w=W)
    def probe(self, w: int) -> None:
        """The engine writer's periodic usage refresh (switched to on-demand in the agent)."""
        self._probe(w)

    @precondition(lambda self: self.steps - self.last_kill >= KILL_EVERY)
    @rule(w=W, storm=st.booleans())
    def kill_writer(self, w: int, storm: bool) -> None:
        """SIGKILL a writer process, idle or in the middle of publishing a record; a new one takes its place.
        Its unfinished records must never be served as finished."""
        self.last_kill = self.steps
        agent = self._agent(w)
        if storm:
            rec = Rec(self.model.new_rid("s"), w, self.model.gen(), rows=MAX_ROWS, state="orphan")
            self.model.recs[rec.rid] = rec
            agent.send("storm", rid=rec.rid, gen=rec.gen, report_after=20)
            agent.read()  # {"storming": n}: it is publishing now
        self.procs.respawn(w)
        for rec in self.model.live_of(w):
            rec.state = "orphan"
        for name in self._age(leftovers(self.procs.records)):  # what the kill left, made old: to be reclaimed
            self.planted.setdefault(name, time.monotonic())
        self._probe(w)

    # ---- sidecar ----------------------------------------------------------------------------------
    @precondition(lambda self: self.restarts < RESTARTS_PER_RUN and self.steps >= 20)
    @rule(kill=st.booleans())
    def restart_sidecar(self, kill: bool) -> None:
        """SIGKILL or SIGTERM the sidecar and start it again on the same spool: it indexes the spool (and
        reclaims crash leftovers older than `R3_STALE_S`) before it reports ready."""
        self.restarts += 1
        old = set(leftovers(self.procs.records))
        aged = self._age(old)
        down_from = time.monotonic()
        self.procs.restart_sidecar(signal.SIGKILL if kill else signal.SIGTERM)
        self.down.append((down_from, time.monotonic()))
        still = sorted(set(leftovers(self.procs.records)) & set(aged))
        if still:
            raise Violation(f"restarted sidecar ready with crash leftovers older than R3_STALE_S: {still}")
        for name in aged:
            self.planted.pop(name, None)

    @precondition(lambda self: self.steps - self.last_plant >= PLANT_EVERY)
    @rule(orphan_bin=st.booleans())
    def crash_leftover(self, orphan_bin: bool) -> None:
        """Leave in the spool what a crash leaves, an hour old: a writer killed inside a metadata replace (its
        `.tmp`) or a sidecar killed between a delete's two unlinks (a `.bin` with no `.json`). Planted, because a
        real SIGKILL lands inside that window rarely (0 of 10 mid-publish kills measured); the sidecar's rescan
        must reclaim them (`every_step` checks, D5)."""
        self.last_plant = self.steps
        stem = f"{self.model.new_rid('l')}"
        name = f"{stem}.bin" if orphan_bin else f".{stem}.json.{os.getpid()}.{self.steps}.tmp"
        (self.procs.records / name).write_bytes(b"\x00" * 48 if orphan_bin else b'{"v": 1, "rid"')
        self._age([name])
        self.planted[name] = time.monotonic()

    def _check_leftovers(self) -> None:
        """Crash leftovers an hour old are gone within a few rescans (or by a restart's ready)."""
        if not self.planted:
            return
        present = set(leftovers(self.procs.records))
        now = time.monotonic()
        for name, since in list(self.planted.items()):
            if name not in present:
                del self.planted[name]
            elif now - since > RECLAIM_S:
                raise Violation(f"crash leftover {name} (an hour old) still there {now - since:.1f} s later")

    def _age(self, names) -> list[str]:
        aged = []
        past = time.time() - 3600
        for name in names:
            try:
                os.utime(self.procs.records / name, (past, past))
                aged.append(name)
            except FileNotFoundError:
                continue
        return aged

    # ---- trainers ---------------------------------------------------------------------------------
    @precondition(lambda self: self.model.recs)
    @rule(i=PICK, local=st.booleans())
    def get(self, i: int, local: bool) -> None:
        rec = self._pick(list(self.model.recs.values()), i)
        client = self.local if local else self.http
        # A final record may not be indexed yet (its file event is due): wait for it, unless its TTL may have run
        # out, where the 404 is allowed anyway and a wait only spends 2 s (a quarter of a run's time before).
        wait = 2 if rec.state == "final" and not rec.may_be_expired(TTL_S) else 0
        self._judge(rec, answer_of(lambda: client.get(rec.rid, wait=wait)), "local get" if local else "get")

    @precondition(lambda self: self.model.recs)
    @rule(picks=st.lists(PICK, min_size=1, max_size=6), local=st.booleans())
    def batch(self, picks: list[int], local: bool) -> None:
        recs = list({self._pick(list(self.model.recs.values()), i).rid: None for i in picks})
        recs = [self.model.recs[r] for r in recs]
        client = self.local if local else self.http
        got = client.get_many([r.rid for r in recs], wait=0)
        for rec, item in zip(recs, got, strict=True):
            self._judge(rec, item_answer(item), "batch")

    @precondition(lambda self: self._writable() and self.streams_started < STREAMS_PER_RUN)
    @rule(i=PICK, ahead=st.integers(-4, 6))
    def stream(self, i: int, ahead: int) -> None:
        """A trainer streams a live record from a row near its end, possibly past the rows written so far."""
        rec = self._pick(self._writable(), i)
        start = max(0, rec.rows + ahead)
        self.streams_started += 1
        self.streams.append(StreamWatch(rec.rid, rec.gen, start, self.procs.sidecar.url).begin())

    @precondition(lambda self: self.model.by_state("final", "orphan", "raced"))
    @rule(i=PICK)
    def ack(self, i: int) -> None:
        rec = self._pick(self.model.by_state("final", "orphan", "raced"), i)
        self.http.ack(rec.rid, missing_ok=True)
        rec.state = "acked"
        self._judge(rec, answer_of(lambda: self.http.get(rec.rid)), "get after ack")

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def every_step(self) -> None:
        self.steps += 1
        TALLY["steps"] += 1
        self._judge_streams(done_only=True)
        check_disk(self.procs.records, self.seen_meta)
        self._check_leftovers()
        if self.steps % SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> None:
        recs = sorted(self.model.recs.values(), key=lambda r: r.rid)
        for lo in range(0, len(recs), 256):
            part = recs[lo : lo + 256]
            for rec, item in zip(part, self.http.get_many([r.rid for r in part], wait=0), strict=True):
                self._judge(rec, item_answer(item), "sweep")
        for w in range(AGENTS):
            self._check_writer(w, self._agent(w).call("flush"))
        self._check_sidecar_bytes()

    def _check_writer(self, w: int, snap: dict) -> None:
        check_writer(f"a{w}", snap, self.charged[w], pages_of(self.procs.records, self.since_probe[w]))

    def _check_sidecar_bytes(self) -> None:
        def agrees() -> bool:
            before = disk_bytes(self.procs.records)
            text = self.procs.metrics()
            after = disk_bytes(self.procs.records)
            said = next(float(x.split()[1]) for x in text.splitlines() if x.startswith("r3_spool_bytes "))
            return min(before, after) <= said <= max(before, after)

        wait_until(agrees, 5, "r3_spool_bytes equal to the files on disk")

    def _judge_streams(self, *, done_only: bool) -> None:
        keep = []
        for s in self.streams:
            if done_only and not s.done:
                keep.append(s)
                continue
            s.judge(self.model.recs[s.rid], TTL_S, tuple(self.down))
        self.streams = keep

    def teardown(self) -> None:
        """End the run: finish what is live, acknowledge what streams still wait on, judge every stream."""
        try:
            for rec in self.model.by_state("live"):
                self._agent(rec.writer).call("finish", rid=rec.rid, status="ok")
                rec.state, rec.final_sent = "final", time.monotonic()
            for s in self.streams:
                if not s.done:
                    self.http.ack(s.rid, missing_ok=True)
                    self.model.recs[s.rid].state = "acked"
            for s in self.streams:
                wait_until(lambda s=s: s.done, 30, f"stream of {s.rid} ended")
            self._judge_streams(done_only=False)
            if self.planted:
                try:
                    wait_until(lambda: not set(self.planted) & set(leftovers(self.procs.records)), RECLAIM_S, "gone")
                except WaitTimeout as exc:
                    raise Violation(f"crash leftovers never reclaimed: {sorted(self.planted)}") from exc
        finally:
            for c in (getattr(self, "http", None), getattr(self, "local", None)):
                if c is not None:
                    c.close()
