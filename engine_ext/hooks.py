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


# The last resolution step (pipeline.py): speculative, CUDA-graph and MoE settings are final by then.
# A dummy/none model path returns from the pipeline before it; the offline CLI covers that case.
BUDGET_RESOLUTION_STEP = "validate_deepep_v2_dispatch_token_budget"
_budget_hook_registered: list[bool] = []  # one registration per process, however often register() runs


def install_budget_hooks(settings: EngineSettings) -> None:
    """Check every buffer's budget once the server arguments are final (main process, at resolution)."""
    from functools import partial

    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    if _budget_hook_registered:
        return
    register_resolution_hook(BUDGET_RESOLUTION_STEP)(partial(_check_budget_at_resolution, settings))
    _budget_hook_registered.append(True)


def _check_budget_at_resolution(settings: EngineSettings, server_args, previous) -> None:
    """Run the built-in step, then log the table; under `R3_BUDGET=enforce` refuse a blocking shortfall."""
    import logging

    from engine_ext.budget import blocking_rows, format_table, refusal_message
    from engine_ext.settings import BudgetPolicy

    previous(server_args)
    rows = budget_table(server_args)
    log = logging.getLogger("r3_sidecar")
    blocking = blocking_rows(rows)
    log.log(logging.WARNING if blocking else logging.INFO, "r3-sidecar buffer budget:\n%s", format_table(rows))
    if blocking and settings.budget is BudgetPolicy.ENFORCE:
        raise ValueError(refusal_message(rows))


def budget_table(server_args) -> list:
    """Budget rows of a `ServerArgs` under resolution or resolved (model config read when the path has one)."""
    from engine_ext.budget import budget_rows, inputs_from_server_args

    return budget_rows(inputs_from_server_args(server_args, _budget_model_config(server_args)))


def _budget_model_config(server_args):
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    if str(resolving_view(server_args).model_path).lower() in ("dummy", "none"):
        return None
    try:
        return model_config_of(server_args)
    except Exception:  # the table does without layers/topk/context; resolution reports a bad model itself
        return None


# ---- delivery: collection, writer, live rows, telemetry, pointer (owner: delivery work) ------------------


def install_delivery_hooks(settings: EngineSettings) -> None:
    """Deliver finished (and, when asked, live) rows to the spool without blocking the scheduler."""
