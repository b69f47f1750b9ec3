"""Budget hooks (main process, at the last `ServerArgs` resolution step): every buffer's budget, logged, and
refused under `R3_BUDGET=enforce` when one blocks; a process layout where no rows and no pointer reach a
trainer, refused or warned about. The table itself is `budget.budget_rows` of `budget.inputs_from_server_args`.
"""

from __future__ import annotations

import logging

from engine_ext.core.settings import EngineSettings
from engine_ext.sglang import compat
from engine_ext.sglang.hooks.frontdoor import why_no_pointer


def check_budget_at_resolution(settings: EngineSettings, server_args, previous) -> None:
    """Run the built-in step, then log the table; under `R3_BUDGET=enforce` refuse a blocking shortfall."""

    from engine_ext.core.settings import BudgetPolicy
    from engine_ext.sglang.budget import blocking_rows, format_table, refusal_message

    previous(server_args)
    log = logging.getLogger("r3_sidecar")
    try:
        rows = budget_table(server_args)
    except Exception:  # a defect in the check itself must not stop a launch SGLang accepted
        log.exception("r3-sidecar: the buffer budget check failed; starting without it")
        return
    blocking = blocking_rows(rows)
    log.log(logging.WARNING if blocking else logging.INFO, "r3-sidecar buffer budget:\n%s", format_table(rows))
    if blocking and settings.budget is BudgetPolicy.ENFORCE:
        raise ValueError(refusal_message(rows))
    _check_layout(settings, server_args)


def _check_layout(settings: EngineSettings, server_args) -> None:
    """Refuse (under enforce) or warn about a process layout where no rows and no pointer can reach a trainer."""

    from engine_ext.core.settings import BudgetPolicy
    from engine_ext.sglang.frontdoors import layout_refusal

    view = compat.function("resolving_view")(server_args)
    unreachable = why_no_pointer(settings, view)
    refusal = layout_refusal(mode=settings.mode, capture_all=settings.capture_all, unreachable=unreachable)
    if refusal is None:
        return
    if settings.budget is BudgetPolicy.ENFORCE:
        raise ValueError(refusal)
    logging.getLogger("r3_sidecar").warning("%s (R3_BUDGET=warn: starting anyway)", refusal)


def budget_table(server_args) -> list:
    """Budget rows of a `ServerArgs` under resolution or resolved (model config read when the path has one)."""
    from engine_ext.sglang.budget import budget_rows, inputs_from_server_args

    return budget_rows(inputs_from_server_args(server_args, _budget_model_config(server_args)))


def _budget_model_config(server_args):
    if str(compat.function("resolving_view")(server_args).model_path).lower() in ("dummy", "none"):
        return None
    try:
        return compat.function("model_config_of")(server_args)
    except Exception:  # the table does without layers/topk/context; resolution reports a bad model itself
        return None
