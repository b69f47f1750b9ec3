"""r3-sidecar's SGLang plugin: correct routed-experts capture, budget checks, and spool delivery.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in each of its processes; it only
registers hooks with `HookRegistry`, which SGLang applies right after.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("r3_sidecar")


def register() -> None:
    """Entry point: register every hook where the installed build fits a layout (`fit`), else none, loudly.

    Under `R3_BUDGET=enforce` an unsupported SGLang stops the start (`SystemExit`: SGLang's plugin loader
    catches `Exception` only) with the one message naming the version. Any other failure here leaves SGLang as
    it is, as a failed hook does (`guard.py`): the hooks registered so far call SGLang's originals only, one
    ERROR line, the failure in `degraded`.
    """
    from engine_ext.sglang import guard

    try:
        _register()
    except Exception as exc:
        guard.failed_outside_hooks("register", f"{__name__}:register", exc)


def _register() -> None:
    from engine_ext.core.settings import BudgetPolicy, EngineSettings
    from engine_ext.sglang import fit

    plan = fit.installed()
    settings = EngineSettings()
    if not plan.full:
        message = plan.describe()
        if settings.budget is BudgetPolicy.ENFORCE:
            raise SystemExit(f"{message}; refusing to start (R3_BUDGET=enforce)")
        logger.error(message)
        return

    from engine_ext.core.node_sidecar import with_node_sidecar
    from engine_ext.core.startup_line import announce
    from engine_ext.sglang import compat
    from engine_ext.sglang.hooks import table

    announce(logger, plan.describe(), proven=plan.proven)
    compat.use(plan.layout)
    announce_front_door(settings)
    table.install(with_node_sidecar(settings))


def announce_front_door(settings) -> str | None:
    """At start, in every process: under `SGLANG_RUST_SERVER` the front-door hooks never fire, so say (once,
    loudly) what still works and what does not, instead of pointers that silently never appear. Never raises:
    an unreadable setting is SGLang's to report."""
    from engine_ext.sglang.hooks import frontdoor

    try:
        note = frontdoor.rust_server_note(settings)
    except Exception:  # SGLang rejects a malformed SGLANG_RUST_SERVER itself
        return None
    if note:
        logger.warning("r3-sidecar: %s", note)
    return note
