"""The rids whose responses promised a record, and a bounded wait at shutdown until those records are final.

Why: a response carries `routed_experts_url` as soon as the scheduler has queued the request's rows, and the
writer thread makes the record final a few milliseconds later; a request whose rows the spool refused carries
its rows inline, and its `error` record (the sidecar's 410) is just as far behind. An offline engine shut down
right after its last `generate` (`sglang.Engine.shutdown` kills the scheduler with SIGKILL) would otherwise
leave a pointer whose record never becomes final, or a rid the sidecar never heard of. Plain file reads of the
spool: the main process has no writer of its own.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from engine_ext.core.bounded_rids import BoundedRids
from service.spool import Spool
from service.spool.record.meta import SpoolFormatError

logger = logging.getLogger("r3_sidecar.promised")

REMEMBERED = 4096
"""Rids remembered (oldest forgotten first): the requests that may still be in the writer's hands."""


class Promised(BoundedRids):
    """The rids this process promised a record for, and the wait at shutdown until their records are final."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        super().__init__(limit)

    def settle(self, spool_dir: Path, timeout_s: float, poll_s: float = 0.01) -> list[str]:
        """Wait up to `timeout_s` until every remembered rid's record is final; return those still open."""
        spool = Spool(spool_dir, create=False)
        if not os.access(spool.records_dir, os.W_OK):  # the writer refuses every record then: none will come
            return self.snapshot()
        deadline = time.monotonic() + timeout_s
        checked = self.snapshot()
        waiting = checked
        while True:
            waiting = [rid for rid in waiting if not _final(spool, rid)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        self.forget(set(checked) - set(waiting))
        if waiting:
            logger.warning(
                "r3-sidecar: %d record(s) a response promised were not final after %.1f s at shutdown (first: %r)",
                len(waiting),
                timeout_s,
                waiting[0],
            )
        return waiting


def _final(spool: Spool, rid: str) -> bool:
    try:
        meta = spool.read_meta(rid)
    except (OSError, SpoolFormatError):
        return False
    return meta is not None and meta.final
