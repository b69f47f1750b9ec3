"""SGLang's HTTP app as its tokenizer worker processes import it, with the plugin's inline hooks applied first.

Why: with `--tokenizer-worker-num N > 1`, N worker processes build the responses, and SGLang loads no plugins in
them, so the rows they return inline (sidecar mode keeps them there: `frontdoors.effective_mode`) said neither
their shape nor their start. SGLang 0.5.23 imports the workers' app from `SGLANG_HTTP_SERVER_APP_PATH`
(default `sglang.srt.entrypoints.http_server:app`); the plugin, where it loads, points that setting here when it
is unset (`hooks.frontdoor.point_workers_here`); SGLang 0.5.12-0.5.20 write that default into their code, and the plugin
retargets the one call that receives it (`worker_app`). This module applies the "inline" rows of `hooks.table.HOOKS`
in the worker before SGLang serves: `meta_info` and the OpenAI `sglext` get `routed_experts_shape` and
`routed_experts_start_len`, as with one tokenizer process. No pointer is attached there
(`frontdoors.MULTI_TOKENIZER`).

The workers serve the very app object of `sglang.srt.entrypoints.http_server`, untouched; a failure applying the
hooks degrades to SGLang's own responses, loudly (`guard`).
"""

from __future__ import annotations


def install_in_worker() -> None:
    """Apply the "inline" hooks in this tokenizer worker, as the plugin's entry point would; never raises."""
    from engine_ext.sglang import guard

    try:
        _install()
    except Exception as exc:
        guard.failed_outside_hooks("http_worker", f"{__name__}:install_in_worker", exc)


def _install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from engine_ext.core.settings import EngineSettings, Mode
    from engine_ext.sglang import compat, fit
    from engine_ext.sglang.hooks import table

    plan = fit.installed()
    settings = EngineSettings()
    if not plan.full or settings.mode is Mode.OFF:
        return
    compat.use(plan.layout)
    table.install_worker_hooks(settings)
    HookRegistry.apply_hooks()


from sglang.srt.entrypoints import http_server  # noqa: E402 (the workers' SGLang first, then its hooks)

install_in_worker()
app = http_server.app
