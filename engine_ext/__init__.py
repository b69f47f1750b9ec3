"""r3-sidecar's SGLang plugin: correct routed-experts capture, budget checks, and spool delivery.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in each of its processes; it only
registers hooks with `HookRegistry`, which SGLang applies right after.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_ext.settings import EngineSettings

logger = logging.getLogger("r3_sidecar")


def register() -> None:
    """Entry point: register every hook where `versions.support` says the plugin is proven, else none, loudly.

    Under `R3_BUDGET=enforce` an unsupported SGLang stops the start (`SystemExit`: SGLang's plugin loader
    catches `Exception` only) with the one message naming the version.
    """
    from importlib.metadata import PackageNotFoundError, version

    from engine_ext.settings import BudgetPolicy, EngineSettings
    from engine_ext.versions import support

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    plan = support(found)
    settings = EngineSettings()
    if not plan.full:
        message = f"r3-sidecar: {plan.reason}"
        if settings.budget is BudgetPolicy.ENFORCE:
            raise SystemExit(f"{message}; refusing to start (R3_BUDGET=enforce)")
        logger.error(message)
        return

    from engine_ext import hooks

    hooks.install(with_node_sidecar(settings))


def with_node_sidecar(settings: EngineSettings) -> EngineSettings:
    """`R3_SIDECAR=auto`: the node's sidecar started or found, and its URL as `R3_SIDECAR_URL` (unless set)."""
    if settings.sidecar != "auto" or settings.sidecar_url:
        return settings
    from engine_ext import node_sidecar

    try:
        found = node_sidecar.ensure(
            settings.spool_dir,
            advertise=settings.advertise_host,
            port=settings.sidecar_port,
            idle_s=settings.sidecar_idle_s,
        )
    except (OSError, RuntimeError) as exc:  # delivery goes on: records reach the spool, responses keep rows inline
        logger.error("r3-sidecar: R3_SIDECAR=auto could not start or find the node's sidecar: %s", exc)
        return settings
    return settings.model_copy(update={"sidecar_url": found.url})
