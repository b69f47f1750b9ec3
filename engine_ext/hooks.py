"""The one module that names SGLang 0.5.23 internals: hook targets, private attributes, argument names.

Everything it calls is plain functions of plain values (`capturer`, `slicing`, `budget`, `writer`, …), so
those stay testable without SGLang. Hooks are registered with `HookRegistry`; SGLang applies them.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from engine_ext.settings import EngineSettings, Mode


def install(settings: EngineSettings) -> None:
    """Register every hook this plugin needs for `settings`."""
    install_capture_hooks(settings)
    install_budget_hooks(settings)
    if settings.mode is not Mode.OFF:
        install_delivery_hooks(settings)


# ---- capture: capturer sizing, DP slicing, runtime assertions, occupancy (owner: capture work) ----------


def install_capture_hooks(settings: EngineSettings) -> None:
    """Correct capturer sizing and sync-free DP slicing."""
    _ = (HookRegistry, HookType)


# ---- budget: pre-launch check (owner: budget work) -------------------------------------------------------


def install_budget_hooks(settings: EngineSettings) -> None:
    """Check every buffer's budget once the server arguments are final."""


# ---- delivery: collection, writer, live rows, telemetry, pointer (owner: delivery work) ------------------


def install_delivery_hooks(settings: EngineSettings) -> None:
    """Deliver finished (and, when asked, live) rows to the spool without blocking the scheduler."""
