"""What one training rank fetches: its pipeline stage's layers and its context-parallel token chunks.

A Megatron-style trainer rank replays routing only for the layers it holds and the tokens it processes, so only
those bytes need to cross the network: the sidecar slices on its side (`layers=` model-layer ranges, `start`/
`end` token positions, `clamp`), and this module turns a rank's place into those parameters.

- Pipeline stage → model-layer ranges, as Megatron-LM assigns them (`get_transformer_layer_offset`,
  megatron/core/transformer/transformer_layer.py:65-218 at d98e8a6): `num_layers // pp` each, or uneven first
  and last stages (`num_layers_in_first/last_pipeline_stage`) with the middle split evenly; with virtual
  stages (`vp`) a rank holds `vp` chunks of `num_layers // pp // vp`, chunk `v` at `v * num_layers // vp +
  pp_rank * num_layers // pp // vp`.
- Context parallelism → token ranges. Load-balanced (causal attention: early tokens are cheap) the sequence is
  cut into `2·cp` equal chunks and rank `r` takes chunks `r` and `2·cp − 1 − r`, in that order: Megatron-LM
  `_get_batch_on_this_cp_rank_per_sequence_balancing` (megatron/core/utils.py:2504-2557 at d98e8a6: the view
  into `2 * cp_size` chunks and `index = [cp_rank, 2 * cp_size - cp_rank - 1]`), and for packed `thd` batches
  slime/miles `slice_with_cp` with `chunk_size = ceil(len / (2·cp))`, the tail padded (slime
  slime/backends/megatron_utils/cp_utils.py:200-209 at 624b824; miles miles/backends/training_utils/
  cp_utils.py:292-303 at 31f1ca9). Ranges past the rows a record holds are cut by `clamp` (the padding has no
  rows; neither has a sequence's last token, which SGLang never feeds to a forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from service.client.calls import BatchItem
from service.client.decoding import RoutedExperts
from service.client.errors import R3Error
from service.client.refs import RoutedExpertsRef, SidecarPool, default_pool

Range = tuple[int, int]
"""Half-open `[lo, hi)`: model layers, or token positions."""


def stage_layers(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    *,
    vp_size: int | None = None,
    first_stage: int | None = None,
    last_stage: int | None = None,
) -> tuple[Range, ...]:
    """Model-layer ranges of pipeline rank `pp_rank` (one per virtual stage), as Megatron-LM places them."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} outside [0, {pp_size})")
    if first_stage is not None or last_stage is not None:
        if vp_size is not None:
            raise ValueError("uneven first/last stages with virtual stages: not supported here; pass layers yourself")
        return (_uneven_stage(num_layers, pp_size, pp_rank, first_stage, last_stage),)
    return _even_stages(num_layers, pp_size, pp_rank, vp_size or 1)


def _uneven_stage(
    num_layers: int, pp_size: int, pp_rank: int, first_stage: int | None, last_stage: int | None
) -> Range:
    """Megatron-LM's `decoder_first_pipeline_num_layers` / `..._last_...`: the first and last stages hold the layers
    given, the stages between split the rest evenly."""
    first, last = first_stage or 0, last_stage or 0
    middle_stages = pp_size - (first_stage is not None) - (last_stage is not None)
    middle = num_layers - first - last
    if middle < 0 or (middle_stages > 0 and middle % middle_stages) or (middle_stages == 0 and middle):
        raise ValueError(f"{num_layers} layers do not split as first={first_stage}, last={last_stage}, pp={pp_size}")
    per = middle // middle_stages if middle_stages else 0
    if pp_rank == 0 and first_stage is not None:
        return (0, first)
    if pp_rank == pp_size - 1 and last_stage is not None:
        return (num_layers - last, num_layers)
    lo = first + (pp_rank - (first_stage is not None)) * per
    return (lo, lo + per)


def _even_stages(num_layers: int, pp_size: int, pp_rank: int, vp: int) -> tuple[Range, ...]:
    """Every stage the same number of layers; with `vp` virtual stages, rank `pp_rank` holds one chunk in each."""
    if num_layers % (pp_size * vp):
        raise ValueError(f"num_layers={num_layers} is not a multiple of pp×vp={pp_size * vp}")
    per = num_layers // pp_size // vp
    return tuple(
        (v * (num_layers // vp) + pp_rank * per, v * (num_layers // vp) + (pp_rank + 1) * per) for v in range(vp)
    )


def layers_param(ranges: Sequence[Range]) -> str:
    """The `layers=` text for model-layer ranges (inclusive `a-b` items): the sidecar returns the stored (MoE)
    layers inside them, so a stage of dense layers gets an empty, well-formed answer."""
    return ",".join(f"{lo}-{hi - 1}" for lo, hi in ranges if hi > lo)


def cp_tokens(seq_len: int, cp_size: int, cp_rank: int, *, balanced: bool = True) -> tuple[Range, ...]:
    """Token ranges of context-parallel rank `cp_rank` in a sequence of `seq_len` tokens, in the rank's order.

    `balanced`: chunks `r` and `2·cp − 1 − r` of `ceil(seq_len / 2·cp)` tokens (Megatron, slime, miles);
    otherwise one contiguous chunk of `ceil(seq_len / cp)`. Cut to `seq_len` (the padding has no tokens).
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return ((0, seq_len),)
    if not balanced:
        size = -(-seq_len // cp_size)
        return ((min(cp_rank * size, seq_len), min((cp_rank + 1) * size, seq_len)),)
    size = -(-seq_len // (2 * cp_size))
    chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
    return tuple((min(c * size, seq_len), min((c + 1) * size, seq_len)) for c in chunks)


@dataclass(frozen=True, slots=True)
class Place:
    """A training rank's place: pipeline and context-parallel sizes and ranks (tensor/data ranks fetch alike)."""

    pp_size: int = 1
    pp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    vp_size: int | None = None
    first_stage: int | None = None  # Megatron's num_layers_in_first_pipeline_stage
    last_stage: int | None = None  # num_layers_in_last_pipeline_stage
    balanced: bool = True  # load-balanced CP split (2·cp chunks)

    def layers(self, num_layers: int) -> tuple[Range, ...]:
        return stage_layers(
            num_layers,
            self.pp_size,
            self.pp_rank,
            vp_size=self.vp_size,
            first_stage=self.first_stage,
            last_stage=self.last_stage,
        )

    def tokens(self, seq_len: int) -> tuple[Range, ...]:
        return cp_tokens(seq_len, self.cp_size, self.cp_rank, balanced=self.balanced)


@dataclass(frozen=True, slots=True)
class RankRows:
    """One sequence's rows for one rank: its token chunks' rows concatenated in the rank's order."""

    rid: str
    array: np.ndarray  # (rows, stage's MoE layers, topk)
    positions: tuple[Range, ...]  # the token positions of the rows, chunk by chunk (cut to the rows held)
    layers: tuple[int, ...]


def _join(rid: str, parts: Sequence[RoutedExperts]) -> RankRows:
    arrays = [p.array for p in parts]
    array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
    return RankRows(rid, array, tuple((p.start, p.end) for p in parts), parts[0].layers)


def fetch_rank(
    refs: Sequence[RoutedExpertsRef],
    seq_lens: Sequence[int],
    place: Place,
    num_layers: int,
    *,
    wait: float = 0,
    pool: SidecarPool | None = None,
) -> list[RankRows]:
    """The rows rank `place` needs of each ref (sequence `i` has `seq_lens[i]` tokens): one batch request per
    sidecar holding only the rank's chunks and layers; inline refs are sliced locally the same way."""
    if len(refs) != len(seq_lens):
        raise ValueError(f"{len(refs)} refs but {len(seq_lens)} sequence lengths")
    pool = pool or default_pool()
    layers = layers_param(place.layers(num_layers))
    chunks = [place.tokens(n) for n in seq_lens]
    parts: list[list[RoutedExperts]] = [[] for _ in refs]
    groups: dict[str, list[int]] = {}
    for i, ref in enumerate(refs):
        if ref.inline is not None:
            parts[i] = [ref.fetch(lo, hi, layers=layers, clamp=True) for lo, hi in chunks[i]]
        else:
            if ref.sidecar is None:
                raise R3Error("the response carried neither rows nor a pointer for this output", rid=ref.rid)
            groups.setdefault(ref.sidecar, []).append(i)

    def one(base: str, idx: list[int]) -> None:
        items = [BatchItem(refs[i].record_rid or "", lo, hi) for i in idx for lo, hi in chunks[i]]
        got = iter(pool.client(base).get_many(items, wait=wait, layers=layers, clamp=True))
        for i in idx:
            for _ in chunks[i]:
                r = next(got)
                if isinstance(r, R3Error):
                    raise r
                parts[i].append(r)

    with ThreadPoolExecutor(max(1, len(groups)), thread_name_prefix="r3-rank") as ex:
        for f in [ex.submit(one, base, idx) for base, idx in groups.items()]:
            f.result()
    return [_join(ref.record_rid or "", p) for ref, p in zip(refs, parts, strict=True)]
