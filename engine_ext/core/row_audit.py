"""The writer thread's row check: each record's rows are checked as they are written, a failing record is marked.

Why here: the check costs about a microsecond a row (BENCHMARKS.md, "Row check"), which the scheduler's step must
not pay; the writer thread already holds every row on its way to `.bin`. A record that fails is kept, marked
`suspect` with its first bad row (docs/design.md, Contract 1), counted (`writer.suspect_records`,
`r3_engine_suspect_records_total`) and logged, at most once per `LOG_EVERY_S` with the running count: an engine
whose capture is broken fails every record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from service.spool.record.meta import Suspect
from service.spool.record.writer import RecordWriter
from service.spool.row_check import first_bad_row

logger = logging.getLogger("r3_sidecar.writer")

LOG_EVERY_S = 10.0


class RowAudit:
    """Checks rows before they are appended; one per writer thread (not shared between threads)."""

    def __init__(self, sentinels: tuple[int, ...] = (), *, enabled: bool = True) -> None:
        self.sentinels = sentinels
        self.enabled = enabled
        if not enabled:
            logger.warning("r3-sidecar: the row check is off (R3_ROW_CHECK=0): a wrong route is served as `ok`")
        self.marked = 0
        self._logged = -LOG_EVERY_S

    def check(self, writer: RecordWriter, rows: np.ndarray) -> Suspect | None:
        """Check `rows` about to be appended to `writer`'s record; mark the record at its first bad row.

        Returns the finding when this call marked the record (a record is marked, counted and logged once)."""
        if not self.enabled or writer.suspect or rows.shape[0] == 0:
            return None
        meta = writer.meta
        found = first_bad_row(rows, meta.num_experts, sentinels=self.sentinels, layers=meta.layers)
        if found is None:
            return None
        found = replace(found, row=found.row + writer.rows)  # rows appended before: the record's own index
        writer.mark_suspect(found)
        self.marked += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            logger.warning(
                "r3-sidecar: record %r has rows no true route has (%s); kept as suspect; %d suspect records so far",
                meta.rid,
                found.describe(meta.start),
                self.marked,
            )
        return found
