"""The spool index on its own: rebuild by rescan, skipped files counted once, waiters woken by changes."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import FakeClock, random_rows, write_record
from waiting import await_until

from service.server.settings import Settings
from service.server.store import Store
from service.spool import Spool
from service.spool.record.meta import RecordMeta, Suspect


def make_store(spool: Spool, **overrides: object) -> Store:
    return Store(spool, Settings.model_validate({"spool_dir": spool.root, **overrides}))


def test_rescan_indexes_updates_and_forgets(spool: Spool) -> None:
    store = make_store(spool)
    write_record(spool, "a", random_rows(3))
    writer = spool.writer("b/ü", num_experts=8, topk=1, layers=[0])
    asyncio.run(store.rescan())
    assert {m.rid for m in store.records()} == {"a", "b/ü"}
    assert store.state_counts() == {"ok": 1, "open": 1}
    writer.append(np.zeros((4, 1, 1)))
    spool.delete("a")
    asyncio.run(store.rescan())
    assert [(m.rid, m.rows) for m in store.records()] == [("b/ü", 4)]


def test_bad_files_counted_once_per_version(spool: Spool) -> None:
    store = make_store(spool)
    bad = spool.records_dir / "bad.json"
    bad.write_bytes(b"{")
    (spool.records_dir / ".tmp-ignored.json").write_bytes(b"{")
    for _ in range(3):
        asyncio.run(store.rescan())
        assert store.lookup("bad") is None
    assert store.skipped == {"bad_json": 1}
    bad.write_bytes(b'{"v": 9}')
    asyncio.run(store.rescan())
    assert store.skipped == {"bad_json": 1, "unknown_version": 1}
    bad.unlink()
    write_record(spool, "bad", random_rows(1))
    assert store.lookup("bad").rows == 1, "a good file under a once-bad name is served"


def test_lookup_sees_changes_without_events(spool: Spool) -> None:
    """The serving path re-checks the metadata file, so a coalesced or late event never serves stale rows."""
    store = make_store(spool)
    writer = spool.writer("w", num_experts=8, topk=1, layers=[0])
    assert store.lookup("w").rows == 0
    writer.append(np.zeros((5, 1, 1)))
    assert store.lookup("w").rows == 5
    writer.finalize()
    assert store.lookup("w").final


def test_hash_named_rid_collision_is_not_served(spool: Spool) -> None:
    store = make_store(spool)
    write_record(spool, "x/1", random_rows(1))
    os.replace(spool.meta_path("x/1"), spool.meta_path("x/2"))  # a file whose content names another rid
    assert store.lookup("x/2") is None and store.lookup("x/1") is None
    assert store.skipped == {"name_mismatch": 1}


def test_waiters_wake_on_events_and_time_out(spool: Spool) -> None:
    """Woken by the change: the deadline clock is frozen and `rescan_s` (60) lies past the 30 s hang guard, so
    nothing else could end the first wait. The second wait ends when its deadline passes on that clock."""
    clock = FakeClock()

    async def scenario() -> tuple[RecordMeta | None, RecordMeta | None, float]:
        store = Store(spool, Settings.model_validate({"spool_dir": spool.root, "rescan_s": 60}), deadline_clock=clock)
        await store.start()
        try:
            writer = spool.writer("ev", num_experts=8, topk=1, layers=[0])
            rows = asyncio.create_task(store.wait_until("ev", lambda m: m is not None and m.rows >= 2, 600))
            await await_until(lambda: store.is_waited("ev"), 30, "the waiter looked and waits")
            writer.append(np.zeros((2, 1, 1)))
            meta = await asyncio.wait_for(rows, 30)
            reads = clock.reads
            waiting = asyncio.create_task(store.wait_final("ev", 0.3))
            await asyncio.sleep(0)  # not a wait: one loop step, the waiter's first: it sets its deadline, looks
            assert clock.reads > reads and not waiting.done()
            deadline = clock.now + 0.3
            clock.advance(1)
            return meta, await asyncio.wait_for(waiting, 30), deadline
        finally:
            await store.stop()

    meta, none, deadline = asyncio.run(scenario())
    assert meta.rows == 2, "woken by the rows"
    assert not none.final and clock.last_read >= deadline, "the second wait ended once its deadline passed"


def test_capacity_from_setting_or_filesystem(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    assert make_store(spool, spool_max_bytes=1234).capacity_bytes() == 1234
    st = os.statvfs(tmp_path)
    assert make_store(spool).capacity_bytes() == st.f_blocks * st.f_frsize
    write_record(spool, "bytes", random_rows(10))
    assert make_store(spool).usage_bytes() >= 10 * 32


class FullSpool(Spool):
    """A spool whose file system refuses new metadata, as a full tmpfs does (ENOSPC)."""

    def write_meta(self, meta) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_stale_record_on_a_full_spool_is_aborted_in_the_index(spool: Spool) -> None:
    writer = spool.writer("silent", num_experts=8, topk=1, layers=[0])
    writer.append(np.zeros((3, 1, 1)))
    now = [spool.read_meta("silent").updated]  # wall time as the store reads it: moved by the test, not slept
    store = Store(
        FullSpool(spool.root),
        Settings.model_validate({"spool_dir": spool.root, "stale_s": 0.2, "ttl_s": 0.4}),
        clock=lambda: now[0],
    )
    assert not store.lookup("silent").final
    now[0] += 0.25  # past stale_s since its last update
    meta = store.lookup("silent")
    assert meta.final and meta.status == "aborted" and meta.rows == 3
    assert not spool.read_meta("silent").final, "the file could not be rewritten"
    asyncio.run(store.rescan())
    assert store.lookup("silent").status == "aborted", "an unchanged file keeps the index's verdict"
    now[0] += 0.45  # past ttl_s since it was marked aborted
    assert store.lookup("silent") is None and store.expired("silent")
    assert not spool.meta_path("silent").exists(), "expiry deletes (unlink needs no space)"


def test_a_stale_suspect_record_ends_suspect_not_aborted(spool: Spool) -> None:
    """A silent open record is ended by the sidecar; one the row check marked keeps its mark (issue 40)."""
    writer = spool.writer("odd", num_experts=8, topk=2, layers=[0])
    writer.mark_suspect(Suspect(0, 0, "repeated", "ids [0, 0] repeat an expert"))
    writer.append(np.zeros((3, 1, 2)))
    now = [spool.read_meta("odd").updated]
    store = Store(spool, Settings.model_validate({"spool_dir": spool.root, "stale_s": 0.2}), clock=lambda: now[0])
    now[0] += 0.25  # past stale_s since its last update
    meta = store.lookup("odd")
    assert meta.final and meta.status == "suspect" and meta.suspect.row == 0
    assert spool.read_meta("odd") == meta, "the file parses back as written"


class HeldScan:
    """A store's directory walk held in its thread once done, until `release()`: what the loop does meanwhile
    (an ack, an expiry) happens after the walk read the spool and before the rescan folds in what it read, as
    on a loaded machine where that thread waits for a core. No sleep decides the order."""

    def __init__(self, store: Store) -> None:
        self.walked, self._go, self._walk, self.seen = threading.Event(), threading.Event(), store._scan, None
        store._scan = self._held

    def _held(self, known: dict) -> tuple:
        self.seen = self._walk(known)
        self.walked.set()
        assert self._go.wait(30), "hang guard: the test never released the walk"
        return self.seen

    def release(self) -> None:
        self._go.set()


@pytest.mark.parametrize("leave", ["acknowledged", "expired"])
def test_a_rescan_never_brings_back_a_record_that_left_during_its_walk(spool: Spool, leave: str) -> None:
    """A trainer's GET right after its ack must be 410 `acknowledged`, and a second ack must say "already
    acknowledged" (docs/api.md): a rescan whose walk read the record before it left must not index it again
    and so erase why it left (it did, under load: `test_ack_frees_the_record`'s GET after the ack got 404)."""
    write_record(spool, "left", random_rows(3))
    now = [spool.read_meta("left").updated]
    store = Store(spool, Settings.model_validate({"spool_dir": spool.root, "ttl_s": 60}), clock=lambda: now[0])

    async def scenario() -> None:
        held = HeldScan(store)
        rescan = asyncio.create_task(store.rescan())
        assert await asyncio.to_thread(held.walked.wait, 30), "hang guard: the walk never ran"
        if leave == "acknowledged":
            assert store.delete("left")
        else:
            now[0] += 61  # past ttl_s: the lookup expires it
            assert store.lookup("left") is None
        held.release()
        await rescan
        assert "left" in held.seen[1], "the walk read the record before it left: the race this test is about"

    asyncio.run(scenario())
    assert not spool.meta_path("left").exists()
    assert store.gone_reason("left") == leave
    assert store.records() == [] and store.state_counts() == {}
