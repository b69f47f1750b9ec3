"""The rids this process handed a pointer to, and a bounded wait at shutdown until their records are final.

Why: a response carries `routed_experts_url` as soon as the scheduler has queued the request's rows, and the
writer thread makes the record final a few milliseconds later. An offline engine shut down right after its
last `generate` (`sglang.Engine.shutdown` kills the scheduler with SIGKILL) would otherwise leave a pointer
whose record never becomes final. Plain file reads of the spool: the main process has no writer of its own.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from engine_ext.core.bounded_rids import BoundedRids
from service.record_meta import SpoolFormatError
from service.spool import Spool

logger = logging.getLogger("r3_sidecar.pointed")

REMEMBERED = 4096
"""Pointers remembered (oldest forgotten first): the requests that may still be in the writer's hands."""


class Pointed(BoundedRids):
    """The rids that got a pointer in this process, and the wait at shutdown until their records are final."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        super().__init__(limit)

    def settle(self, spool_dir: Path, timeout_s: float, poll_s: float = 0.01) -> list[str]:
        """Wait up to `timeout_s` until every remembered rid's record is final; return those still open."""
        spool = Spool(spool_dir, create=False)
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
                "r3-sidecar: %d record(s) a response pointed to were not final after %.1f s at shutdown (first: %r)",
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
