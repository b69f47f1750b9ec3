"""Where SGLang writes its tokenizer workers' app path into its code (≤ 0.5.20): the one call that receives it,
retargeted to `http_worker`'s app.

Why: with `--tokenizer-worker-num N > 1`, N uvicorn worker processes build the responses, and SGLang loads no
plugins in them, so the rows they hand inline would not say their shape and start. SGLang 0.5.23 names the
workers' app in a setting (`hooks.frontdoor.point_workers_here`); 0.5.12-0.5.20 hand the literal
`"sglang.srt.entrypoints.http_server:app"` to `uvicorn.run(..., workers=N)` in the main process, which is a process
that loads the plugin. uvicorn spawns each worker (`multiprocessing` "spawn": a fresh interpreter that imports the
app string named in the pickled `uvicorn.Config`), so that call is the one place the workers' app can be chosen.
`retarget_worker_app` is an AROUND hook on it (`compat.Layout.worker_app_call`, data per version): it passes on
every call unchanged except that exact one, SGLang's literal app with several workers, whose app becomes
`http_worker`'s, the very app object of SGLang's module with the "inline" hooks applied there first.

Granian, SGLang's HTTP/2 server (`--enable-http2`), gets the same literal as its `target` on those versions
(`_run_granian_server`: with several workers on 0.5.16-0.5.20, always on 0.5.12, where even one worker is a process
Granian spawns). Its multi-process server imports a target string in each worker it spawns, so
`retarget_granian_app`, AROUND Granian's server constructor (`compat.Layout.granian_app_call`), swaps exactly that
string; an app object (Granian embedded in SGLang's process) passes unchanged. Registered only where granian
imports: without it SGLang cannot serve HTTP/2 at all.

Behind its guard like every hook (`guard`): a failure here calls uvicorn or Granian with SGLang's own arguments
(its app path, rows without shape), loudly, and degrades the process's hooks as any failed hook does.
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


def app_for_granian(target: Any) -> Any:
    """The target Granian's spawned workers should import: `http_worker`'s in place of SGLang's literal, whatever
    the worker count (each is a fresh process); anything else (an app object, another path) as given."""
    return WORKER_APP if target == SGLANG_APP else target


def retarget_granian_app(original: Callable[..., Any], server: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND Granian's server constructor in SGLang's main process: its workers import `http_worker`'s app."""
    if args:
        args = (app_for_granian(args[0]), *args[1:])
        chosen = args[0]
    elif "target" in kwargs:
        chosen = kwargs["target"] = app_for_granian(kwargs["target"])
    else:  # no target at all: Granian's own error, unchanged
        chosen = None
    if chosen == WORKER_APP:
        log.info("r3-sidecar: SGLang's Granian (HTTP/2) workers serve %s (SGLang's app, inline hooks applied)", chosen)
    return original(server, *args, **kwargs)


def register(call: str | None, granian_call: str | None = None) -> list[str]:
    """Register `retarget_worker_app` on `call` and `retarget_granian_app` on `granian_call`, SGLang's literal-app
    calls on this version (None: SGLang names the app in a setting, or has no such call), the latter only where
    granian imports. Behind their guards, as `hooks.HOOKS` rows are. Returns the calls hooked."""
    from importlib.util import find_spec

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from engine_ext.sglang import guard

    hooked = []
    for name, where, body in (
        ("retarget_worker_app", call, retarget_worker_app),
        ("retarget_granian_app", granian_call if find_spec("granian") else None, retarget_granian_app),
    ):
        if where is not None:
            HookRegistry.register(where, guard.wrap(name, where, body, replace=False), HookType.AROUND)
            hooked.append(where)
    return hooked
