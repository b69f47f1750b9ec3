"""Which weights routed which rows: SGLang's weight-version spans, moved from output tokens to token positions.

SGLang (0.5.23) keeps, per request, the output-token counts at which `update_weights_from_*` or
`/update_weight_version` changed the serving version, and reports them as spans over output tokens
(`weight_versions: [{version, start, end}]`, `srt/utils/weight_versions.py`). A record's rows are indexed by
token position: the row of position `p` was computed by the forward that produced output token
`p - prompt_len + 1` (the prompt's rows by the forward that produced output token 0). So output span
`[s, e)` covers positions `[prompt_len + s - 1, prompt_len + e - 1)`, from position 0 when `s == 0`.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.spool.record.meta import Weights

Span = tuple[str, int, int]
"""One SGLang `WeightVersionSpan` as plain values: (version, first output token, one past the last)."""


def record_weights(spans: Sequence[Span], current: str | None, *, prompt_len: int, lo: int, hi: int) -> Weights:
    """`(weight_version, weight_versions)` of a record holding the rows of positions `[lo, hi)`.

    `weight_version` is the version of the last row (`current` when SGLang reported no spans);
    `weight_versions` is empty unless the rows span more than one version, else `(position, version)` pairs,
    the first at `lo`.
    """
    pairs: list[tuple[int, str]] = []
    for i, (version, start, end) in enumerate(spans):
        first = 0 if start == 0 else prompt_len + start - 1
        stop = hi if i == len(spans) - 1 else prompt_len + end - 1
        a, b = max(first, lo), min(stop, hi)
        if a >= b:
            continue
        if pairs and pairs[-1][1] == version:
            continue
        pairs.append((a, version))
    if not pairs:
        return (spans[-1][0] if spans else current), ()
    return pairs[-1][1], (tuple(pairs) if len(pairs) > 1 else ())
