"""The plugin never takes SGLang down: every hook is registered behind a guard with a "degraded → original" switch.

Why one mechanism at registration: a hook body cannot know every way its own code may fail, and try/except spread
through the bodies each decide differently. `wrap` turns each row of `hooks.HOOKS` into the AROUND hook that
`HookRegistry` applies (a REPLACE row too, so SGLang's original stays at hand). While no hook of the process has
failed, the guard calls the hook. When the plugin's own code raises `Exception` at any hook:

- that call ends as SGLang's own would: the original is called with the caller's arguments if the hook had not
  called it yet, else its result (or its exception) stands, finished by the hook row's `settle` where the hook
  called it with other arguments; an item a stream hook had pulled from SGLang's stream and not passed on is
  passed on as SGLang made it, then the rest of SGLang's stream;
- every guard of the process switches to degraded, and from then on calls the original only. All of them, not the
  one: the hooks share state (a forward's extent feeds the slice, a drain must precede the host-cache write, the
  finish path ends what live rows began), so half a plugin could hand out rows that are not what SGLang routed;
- it is loud: one ERROR line per failed hook, the failure in `core.degraded.DEGRADED` (the engine file's
  `degraded`, `r3_engine_degraded_hooks_total`), and the process's `on_step_aside` callbacks run once (delivery
  ends every record not yet whole as `error`, and makes sure an engine file reports it).

An exception raised by SGLang's original is SGLang's behaviour: it passes through untouched and degrades nothing. So
does an `EngineFailure` the plugin raises on purpose (a capture buffer overflow, named before the write where SGLang
would fail at it or write past it).
Only the budget check under `R3_BUDGET=enforce` refuses a start; it is a resolution hook, not one of these.

Inside a compiled region (`torch.compiler.is_compiling()`: SGLang's piecewise CUDA graphs and torch.compile trace
the per-layer hook with Dynamo) the guard is a plain branch on the switch: no try/except, no logging, no state
written, so it traces to the hook or, degraded, to the original alone. A failure there surfaces at trace time,
where no try/except reaches; the forward-level hooks around the compiled region are guarded as usual.

Tests inject a fault with `R3_TEST_FAULT_HOOKS=<hook function>[:after][@n],...` (or `*` for every hook): the guard
raises `InjectedFault` as the hook's own code at the n-th call (default the first), on entry, or (`:after`) right
after the hook's call of the original returns (a stream hook: after it pulled an item from SGLang's stream). Read
once when the hooks are registered; test-only.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch.compiler import is_compiling

from engine_ext.core.degraded import DEGRADED, EngineFailure

log = logging.getLogger("r3_sidecar")

FAULT_ENV = "R3_TEST_FAULT_HOOKS"


class InjectedFault(RuntimeError):
    """The test-only fault `R3_TEST_FAULT_HOOKS` makes a hook raise, as if the plugin's own code had failed."""


@dataclass(slots=True)
class _Call:
    """One call of a guarded hook: what happened to SGLang's original during it. Called, it is that original as
    the hook receives it: it records the call, its result, and an exception as SGLang's own."""

    original: Callable[..., Any]
    guard: Guard
    called: bool = False
    returned: bool = False
    result: Any = None
    error: BaseException | None = None  # raised by the original: SGLang's own, passed on
    stream: Any = None  # a stream hook: SGLang's stream, finished on its behalf after a failure
    pending: list[Any] = field(default_factory=list)  # an item pulled from that stream and not yet passed on

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        try:
            self.result = self.original(*args, **kwargs)
        except BaseException as exc:
            self.error = exc
            raise
        self.returned = True
        if self.guard.fault is not None:
            self.guard.injected("after")
        return self.result

    def settle(self) -> Any:
        """After the hook failed: what SGLang's own call gives, without calling the original twice."""
        if self.error is not None:
            raise self.error
        return self.result


class Guard:
    """One registered hook's switch; `trip` degrades every guard of the process at once."""

    __slots__ = ("calls", "degraded", "fault", "name", "target")
    all: list[Guard] = []  # noqa: RUF012 (the process's guards, in registration order)
    on_step_aside: list[Callable[[], None]] = []  # noqa: RUF012 (run once, at the first failure)

    def __init__(self, name: str, target: str, fault: list | None = None) -> None:
        self.name, self.target, self.fault = name, target, fault
        self.degraded = False
        self.calls: ContextVar[_Call] = ContextVar(f"r3_guard_{name}")
        Guard.all.append(self)

    def trip(self, error: BaseException) -> None:
        """The plugin's code failed in this hook: SGLang's own behaviour for every hook from now on, loudly."""
        first = not any(g.degraded for g in Guard.all)
        for guard in Guard.all:
            guard.degraded = True
        if DEGRADED.note(self.name, self.target, error):
            log.error(
                "r3-sidecar: hook %s (%s) failed: %s: %s; every r3-sidecar hook in this process now runs SGLang's "
                "own code only (degraded)",
                self.name,
                self.target,
                type(error).__name__,
                error,
                exc_info=(type(error), error, error.__traceback__),
            )
        if first:
            for callback in Guard.on_step_aside:
                try:
                    callback()
                except Exception as exc:  # the step aside itself must not take the engine down either
                    log.warning("r3-sidecar: stepping aside after a failed hook: %s: %s", type(exc).__name__, exc)

    def injected(self, where: str) -> None:
        """The test-only fault: raise at `where` ("enter" or "after") of the call it names."""
        if self.fault is not None and self.fault[0] == where:
            self.fault[1] -= 1
            if self.fault[1] == 0:
                raise InjectedFault(f"{FAULT_ENV}: {self.name} ({where})")


def failed_outside_hooks(name: str, where: str, error: Exception) -> None:
    """The plugin's own code failed outside any hook (its entry point): the same step aside as a failed hook's."""
    Guard(name, where).trip(error)


def thread_failed(name: str, error: Exception) -> None:
    """One of the plugin's daemon threads died of our code (`core.degraded.guarded_thread`): a failed hook too,
    since the hooks hand it their records (a dead writer would leave every later record unwritten)."""
    failed_outside_hooks(f"thread {name}", name, error)


def faults(spec: str | None = None) -> dict[str, list]:
    """`R3_TEST_FAULT_HOOKS` as {hook function or "*": [where, call]}: `name[:after][@n]`, the n-th call (1)."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    out: dict[str, list] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        item, _, nth = item.partition("@")
        name, _, where = item.partition(":")
        out[name] = [where or "enter", int(nth or 1)]
    return out


def wrap(
    name: str, target: str, fn: Callable[..., Any], *, replace: bool, settle: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """The AROUND hook to register for `fn` (an AROUND hook, or with `replace` a REPLACE one) at `target`.

    `settle(result, *args, **kwargs)`: for a hook that calls the original with other arguments than its caller's,
    how SGLang's own call ends from that result when the hook fails after the original returned."""
    wanted = faults()
    fault = wanted.get(name, wanted.get("*"))
    guard = Guard(name, target, None if fault is None else list(fault))
    if inspect.isasyncgenfunction(fn):
        hook = _stream(guard, fn, replace)
    elif inspect.iscoroutinefunction(fn):
        hook = _coroutine(guard, fn, replace)
    else:
        hook = _function(guard, fn, replace, settle)
    hook.__name__ = hook.__qualname__ = f"guarded_{name}"
    hook.__r3_guard__ = guard  # type: ignore[attr-defined]
    return hook


class _Tracked:
    """The `original` a timed hook receives instead (`timers.timed` keys its wrapper on it, so one per guard): the
    call now running, found in a ContextVar (the main process's hooks interleave on its event loop)."""

    __slots__ = ("guard",)

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.guard.calls.get()(*args, **kwargs)


def _function(
    guard: Guard, fn: Callable[..., Any], replace: bool, settle: Callable[..., Any] | None
) -> Callable[..., Any]:
    stable = _Tracked(guard) if hasattr(fn, "__r3_untimed__") else None  # a timed hook

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if guard.degraded:
            return original(*args, **kwargs)
        if is_compiling():  # traced by Dynamo: a plain call, nothing Dynamo cannot trace or replay
            return fn(*args, **kwargs) if replace else fn(original, *args, **kwargs)
        call = _Call(original, guard)
        token = None if stable is None else guard.calls.set(call)
        try:
            if guard.fault is not None:
                guard.injected("enter")
            return fn(*args, **kwargs) if replace else fn(stable or call, *args, **kwargs)
        except Exception as exc:
            if exc is call.error or isinstance(exc, EngineFailure):
                raise
            guard.trip(exc)
            if call.returned and settle is not None:
                return settle(call.result, *args, **kwargs)
            return call.settle() if call.called else original(*args, **kwargs)
        finally:
            if token is not None:
                guard.calls.reset(token)

    return hook


def _coroutine(guard: Guard, fn: Callable[..., Any], replace: bool) -> Callable[..., Any]:
    async def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if guard.degraded:
            return await original(*args, **kwargs)
        call = _Call(original, guard)

        async def tracked(*a: Any, **k: Any) -> Any:
            call.called = True
            try:
                call.result = await original(*a, **k)
            except BaseException as exc:
                call.error = exc
                raise
            call.returned = True
            guard.injected("after")
            return call.result

        try:
            guard.injected("enter")
            return await (fn(*args, **kwargs) if replace else fn(tracked, *args, **kwargs))
        except Exception as exc:
            if exc is call.error or isinstance(exc, EngineFailure):
                raise
            guard.trip(exc)
            return call.settle() if call.called else await original(*args, **kwargs)

    return hook


def _stream(guard: Guard, fn: Callable[..., Any], replace: bool) -> Callable[..., Any]:
    async def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if guard.degraded:
            async for item in original(*args, **kwargs):
                yield item
            return
        call = _Call(original, guard)

        def tracked(*a: Any, **k: Any) -> Any:
            call.called = True
            call.stream = original(*a, **k)
            return _pulled(guard, call)

        try:
            guard.injected("enter")
            async for item in fn(*args, **kwargs) if replace else fn(tracked, *args, **kwargs):
                call.pending.clear()
                yield item
            return
        except Exception as exc:
            if exc is call.error or isinstance(exc, EngineFailure):
                raise
            guard.trip(exc)
        if call.error is not None:
            raise call.error
        for item in call.pending:
            yield item
        async for item in call.stream if call.called else original(*args, **kwargs):
            yield item

    return hook


async def _pulled(guard: Guard, call: _Call) -> Any:
    """SGLang's stream as the hook sees it: each item is pending until the hook passes something on."""
    stream = call.stream
    while True:
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return
        except BaseException as exc:
            call.error = exc
            raise
        call.pending[:] = [item]
        guard.injected("after")
        yield item


def reset() -> None:
    """Every guard back on and no failure recorded (tests only: a running engine never un-degrades)."""
    for guard in Guard.all:
        guard.degraded = False
    DEGRADED.clear()
