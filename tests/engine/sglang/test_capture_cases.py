"""A real 0.5.23 `RoutedExpertsCapturer` on CPU fed synthetic forwards: the right rows with r3-sidecar, not upstream.

Each case builds the gathered device-cache layout a real forward produces (all DP ranks' rows, rank by rank),
routes it through `topk.capture_routed_experts_if_allowed`, then calls `on_forward_end` exactly as
`ModelRunner.forward` does and reads the host cache at this rank's `out_cache_loc`. The same case runs twice
in one child process: first on upstream's code, then with the capture hooks applied through `HookRegistry`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from sglang_env import run_sglang

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


_SPEC = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_draft_tokens": 4,
    "speculative_num_steps": 3,
    "speculative_eagle_topk": 1,
    "speculative_draft_model_path": "dummy",
}
_DP2 = {"tp_size": 2, "attn_dp_size": 2, "enable_return_routed_experts": True}

CASES = [
    # #26123 as merged: mrr > cps under DP attention, decode graph at full batch on rank 1. 0.5.23 has this fix.
    Case(
        "dp_mrr_gt_cps",
        {**_DP2, "world_rank": 1, "chunked_prefill_size": 32, "max_running_requests": 64},
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
        {**_DP2, **_SPEC, "world_rank": 1, "chunked_prefill_size": 64, "max_running_requests": 32},
        rank=1,
        raw=[128, 96],
        graph="decode",
        graph_bs=32,
        w=4,
    ),
    # Rank 1 after a verify graph, buffer big enough: upstream starts at 1 · bs = 16 instead of 1 · 16 · 4.
    Case(
        "verify_graph_rank1_offset",
        {**_DP2, **_SPEC, "world_rank": 1, "chunked_prefill_size": 512, "max_running_requests": 16},
        rank=1,
        raw=[40, 48],
        graph="decode",
        graph_bs=16,
        w=4,
    ),
    # Prefill (breakable) CUDA graph under DP attention: MAX_LEN padding to the 64-token bucket.
    Case(
        "prefill_graph_dp",
        {**_DP2, "world_rank": 1, "chunked_prefill_size": 64, "max_running_requests": 8},
        rank=1,
        raw=[60, 50],
        graph="prefill",
        padded=[64, 64],
    ),
    # #31116: a prefill-graph bucket (128) above the per-rank chunk (64) under DP attention.
    Case(
        "prefill_graph_bucket_gt_cps",
        {
            **_DP2,
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
            **_DP2,
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


# ---------------------------------------------------------------- child side (runs inside run_sglang) ----


def _gathered_topk(case: Case, layer: int, device):
    import torch

    blocks = []
    for rank, rows in enumerate(case.blocks):
        if rank not in case.captured:
            continue
        if case.scattered:
            rows = case.raw[rank]  # the local batch as it is, no DP padding into a gathered layout
        block = torch.full((rows, TOPK), -7, dtype=torch.int32)  # padding rows
        for i in range(min(case.raw[rank], rows)):
            block[i] = torch.tensor([expected_value(rank, i, layer, k) for k in range(TOPK)], dtype=torch.int32)
        blocks.append(block)
    return torch.cat(blocks).to(device)


_CURRENT: dict = {}


def _synthetic_forward_raw(runner, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    """Stand-in for the model body of `ModelRunner._forward_raw`: what each path leaves behind for the capturer."""
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    case: Case = _CURRENT["case"]
    if case.graph != "decode":  # _prepare_eager_forward_batch → prepare_mlp_sync_batch
        forward_batch.global_num_tokens_padded_cpu = case.padded if len(case.raw) > 1 else None
        forward_batch.global_num_tokens_cpu = case.padded if len(case.raw) > 1 else None
    graph = _CURRENT.get("graph")
    if graph is not None:  # a CUDA graph of the loop below (`test_capture_graph_cuda`): a replay runs no Python
        graph.replay()
    else:
        for layer in range(LAYERS):
            capture_routed_experts_if_allowed(TopKConfig(top_k=TOPK), layer, _CURRENT["topk"][layer])
    if case.graph == "decode":
        runner.decode_cuda_graph_runner.bs = case.graph_bs  # set by the replay (`load_batch`)
    return ModelRunnerOutput(logits_output=None, can_run_graph=case.graph != "eager")


def setup_case(case: Case, device: str = "cpu"):
    """Publish the case's config, build the capturer (through `create`, hooked or not) and this rank's batch."""
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args, tiny_model_config

    server = dict(case.server)
    publish_args(world_rank=server.pop("world_rank", 0), **server)
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model,
        model_config=tiny_model_config(case.context_length),
        num_tokens=4096,
        max_running_requests=server["max_running_requests"],
        device=device,
    )
    set_global_experts_capturer(cap)
    runner = ModelRunner.__new__(ModelRunner)
    graph_runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)  # built, never replayed yet
    graph_runner.captured_req_width, graph_runner.ragged_verify_mode = case.w, False
    runner.decode_cuda_graph_runner = graph_runner

    real = case.raw[case.rank]
    local = case.blocks[case.rank] if case.graph != "decode" else real
    slots = torch.arange(SLOT0, SLOT0 + real)
    out_cache_loc = torch.cat([slots, torch.zeros(local - real, dtype=torch.int64)])  # DP padding → slot 0
    mode = ForwardMode.DECODE if case.graph == "decode" else ForwardMode.EXTEND
    mode = ForwardMode.TARGET_VERIFY if case.w > 1 else mode
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=max(1, real // case.w),
        input_ids=torch.zeros(local, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
        seq_lens=torch.ones(1, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc.to(device),
        seq_lens_sum=real,
    )
    fb.global_num_tokens_cpu = list(case.raw) if len(case.raw) > 1 else None
    _CURRENT["topk"] = [_gathered_topk(case, layer, device) for layer in range(LAYERS)]  # the router's output
    return cap, runner, fb, slots


def forward(case: Case, cap, runner, fb, *, patched: bool, no_copy_to_cpu: bool):
    """One forward and its `on_forward_end`, called as `ModelRunner.forward` calls it."""
    _CURRENT["case"] = case
    out = runner._forward_raw(fb, None) if patched else _synthetic_forward_raw(runner, fb, None)
    return cap.on_forward_end(
        forward_batch=fb,
        can_run_graph=out.can_run_graph,
        cuda_graph_batch=getattr(runner.decode_cuda_graph_runner, "bs", None),
        no_copy_to_cpu=no_copy_to_cpu,
    )


def _run_case(case: Case, patched: bool) -> dict:
    from sglang.srt.state_capturer.routed_experts import destroy_global_experts_capturer

    cap, runner, fb, slots = setup_case(case)
    outcome: dict = {"capacity": int(cap.device_cache.buffer.shape[0])}
    try:
        forward(case, cap, runner, fb, patched=patched, no_copy_to_cpu=False)
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    else:
        got = cap.host_cache.buffer[slots].tolist()
        want = [
            [[expected_value(case.rank, i, layer, k) for k in range(TOPK)] for layer in range(LAYERS)]
            for i in range(case.raw[case.rank])
        ]
        outcome["rows_ok"] = got == want
        outcome["first_row"] = got[0]
    destroy_global_experts_capturer()
    return outcome


def _overflow_message() -> str:
    """A write past the device cache, r3-sidecar hooks applied: the error names what to change."""
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer
    from sglang_env import publish_args, tiny_model_config

    publish_args(tp_size=1, enable_return_routed_experts=True, chunked_prefill_size=16, max_running_requests=4)
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model, model_config=tiny_model_config(64), num_tokens=256, max_running_requests=4, device="cpu"
    )
    try:
        cap.capture(layer_id=0, topk_indices=torch.zeros(cap.device_cache.buffer.shape[0] + 1, TOPK, dtype=torch.int32))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def apply_capture_hooks() -> None:
    """The plugin's capture hooks through the real `HookRegistry`, over the synthetic model body."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from engine_ext.core.settings import EngineSettings
    from engine_ext.sglang import hooks

    HookRegistry.reset()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _synthetic_forward_raw, HookType.REPLACE
    )
    hooks.install_capture_hooks(EngineSettings())
    HookRegistry.apply_hooks()


def _cutedsl_tokens() -> int:
    """`cutedsl_moe_max_num_tokens()` with a breakable prefill graph bucket above max_prefill_tokens."""
    from sglang.srt import runtime_context
    from sglang_env import publish_args

    publish_args(
        tp_size=1,
        chunked_prefill_size=2048,
        max_prefill_tokens=4096,
        max_running_requests=64,
        cuda_graph_config={"prefill": {"backend": "breakable", "bs": [1024, 4096, 8192]}, "decode": {"max_bs": 64}},
    )
    return runtime_context.cutedsl_moe_max_num_tokens()


def _draft_kv_indices(seq_lens_sum: int) -> str:
    """Triton EAGLE draft backend, 4 sequences × topk 2 × 3 steps, row width 4 · 2 · 64 = 512 (max context 64)."""
    import torch
    from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    backend = TritonMultiStepDraftBackend.__new__(TritonMultiStepDraftBackend)  # the fields the bound reads
    backend.topk, backend.speculative_num_steps = 2, 3
    backend.cuda_graph_kv_indices = torch.zeros(3, 4 * 2 * 64, dtype=torch.int32)
    zeros = torch.zeros(4, dtype=torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=4,
        input_ids=zeros,
        req_pool_indices=zeros,
        seq_lens=zeros + seq_lens_sum // 4,
        out_cache_loc=zeros,
        seq_lens_sum=seq_lens_sum,
    )
    try:
        backend.common_template(fb, None, None)
    except Exception as exc:  # past the bound, this partial backend fails inside the kernel launch on CPU
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "ran"


def _capacity_from_published_config() -> int:
    """Device rows the hooked `create` picks from the published config: DP2, verify w=4, decode graph to 80."""
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer
    from sglang_env import publish_args, tiny_model_config

    publish_args(
        **_DP2,
        **_SPEC,
        world_rank=1,
        chunked_prefill_size=64,
        max_running_requests=48,
        cuda_graph_config={"decode": {"backend": "full", "max_bs": 80}},
    )
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model, model_config=tiny_model_config(), num_tokens=64, max_running_requests=48, device="cpu"
    )
    return int(cap.device_cache.buffer.shape[0])


def child_main() -> dict:
    from engine_ext.sglang.capturer import occupancy_snapshot

    results = {case.name: {"upstream": _run_case(case, patched=False)} for case in CASES}
    cutedsl_upstream = _cutedsl_tokens()
    kv_upstream = _draft_kv_indices(256)
    apply_capture_hooks()
    for case in CASES:
        results[case.name]["r3"] = _run_case(case, patched=True)
        results[case.name]["r3"]["occupancy"] = occupancy_snapshot()
    results["overflow_message"] = _overflow_message()
    results["published_capacity"] = _capacity_from_published_config()
    results["cutedsl"] = {"upstream": cutedsl_upstream, "r3": _cutedsl_tokens()}
    results["draft_kv_indices"] = {
        "upstream": kv_upstream,
        "r3": _draft_kv_indices(256),
        "r3_fits": _draft_kv_indices(200),
    }
    return results


# ---------------------------------------------------------------- test side --------------------------------


@pytest.fixture(scope="module")
def outcomes() -> dict:
    (results,) = run_sglang("import test_capture_cases as t\nemit(t.child_main())")
    return results


pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_r3_puts_exactly_the_right_rows_in_the_host_cache(outcomes: dict, case: Case) -> None:
    r3 = outcomes[case.name]["r3"]
    assert "error" not in r3, r3
    assert r3["rows_ok"], r3
    assert r3["capacity"] >= case.written_rows


def test_upstream_still_right_where_0523_has_the_fix(outcomes: dict) -> None:
    assert outcomes["dp_mrr_gt_cps"]["upstream"].get("rows_ok") is True, outcomes["dp_mrr_gt_cps"]


@pytest.mark.parametrize(
    ("name", "failure"),
    [
        ("dp_mrr_gt_cps_attn_tp_padding", "RuntimeError"),  # shape mismatch at capture: 128 rows > 126
        ("verify_mrr_w_gt_cps", "RuntimeError"),  # 256 rows > 128
        ("verify_graph_rank1_offset", "wrong rows"),  # silent: rank 0's rows
        ("a2a_local_rows_rank1", "wrong rows"),  # silent: rows past this rank's own
        ("prefill_graph_dp", "TypeError"),  # dp_rank * None
        ("prefill_graph_bucket_gt_cps", "RuntimeError"),  # 256 rows > 128
        ("chunked_prefill_off_long_prompt", "RuntimeError"),  # 300 rows > max(-1, 8)
    ],
)
def test_upstream_fails_or_is_wrong(outcomes: dict, name: str, failure: str) -> None:
    upstream = outcomes[name]["upstream"]
    if failure == "wrong rows":
        assert upstream.get("rows_ok") is False, upstream
    else:
        assert upstream.get("error", "").startswith(failure), upstream


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_occupancy_is_the_gathered_rows_of_the_forward(outcomes: dict, case: Case) -> None:
    r3 = outcomes[case.name]["r3"]
    (device_cache,) = r3["occupancy"]
    assert device_cache["buffer"] == "routed_experts.device_cache"
    assert device_cache["capacity"] == r3["capacity"]
    assert device_cache["peak"] == case.written_rows


def test_sizing_reads_decode_graph_and_verify_width_from_the_published_config(outcomes: dict) -> None:
    assert outcomes["published_capacity"] == 2 * 80 * 4  # N · max(P = 64, graph_max_bs 80 · w 4); upstream 128


def test_cutedsl_tokens_count_the_breakable_prefill_graph(outcomes: dict) -> None:
    assert outcomes["cutedsl"] == {"upstream": 4096, "r3": 8192}


def test_triton_draft_kv_indices_overflow_is_caught_before_the_kernel(outcomes: dict) -> None:
    kv = outcomes["draft_kv_indices"]
    # every sequence at the 64-token context: 256 · 2 + 8 · 3 = 536 entries > 512
    assert kv["r3"].startswith("CaptureOverflowError: EAGLE draft kv_indices row"), kv
    assert "536 entries but the buffer holds 512" in kv["r3"]
    assert not kv["upstream"].startswith("CaptureOverflowError"), kv  # 0.5.23 has no bound: on to the kernel
    assert not kv["r3_fits"].startswith("CaptureOverflowError"), kv  # 424 ≤ 512: passes the check


def test_overflowing_write_names_the_setting(outcomes: dict) -> None:
    message = outcomes["overflow_message"]
    assert message.startswith("CaptureOverflowError"), message
    assert "--chunked-prefill-size" in message and "buffer holds" in message
