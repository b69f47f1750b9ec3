"""Inline rows get the row check here: a trainer on an engine we do not hook (or in mirror mode, or whose spool
refused a record) is protected like one that fetches from the sidecar (docs/design.md, Contract 4).

What a response does not say is inferred, on the safe side. The expert count: unknown unless the caller names it
(`num_experts=`), so only ids no model has (negative ones other than SGLang's -1) are out of range. Dense layers:
SGLang's and vLLM's inline arrays hold every model layer, dense ones as zeros; a slot zero in every row is taken
as dense, unless every slot is (a model whose every layer routes to expert 0 has no routed experts: the
"routes to expert 0" kernel bug). So a single MoE layer zeroed from the first row to the last passes here
unless the caller names the dense layers (`dense_layers=`); the spool's records know their layers and do not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.client.errors import SuspectRows
from service.spool.row_check import SGLANG_SENTINELS, first_bad_row


def check_inline(
    array: np.ndarray,
    *,
    rid: str | None,
    start: int,
    num_experts: int | None = None,
    dense_layers: Sequence[int] | None = None,
) -> None:
    """Raise `SuspectRows` naming the first bad row of inline rows `(rows, layers, topk)`; None when none is."""
    if array.ndim != 3 or array.shape[0] == 0:
        return
    if dense_layers is None:
        zero = ~array.any(axis=(0, 2))
        dense_layers = [] if zero.all() else [int(i) for i in np.flatnonzero(zero)]
    bound = num_experts if num_experts is not None else _no_bound(array.dtype)
    found = first_bad_row(array, bound, sentinels=SGLANG_SENTINELS, dense=tuple(dense_layers))
    if found is None:
        return
    err = SuspectRows(
        f"inline rows are suspect: {found.describe(start)}; pass allow_suspect=True to get them anyway",
        rid=rid,
        status=422,
    )
    err.suspect = found
    raise err


def _no_bound(dtype: np.dtype) -> int:
    """The expert count to check against when none is known: every id the dtype holds (SGLang's int32 payload:
    every non-negative one)."""
    return int(np.iinfo(dtype).max) + 1
