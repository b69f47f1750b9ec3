"""Where SGLang writes its tokenizer workers' app path into its code (≤ 0.5.20): the one call that receives it,
retargeted to `http_worker`'s app.

Why: with `--tokenizer-worker-num N > 1`, N uvicorn worker processes build the responses, and SGLang loads no
plugins in them, so the rows they hand inline would not say their shape and start. SGLang 0.5.23 names the
workers' app in a setting (`frontdoor_hooks.point_workers_here`); 0.5.12-0.5.20 hand the literal
`"sglang.srt.entrypoints.http_server:app"` to `uvicorn.run(..., workers=N)` in the main process, which is a process
that loads the plugin. uvicorn spawns each worker (`multiprocessing` "spawn": a fresh interpreter that imports the
app string named in the pickled `uvicorn.Config`), so that call is the one place the workers' app can be chosen.
`retarget_worker_app` is an AROUND hook on it (`compat.Layout.worker_app_call`, data per version): it passes on
every call unchanged except that exact one, SGLang's literal app with several workers, whose app becomes
`http_worker`'s, the very app object of SGLang's module with the "inline" hooks applied there first.

Behind its guard like every hook (`guard`): a failure here calls uvicorn with SGLang's own arguments (its app path,
rows without shape), loudly, and degrades the process's hooks as any failed hook does. Not retargeted: Granian's
workers (`--enable-http2`), whose target is a literal too (0.5.16-0.5.20 `_run_granian_server`); their inline rows
stay without shape, as SGLang makes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

WORKER_APP = "engine_ext.sglang.http_worker:app"
SGLANG_APP = "sglang.srt.entrypoints.http_server:app"  # SGLang's default, and the literal ≤ 0.5.20 write

log = logging.getLogger("r3_sidecar")


def app_for_workers(app: Any, workers: Any) -> Any:
    """The app uvicorn should import: `http_worker`'s in place of SGLang's literal when several workers serve it;
    anything else (an app object, another path, one worker) as given."""
    if app == SGLANG_APP and isinstance(workers, int) and workers > 1:
        return WORKER_APP
    return app


def retarget_worker_app(original: Callable[..., Any], app: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `uvicorn.run` in SGLang's main process: its tokenizer workers import `http_worker`'s app."""
    chosen = app_for_workers(app, kwargs.get("workers"))
    if chosen != app:
        log.info(
            "r3-sidecar: SGLang's %s tokenizer workers serve %s (SGLang's app, inline hooks applied)",
            kwargs["workers"],
            chosen,
        )
    return original(chosen, *args, **kwargs)


def register(call: str | None) -> bool:
    """Register `retarget_worker_app` on `call`, SGLang's literal-app call on this version (None: SGLang names the
    app in a setting, or has no such call: nothing to do). Behind its guard, as `hooks.HOOKS` rows are."""
    if call is None:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from engine_ext.sglang import guard

    HookRegistry.register(
        call, guard.wrap("retarget_worker_app", call, retarget_worker_app, replace=False), HookType.AROUND
    )
    return True
