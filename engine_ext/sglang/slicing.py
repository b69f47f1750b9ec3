"""Where one DP rank's rows sit in the DP-gathered routed-experts device cache, from host-side integers.

Under DP attention (without a scattering all-to-all backend) every MoE layer sees the batch of all DP ranks
concatenated rank by rank, and the capturer writes those gathered rows to the device cache. Each rank then
copies out its own rows. Two layouts exist in SGLang 0.5.23:

- a replayed decode/verify CUDA graph: every rank padded to the graph's batch, so rank `r` starts at
  `r · graph_bs · w` (`w` tokens per request; a ragged verify graph uses its token tier instead),
  `DecodeCudaGraphRunner._global_num_tokens_for_graph`;
- an eager or prefill-graph forward: ranks at the prefix sums of the per-rank token counts as padded by
  `ForwardBatch.prepare_mlp_sync_batch` (`global_num_tokens_padded_cpu`, the same list it writes back to
  `global_num_tokens_cpu`).

Upstream's `get_dp_local_slice_cpu` uses the graph *request* count (`bs`) as the stride and the decode runner's
`bs` for prefill-graph forwards too (stale, or `None` → TypeError). Everything here is plain integers: no
device value is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class DecodeGraphExtent:
    """What the decode/verify CUDA graph that ran for one forward laid out per DP rank."""

    graph_bs: int  # the padded request count the graph was replayed at (`DecodeCudaGraphRunner.bs`)
    tokens_per_req: int  # `captured_req_width`: 1 for decode, speculative_num_draft_tokens for verify
    ragged_tokens: int | None = None  # the token tier of a ragged verify graph (rows per rank), else None

    def __post_init__(self) -> None:
        if self.graph_bs < 0 or self.tokens_per_req < 1:
            raise ValueError(f"bad decode graph extent: graph_bs={self.graph_bs}, tokens_per_req={self.tokens_per_req}")
        if self.ragged_tokens is not None and self.ragged_tokens < 0:
            raise ValueError(f"bad decode graph extent: ragged_tokens={self.ragged_tokens}")

    @property
    def rows_per_rank(self) -> int:
        """Rows each DP rank occupies in the gathered batch of this graph."""
        return self.ragged_tokens if self.ragged_tokens is not None else self.graph_bs * self.tokens_per_req


class LocalSlice(NamedTuple):
    """One rank's rows `[start, stop)` of the gathered device cache and the gathered rows in use.

    A NamedTuple: one is built per forward on the scheduler thread, and tuples are the cheapest to build.
    """

    start: int
    stop: int
    gathered_rows: int  # rows the forward wrote (all ranks): what the device cache had to hold

    @property
    def rows(self) -> int:
        return self.stop - self.start


def local_slice(
    *,
    rank: int,
    local_tokens: int,
    decode_graph: DecodeGraphExtent | None,
    padded_counts: Sequence[int] | None,
    counts: Sequence[int] | None,
) -> LocalSlice:
    """Rank `rank`'s rows of a DP-gathered forward that routed `local_tokens` tokens on this rank.

    `decode_graph` is the extent of the decode/verify graph that ran, None for eager and prefill-graph forwards;
    those use `padded_counts` (`global_num_tokens_padded_cpu`), else `counts` (`global_num_tokens_cpu`).
    Raises ValueError (never TypeError, never a device read) when what the layout needs is missing.
    """
    if rank < 0:
        raise ValueError(f"DP rank {rank} is negative")
    if local_tokens < 0:
        raise ValueError(f"local token count {local_tokens} is negative")
    if decode_graph is not None:
        per_rank = decode_graph.rows_per_rank
        if local_tokens > per_rank:
            raise ValueError(
                f"rank {rank} routed {local_tokens} tokens but the decode graph holds {per_rank} per rank "
                f"(graph_bs={decode_graph.graph_bs}, tokens_per_req={decode_graph.tokens_per_req})"
            )
        width = len(counts) if counts is not None else rank + 1
        start = rank * per_rank
        return LocalSlice(start, start + local_tokens, max(width, rank + 1) * per_rank)
    per_rank_counts = padded_counts if padded_counts is not None else counts
    if per_rank_counts is None:
        raise ValueError(
            "DP-gathered forward without a decode-graph extent needs host-side per-rank token counts, but "
            "ForwardBatch.global_num_tokens_padded_cpu and global_num_tokens_cpu are both None"
        )
    if rank >= len(per_rank_counts):
        raise ValueError(f"DP rank {rank} has no entry in the per-rank token counts {list(per_rank_counts)}")
    start = sum(int(n) for n in per_rank_counts[:rank])
    return LocalSlice(start, start + local_tokens, sum(int(n) for n in per_rank_counts))
