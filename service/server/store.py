"""The sidecar's index over the spool: what records exist, their metadata, and who is waiting on them.

File-system events (`watchfiles.awatch`) keep the index fresh; a periodic rescan is the safety net for
events the kernel coalesced or dropped. Readers re-check one record's metadata file (a `stat`, and a
small read when it changed) before serving it, so a late event never serves stale rows. Retention
(TTL after final, stale non-final records marked aborted, crash leftovers removed) is applied here,
through the spool.

Everything runs on the server's event loop; only the full rescan's directory walk runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import watchfiles

from service.server.settings import Settings
from service.spool import Spool
from service.spool.record.meta import RecordMeta, SpoolFormatError, safe_name

log = logging.getLogger("r3.store")

Stamp = tuple[int, int, int]
"""(inode, mtime_ns, size) of a metadata file: changes on every atomic replace."""

_GONE_MEMORY = 1 << 16
_MIN_TICK_S = 0.02


@dataclass(frozen=True, slots=True)
class Entry:
    meta: RecordMeta
    stamp: Stamp


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _load(spool: Spool, path: Path) -> tuple[Stamp | None, RecordMeta | SpoolFormatError | None]:
    """Stat and parse one record metadata file: `(None, None)` when it is gone."""
    try:
        stamp = _stamp(os.stat(path))
        return stamp, spool.read_meta_file(path)
    except FileNotFoundError:
        return None, None
    except SpoolFormatError as exc:
        return stamp, exc
    except (OSError, UnicodeError) as exc:
        return None, SpoolFormatError("unreadable", f"{path.name}: {exc}")


def _is_meta_name(filename: str) -> bool:
    return filename.endswith(".json") and not filename.startswith(".")


class Store:
    """Index of one spool's records, with async waiters and retention."""

    def __init__(
        self,
        spool: Spool,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        deadline_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` is wall time, compared with records' `updated` (retention); `deadline_clock` times the waits
        (monotonic seconds; injectable so a test, not the machine's speed, decides when a deadline has passed)."""
        self.spool = spool
        self.settings = settings
        self.clock = clock
        self.deadline_clock = deadline_clock
        self.skipped: Counter[str] = Counter()
        self.expired_total = 0
        self.acked: Counter[str] = Counter()  # records freed by trainers: `delete`, `rids`, `weight_version`
        self.ready = False
        self._entries: dict[str, Entry] = {}
        self._bad: dict[str, Stamp | None] = {}
        self._bad_engines: dict[str, Stamp | None] = {}
        self._served_bad: set[tuple[str, str, int, float]] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # rid → why it left: `expired` or `acknowledged`
        self._events: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()
        self._walks: list[set[str]] = []  # per rescan in flight: the names the index changed since it began
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    # ---- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the spool directories if needed, rebuild the index, then follow events and rescan."""
        for path in (self.spool.records_dir, self.spool.engines_dir):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.error("cannot create %s (%s); not ready until it exists", path, exc)
        await self.rescan()
        self._stop.clear()
        self._tasks = [
            asyncio.create_task(self._watch(), name="r3-store-watch"),
            asyncio.create_task(self._housekeeping(), name="r3-store-housekeeping"),
        ]
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _watch(self) -> None:
        def wanted(_change: watchfiles.Change, path: str) -> bool:
            return _is_meta_name(os.path.basename(path))

        while not self._stop.is_set():
            try:
                async for changes in watchfiles.awatch(
                    self.spool.records_dir, watch_filter=wanted, debounce=50, step=5, stop_event=self._stop
                ):
                    for name in {os.path.basename(path)[:-5] for _change, path in changes}:
                        self.refresh_name(name)
            except (OSError, RuntimeError) as exc:
                log.warning("spool watcher stopped (%s); rescans continue, retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.rescan_s)

    async def _housekeeping(self) -> None:
        """Retention on a short tick; a full rescan every `rescan_s`."""
        s = self.settings
        tick = max(_MIN_TICK_S, min(s.rescan_s, s.ttl_s / 4, s.stale_s / 4))
        last_scan = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), tick)
            try:
                if time.monotonic() - last_scan >= s.rescan_s:
                    last_scan = time.monotonic()
                    await self.rescan()
                self.apply_retention()
            except Exception:
                log.exception("spool housekeeping failed; next tick retries")

    # ---- index -------------------------------------------------------------------------------
    async def rescan(self) -> None:
        """Walk the records directory (in a thread) and fold every change into the index.

        What the walk read is older than whatever the loop learned while it ran (an event, a lookup, an ack, an
        expiry), so a name the index changed meanwhile keeps the loop's view. Comparing stamps cannot tell: a
        record written and acked during the walk is absent before and after, and folding in the walk's read
        would index it again and forget that it was acknowledged (a GET after the ack: 404, not 410)."""
        known = {name: entry.stamp for name, entry in self._entries.items()}
        known.update({name: stamp for name, stamp in self._bad.items() if stamp is not None})
        changed: set[str] = set()
        self._walks.append(changed)
        try:
            names, results = await asyncio.to_thread(self._scan, known)
        finally:
            self._walks.remove(changed)
        for name, (stamp, result) in results.items():
            if name not in changed:
                self._apply(name, stamp, result)
        for name in [n for n in self._entries if n not in names and n not in changed]:
            self._apply(name, None, None)
        for name in [n for n in self._bad if n not in names and n not in changed]:
            del self._bad[name]

    def _scan(self, known: dict[str, Stamp]) -> tuple[set[str], dict[str, Any]]:
        for path in self.spool.reclaim_leftovers(self.settings.stale_s):
            log.info("removed crash leftover %s", path.name)
        names = set(self.spool.record_names())
        results = {}
        for name in names:
            path = self.spool.records_dir / f"{name}.json"
            try:
                if _stamp(os.stat(path)) == known.get(name):
                    continue
            except FileNotFoundError:
                continue
            results[name] = _load(self.spool, path)
        return names, results

    def refresh_name(self, name: str) -> Entry | None:
        """Re-check one metadata file (a stat; a read only when it changed) and update the index."""
        path = self.spool.records_dir / f"{name}.json"
        current = self._entries.get(name)
        try:
            stamp = _stamp(os.stat(path))
        except FileNotFoundError:
            stamp = None
        except OSError:
            return current
        if stamp is not None and current is not None and current.stamp == stamp:
            return current
        if stamp is not None and current is None and name in self._bad and self._bad[name] == stamp:
            return None
        stamp, result = _load(self.spool, path) if stamp is not None else (None, None)
        self._apply(name, stamp, result)
        return self._entries.get(name)

    def reread(self, rid: str) -> RecordMeta | None:
        """The rid's metadata read from its file now, folded into the index. Unlike `lookup` it does not trust the
        stat stamp: a metadata file replaced twice within one mtime tick can reuse the first file's inode and size,
        and so its stamp, while naming another record."""
        name = safe_name(rid)
        self._apply(name, *_load(self.spool, self.spool.records_dir / f"{name}.json"))
        entry = self._entries.get(name)
        return entry.meta if entry is not None and entry.meta.rid == rid else None

    def _apply(self, name: str, stamp: Stamp | None, result: RecordMeta | SpoolFormatError | None) -> None:
        self._changed(name)
        old = self._entries.get(name)
        if isinstance(result, RecordMeta):
            self._bad.pop(name, None)
            self._entries[name] = Entry(result, stamp)  # type: ignore[arg-type]
            self._gone.pop(result.rid, None)
            if old is None or old.meta != result:
                self._notify(result.rid)
            return
        if isinstance(result, SpoolFormatError):
            if self._bad.get(name, ()) != stamp:
                self.skipped[result.reason] += 1
                log.warning("skipping spool file %s.json: %s", name, result)
            self._bad[name] = stamp
        else:
            self._bad.pop(name, None)
        if old is not None:
            del self._entries[name]
            self._notify(old.meta.rid)

    def _changed(self, name: str) -> None:
        """Tell every rescan in flight that the index changed `name`: its walk's read of it is out of date."""
        for changed in self._walks:
            changed.add(name)

    def count_skip(self, reason: str, meta: RecordMeta) -> None:
        """Count a malformed file found while serving (e.g. a truncated `.bin`), once per record version."""
        key = (reason, meta.rid, meta.rows, meta.updated)
        if key not in self._served_bad:
            self._served_bad.add(key)
            self.skipped[reason] += 1

    # ---- queries -----------------------------------------------------------------------------
    def lookup(self, rid: str) -> RecordMeta | None:
        """The record's current metadata (re-checked on disk), after retention; None when absent."""
        entry = self.refresh_name(safe_name(rid))
        if entry is None or entry.meta.rid != rid:
            return None
        meta = self._retain(entry.meta, self.clock())
        return meta

    def expired(self, rid: str) -> bool:
        """Whether the record was removed by retention (410 rather than 404)."""
        return self._gone.get(rid) == "expired"

    def gone_reason(self, rid: str) -> str | None:
        """Why a record this sidecar served is no longer here: `expired` (TTL) or `acknowledged` (a trainer's
        DELETE or ack), or None when it never existed or left too long ago to remember (the last 65,536)."""
        return self._gone.get(rid)

    def _forget(self, rid: str, reason: str) -> None:
        self._gone[rid] = reason
        self._gone.move_to_end(rid)
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    def records(self) -> list[RecordMeta]:
        return [entry.meta for entry in self._entries.values()]

    def state_counts(self) -> Counter[str]:
        """Records by state: `open` (not final) or the final status (`ok`, `aborted`, `error`, `suspect`)."""
        return Counter("open" if not e.meta.final else e.meta.status for e in self._entries.values())

    def usage_bytes(self) -> int:
        return self.spool.usage_bytes()

    def capacity_bytes(self) -> int:
        try:
            return self.spool.capacity_bytes(self.settings.spool_max_bytes)
        except OSError:
            return 0

    def engines(self) -> list[dict[str, Any]]:
        """Every well-formed engine file; malformed ones are skipped and counted once per version."""
        out = []
        for path in sorted(self.spool.engine_paths()):
            key = path.name
            stamp = None
            try:
                stamp = _stamp(os.stat(path))
                out.append(self.spool.read_engine_file(path))
                self._bad_engines.pop(key, None)
            except FileNotFoundError:
                continue
            except (SpoolFormatError, OSError, UnicodeError) as exc:
                reason = exc.reason if isinstance(exc, SpoolFormatError) else "unreadable"
                if self._bad_engines.get(key, ()) != stamp:
                    self.skipped[reason] += 1
                    self._bad_engines[key] = stamp
        return out

    # ---- waiting -----------------------------------------------------------------------------
    def _event(self, rid: str) -> asyncio.Event:
        event = self._events.get(rid)
        if event is None:
            event = asyncio.Event()
            self._events[rid] = event
        return event

    def _notify(self, rid: str) -> None:
        event = self._events.pop(rid, None)
        if event is not None:
            event.set()

    def is_waited(self, rid: str) -> bool:
        """Whether a request waits on `rid` now: a test acts on a record once its reader waits, never after a
        guessed delay."""
        return rid in self._events

    async def wait_until(
        self, rid: str, done: Callable[[RecordMeta | None], bool], timeout: float
    ) -> RecordMeta | None:
        """Wait (woken by index changes) until `done(meta)` holds or `timeout` passes; return the meta.

        The event is taken before each look, so a change between the look and the wait is never lost.
        The wait is also cut at `rescan_s`, the same safety net as the index's own rescan. `timeout` is
        counted on `deadline_clock`.
        """
        deadline = self.deadline_clock() + max(0.0, timeout)
        while True:
            event = self._event(rid)
            meta = self.lookup(rid)
            remaining = deadline - self.deadline_clock()
            if done(meta) or remaining <= 0 or (meta is None and self.expired(rid)):
                return meta
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, self.settings.rescan_s))

    async def wait_final(self, rid: str, timeout: float) -> RecordMeta | None:
        return await self.wait_until(rid, lambda m: m is not None and m.final, timeout)

    # ---- retention ---------------------------------------------------------------------------
    def apply_retention(self) -> None:
        now = self.clock()
        for entry in list(self._entries.values()):
            self._retain(entry.meta, now)

    def _retain(self, meta: RecordMeta, now: float) -> RecordMeta | None:
        """Expire a final record past its TTL; mark a silent non-final record aborted."""
        s = self.settings
        if meta.final and now - meta.updated >= s.ttl_s:
            self._remove(meta)
            self._forget(meta.rid, "expired")
            self.expired_total += 1
            return None
        if not meta.final and now - meta.updated >= s.stale_s:
            name = safe_name(meta.rid)
            entry = self.refresh_name(name)
            if entry is None or entry.meta != meta:
                return entry.meta if entry else None
            status = "suspect" if meta.status == "suspect" else "aborted"  # a suspect record stays marked
            aborted = replace(meta, final=True, status=status, updated=now)
            try:
                self.spool.write_meta(aborted)
            except OSError as exc:
                # A full spool cannot take the new metadata: the index holds the verdict (410, TTL) until
                # the file changes; a later rescan or write reconciles it.
                log.warning("could not write %r aborted (%s); aborted in the index only", meta.rid, exc)
                self._entries[name] = replace(entry, meta=aborted)
                self._changed(name)
                self._notify(meta.rid)
                return aborted
            log.info("record %r: no update for %.0fs, marked aborted", meta.rid, now - meta.updated)
            entry = self.refresh_name(safe_name(meta.rid))
            return entry.meta if entry else None
        return meta

    def _remove(self, meta: RecordMeta) -> None:
        """Delete the record this index holds, and only it: a record that replaced it on disk stays (D11)."""
        self.spool.delete(meta.rid, created=meta.created)
        self._apply(safe_name(meta.rid), None, None)

    def delete(self, rid: str, *, how: str = "delete") -> bool:
        """The trainer's acknowledgement: remove both files now. False when there is no such record."""
        meta = self.lookup(rid)
        if meta is None:
            return False
        self._remove(meta)
        self._forget(rid, "acknowledged")
        self.acked[how] += 1
        return True

    def ack_rids(self, rids: list[str]) -> tuple[int, list[str]]:
        """Free each record of `rids` (`POST /routed_experts/ack`): (how many were freed, the unknown rids)."""
        missing = [rid for rid in dict.fromkeys(rids) if not self.delete(rid, how="rids")]
        return len(dict.fromkeys(rids)) - len(missing), missing

    def ack_before(self, version: int, number: Callable[[object], int | None]) -> tuple[int, int]:
        """Free every final record whose weight version (`number` of it) is below `version`: (freed, unordered),
        `unordered` counting final records whose version is not a number and so were kept."""
        freed = unordered = 0
        for meta in self.records():
            if not meta.final:
                continue
            mine = number(meta.weight_version)
            if mine is None:
                unordered += 1
            elif mine < version and self.delete(meta.rid, how="weight_version"):
                freed += 1
        return freed, unordered
