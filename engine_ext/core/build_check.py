"""What every engine's build check shares: its states, its failure, and where two records' rows first differ.

Why a check at all: a build that fits a layout or a matrix row but whose real server no test ran (a post or dev
release, a fork's build, a patched image, an editable install) may still differ where no name shows it. So the
plugin compares its first records, as it would deliver them, with the engine's own inline rows of the same
requests, and takes delivery over only once they agree (`pending`, then `agreed`: the engine file's
`build.check`, `r3_engine_build_info{check}`). A difference is `BuildMismatch`: the plugin's own failure, so the
engine's own path stays in charge in that process. How each engine gets the two sides is its adapter's
(`engine_ext/sglang/build_check.py`, `engine_ext/vllm/build_check.py`); this module names no engine.
"""

from __future__ import annotations

import numpy as np

PENDING, AGREED = "pending", "agreed"


class BuildMismatch(RuntimeError):
    """The plugin's rows for a record differ from the engine's own on a build no test proved (a plugin failure)."""


def first_difference(ours: np.ndarray, theirs: np.ndarray, *, engine: str) -> str | None:
    """Where two records' rows `(rows, layers, topk)` first differ, in words (None: equal). Values are compared,
    not dtypes: a record may be stored wider than the engine's array (`R3_DTYPE`)."""
    if ours.shape != theirs.shape:
        return f"shape {ours.shape} where {engine}'s is {theirs.shape}"
    differs = np.argwhere(ours != theirs)
    if not len(differs):
        return None
    row, layer = (int(i) for i in differs[0][:2])
    mine, its = ours[row, layer].tolist(), theirs[row, layer].tolist()
    return f"row {row}, layer slot {layer}: {mine} where {engine}'s is {its}"


def check_report(agreed: int, needed: int) -> dict[str, object]:
    """The engine file's `build.check`: the state, and how many records agreed of those needed."""
    return {"state": AGREED if agreed >= needed else PENDING, "agreed": min(agreed, needed), "needed": needed}
