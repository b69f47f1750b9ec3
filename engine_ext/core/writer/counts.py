"""What the spool writer counts (the engine file's `writer` object) and why it refuses a reservation.

`UNDELIVERED_REASONS` (Contract 1, `service.spool`): why a request's rows did not reach the spool: refused
reservations (`spool_full`, `queue_full`, `spool_not_writable`), a mirror-mode inline payload that did not
match its reservation, or a write that failed on the writer thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.spool.engine_report import UNDELIVERED_REASONS, WriterCounters

UNDELIVERED_LOG_EVERY_S = 10.0


@dataclass(slots=True)
class WriterStats:
    """The counters behind the engine file's `writer` object (Contract 1); all of them are exported."""

    queued_bytes: int = 0
    records_written: int = 0
    fallback_inline: int = 0
    spool_full: int = 0  # refused reservations for lack of room (live appends included)
    queue_full: int = 0
    write_errors: int = 0
    suspect_records: int = 0  # records marked `suspect` by the row check (`row_audit`)
    undelivered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNDELIVERED_REASONS, 0))

    def contract(self) -> dict[str, Any]:
        """The engine file's `writer` object (`service.spool.WriterCounters`)."""
        return WriterCounters(
            queued_bytes=self.queued_bytes,
            records_written=self.records_written,
            fallback_inline=self.fallback_inline,
            spool_full=self.spool_full,
            queue_full=self.queue_full,
            write_errors=self.write_errors,
            suspect_records=self.suspect_records,
            undelivered=dict(self.undelivered),
        ).to_dict()


class Refusal(str):
    """Why a reservation was refused: `spool_full`, `queue_full` or `not_writable`."""


SPOOL_FULL = Refusal("spool_full")
QUEUE_FULL = Refusal("queue_full")
NOT_WRITABLE = Refusal("not_writable")
_REFUSAL_REASON = {SPOOL_FULL: "spool_full", QUEUE_FULL: "queue_full", NOT_WRITABLE: "spool_not_writable"}


def undelivered_reason(refusal: str) -> str:
    """The `undelivered` reason of a refused reservation."""
    return _REFUSAL_REASON.get(refusal, str(refusal))
