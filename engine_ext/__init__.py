"""r3-sidecar's SGLang plugin: correct routed-experts capture, budget checks, and spool delivery.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in each of its processes; it only
registers hooks with `HookRegistry`, which SGLang applies right after.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_ext.settings import EngineSettings

SUPPORTED_SGLANG = "0.5.23"

logger = logging.getLogger("r3_sidecar")


def register() -> None:
    """Entry point: register every hook, or none at all on an SGLang this plugin was not built for."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    if found != SUPPORTED_SGLANG:
        logger.error(
            "r3-sidecar: built for sglang==%s, found %s; registering no hooks (capture stays upstream's)",
            SUPPORTED_SGLANG,
            found,
        )
        return

    from engine_ext import hooks
    from engine_ext.settings import EngineSettings

    hooks.install(with_node_sidecar(EngineSettings()))


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
