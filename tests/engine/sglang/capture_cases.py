"""The forward layouts the capture tests put through SGLang 0.5.23's real `RoutedExpertsCapturer`: each `Case` is
one forward on one DP rank, its batch laid out as the real forward lays it out (decode or verify CUDA graph,
prefill graph, eager; DP padding; an all-to-all backend's local rows), and each row's top-k ids say whose row it
is (`expected_value`). `synthetic_forward.py` runs a case; `test_capture_cases.py`, `test_capture_sync.py` and
`test_capture_graph_cuda.py` check what the capturer made of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYERS, TOPK = 2, 2  # tests/sglang_cpu/tiny_qwen3moe
SLOT0 = 100  # first host-cache slot of this rank's real tokens


@dataclass(frozen=True)
class Case:
    """One forward on DP rank `rank`: `raw[r]` real tokens on rank r, laid out by `graph`."""

    name: str
    server: dict  # publish_args(**server)
    rank: int
    raw: list[int]
    graph: str  # "decode": decode/verify CUDA graph; "prefill": prefill CUDA graph; "eager"
    graph_bs: int = 0  # decode graph: padded request count
    w: int = 1  # tokens per request (verify: speculative_num_draft_tokens)
    padded: list[int] = field(default_factory=list)  # eager / prefill graph: counts after DP padding
    context_length: int | None = None
    scattered: bool = False  # an all-to-all MoE backend: TopK routes this rank's tokens only

    @property
    def blocks(self) -> list[int]:
        """Rows each rank occupies in the gathered batch."""
        return [self.graph_bs * self.w] * len(self.raw) if self.graph == "decode" else self.padded

    @property
    def written_rows(self) -> int:
        """Rows the forward writes to the device cache on this rank."""
        return self.raw[self.rank] if self.scattered else sum(self.blocks)

    @property
    def captured(self) -> list[int]:
        """The ranks whose rows the MoE routes on this rank: all of them, or this one under all-to-all."""
        return [self.rank] if self.scattered else list(range(len(self.raw)))


SPEC = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_draft_tokens": 4,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_draft_model_path": "dummy",
}
DP2 = {"tp_size": 2, "attn_dp_size": 2, "enable_return_routed_experts": True}

CASES = [
    # #26123 as merged: mrr > cps under DP attention, decode graph at full batch on rank 1. 0.5.23 has this fix.
    Case(
        "dp_mrr_gt_cps",
        {**DP2, "world_rank": 1, "chunked_prefill_size": 32, "max_running_requests": 64},
        rank=1,
        raw=[64, 64],
        graph="decode",
        graph_bs=64,
    ),
    # #26123 beyond: attention TP 2 pads every rank's count to even (63 → 64): 2 × 64 rows > 2 × max(32, 63).
    Case(
        "dp_mrr_gt_cps_attn_tp_padding",
        {
            "tp_size": 4,
            "attn_dp_size": 2,
            "enable_return_routed_experts": True,
            "world_rank": 2,
            "chunked_prefill_size": 32,
            "max_running_requests": 63,
        },
        rank=1,
        raw=[63, 63],
        graph="eager",
        padded=[64, 64],
    ),
    # Speculative verify: mrr · w = 32 · 4 = 128 > cps = 64 per rank.
    Case(
        "verify_mrr_w_gt_cps",
        {**DP2, **SPEC, "world_rank": 1, "chunked_prefill_size": 64, "max_running_requests": 32},
        rank=1,
        raw=[128, 96],
        graph="decode",
        graph_bs=32,
        w=4,
    ),
    # Rank 1 after a verify graph, buffer big enough: upstream starts at 1 · bs = 16 instead of 1 · 16 · 4.
    Case(
        "verify_graph_rank1_offset",
        {**DP2, **SPEC, "world_rank": 1, "chunked_prefill_size": 512, "max_running_requests": 16},
        rank=1,
        raw=[40, 48],
        graph="decode",
        graph_bs=16,
        w=4,
    ),
    # Prefill (breakable) CUDA graph under DP attention: MAX_LEN padding to the 64-token bucket.
    Case(
        "prefill_graph_dp",
        {**DP2, "world_rank": 1, "chunked_prefill_size": 64, "max_running_requests": 8},
        rank=1,
        raw=[60, 50],
        graph="prefill",
        padded=[64, 64],
    ),
    # #31116: a prefill-graph bucket (128) above the per-rank chunk (64) under DP attention.
    Case(
        "prefill_graph_bucket_gt_cps",
        {
            **DP2,
            "world_rank": 1,
            "chunked_prefill_size": 64,
            "max_running_requests": 8,
            "cuda_graph_config": {"prefill": {"backend": "breakable", "bs": [32, 64, 128]}},
        },
        rank=1,
        raw=[100, 120],
        graph="prefill",
        padded=[128, 128],
    ),
    # Mooncake all-to-all under DP attention: TopK routes the DP-local shard; upstream slices it at 1 · bs.
    Case(
        "a2a_local_rows_rank1",
        {
            **DP2,
            "world_rank": 1,
            "chunked_prefill_size": 64,
            "max_running_requests": 16,
            "moe_a2a_backend": "mooncake",
        },
        rank=1,
        raw=[10, 12],
        graph="decode",
        graph_bs=16,
        scattered=True,
    ),
    # chunked_prefill_size = -1 and one 300-token prompt, no DP.
    Case(
        "chunked_prefill_off_long_prompt",
        {"tp_size": 1, "enable_return_routed_experts": True, "chunked_prefill_size": -1, "max_running_requests": 8},
        rank=0,
        raw=[300],
        graph="eager",
        padded=[300],
        context_length=512,
    ),
]


def expected_value(rank: int, row: int, layer: int, k: int) -> int:
    """The top-k id the synthetic router writes for `row` of `rank`'s block: identifies all four."""
    return ((layer * 10 + k) * 100 + rank) * 1000 + row
