"""A sidecar's spool read by the client itself: the check that it is the same spool, and a safe read of one record.

Why: on the node whose spool holds a record (verl's hybrid engine, slime's and miles' colocated modes, any
in-process launch) every HTTP fetch copies the rows three times and crosses a socket; reading the `.bin`
here is one `pread` into the trainer's buffer. It is only as safe as the HTTP path if it serves only what
the sidecar would serve the same way, so `read` answers None (the caller asks the sidecar) for anything
else: a record missing, not final, ended in `error`, past its TTL, malformed, shorter than its metadata, or
a range or layer selection the sidecar would refuse (its errors then come from the sidecar itself).

Replaced records (a rid reused): a writer replaces `.json` before it unlinks and recreates `.bin`
(service.spool.record.writer). The reader holds the `.json` it parsed open, opens `.bin`, and checks that the path
still names the very `.json` it holds (same device and inode; an inode held open cannot be reused). Then the
`.bin` it opened is that record's: its replacement had not begun. A final record's `.bin` is never written
again, and an unlinked one keeps its bytes while open, so the rows read match the metadata read.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.client.decoding import RoutedExperts
from service.spool.files import same_file
from service.spool.record.meta import MAX_META_BYTES, RecordMeta, SpoolFormatError, safe_name
from service.wire.buffers import uninitialized
from service.wire.formats import layer_slots, parse_layers, resolve_layers
from service.wire.node_identity import NodeIdentity

__all__ = ["Allocator", "LocalSpool", "Selection"]

Allocator = Callable[[int], Any]
"""Returns a writable buffer of n bytes for one record's rows (default: `service.wire.buffers.uninitialized`)."""

TTL_MARGIN_S = 1.0  # a record this close to its TTL is asked of the sidecar, whose clock decides expiry
_REPLACED = object()


@dataclass(frozen=True, slots=True)
class Selection:
    """What one read asks for: token range, layers (the query's text), clamp."""

    start: int | None = None
    end: int | None = None
    layers: str | None = None
    clamp: bool = False


@dataclass(frozen=True, slots=True)
class LocalSpool:
    """A spool this process verified it sees as its sidecar does (`verify`), and reads final records from."""

    records: str
    probe: str
    ttl_s: float

    @classmethod
    def verify(cls, advert: Any, me: NodeIdentity) -> LocalSpool | str:
        """The spool of a `GET /v1/node` answer when this process can read it, else why not (a short reason)."""
        if not isinstance(advert, dict):
            return "the sidecar does not advertise its spool (an older sidecar)"
        node = NodeIdentity.from_dict(advert.get("node"))
        if node is None:
            return "the sidecar does not advertise its node (an older sidecar)"
        if not me.same_node(node):
            return "other node (boot id differs)"
        probe, token, records, ttl = (advert.get(k) for k in ("probe", "token", "records", "ttl_s"))
        if not (isinstance(probe, str) and isinstance(token, str) and isinstance(records, str)):
            return "the sidecar could not write its probe file"
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or ttl <= 0:
            return "the sidecar's advert has no ttl_s"
        try:
            with open(probe, "rb") as f:
                seen = f.read(256)
        except PermissionError:
            return f"no permission to read {probe}"
        except OSError:
            return f"the spool at {advert.get('spool')} is not visible here (another mount namespace or volume)"
        if seen != token.encode():
            return f"{probe} is another spool's (another mount namespace or volume)"
        if not os.access(records, os.R_OK | os.X_OK):
            return f"no permission to read {records}"
        return cls(records, probe, float(ttl))

    def read(
        self, rid: str, sel: Selection, *, view: bool = False, alloc: Allocator | None = None, frames: bool = False
    ) -> RoutedExperts | None:
        """The rows of a final record as the sidecar would serve them, or None: ask the sidecar.

        `view`: a read-only array over the spool file (no copy; it keeps the file's pages until dropped).
        `frames`: fields as a batch frame states them (`get_many`), else as a GET's headers do (`get`).
        """
        for _ in range(2):  # a record replaced under the reader is read again once, then left to the sidecar
            got = self._read_once(rid, sel, view, alloc or uninitialized, frames)
            if got is not _REPLACED:
                return got  # type: ignore[return-value]
        return None

    def _read_once(
        self, rid: str, sel: Selection, view: bool, alloc: Allocator, frames: bool
    ) -> RoutedExperts | object | None:
        name = os.path.join(self.records, safe_name(rid))
        try:
            jfd = os.open(name + ".json", os.O_RDONLY)
        except OSError:
            return None
        try:
            meta = _servable(_meta_of(jfd), rid, self.ttl_s)
            if meta is None:
                return None
            plan = _plan(meta, sel)
            if plan is None:
                return None
            try:
                bfd = os.open(name + ".bin", os.O_RDONLY)
            except OSError:
                return None
            try:
                if not same_file(name + ".json", jfd):
                    return _REPLACED
                return _rows(meta, plan, bfd, view, alloc, frames)
            finally:
                os.close(bfd)
        finally:
            os.close(jfd)


def _meta_of(fd: int) -> RecordMeta | None:
    data = b""
    while len(data) <= MAX_META_BYTES and (chunk := os.read(fd, MAX_META_BYTES + 1 - len(data))):
        data += chunk
    try:
        return RecordMeta.from_json(data)
    except SpoolFormatError:
        return None


def _servable(meta: RecordMeta | None, rid: str, ttl_s: float) -> RecordMeta | None:
    """The metadata when the sidecar would serve its rows as they are now: final, not `error`, within its TTL."""
    if meta is None or meta.rid != rid or not meta.final or meta.status not in ("ok", "aborted"):
        return None
    if time.time() - meta.updated >= ttl_s - TTL_MARGIN_S:
        return None
    return meta


@dataclass(frozen=True, slots=True)
class _Plan:
    lo: int
    hi: int
    clamped: bool
    layers: tuple[int, ...]
    slots: list[int] | None


def _plan(meta: RecordMeta, sel: Selection) -> _Plan | None:
    """Rows and layers to return by the sidecar's rules (service.server.record_answer); None where it would refuse
    them."""
    lo = meta.start if sel.start is None else sel.start
    hi = meta.end if sel.end is None else sel.end
    clamped = False
    if hi < lo:
        return None
    if sel.clamp:
        c_lo = min(max(lo, meta.start), meta.end)
        c_hi = max(max(min(hi, meta.end), meta.start), c_lo)
        clamped, lo, hi = (c_lo, c_hi) != (lo, hi), c_lo, c_hi
    elif not meta.start <= lo <= hi <= meta.end:
        return None
    if sel.layers is None:
        return _Plan(lo, hi, clamped, meta.layers, None)
    try:
        wanted = resolve_layers(meta.layers, parse_layers(sel.layers))
    except ValueError:
        return None
    return _Plan(lo, hi, clamped, tuple(wanted), layer_slots(meta.layers, wanted))


def _rows(meta: RecordMeta, plan: _Plan, fd: int, view: bool, alloc: Allocator, frames: bool) -> RoutedExperts | None:
    row_bytes = meta.row_bytes
    first, count = plan.lo - meta.start, plan.hi - plan.lo
    offset, nbytes = first * row_bytes, count * row_bytes
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < offset + nbytes:
        return None  # corrupt: the sidecar answers it (410) and counts it
    shape = (count, len(meta.layers), meta.topk)
    if nbytes == 0:
        array = np.empty(shape, dtype=meta.dtype)
    elif view:
        array = _mapped(fd, offset, nbytes, meta.dtype).reshape(shape)
    else:
        buf = alloc(nbytes)
        if not _fill(fd, buf, offset, nbytes):
            return None
        array = np.frombuffer(buf, dtype=meta.dtype, count=nbytes // meta.itemsize).reshape(shape)
    if plan.slots is not None:
        array = np.ascontiguousarray(array[:, plan.slots, :])
    return _result(meta, plan, array, frames)


def _mapped(fd: int, offset: int, nbytes: int, dtype: str) -> np.ndarray:
    mm = mmap.mmap(fd, offset + nbytes, prot=mmap.PROT_READ)
    return np.frombuffer(mm, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=offset)


def _fill(fd: int, buf: Any, offset: int, nbytes: int) -> bool:
    """`pread` rows into `buf` (one copy, the GIL released); False when the file ends early."""
    view = memoryview(buf).cast("B")[:nbytes]
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def _result(meta: RecordMeta, plan: _Plan, array: np.ndarray, frames: bool) -> RoutedExperts:
    """`RoutedExperts` with the fields a GET's headers (or, `frames`, a batch frame) would have given."""
    version, versions = meta.weight_version, meta.weight_versions
    if not frames:  # headers carry text
        version = None if version is None else str(version)
        versions = tuple((pos, str(v)) for pos, v in versions)
    return RoutedExperts(
        rid=meta.rid,
        array=array,
        start=plan.lo,
        prompt_len=meta.prompt_len,
        layers=plan.layers,
        final=True,
        dtype=meta.dtype,
        status=meta.status,
        num_hidden_layers=meta.sglang_layers,
        clamped=plan.clamped,
        created=meta.created,
        weight_version=version,
        weight_versions=versions,
        source="spool",
    )
