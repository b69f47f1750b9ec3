"""A plugin-off baseline proves it is one wherever its rows become a reference (issue 40: no reference from the
plugin itself).

A loaded plugin leaves two traces a baseline cannot: files under its spool (its telemetry writes the engine file
within a second of the scheduler's start; its writer, the records) and a pointer in its answers (its default
mode, sidecar, puts `routed_experts_url` in every answer that asks for routed experts). SGLang's and vLLM's
plugin-off servers (`SGLANG_PLUGINS=__none__`, `VLLM_PLUGINS=__none__`) get the same spool directory setting as
the others, so a plugin that loaded anyway would leave both.

Two CPU servers given the same request can still route a few rows differently (near ties that another batch
shape or cached prefix tips the other way), so rows from two servers are compared with `assert_near`; rows the
plugin recorded are compared byte for byte with the same server's own inline payload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def spool_files(spool: Path) -> list[str]:
    """Every file under a spool, as paths relative to it; none where no plugin ran (the directory may not exist)."""
    if not spool.exists():
        return []
    return sorted(str(path.relative_to(spool)) for path in spool.rglob("*") if path.is_file())


def assert_plugin_off(name: str, spool: Path, meta_info: dict[str, Any]) -> None:
    """Fail, naming what the plugin left, unless `spool` is empty and the answer's `meta_info` has no pointer."""
    traces = spool_files(spool) + [key for key in ("routed_experts_url",) if key in meta_info]
    assert not traces, f"{name} is a plugin-off baseline, yet the plugin left {traces[:5]}"


def differing_rows(a: np.ndarray, b: np.ndarray) -> list[int]:
    """The rows (tokens) where two `(rows, layers, topk)` arrays of one request differ in any slot."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.flatnonzero((a != b).reshape(a.shape[0], -1).any(axis=1)).tolist()


def near(rows: int) -> int:
    """How many of a request's rows two CPU servers may route differently for the same tokens: near-tie flips
    (docs/testing.md, "Baselines": 0-2 rows of a 12-97-row request between two DP-attention servers; 1 of 30 and
    1 of 157 between a plugin-off server and a tokenizer-workers one whose radix cache held other prefixes). A
    shifted, missing or mixed-up row run differs in most rows (`assert_near` checks that the bound sees it)."""
    return max(2, rows // 20)


def assert_near(name: str, reference: np.ndarray, rows: np.ndarray) -> None:
    """`rows` are another server's for the same request and tokens: the same shape, and equal to `reference` but
    for `near` rows. The bound is checked too: `reference` shifted by one row must break it (a request whose
    rows barely change from token to token could not show a wrong row, and then fails here)."""
    assert rows.shape == reference.shape, (name, rows.shape, reference.shape)
    wrong = differing_rows(rows, reference)
    assert len(wrong) <= near(len(reference)), f"{name}: {len(wrong)} of {len(reference)} rows differ: {wrong[:8]}"
    assert len(differing_rows(reference[1:], reference[:-1])) > near(len(reference)), (name, "rows too alike")
