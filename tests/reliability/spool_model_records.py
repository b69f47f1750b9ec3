"""The spool model's knowledge: every record a writer made, which generation of its rid, and its exact bytes.

Why rows are a function of (rid, generation, row index): a reader that gets rows of another record, of an older
generation of the same rid, or a torn record (rows past what was written, a hole) gets bytes this function does
not give, so every read anywhere is checked exactly. A record's state says what a reader may see of it:

- `live`: its writer is alive and may add rows; a reader sees a prefix, not final (or aborted once stale);
- `final`: finished `ok` or `aborted` by its writer: served whole, exactly, until acknowledged or expired;
- `orphan`: its writer was SIGKILLed before it finished: never served as finished `ok`;
- `acked`: a trainer acknowledged it: gone (404/410) for good, unless its rid is written again;
- `raced`: deleted while its writer reused the rid: either gone or its last generation, whole.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from r3_shape import LAYERS, NUM_EXPERTS, TOPK

MAX_ROWS = 1024
"""Rows any generation of a record can hold (a storm wraps around inside it)."""


ROUTE_TABLE = 4096
"""Distinct top-k choices a row's layer is drawn from: two generations' rows agree on one row with odds
4096^-6 (2^-72), so rows of another record or generation never pass for these."""


@lru_cache(maxsize=1)
def _routes() -> np.ndarray:
    """`ROUTE_TABLE` routes a router can make (top-k distinct experts), once per process: sorting a random key
    per expert for every row of every record took 15 ms a generation, most of a writer's or a check's time."""
    rng = np.random.default_rng(0x5EED)
    return rng.random((ROUTE_TABLE, NUM_EXPERTS)).argsort(axis=-1)[:, :TOPK].astype(np.uint8)


@lru_cache(maxsize=4096)
def _all_rows(rid: str, gen: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(f"{rid}#{gen}".encode()).digest()[:8], "little")
    picks = np.random.default_rng(seed).integers(0, ROUTE_TABLE, size=(MAX_ROWS, len(LAYERS)))
    return _routes()[picks]


def rows_for(rid: str, gen: int, lo: int, hi: int) -> np.ndarray:
    """Rows `[lo, hi)` of generation `gen` of `rid`."""
    return _all_rows(rid, gen)[lo:hi]


def bytes_for(rid: str, gen: int, rows: int) -> bytes:
    return rows_for(rid, gen, 0, rows).tobytes()


@dataclass
class Rec:
    """One rid as the model knows it (its latest generation)."""

    rid: str
    writer: int  # index of the agent that writes it; -1 for none
    gen: int
    rows: int = 0
    state: str = "live"  # live | final | orphan | acked | raced
    status: str = "ok"  # the status it was finished with (final)
    touched: float = field(default_factory=time.monotonic)  # last time its writer answered for it
    final_sent: float = 0.0  # when the finish command was sent: the record's `updated` is no earlier
    engine: bool = False  # written through the capped SpoolWriter

    def may_be_stale(self, stale_s: float) -> bool:
        """The sidecar may have marked it aborted: no update for `stale_s` (measured from our side, so a little
        early is still allowed: the writer stamped `updated` before it answered)."""
        return time.monotonic() - self.touched >= stale_s - 0.05

    def may_be_expired(self, ttl_s: float) -> bool:
        return self.state == "final" and time.monotonic() - self.final_sent >= ttl_s - 0.05


@dataclass
class Model:
    """All records of one run of the machine, plus what the writers' accounting must be."""

    prefix: str
    stale_s: float
    ttl_s: float
    recs: dict[str, Rec] = field(default_factory=dict)
    next_id: int = 0
    next_gen: int = 0

    def new_rid(self, kind: str) -> str:
        self.next_id += 1
        return f"{self.prefix}-{kind}{self.next_id:05d}"

    def gen(self) -> int:
        self.next_gen += 1
        return self.next_gen

    def by_state(self, *states: str) -> list[Rec]:
        return [r for r in self.recs.values() if r.state in states]

    def live_of(self, writer: int) -> list[Rec]:
        return [r for r in self.recs.values() if r.state == "live" and r.writer == writer]
