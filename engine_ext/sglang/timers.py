"""Cumulative time of each hook's own work on the scheduler thread, by forward kind.

Why: an operator must see what the plugin costs a live server, hook by hook, without a profiler. Only hooks
that run outside the model's forward are timed: the per-layer capture check runs inside it, where SGLang's
piecewise CUDA graphs and `--enable-torch-compile` trace it with Dynamo, which skips `perf_counter_ns` (the
capture fails) and would freeze any clock or counter at trace time; `make bench-hooks` measures it per
forward, eager and compiled. Each timed hook adds its *own* time (its total minus the SGLang code it wraps,
minus timed hooks nested inside it) to one slot of a preallocated table `[hook][kind]`: two integer additions
per call, nothing retained, no object built. The kind is the forward kind the hooks last saw (set by the
per-forward and per-batch-result hooks from SGLang's ForwardMode), so per-request work is booked to the
forward it belongs to.

    @timers.timed(timers.FORWARD_END)          # an AROUND hook: `original` is timed and subtracted
    def _around_forward_end(original, self, *args, **kwargs): ...
    timers.TIMERS.snapshot()                    # {"forward_end": {"decode": {"calls": 12, "seconds": 0.0004}}}

`R3_HOOK_TIMERS=0` turns them off: `untimed(fn)` is then what `hooks.install` registers (no timer frame).
Only the scheduler thread books; the telemetry thread reads (list reads are atomic under the GIL).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import perf_counter_ns as clock
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

HOOKS = ("forward_extent", "forward_end", "batch_result", "live_step", "collect", "finalize")
FORWARD_EXTENT, FORWARD_END, BATCH_RESULT, LIVE_STEP, COLLECT, FINALIZE = range(len(HOOKS))
KINDS = ("extend", "decode", "verify", "idle", "other")
EXTEND, DECODE, VERIFY, IDLE, OTHER = range(len(KINDS))


class HookTimers:
    """The `[hook][kind]` table of calls and nanoseconds, the current kind, and the nesting account."""

    __slots__ = ("calls", "child_ns", "kind", "ns", "on")

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.calls = [0] * (len(HOOKS) * len(KINDS))
        self.ns = [0] * (len(HOOKS) * len(KINDS))
        self.kind = OTHER
        self.child_ns = 0  # time of timed regions (and originals) inside the region now running

    def reset(self) -> None:
        for table in (self.calls, self.ns):
            table[:] = [0] * len(table)
        self.kind, self.child_ns = OTHER, 0

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """Booked hooks and kinds only: `{hook: {kind: {"calls", "seconds"}}}` (the engine file's `hooks`)."""
        calls, ns = list(self.calls), list(self.ns)
        out: dict[str, dict[str, dict[str, float]]] = {}
        for h, hook in enumerate(HOOKS):
            for k, kind in enumerate(KINDS):
                slot = h * len(KINDS) + k
                if calls[slot]:
                    out.setdefault(hook, {})[kind] = {"calls": calls[slot], "seconds": ns[slot] / 1e9}
        return out


TIMERS = HookTimers()


def configure(on: bool) -> None:
    """Timers on or off for this process (`R3_HOOK_TIMERS`, read at `install`)."""
    TIMERS.on = on


def _timed_original(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` as called from a timed hook: its time is the region's child time, not the hook's own."""

    def run(*args: Any, **kwargs: Any) -> Any:
        timers = TIMERS
        saved, t0 = timers.child_ns, clock()
        try:
            return original(*args, **kwargs)
        finally:
            timers.child_ns = saved + (clock() - t0)

    return run


_originals: dict[Any, Callable[..., Any]] = {}  # one timed wrapper per original, built once


def timed(hook: int, *, around: bool = True) -> Callable[[F], F]:
    """Book the decorated hook's own time under `hook`; `around`: its first argument is SGLang's `original`."""

    def decorate(fn: F) -> F:
        slot0 = hook * len(KINDS)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            timers = TIMERS
            if not timers.on:
                return fn(*args, **kwargs)
            if around:
                original = args[0]
                wrapped = _originals.get(original)
                if wrapped is None:
                    wrapped = _originals[original] = _timed_original(original)
                args = (wrapped, *args[1:])
            saved = timers.child_ns
            timers.child_ns = 0
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total = clock() - t0
                slot = slot0 + timers.kind
                timers.ns[slot] += total - timers.child_ns
                timers.calls[slot] += 1
                timers.child_ns = saved + total

        run.__r3_untimed__ = fn  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate


def untimed(fn: F) -> F:
    """The hook without its timer when timers are off (what `install` registers), else `fn` itself."""
    return fn if TIMERS.on else getattr(fn, "__r3_untimed__", fn)
