"""Which of the plugin's hooks failed in this process, and with what: the engine file's `degraded` part.

Why it exists: the plugin never takes the engine down. When its own code fails at a hook, the process falls back to
the engine's own behaviour for the rest of the run (`engine_ext/sglang/guard.py`), and this record is how that
stays loud: the engine file lists each failed hook with its error (`GET /v1/engines`), and the sidecar exports
it as `r3_engine_degraded_hooks_total{engine,hook}`. Plain values only; any thread may read a snapshot.

The plugin's daemon threads (spool writer, telemetry, collect ticker) run their bodies through `guarded_thread`:
an exception from our code there would otherwise end the thread alone, silently, with records left unwritten.
It counts as a failed hook named `thread <name>`; the adapter whose hooks can step aside says how in
`ON_THREAD_FAILURE` (SGLang's guard degrades every hook), else it is recorded and logged here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("r3_sidecar")


class EngineFailure(RuntimeError):
    """Raised on purpose where the engine itself would fail (or write rows it did not route) at the same point,
    saying which setting to change: not a fault of the plugin, so the guard passes it on as it does the engine's own
    exceptions and degrades nothing. Falling back there would only trade this message for the engine's shape
    error, or for rows written past a buffer."""


class Degraded:
    """Failed hooks in order of failure: hook name → (target, error text, time of the failure)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: dict[str, dict[str, Any]] = {}

    def note(self, hook: str, target: str, error: BaseException) -> bool:
        """Record the first failure of `hook`; False when it had already failed (nothing changes)."""
        with self._lock:
            if hook in self._faults:
                return False
            text = f"{type(error).__name__}: {error}"
            self._faults[hook] = {"hook": hook, "target": target, "error": text[:2000], "since": time.time()}
            return True

    def __bool__(self) -> bool:
        return bool(self._faults)

    def snapshot(self) -> list[dict[str, Any]]:
        """The engine file's `degraded` list: `{"hook", "target", "error", "since"}` per failed hook."""
        with self._lock:
            return [dict(fault) for fault in self._faults.values()]

    def clear(self) -> None:
        """Forget every failure (tests; a process never recovers a hook it degraded)."""
        with self._lock:
            self._faults.clear()


DEGRADED = Degraded()

# (thread name, error) -> None: what a failed thread makes of the process; set by an adapter that can step aside.
ON_THREAD_FAILURE: list[Callable[[str, BaseException], None]] = []


def guarded_thread(name: str, body: Callable[[], None]) -> Callable[[], None]:
    """`body` as a daemon thread's target whose failure is loud and degrades the plugin, never dies unseen."""

    def run() -> None:
        try:
            body()
        except Exception as exc:
            if ON_THREAD_FAILURE:
                for react in ON_THREAD_FAILURE:
                    react(name, exc)
            elif DEGRADED.note(f"thread {name}", name, exc):
                log.error("r3-sidecar: thread %s failed: %s: %s", name, type(exc).__name__, exc, exc_info=exc)

    return run
