"""The hook table: which SGLang internals (in 0.5.23's spelling) the plugin hooks, and how it installs them.

The hook bodies live in rooms by concern beside this module (`engine_ext/sglang/hooks/`), the only modules besides
this one that name SGLang internals: `capture` (device-cache sizing, DP slicing, checks), `budget` (the pre-launch
check), `delivery` (finished rows to the spool), `live` (live rows), `frontdoor` (the pointer and inline rows'
shape in responses). A row names its function; `body(name)` finds it in its room.

How it works. SGLang's `HookRegistry` (`srt/plugins/hook_registry.py`) patches a dotted target in every
process that loads plugins: an AROUND hook is called as `hook(original, *args, **kwargs)` and decides when to
call `original`; a REPLACE hook takes the target's place. `install(settings)` registers the rows of `HOOKS`
below that the settings ask for, one hook per target; SGLang applies them right after (`register()` in
`engine_ext/sglang/__init__.py` is the entry point). Hooks read SGLang's objects into plain values; everything they
compute is plain functions of those outside this folder (`capturer`, `slicing`, `budget`, `collect`, `live`,
`writer`, `frontdoors`), testable without SGLang, and the process's delivery state is one object (`delivery.PROCESS`).
Older SGLangs keep some of these elsewhere: targets, settings and helpers go through `compat` (a `Layout`
per proven version, as data), so no hook body checks a version.

Usage, e.g. to see what a launch registers:

    from engine_ext.sglang.hooks import table
    for hook in table.HOOKS: print(hook.groups, hook.type.name, hook.target)

The budget check is not a `HookRegistry` target: it runs at the last ServerArgs resolution step
(`register_resolution_hook`, see `install_budget_hooks`).
"""

from __future__ import annotations

import os
import pkgutil
from dataclasses import dataclass
from functools import partial

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from engine_ext.core.degraded import ON_THREAD_FAILURE
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.sglang import compat, guard, timers, worker_app
from engine_ext.sglang.delivery import PROCESS
from engine_ext.sglang.hooks import budget as budget_hooks
from engine_ext.sglang.hooks import capture as capture_hooks
from engine_ext.sglang.hooks import delivery as delivery_hooks
from engine_ext.sglang.hooks import frontdoor as frontdoor_hooks
from engine_ext.sglang.hooks import live as live_hooks

_RE = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer"
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_OPENAI = "sglang.srt.entrypoints.openai"


@dataclass(frozen=True)
class Hook:
    """One row of the table: where, what (a hook function, by name: `body`), how, and when it is wanted."""

    target: str
    function: str
    type: HookType
    # capture: always · hip: ROCm only · delivery, inline: R3_MODE not off · pointer: R3_SIDECAR_URL
    groups: tuple[str, ...]
    settle: str | None = None  # calls the original with other arguments: how the guard ends SGLang's call (`guard`)
    keywords: tuple[str, ...] = ()  # the target's parameters the hook reads from `kwargs` by name (`fit`)


AROUND, REPLACE = HookType.AROUND, HookType.REPLACE
HOOKS: tuple[Hook, ...] = (
    # capture: sizing, sync-free DP slicing, overflow checks, occupancy (scheduler)
    Hook(
        f"{_RE}.create",
        "_create_sized_capturer",
        AROUND,
        ("capture",),
        keywords=("model_config", "max_running_requests"),
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
        "_record_forward_extent",
        AROUND,
        ("capture",),
    ),
    Hook(f"{_RE}._get_local_slice", "_get_local_slice", REPLACE, ("capture",)),
    Hook(  # occupancy; host rows
        f"{_RE}.on_forward_end", "_around_forward_end", AROUND, ("capture", "delivery"), "_settle_forward_end"
    ),
    Hook("sglang.srt.state_capturer.base.BaseDeviceCache.capture", "_checked_device_capture", AROUND, ("capture",)),
    Hook("sglang.srt.runtime_context.cutedsl_moe_max_num_tokens", "_cutedsl_moe_max_num_tokens", REPLACE, ("capture",)),
    Hook(
        "sglang.srt.layers.attention.triton_backend.TritonMultiStepDraftBackend.common_template",
        "_checked_draft_kv_indices",
        AROUND,
        ("capture",),
    ),
    Hook(  # aiter_backend imports only where aiter is installed
        "sglang.srt.layers.attention.aiter_backend.AiterMultiStepDraftBackend.common_template",
        "_checked_draft_kv_indices",
        AROUND,
        ("hip",),
    ),
    # delivery: finished and live rows to the spool, off the scheduler thread (scheduler)
    Hook(f"{_BRP}._maybe_collect_routed_experts", "_around_collect", AROUND, ("delivery",)),
    Hook(f"{_BRP}.process_batch_result_prefill", "_around_process_result", AROUND, ("delivery",)),
    Hook(f"{_BRP}.process_batch_result_decode", "_around_process_result", AROUND, ("delivery",)),
    Hook(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
        "_around_disagg_prefill_done",
        AROUND,
        ("delivery",),
    ),
    Hook("sglang.srt.state_capturer.base.TopkCaptureOutput.finalize", "_around_finalize", AROUND, ("delivery",)),
    Hook("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", "_around_arrival", AROUND, ("delivery",)),
    # pointer: `routed_experts_url` in meta_info and in the OpenAI responses' `sglext` (main process);
    # inline: the shape and start of rows a response carries inline (`frontdoors.inline_shape`)
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
        "_around_handle_batch_output",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        "sglang.srt.beam_search.output.try_build_beam_search_out_dict",
        "_around_build_out_dict",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_completions.OpenAIServingCompletion._build_completion_response",
        "_around_openai_response",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_chat.OpenAIServingChat._build_chat_response",
        "_around_openai_response",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_completions.OpenAIServingCompletion._generate_completion_stream",
        "_around_openai_stream",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_chat.OpenAIServingChat._generate_chat_stream",
        "_around_openai_stream",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook("sglang.srt.entrypoints.engine.Engine.shutdown", "_around_engine_shutdown", AROUND, ("pointer",)),
)


def install(settings: EngineSettings) -> None:
    """Register every hook this plugin needs for `settings`, each behind its guard (`guard.py`)."""
    _step_aside_on_failure(settings)
    install_capture_hooks(settings)
    install_budget_hooks(settings)
    if settings.mode is not Mode.OFF:
        install_delivery_hooks(settings)


def body(name: str):
    """The hook function `name` of a row (or a version's `compat` row), from the room that holds it."""
    for room in _ROOMS:
        if (fn := getattr(room, name, None)) is not None:
            return fn
    raise LookupError(f"r3-sidecar: no hook function {name!r} in {[room.__name__ for room in _ROOMS]}")


_ROOMS = (capture_hooks, delivery_hooks, live_hooks, frontdoor_hooks)
_registered: set[Hook] = set()  # a row wanted by two groups (on_forward_end) is registered once


def _register(*groups: str) -> None:
    for hook in HOOKS:
        if hook not in _registered and set(hook.groups) & set(groups):
            where = compat.hook(hook.target, hook.function)  # this version's target and function for the row
            if where is not None:
                target, name = where
                fn, settle = timers.untimed(body(name)), body(hook.settle) if hook.settle else None
                fn = guard.wrap(name, target, fn, replace=hook.type is REPLACE, settle=settle)
                HookRegistry.register(target, fn, AROUND)  # behind its guard: SGLang's own code if ours fails
            _registered.add(hook)


def degraded_report(settings: EngineSettings):
    """The engine file of a process whose hooks fell back to SGLang's own and that writes none otherwise: its
    `degraded` part says which hook failed and how (a started `telemetry.Telemetry`)."""
    from importlib.metadata import version

    from engine_ext.core.telemetry import Sources, Telemetry

    try:
        publisher, dp_rank = delivery_hooks.attention_ranks()
    except Exception:  # a process without SGLang's parallel state (the main process): it names itself
        publisher, dp_rank = True, None
    engine = settings.engine_name(dp_rank)  # without DP it names this process (`/pid<pid>`)
    if dp_rank is not None and not publisher:  # the group's name is its publishing rank's file
        engine = f"{engine}/pid{os.getpid()}"
    return Telemetry(
        spool_dir=settings.spool_dir,
        engine=engine,
        dp_rank=dp_rank,
        sources=Sources(),
        interval_s=settings.telemetry_interval_s,
        sglang=version("sglang"),
    ).start()


def _step_aside_on_failure(settings: EngineSettings) -> None:
    """What a failed hook or plugin thread makes of this process: every hook runs SGLang's own code, loudly."""
    guard.Guard.on_step_aside[:] = [lambda: PROCESS.step_aside(lambda: degraded_report(settings))]
    ON_THREAD_FAILURE[:] = [guard.thread_failed]


def install_capture_hooks(settings: EngineSettings) -> None:
    """Correct capturer sizing and sync-free DP slicing, check writes against capacities, track occupancy."""
    from sglang.srt.utils import is_hip

    timers.configure(settings.hook_timers)
    _register("capture", *(("hip",) if is_hip() else ()))


# The last resolution step (pipeline.py): speculative, CUDA-graph and MoE settings are final by then.
# A dummy/none model path returns from the pipeline before it; the offline CLI covers that case.
BUDGET_RESOLUTION_STEP = "validate_deepep_v2_dispatch_token_budget"
_budget_hook_registered: list[bool] = []  # one registration per process, however often register() runs


def install_budget_hooks(settings: EngineSettings) -> None:
    """Check every buffer's budget once the server arguments are final (main process, at resolution)."""
    if _budget_hook_registered:
        return
    if not compat.layout().budget_at_resolution:
        import logging

        logging.getLogger("r3_sidecar").info(
            "r3-sidecar: sglang==%s has no resolution hooks: no buffer budget check at start (r3-budget prints it)",
            compat.layout().version,
        )
        _budget_hook_registered.append(True)
        return
    register_resolution_hook = pkgutil.resolve_name(compat.RESOLUTION_HOOK)
    register_resolution_hook(BUDGET_RESOLUTION_STEP)(partial(budget_hooks.check_budget_at_resolution, settings))
    _budget_hook_registered.append(True)


def install_delivery_hooks(settings: EngineSettings) -> None:
    """Deliver finished (and, when asked, live) rows to the spool without blocking the scheduler.

    Scheduler process: the `Delivery` of `engine_ext/sglang/delivery.py`, built at the first batch result (other
    processes never build it). Main process: the `routed_experts_url` pointer in `meta_info` and `sglext`
    when `R3_SIDECAR_URL` is set, and the shape and start of rows a response carries inline.
    """
    PROCESS.configure(settings)
    _register("delivery", "inline", *(("pointer",) if settings.sidecar_url else ()))
    layout = compat.layout()
    frontdoor_hooks.point_workers_here(layout.worker_app_env)
    worker_app.register(layout.worker_app_call, layout.granian_app_call)  # ≤ 0.5.20: the literal, retargeted


def install_worker_hooks(settings: EngineSettings) -> None:
    """In a tokenizer worker process (`http_worker`): the "inline" hooks only. No pointer: none can be attached
    there (`frontdoors.MULTI_TOKENIZER`), so the worker's settings have no sidecar URL."""
    _step_aside_on_failure(settings)
    PROCESS.configure(settings.model_copy(update={"sidecar_url": None}))
    _register("inline")
