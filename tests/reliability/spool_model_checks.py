"""The spool model's invariants: what any answer, the spool on disk and the writers' counters must be.

Why judged against the model and not against the last answer: the model knows each record's exact bytes, its
state (live, final, killed, acknowledged) and when it may have expired or gone stale, so a check says precisely
which promise broke: rows of another record or a torn record (`judge`), a final record lost before it was
acknowledged or expired (`judge`), a 5xx (`judge`), a final `.json` whose `.bin` cannot hold its rows
(`check_disk`), byte accounting that is not the files on disk (`check_writer`, `check_sidecar_bytes`), a crash
leftover never reclaimed (`leftovers`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import orjson
from spool_model_records import MAX_ROWS, Rec, bytes_for

ROW_BYTES = 24
JUST_OPENED_S = 2.0
"""A record opened this recently may not be in the sidecar's index yet (its file event or rescan is due)."""


TALLY = {"steps": 0, "first": None, "began": time.monotonic()}
"""Steps taken in this process, and (steps, time, message) of the first violation: what finding a fault took,
before hypothesis goes on to shrink it (RELIABILITY.md's table of reverted fixes)."""


class Violation(AssertionError):
    """A broken invariant: the state machine fails the run with it, hypothesis prints the seed and shrinks."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        if TALLY["first"] is None:
            TALLY["first"] = (TALLY["steps"], time.monotonic(), message)
            took, steps = time.monotonic() - TALLY["began"], TALLY["steps"]
            print(f"spool model: first violation after {steps} steps, {took:.1f} s: {message}", file=sys.stderr)


def judge(rec: Rec, code: int, body: bytes, status: str | None, *, ttl_s: float, stale_s: float, how: str) -> None:
    """One answer for `rec` (`code`, the rows as bytes, the record status the answer named), as `how` got it."""
    where = f"{how} {rec.rid} (gen {rec.gen}, {rec.state}, {rec.rows} rows)"
    if code >= 500:
        raise Violation(f"{where}: {code} {body[:200]!r}")
    young = time.monotonic() - rec.touched < JUST_OPENED_S
    if rec.state == "final":
        if code == 200:
            if status != rec.status:
                raise Violation(f"{where}: served as {status!r}, finished {rec.status!r}")
            _exact(where, rec, body, rec.rows)
            return
        if code in (404, 410) and rec.may_be_expired(ttl_s):
            return
        raise Violation(f"{where}: final record answered {code} before it was acknowledged or expired")
    if rec.state in ("live", "orphan"):
        if code == 202 or (code == 404 and young):
            return
        if code == 200:
            if status == "ok":
                raise Violation(f"{where}: an unfinished record served as finished ok")
            if rec.state == "live" and not rec.may_be_stale(stale_s):
                raise Violation(f"{where}: served {status!r} while its writer writes it")
            _prefix(where, rec, body)
            return
        raise Violation(f"{where}: unfinished record answered {code}")
    if rec.state == "acked":
        if code in (404, 410):
            return
        raise Violation(f"{where}: acknowledged record answered {code}")
    if rec.state == "raced":
        if code in (404, 410):
            return
        if code == 200 and status == "ok":
            _exact(where, rec, body, rec.rows)
            return
        raise Violation(f"{where}: a rid deleted while reused answered {code} ({status})")
    raise Violation(f"{where}: unknown model state")


def _exact(where: str, rec: Rec, body: bytes, rows: int) -> None:
    if body != bytes_for(rec.rid, rec.gen, rows):
        raise Violation(f"{where}: {len(body)} bytes, not the {rows} rows written ({_which(rec, body)})")


def _prefix(where: str, rec: Rec, body: bytes) -> None:
    rows, rest = divmod(len(body), ROW_BYTES)
    limit = rec.rows if rec.state == "live" else MAX_ROWS
    if rest or rows > limit or body != bytes_for(rec.rid, rec.gen, rows):
        raise Violation(f"{where}: {len(body)} bytes are not a prefix of the rows written ({_which(rec, body)})")


def _which(rec: Rec, body: bytes) -> str:
    """Whose rows a wrong body holds, when it is an older generation of the same rid."""
    for gen in range(rec.gen - 1, max(0, rec.gen - 50), -1):
        if body and body == bytes_for(rec.rid, gen, len(body) // ROW_BYTES):
            return f"rows of generation {gen}"
    return "torn or foreign rows"


def check_disk(records: Path, seen: dict[str, tuple] | None = None) -> int:
    """Every final `.json` has a `.bin` holding its rows: else the record is lost while the sidecar promises it
    (the 0f9edea race leaves exactly that). A `.json` that goes meanwhile (a delete: `.json` first) is fine.
    Returns how many records it looked at.

    `seen` (kept by the caller between calls) holds each `.json` parsed before, by its file's identity: every
    metadata write is a new file renamed into place, a new inode, and on tmpfs inode numbers only grow, so an
    unchanged identity is unchanged metadata and only new files are read (reading and parsing every `.json`
    took two thirds of this check's time). Every final record's `.bin` is looked at every time: a delete can
    take it at any moment."""
    n, now = 0, {}
    for entry in os.scandir(records):
        name = entry.name
        if name.startswith(".") or not name.endswith(".json"):
            continue
        try:
            now[name] = _meta(entry, seen)
        except (FileNotFoundError, ValueError):
            continue
        n += 1
        meta = now[name][1]
        if not meta.get("final") or meta.get("status") == "error":
            continue
        want = meta["rows"] * ROW_BYTES
        try:
            have = os.stat(entry.path[:-5] + ".bin").st_size
        except FileNotFoundError:
            have = -1
        if have < want and _still(entry.path, meta):
            raise Violation(f"{name}: final, {meta['rows']} rows, but its .bin holds {have} bytes (of {want})")
    if seen is not None:
        seen.clear()
        seen.update(now)
    return n


def _meta(entry: os.DirEntry, seen: dict[str, tuple] | None) -> tuple[tuple, dict]:
    """(file identity, metadata) of one `.json`, from `seen` when its file is the one parsed before (same
    inode, size and change times: the spool replaces a `.json` by renaming a new file over it)."""
    st = entry.stat()
    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if seen is not None and (hit := seen.get(entry.name)) is not None and hit[0] == key:
        return hit
    with open(entry.path, "rb") as f:
        return key, orjson.loads(f.read())


def _still(path: str, meta: dict) -> bool:
    try:
        with open(path, "rb") as f:
            return orjson.loads(f.read()) == meta
    except (FileNotFoundError, ValueError):
        return False


def leftovers(records: Path) -> list[str]:
    """Names a crash leaves behind: temporary files of a metadata replace, `.bin` files with no `.json`."""
    names = set(os.listdir(records))
    tmp = {n for n in names if n.startswith(".") and n.endswith(".tmp")}
    return sorted(tmp | {n for n in names if n.endswith(".bin") and n[:-4] + ".json" not in names})


def disk_bytes(records: Path) -> int:
    """What the sidecar's `r3_spool_bytes` means: the sizes of every file in the records directory."""
    total = 0
    for entry in os.scandir(records):
        try:
            total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


def check_writer(name: str, snap: dict, charged: int, pages_on_disk: int) -> None:
    """A flushed engine writer: nothing reserved or queued, usage its last probe plus exactly what it wrote
    (`charged`, the model's sum), and the file-system bytes it counted no fewer than its files take."""
    if snap["reserved"] or snap["reserved_blocks"] or snap["queued"]:
        raise Violation(f"writer {name} idle with reservations left: {snap}")
    if snap["write_errors"]:
        raise Violation(f"writer {name}: {snap['write_errors']} write errors (an accepted request lost)")
    if snap["usage"] != charged:
        raise Violation(f"writer {name} counts {snap['usage']} bytes used, its probe and writes make {charged}")
    counted = snap["free_at_probe"] - snap["free"]
    if counted < pages_on_disk:
        raise Violation(
            f"writer {name} counted {counted} file-system bytes for its records since its probe; they take "
            f"{pages_on_disk} (the spool fills up before the writer refuses: ENOSPC after a reservation)"
        )


def pages_of(records: Path, rids_names: list[str]) -> int:
    """File-system bytes the named records' files take now (`st_blocks`, as tmpfs or ext4 charge them)."""
    total = 0
    for stem in rids_names:
        for ext in (".json", ".bin"):
            try:
                total += os.stat(records / f"{stem}{ext}").st_blocks * 512
            except FileNotFoundError:
                continue
    return total
