"""A real 0.5.23 `RoutedExpertsCapturer` on CPU fed synthetic forwards: the right rows with r3-sidecar, not upstream.

Each case builds the gathered device-cache layout a real forward produces (all DP ranks' rows, rank by rank),
routes it through `topk.capture_routed_experts_if_allowed`, then calls `on_forward_end` exactly as
`ModelRunner.forward` does and reads the host cache at this rank's `out_cache_loc`. The same case runs twice
in one child process: first on upstream's code, then with the capture hooks applied through `HookRegistry`.
The cases are `capture_cases.py`'s, the synthetic forward that runs them `synthetic_forward.py`'s.
"""

from __future__ import annotations

import pytest
from capture_cases import CASES, DP2, LAYERS, SPEC, TOPK, Case, expected_value
from sglang_env import run_sglang
from synthetic_forward import apply_capture_hooks, forward, setup_case

# ---------------------------------------------------------------- child side (runs inside run_sglang) ----


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
        **DP2,
        **SPEC,
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
