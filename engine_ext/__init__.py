"""r3-sidecar's SGLang plugin: correct routed-experts capture, budget checks, and spool delivery.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in each of its processes; it only
registers hooks with `HookRegistry`, which SGLang applies right after.
"""

from __future__ import annotations

import logging

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

    hooks.install(EngineSettings())
