"""Whether rows of routed experts can be true: the check every record's rows pass when written and read inline.

Why: wrong routes crash nothing. A kernel that routes inside itself and never runs the capture hook, a capture
buffer read from a stale slot, an engine that fills ids with zeros: each hands the trainer a correctly shaped
array of experts the rollout never used. What can be checked without the model is what every true row obeys:
in an MoE layer a token's top-k ids are distinct and name real experts (`0 … num_experts-1`, or an engine's own
sentinel for an unused slot), and the slots of dense layers in an engine's inline payload are zero. An all-zero
MoE layer fails the first rule whenever top-k > 1 ("every token routes to expert 0").

Pure numpy, vectorised, no engine or server import: the engine's writer thread and the trainer client both call it.
The common case (nothing wrong) is a max and `k·(k-1)/2` contiguous comparisons; only a failing array is
searched for its first bad row (BENCHMARKS.md, "Row check").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from service.spool.record.meta import Suspect

SGLANG_SENTINELS = (-1,)
"""SGLang fills the top-k ids of padded tokens (and of shared-expert columns) with -1 (`topk.py`'s
`_mask_topk_ids_padded_region`, `RoutedExpertsCapturer.capture`'s pad)."""
VLLM_SENTINELS: tuple[int, ...] = ()
"""vLLM's routed-experts array is unsigned (uint8 / uint16) with no value set aside."""

REASONS = ("out_of_range", "repeated", "dense_not_zero")


def allowed_sentinels(dtype: np.dtype, sentinels: Iterable[int], num_experts: int) -> tuple[int, ...]:
    """The sentinels as `dtype` stores them (-1 is 255 in uint8), kept only where no real id could be that value."""
    info = np.iinfo(dtype)
    kept = []
    for s in sentinels:
        stored = int(s) % (int(info.max) + 1) if info.min == 0 and s < 0 else int(s)
        if info.min <= stored <= info.max and not 0 <= stored < num_experts:
            kept.append(stored)
    return tuple(kept)


def first_bad_row(
    rows: np.ndarray,
    num_experts: int,
    *,
    sentinels: Iterable[int] = (),
    layers: Sequence[int] | None = None,
    dense: Sequence[int] = (),
) -> Suspect | None:
    """None when every row of `rows` `(n, slots, topk)` can be true, else the first bad (row, layer, why).

    `layers`: the model layer of each slot (a record's `layers`; default the slot index); `dense`: slots that
    hold a dense layer (an inline payload's), which must be zero. Rows are scanned in order, a row's layers too.
    """
    if rows.ndim != 3 or rows.shape[0] == 0:
        return None
    moe = [i for i in range(rows.shape[1]) if i not in set(dense)]
    names = list(layers) if layers is not None else list(range(rows.shape[1]))
    allowed = allowed_sentinels(rows.dtype, sentinels, num_experts)
    routed = rows if not dense else rows[:, moe]
    if not _looks_bad(routed, num_experts, allowed) and not (dense and rows[:, list(dense)].any()):
        return None
    bad = np.zeros(rows.shape[:2], dtype=bool)
    why = np.full(rows.shape[:2], -1, dtype=np.int8)
    if dense:
        cells = rows[:, list(dense)].any(axis=-1)
        bad[:, list(dense)] |= cells
        why[:, list(dense)] = np.where(cells, 2, -1)
    if moe:
        out, rep = _cell_faults(routed, num_experts, allowed)
        bad[:, moe] |= out | rep
        why[:, moe] = np.where(out, 0, np.where(rep, 1, -1))
    flat = int(np.argmax(bad))
    row, slot = divmod(flat, rows.shape[1])
    reason = REASONS[int(why[row, slot])]
    return Suspect(row, int(names[slot]), reason, _detail(reason, rows[row, slot], num_experts))


def _looks_bad(routed: np.ndarray, num_experts: int, allowed: tuple[int, ...]) -> bool:
    """The fast path over the whole array: any id out of range, or any row repeating an id (sentinels aside)."""
    if routed.size == 0:
        return False
    beyond = int(routed.max()) >= num_experts or int(routed.min()) < 0
    if beyond and _out_of_range(routed, num_experts, allowed).any():
        return True
    return bool(_repeats(routed, allowed).any())


def _out_of_range(a: np.ndarray, num_experts: int, allowed: tuple[int, ...]) -> np.ndarray:
    bad = (a >= num_experts) | (a < 0) if a.dtype.kind == "i" else a >= num_experts
    return bad & ~np.isin(a, allowed) if allowed else bad


def _repeats(a: np.ndarray, allowed: tuple[int, ...]) -> np.ndarray:
    """Per (row, slot): whether two of its top-k ids are equal (two equal sentinels do not count).

    Pairwise over contiguous columns: for top-k 8, 28 comparisons of one byte per cell beat sorting each row
    by 5-10x in numpy (a sort is a call per 8 values; these are 28 calls over all cells)."""
    k = a.shape[-1]
    cols = np.ascontiguousarray(a.reshape(-1, k).T)
    acc = np.zeros(cols.shape[1], dtype=bool)
    tmp = np.empty_like(acc)
    for i in range(k):
        for j in range(i + 1, k):
            np.equal(cols[i], cols[j], out=tmp)
            acc |= tmp
    if allowed and acc.any():
        acc = _repeats_slow(cols, allowed)
    return acc.reshape(a.shape[:-1])


def _repeats_slow(cols: np.ndarray, allowed: tuple[int, ...]) -> np.ndarray:
    """Repeats not made of sentinels: only run when a repeat was seen and the engine has sentinels."""
    acc = np.zeros(cols.shape[1], dtype=bool)
    for i in range(cols.shape[0]):
        real = ~np.isin(cols[i], allowed)
        for j in range(i + 1, cols.shape[0]):
            acc |= real & (cols[i] == cols[j])
    return acc


def _cell_faults(routed: np.ndarray, num_experts: int, allowed: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per (row, slot) of the routed slots: (an id out of range, a repeated id)."""
    return _out_of_range(routed, num_experts, allowed).any(axis=-1), _repeats(routed, allowed)


def _detail(reason: str, ids: np.ndarray, num_experts: int) -> str:
    values = [int(v) for v in ids]
    if reason == "out_of_range":
        return f"ids {values}, num_experts {num_experts}"
    if reason == "repeated":
        return f"ids {values} repeat an expert"
    return f"dense layer slot holds {values}, expected zeros"
