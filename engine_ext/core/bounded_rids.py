"""A bounded, thread-safe, ordered set of request ids: the oldest is forgotten first.

Why: both engines remember requests for a while (SGLang: those whose response promised a record, to settle at
shutdown; vLLM: those spooled, until the response builder attaches their pointer); neither may grow without
bound on a server that runs for weeks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class BoundedRids:
    """Insertion-ordered rids, at most `limit` of them; every operation takes the one lock."""

    def __init__(self, limit: int) -> None:
        self._rids: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, rid: str) -> None:
        """Remember `rid` as the newest (again, if it was there), forgetting the oldest beyond the limit."""
        with self._lock:
            self._rids[rid] = None
            self._rids.move_to_end(rid)
            while len(self._rids) > self._limit:
                self._rids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        with self._lock:
            return rid in self._rids

    def take(self, rid: str) -> bool:
        """Forget `rid`; whether it was remembered."""
        with self._lock:
            return self._rids.pop(rid, 0) is None

    def snapshot(self) -> list[str]:
        """The rids remembered now, oldest first."""
        with self._lock:
            return list(self._rids)

    def forget(self, rids: Iterable[str]) -> None:
        with self._lock:
            for rid in rids:
                self._rids.pop(rid, None)
