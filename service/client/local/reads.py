"""Same-node reads for one client: whether they apply, the reads, and the counts reported to the sidecar.

A client asks its sidecar `GET /v1/node` once (service.server.spool_advert) and checks the answer itself
(service.client.local.spool): same boot id, the probe file readable at the path named and holding the token. From
then on every `.npy` read of a final record (`get`, `get_many`, refs' `fetch`/`afetch`/`fetch_many`) is read
from the spool's file, and anything else goes over HTTP as before. The sidecar learns of the reads it did not
serve from a small `POST /v1/local_reads` at most once per `report_s` (`r3_local_reads_total`); acks and
expiry are the sidecar's as before, since a local read removes nothing.

On by default where it applies; `R3_LOCAL_READS=0` (or the client's `local_reads=False`) turns it off. Only
clients that talk plain `http://` through their own connections read locally (not `https://`, not a custom
httpx transport).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import httpx
import orjson

from service.client.calls import BatchItem, BatchRid, Call, Layers, layers_param
from service.client.connections import Connections
from service.client.decoding import RoutedExperts
from service.client.errors import R3Error
from service.client.local.spool import Allocator, LocalSpool, Selection
from service.wire.node_identity import this_node

__all__ = ["ENV", "LocalReads", "as_items", "enabled_by_env", "layers_text", "merged"]

log = logging.getLogger("r3.client")

ENV = "R3_LOCAL_READS"
REPORT_S = 1.0


def enabled_by_env() -> bool:
    """`R3_LOCAL_READS` unset or true: on; `0`, `false`, `no`, `off`: off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class LocalReads:
    """One client's local reads: `read` / `read_many` give rows or None (then the caller asks over HTTP).

    `reason` says why reads go over HTTP (None while they are local); `reads` counts the local ones.
    """

    def __init__(
        self,
        conns: Connections | None,
        timeout: float,
        *,
        enabled: bool | None = None,
        view: bool = False,
        alloc: Allocator | None = None,
    ) -> None:
        self._conns, self._timeout = conns, timeout
        self.view, self.alloc = view, alloc
        self.on = conns is not None and (enabled_by_env() if enabled is None else enabled)
        self.reason: str | None = None if self.on else _off_reason(conns, enabled)
        self.reads = 0
        self._spool: LocalSpool | None = None
        self._lock = threading.Lock()
        self._report = _Report(conns, timeout) if self.on else None

    @property
    def spool(self) -> LocalSpool | None:
        """The verified spool, asking the sidecar first if this client has not yet (blocking: one small GET).

        Asked again when the probe is gone (the sidecar stopped; a new one may serve another spool)."""
        spool = self._spool
        if not self.on:
            return None
        if spool is not None and os.path.exists(spool.probe):
            return spool
        with self._lock:
            if self.on and self._spool is spool:
                self._spool = self._ask()
            return self._spool

    def read(self, call: Call) -> RoutedExperts | None:
        """A `get_call`'s rows from the spool, or None."""
        if call.rid is None or call.stream or call.params.get("format") != "npy":
            return None
        p = call.params
        sel = Selection(_int(p.get("start")), _int(p.get("end")), p.get("layers"), p.get("clamp") == "true")
        return self._one(call.rid, sel, frames=False)

    def read_many(self, items: Sequence[BatchItem], layers: str | None, clamp: bool) -> list[RoutedExperts | None]:
        """Each batch item's rows from the spool, or None in its place."""
        if self.spool is None:
            return [None] * len(items)
        return [self._one(i.rid, Selection(i.start, i.end, layers, clamp), frames=True) for i in items]

    def close(self) -> None:
        """Report what is left to report (one small POST)."""
        if self._report is not None:
            self._report.close()

    def _one(self, rid: str, sel: Selection, *, frames: bool) -> RoutedExperts | None:
        spool = self.spool
        if spool is None:
            return None
        got = spool.read(rid, sel, view=self.view, alloc=self.alloc, frames=frames)
        if got is not None and self._report is not None:
            self.reads += 1
            self._report.add(got.array.nbytes)
        return got

    def _ask(self) -> LocalSpool | None:
        """The sidecar's advert, verified; a refusal turns local reads off for this client (said in `reason`)."""
        assert self._conns is not None
        where = f"{self._conns.host}:{self._conns.port}"
        try:
            status, _, body = self._conns.send("GET", "/v1/node", timeout=self._timeout)
        except httpx.TimeoutException:  # it accepts and does not answer: not worth a timeout on every read
            self.on, self.reason = False, "the sidecar did not answer GET /v1/node in time"
            return None
        except Exception as exc:  # the sidecar is down: the HTTP path reports it; ask again next time
            log.debug("local reads: cannot ask the sidecar at %s (%s)", where, exc)
            return None
        verdict = LocalSpool.verify(orjson.loads(body) if status == 200 else None, this_node())
        if isinstance(verdict, str):
            self.on = False
            self.reason = verdict if status == 200 else f"the sidecar answered {status} to GET /v1/node"
            log.info("reads from %s go over HTTP: %s", where, self.reason)
            return None
        self.reason = None
        log.info("reads from %s come straight from %s", where, verdict.records)
        return verdict


def as_items(rids: Sequence[BatchRid]) -> list[BatchItem]:
    """`get_many`'s rids, each as a `BatchItem` (what `requests.batch_call` accepts again)."""
    out = []
    for item in rids:
        if isinstance(item, str):
            item = BatchItem(item)
        elif isinstance(item, dict):
            item = BatchItem(**item)
        elif isinstance(item, tuple):
            item = BatchItem(*item)
        out.append(item)
    return out


def layers_text(layers: Layers | None) -> str | None:
    return None if layers is None else layers_param(layers)


def merged(local: Sequence[RoutedExperts | None], remote: Sequence[Any]) -> list[RoutedExperts | R3Error]:
    """Request order again: each local result, else the next answer from the sidecar."""
    answers = iter(remote)
    return [got if got is not None else next(answers) for got in local]


def _off_reason(conns: Connections | None, enabled: bool | None) -> str:
    if conns is None:
        return "not a plain http:// sidecar reached through the client's own connections"
    return "local_reads=False" if enabled is False else f"{ENV}=0"


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)


class _Report:
    """Counts of local reads, sent to the sidecar at most once per `REPORT_S` by a short-lived thread."""

    def __init__(self, conns: Connections | None, timeout: float) -> None:
        self._conns, self._timeout = conns, timeout
        self._records = self._bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._records += 1
            self._bytes += nbytes
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="r3-local-report", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(REPORT_S)
            self.flush()
            with self._lock:
                if self._closed or not self._records:
                    self._thread = None
                    return

    def flush(self) -> None:
        with self._lock:
            records, nbytes, self._records, self._bytes = self._records, self._bytes, 0, 0
        if not records or self._conns is None:
            return
        body = orjson.dumps({"records": records, "bytes": nbytes})
        try:
            self._conns.send("POST", "/v1/local_reads", body=body, headers=_JSON, timeout=self._timeout)
        except Exception as exc:  # counts are metrics, not rows: dropped, never retried against a gone sidecar
            log.debug("local reads: could not report %d reads (%s)", records, exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(self._timeout)
        self.flush()


_JSON = {"Content-Type": "application/json"}
