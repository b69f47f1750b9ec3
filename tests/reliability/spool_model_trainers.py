"""The spool model's trainers: the real client over HTTP (get, batch, stream, ack) and reading the spool locally.

Why streams run in threads: a stream of a live record lasts until its writer finishes it, while the machine
goes on stepping (appending rows, finishing, reusing the rid); each stream is judged when it ends, against
the record as the model knew it when the stream began (`StreamWatch`).
"""

from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from spool_model_checks import ROW_BYTES, Violation
from spool_model_records import Rec, bytes_for

from service.client import R3Error, RoutedExpertsClient
from service.client.errors import (
    RangeNotSatisfiable,
    RecordGone,
    RecordNotFound,
    RecordRestarted,
    SidecarUnreachable,
)

STREAM_WAIT_S = 1.0
TLS = ssl.create_default_context()
"""One TLS context for every stream's client: httpx builds one per client otherwise (0.1 s of CPU loading the
CA bundle, holding the GIL the machine's own thread needs), 16 times a run, though the sidecar speaks http."""


def answer_of(call) -> tuple[int, bytes, str | None]:
    """(HTTP status, rows as bytes, record status) of one client call; an error is its status, no rows."""
    try:
        got = call()
    except R3Error as exc:
        return int(exc.status or 0), b"", None
    return 200, np.ascontiguousarray(got.array).tobytes(), got.status


def item_answer(got) -> tuple[int, bytes, str | None]:
    if isinstance(got, R3Error):
        return int(got.status or 0), b"", None
    return 200, np.ascontiguousarray(got.array).tobytes(), got.status


def _whose(watch: StreamWatch, latest: int) -> str:
    """Which generation's rows a wrong stream holds, block by block (a splice of two shows as two)."""
    out, row = [], watch.start
    for block in watch.blocks:
        n = len(block) // ROW_BYTES
        gens = [g for g in range(watch.gen, latest + 1) if bytes_for(watch.rid, g, row + n)[row * ROW_BYTES :] == block]
        out.append(f"rows {row}-{row + n}: gen {gens or '?'}")
        row += n
    return "; ".join(out)


@dataclass
class StreamWatch:
    """One trainer streaming one record from row `start`, in its own thread and with its own client."""

    rid: str
    gen: int
    start: int
    url: str
    blocks: list[bytes] = field(default_factory=list)
    last_status: str | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    life: tuple[float, float] = (0.0, float("inf"))  # monotonic: begun, ended

    def begin(self) -> StreamWatch:
        self.life = (time.monotonic(), float("inf"))
        self.thread = threading.Thread(target=self._run, name=f"stream-{self.rid}", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            http = httpx.HTTPTransport(verify=TLS)
            with RoutedExpertsClient(self.url, transport=http, timeout=30, retries=20, local_reads=False) as client:
                for block in client.stream(self.rid, start=self.start, wait=STREAM_WAIT_S):
                    self.blocks.append(np.ascontiguousarray(block.array).tobytes())
                    self.last_status = block.status
        except BaseException as exc:  # judged by the machine: some errors are allowed, some are findings
            self.error = exc
        finally:
            self.life = (self.life[0], time.monotonic())

    def _generation(self, body: bytes, latest: int) -> int | None:
        """The generation of the rid whose rows `body` is, from row `start`: the one the stream began on, or a later
        one (the request reached the sidecar after the rid was written again: a new record, served whole). None
        when no one generation's rows are these (a splice of two, rows of another record, a torn record)."""
        rows, rest = divmod(len(body), ROW_BYTES)
        if rest:
            return None
        if not body:
            return self.gen
        for gen in range(self.gen, latest + 1):
            if bytes_for(self.rid, gen, self.start + rows)[self.start * ROW_BYTES :] == body:
                return gen
        return None

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def judge(self, now_rec: Rec, ttl_s: float, down: tuple[tuple[float, float], ...] = ()) -> None:
        """The stream's outcome against the model: rows from `start` exactly as written, and an end it allows.
        `down`: when the model had the sidecar down (its restarts, monotonic from, to)."""
        where = f"stream {self.rid} gen {self.gen} from row {self.start}"
        body = b"".join(self.blocks)
        gen = self._generation(body, now_rec.gen)
        if gen is None:
            raise Violation(
                f"{where}: {len(body)} bytes in {len(self.blocks)} blocks are not one generation's rows from row "
                f"{self.start} (ended {self.last_status!r}, {self.error!r}; the record is now gen {now_rec.gen}, "
                f"{now_rec.state}, {now_rec.rows} rows; {_whose(self, now_rec.gen)})"
            )
        rows = len(body) // ROW_BYTES
        same = now_rec.gen == self.gen
        err = self.error
        if err is None:
            whole = self.start + rows == now_rec.rows
            if self.last_status == "ok" and gen == now_rec.gen and now_rec.state == "final" and not whole:
                raise Violation(f"{where}: ended ok after row {self.start + rows}, the record has {now_rec.rows}")
            return
        if isinstance(err, SidecarUnreachable) and any(a <= self.life[1] and self.life[0] <= b for a, b in down):
            return  # the model restarted the sidecar while this stream lived: its retries outlasted by the restart
        if isinstance(err, RecordRestarted):
            if same and now_rec.state not in ("raced", "acked"):
                raise Violation(f"{where}: 409 record_restarted, but the rid was never reused ({err})")
            return
        if isinstance(err, RecordNotFound | RecordGone):
            if now_rec.state in ("acked", "raced") or not same or now_rec.may_be_expired(ttl_s):
                return
            raise Violation(f"{where}: {type(err).__name__} for a record neither acknowledged nor expired ({err})")
        if isinstance(err, RangeNotSatisfiable):
            shorter = now_rec.state == "final" and now_rec.rows < self.start
            if not same or shorter or now_rec.state in ("orphan", "acked", "raced"):
                return  # finished (or abandoned) shorter than the row it started from, or gone
            raise Violation(f"{where}: 416, but the record is {now_rec.state} with {now_rec.rows} rows ({err})")
        raise Violation(f"{where}: {type(err).__name__}: {err}")
