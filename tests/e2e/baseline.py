"""A plugin-off baseline proves it is one wherever its rows become a reference (issue 40: no reference from the
plugin itself).

A loaded plugin leaves two traces a baseline cannot: files under its spool (its telemetry writes the engine file
within a second of the scheduler's start; its writer, the records) and a pointer in its answers (its default
mode, sidecar, puts `routed_experts_url` in every answer that asks for routed experts). SGLang's and vLLM's
plugin-off servers (`SGLANG_PLUGINS=__none__`, `VLLM_PLUGINS=__none__`) get the same spool directory setting as
the others, so a plugin that loaded anyway would leave both.

Rows of two servers for the same request are compared slot for slot (`assert_same_rows`): the CPU servers run in
float32, where no near tie between two servers' rounding was seen (`sglang_server.BASE_ARGS`).
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


def assert_same_rows(name: str, reference: np.ndarray | None, rows: np.ndarray | None) -> None:
    """Another server's rows for the same request and tokens equal the reference's, slot for slot; a failure
    names the differing rows (a shift differs from one row on; a near tie between servers in one or two rows)."""
    assert reference is not None and rows is not None, (name, "no rows")
    assert rows.shape == reference.shape, (name, rows.shape, reference.shape)
    wrong = differing_rows(rows, reference)
    shown = {row: (reference[row].tolist(), rows[row].tolist()) for row in wrong[:3]}  # (reference, other) by layer
    assert not wrong, f"{name}: {len(wrong)} of {len(reference)} rows differ: {wrong[:8]}; first {shown}"
