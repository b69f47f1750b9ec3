"""The buffer budget: every fixed-size buffer the routed-experts path depends on, its capacity and worst case.

Pure arithmetic over plain values (no SGLang import): the pre-launch check (`hooks/budget.py`), the offline
`r3-budget` command (`cli`) and the engine file all print the same rows. Its rooms:

- `terms`: what a configuration is (`BudgetInputs`), one row (`BudgetRow`), the worst forward's per-rank shape.
- `moe`: the rows of the MoE backend a configuration selects (all-to-all dispatchers, fused runners).
- `table`: every row of a configuration (`budget_rows`), which block a launch, the table as text.
- `inputs`: where a real launch's values come from (`ServerArgs`, `SGLANG_*` caps, FlashInfer's byte count).
- `cli`: `r3-budget <sglang server args…>`, the table of a launch before launching it.

The names below are the whole of what the rest of the plugin and the tests take from here.
"""

from engine_ext.sglang.budget.inputs import inputs_from_server_args
from engine_ext.sglang.budget.table import (
    PLUGIN_CORRECTED,
    blocking_rows,
    budget_rows,
    format_table,
    refusal_message,
)
from engine_ext.sglang.budget.terms import BudgetInputs, BudgetRow

__all__ = [
    "PLUGIN_CORRECTED",
    "BudgetInputs",
    "BudgetRow",
    "blocking_rows",
    "budget_rows",
    "format_table",
    "inputs_from_server_args",
    "refusal_message",
]
