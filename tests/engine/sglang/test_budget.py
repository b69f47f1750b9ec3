"""Budget rows against hand-computed expectations (the arithmetic is written out, not derived from the code).

Conventions of `BudgetInputs`: `chunked_prefill_size` is per attention-DP rank (SGLang divides the flag by
attn_dp_size), `max_running_requests` is the global flag (per rank: // attn_dp_size).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine_ext.sglang.budget import (
    PLUGIN_CORRECTED,
    BudgetInputs,
    blocking_rows,
    budget_rows,
    format_table,
    inputs_from_server_args,
    refusal_message,
)


def rows_by_name(inputs: BudgetInputs) -> dict:
    return {r.buffer: r for r in budget_rows(inputs)}


def dp(n: int, **kw) -> BudgetInputs:
    """n attention-DP ranks on n GPUs (attn_tp = 1)."""
    return BudgetInputs(tp_size=n, attn_dp_size=n, **kw)


def eagle(w: int, topk: int = 1, steps: int = 3) -> dict:
    return {
        "speculative_algorithm": "EAGLE",
        "speculative_num_draft_tokens": w,
        "speculative_eagle_topk": topk,
        "speculative_num_steps": steps,
    }


# ---- routed-experts device cache: DP 1/2/8 x EAGLE w 1/4/8 x chunked prefill 8192/-1 ----------------------


def test_dp1_plain_decode_fits():
    rows = rows_by_name(BudgetInputs(chunked_prefill_size=8192, max_running_requests=256))
    dc = rows["routed_experts.device_cache"]
    assert dc.capacity == 1 * max(8192, 256) == 8192
    assert dc.demand == 1 * max(8192, 256 * 1) == 8192
    assert dc.ok and dc.fix is None and not dc.blocking


def test_dp8_eagle_w4_overflows_upstream_sizing_research_example():
    # --chunked-prefill-size 8192 over 8 DP ranks -> 1024 per rank; 4096 requests -> 512 per rank; w = 4.
    rows = rows_by_name(dp(8, chunked_prefill_size=8192 // 8, max_running_requests=4096, **eagle(4)))
    dc = rows["routed_experts.device_cache"]
    assert dc.capacity == 8 * max(1024, 4096 // 8) == 8192
    assert dc.demand == 8 * max(1024, 512 * 4) == 16384
    assert not dc.ok
    # the plugin sizes this buffer itself: reported, not blocking
    assert dc.corrected and not dc.blocking and "routed_experts.device_cache" in PLUGIN_CORRECTED
    # per-rank chunk 2048 = 512*4 -> flag 2048*8; or 1024 // 4 = 256 requests per rank -> 256*8 global
    assert dc.fix == "--chunked-prefill-size 16384 (2048 per DP rank), or --max-running-requests 2048"


def test_dp8_eagle_w8_verify_dominates():
    rows = rows_by_name(dp(8, chunked_prefill_size=1024, max_running_requests=1024, **eagle(8)))
    dc = rows["routed_experts.device_cache"]
    assert dc.capacity == 8 * max(1024, 1024 // 8) == 8192
    assert dc.demand == 8 * max(1024, 128 * 8) == 8192
    assert dc.ok


def test_dp2_eagle_w8_topk4_tree_and_kv_indices():
    # flag 8192 over 2 ranks -> 4096; 1024 requests -> 512 per rank; w = 8 tree tokens, topk 4.
    inputs = dp(
        2,
        chunked_prefill_size=8192 // 2,
        max_running_requests=1024,
        decode_graph_max_bs=256,
        context_length=4096,
        **eagle(8, topk=4, steps=3),
    )
    rows = rows_by_name(inputs)
    dc = rows["routed_experts.device_cache"]
    assert dc.capacity == 2 * max(4096, 512) == 8192
    assert dc.demand == 2 * max(4096, 512 * 8) == 8192
    assert dc.ok
    kv = rows["eagle.draft_kv_indices"]
    assert kv.capacity == 256 * 4 * 4096 == 4_194_304
    # graph bs min(256, 512) = 256; a request ends at 4096 - 2 tokens; + bs*topk*num_steps
    assert kv.demand == 256 * (4096 - 2) * 4 + 256 * 4 * 3 == 4_195_328
    assert kv.blocking  # 3 draft steps past a sequence 2 short of the context overflow the row (FlashInfer asserts)
    assert kv.fix == f"--max-total-tokens {256 * (4096 - 3)}"
    # with the KV pool pinned below that, the pool bounds seq_lens_sum
    pinned = rows_by_name(replace(inputs, max_total_tokens=1_000_000))["eagle.draft_kv_indices"]
    assert pinned.demand == 1_000_000 * 4 + 256 * 4 * 3 == 4_003_072
    assert pinned.ok
    graph = rows["decode_graph.inputs"]
    assert (graph.capacity, graph.demand) == (256 * 8, 256 * 8)


def test_eagle_kv_indices_two_steps_fit_at_the_context_end():
    inputs = BudgetInputs(max_running_requests=64, decode_graph_max_bs=64, context_length=8192, **eagle(3, 4, 2))
    kv = rows_by_name(inputs)["eagle.draft_kv_indices"]
    assert (kv.capacity, kv.demand) == (64 * 4 * 8192, 64 * (8192 - 2) * 4 + 64 * 4 * 2)
    assert kv.ok


def test_eagle_kv_indices_int32_limit_names_the_graph_bs():
    inputs = BudgetInputs(
        chunked_prefill_size=8192,
        max_running_requests=512,
        decode_graph_max_bs=512,
        context_length=1_048_576,
        **eagle(8, topk=8, steps=7),
    )
    kv = rows_by_name(inputs)["eagle.draft_kv_indices"]
    assert kv.capacity == 512 * 8 * 1_048_576 == 4_294_967_296  # >= 2**31: spec_utils.py asserts at startup
    assert not kv.ok and kv.blocking
    assert kv.fix == f"--cuda-graph-max-bs-decode {(2**31 - 1) // (8 * 1_048_576)}" == "--cuda-graph-max-bs-decode 255"


def test_dp1_w1_chunked_prefill_off_long_context():
    inputs = BudgetInputs(chunked_prefill_size=-1, max_running_requests=128, context_length=131072)
    dc = rows_by_name(inputs)["routed_experts.device_cache"]
    assert dc.capacity == 1 * max(-1, 128) == 128
    assert dc.demand == max(16384, 131072) == 131072  # one prefill forward = a whole prompt
    assert not dc.ok and dc.corrected
    assert dc.fix == "--chunked-prefill-size 16384"  # max(D 128, --max-prefill-tokens 16384)


def test_dp2_chunked_prefill_off_with_eagle_w4():
    inputs = dp(2, chunked_prefill_size=-1, max_running_requests=512, context_length=32768, **eagle(4))
    dc = rows_by_name(inputs)["routed_experts.device_cache"]
    assert dc.capacity == 2 * max(-1, 512 // 2) == 512
    assert dc.demand == 2 * max(max(16384, 32768), 256 * 4) == 65536
    assert dc.fix == f"--chunked-prefill-size {16384 * 2} (16384 per DP rank)"


def test_prefill_graph_bucket_above_chunk_counts():
    inputs = BudgetInputs(
        chunked_prefill_size=8192,
        max_running_requests=64,
        prefill_graph_mode="breakable",
        prefill_graph_max_tokens=16384,
    )
    dc = rows_by_name(inputs)["routed_experts.device_cache"]
    assert (dc.capacity, dc.demand) == (max(8192, 64), max(8192, 16384))  # #31116: 8192 vs 16384
    assert dc.fix == "--chunked-prefill-size 16384"


def test_unknown_max_running_requests_uses_the_estimate_and_says_so():
    dc = rows_by_name(BudgetInputs(chunked_prefill_size=8192, **eagle(4)))["routed_experts.device_cache"]
    assert dc.capacity == max(8192, 4096)
    assert dc.demand == max(8192, 4096 * 4) == 16384
    assert "estimate: pin --max-running-requests" in dc.formula


# ---- MoE backends ----------------------------------------------------------------------------------------


def test_flashinfer_a2a_dp8_eagle_w4():
    inputs = dp(8, chunked_prefill_size=1024, max_running_requests=4096, moe_a2a_backend="flashinfer", **eagle(4))
    fi = rows_by_name(inputs)["flashinfer_a2a.workspace"]
    assert fi.capacity == max(1024, 4096) == 4096  # overrides.py:1886-1894 without the env var
    assert fi.demand == -(-max(1024, 512 * 4) // 1) == 2048
    assert fi.ok
    assert "not importable" in fi.formula  # FlashInfer's byte count is not available on this machine


def test_flashinfer_a2a_env_cap_too_small_names_the_env_var():
    inputs = dp(
        8,
        chunked_prefill_size=1024,
        max_running_requests=4096,
        moe_a2a_backend="flashinfer",
        flashinfer_max_dispatch_tokens_per_rank=1024,
        **eagle(4),
    )
    fi = rows_by_name(inputs)["flashinfer_a2a.workspace"]
    assert (fi.capacity, fi.demand) == (1024, 512 * 4)
    assert fi.blocking
    assert fi.fix == "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK=2048"
    message = refusal_message(budget_rows(inputs))
    assert "flashinfer_a2a.workspace: demand 2048 tokens/rank > capacity 1024" in message
    assert "Set SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK=2048." in message


def test_flashinfer_a2a_needs_chunked_prefill():
    inputs = BudgetInputs(chunked_prefill_size=-1, max_running_requests=64, moe_a2a_backend="flashinfer")
    fi = rows_by_name(inputs)["flashinfer_a2a.workspace"]
    assert fi.capacity == max(0, 4096) and fi.blocking
    assert fi.fix == "--chunked-prefill-size 4096"


def test_cutedsl_breakable_prefill_graph_missed_upstream_corrected_by_plugin():
    # DP2: per rank chunk 4096, breakable prefill graph pinned to 32768 tokens, decode graph 256.
    inputs = dp(
        2,
        chunked_prefill_size=4096,
        max_running_requests=512,
        moe_runner_backend="flashinfer_cutedsl",
        prefill_graph_mode="breakable",
        prefill_graph_max_tokens=32768,
        decode_graph_max_bs=256,
    )
    cd = rows_by_name(inputs)["cutedsl_moe.wrapper"]
    assert cd.capacity == 2 * max(16384, 256 * 1) == 32768  # 0.5.23 ignores the breakable graph
    assert cd.demand == 2 * max(max(4096, 32768), 256 * 1) == 65536
    assert not cd.ok
    assert cd.corrected  # the plugin's bound max(16384, 32768, 256) * 2 = 65536 covers it
    assert cd.fix == "--max-prefill-tokens 32768"


def test_cutedsl_tc_piecewise_is_counted_upstream():
    inputs = BudgetInputs(
        chunked_prefill_size=4096,
        max_running_requests=64,
        moe_runner_backend="flashinfer_cutedsl",
        prefill_graph_mode="tc_piecewise",
        prefill_graph_max_tokens=32768,
    )
    cd = rows_by_name(inputs)["cutedsl_moe.wrapper"]
    assert (cd.capacity, cd.demand) == (max(16384, 32768), 32768) and cd.ok


def test_cutedsl_unchunked_prompt_exceeds_even_the_plugin_bound():
    inputs = BudgetInputs(
        chunked_prefill_size=-1, max_running_requests=64, context_length=65536, moe_runner_backend="flashinfer_cutedsl"
    )
    cd = rows_by_name(inputs)["cutedsl_moe.wrapper"]
    assert (cd.capacity, cd.demand) == (16384, max(16384, 65536))
    assert cd.blocking  # max(16384, 0, 0) < 65536: the plugin's bound does not cover eager whole prompts
    assert cd.fix == "--max-prefill-tokens 65536"


def test_cutedsl_on_a2a_path_is_the_flashinfer_row():
    inputs = BudgetInputs(moe_runner_backend="flashinfer_cutedsl", moe_a2a_backend="flashinfer", max_running_requests=8)
    names = set(rows_by_name(inputs))
    assert "flashinfer_a2a.workspace" in names and "cutedsl_moe.wrapper" not in names


def test_deepep_low_latency_tp8_scatters_over_attn_tp():
    inputs = BudgetInputs(
        tp_size=8, ep_size=8, chunked_prefill_size=8192, max_running_requests=256, moe_a2a_backend="deepep"
    )
    rows = rows_by_name(inputs)
    ll = rows["deepep.low_latency"]
    assert (ll.capacity, ll.demand) == (128, -(-256 // 8)) and ll.ok
    # DeepEP scatters tokens: the device cache holds one rank's tokens, padded to attn_tp 8
    dc = rows["routed_experts.device_cache"]
    assert dc.demand == -(-max(8192, 256) // 8) * 8 == 8192
    gather = rows["routed_experts.gather_buffer"]
    assert gather.capacity == 1 * max(8192, 256) * 8 == 65536


def test_deepep_low_latency_dp8_eagle_w4_beyond_the_hard_cap():
    inputs = dp(8, chunked_prefill_size=1024, max_running_requests=4096, moe_a2a_backend="deepep", **eagle(4))
    rows = rows_by_name(inputs)
    ll = rows["deepep.low_latency"]
    assert (ll.capacity, ll.demand) == (128, 512 * 4)
    assert ll.blocking
    # 2048 > 1024 (deepep.py:409): requests per rank 1024 // 4 = 256 -> 256 * 8 global
    assert ll.fix == "--max-running-requests 2048 and SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=1024"
    dc = rows["routed_experts.device_cache"]
    assert (dc.capacity, dc.demand) == (8 * max(1024, 512), 1 * 2048) and dc.ok  # not DP-gathered under DeepEP


def test_deepep_low_latency_fits_with_env():
    inputs = BudgetInputs(
        tp_size=4,
        chunked_prefill_size=4096,
        max_running_requests=1024,
        moe_a2a_backend="deepep",
        deepep_max_dispatch_tokens_per_rank=256,
    )
    ll = rows_by_name(inputs)["deepep.low_latency"]
    assert (ll.capacity, ll.demand) == (256, 1024 // 4) and ll.ok


def test_deepep_normal_mode_has_no_low_latency_row():
    inputs = BudgetInputs(moe_a2a_backend="deepep", deepep_mode="normal", max_running_requests=8)
    assert "deepep.low_latency" not in rows_by_name(inputs)


def test_deepep_v2_prefill_ceiling_and_decode():
    inputs = BudgetInputs(tp_size=4, chunked_prefill_size=8192, max_running_requests=64, moe_a2a_backend="deepep_v2")
    v2 = rows_by_name(inputs)["deepep_v2.dispatch"]
    assert v2.capacity == 128
    assert v2.demand == max(-(-8192 // 4), 64 * 1) == 2048
    assert v2.fix == "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK=2048"


def test_mori_counts_verify_tokens_too():
    inputs = dp(2, chunked_prefill_size=2048, max_running_requests=2048, moe_a2a_backend="mori", **eagle(8))
    mori = rows_by_name(inputs)["mori.dispatch"]
    assert (mori.capacity, mori.demand) == (4096, max(2048, 1024 * 8))
    assert mori.fix == "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK=8192"


def test_megamoe_rows():
    fim = rows_by_name(
        BudgetInputs(
            chunked_prefill_size=8192,
            max_running_requests=64,
            moe_a2a_backend="flashinfer_megamoe",
            decode_graph_max_bs=64,
        )
    )["flashinfer_megamoe.symm_buffer"]
    assert (fim.capacity, fim.demand) == (max(16384, 64), max(8192, 64)) and fim.ok
    dg = rows_by_name(
        BudgetInputs(tp_size=4, chunked_prefill_size=10000, max_running_requests=64, moe_a2a_backend="megamoe")
    )["deepgemm_megamoe.buffer"]
    assert (dg.capacity, dg.demand) == (8192, -(-10000 // 4) * 4) and dg.fix.endswith("=10000")


# ---- shape of the table ------------------------------------------------------------------------------------


def test_rows_that_do_not_apply_are_omitted():
    names = list(rows_by_name(BudgetInputs(max_running_requests=8)))
    assert names == ["routed_experts.device_cache"]
    assert budget_rows(BudgetInputs(enable_return_routed_experts=False)) == []


def test_host_cache_row_when_pool_is_known():
    inputs = BudgetInputs(max_total_tokens=100_000, page_size=64, num_layers=48, topk=8, max_running_requests=8)
    host = rows_by_name(inputs)["routed_experts.host_cache"]
    assert host.capacity == 100_000 + 64 and host.ok
    assert f"pinned {(100_064) * 48 * 8 * 4} B" in host.formula


def test_corrected_set_is_overridable_and_contract_dict():
    inputs = dp(8, chunked_prefill_size=1024, max_running_requests=4096, **eagle(4))
    rows = budget_rows(inputs, corrected=())
    assert [r.buffer for r in blocking_rows(rows)] == ["routed_experts.device_cache"]
    contract = rows[0].as_contract()
    assert set(contract) == {"buffer", "unit", "capacity", "demand", "ok", "formula"}
    json.dumps(contract)
    assert "FAIL" in format_table(rows) and "corrected" in format_table(budget_rows(inputs))


@pytest.mark.parametrize(
    ("attn_dp", "flag_cps", "per_rank"),
    [(1, 8192, 8192), (2, 8192, 4096), (8, 8192, 1024), (8, -1, -1)],
)
def test_inputs_from_dummy_server_args_divide_the_chunk(attn_dp, flag_cps, per_rank):
    args = {
        "model_path": "dummy",
        "tp_size": attn_dp,
        "attn_dp_size": attn_dp,
        "chunked_prefill_size": flag_cps,
        "max_running_requests": 64,
        "cuda_graph_max_bs_decode": 32,
        "enable_return_routed_experts": True,
    }
    inputs = inputs_from_server_args(args, environ={"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "512"})
    assert inputs.chunked_prefill_size == per_rank
    assert inputs.decode_graph_max_bs == 32 and inputs.prefill_graph_mode == "disabled"
    assert inputs.deepep_max_dispatch_tokens_per_rank == 512
    assert inputs.flashinfer_max_dispatch_tokens_per_rank is None
    assert inputs.attn_tp_size == 1


def test_inputs_from_resolved_graph_config():
    args = {
        "model_path": "/models/x",
        "chunked_prefill_size": 4096,  # resolved: already per rank
        "attn_dp_size": 2,
        "tp_size": 2,
        "cuda_graph_config": {
            "decode": {"backend": "full", "max_bs": 64},
            "prefill": {"backend": "disabled", "max_bs": 8192},
        },
    }
    inputs = inputs_from_server_args(args, environ={})
    assert (inputs.chunked_prefill_size, inputs.decode_graph_max_bs) == (4096, 64)
    assert (inputs.prefill_graph_mode, inputs.prefill_graph_max_tokens) == ("disabled", 0)


def test_pp_dynamic_chunking_grows_the_prefill_ceiling():
    inputs = BudgetInputs(
        pp_size=2,
        enable_dynamic_chunking=True,
        chunked_prefill_size=4096,
        max_running_requests=64,
        moe_a2a_backend="flashinfer",
    )
    rows = rows_by_name(inputs)
    ceiling = max(4096, 16384, -(-4096 * 5 // 4))  # overrides.py: chunks grow toward max_prefill_tokens, probe 1.25x
    assert rows["flashinfer_a2a.workspace"].capacity == max(ceiling, 4096) == 16384
    dc = rows["routed_experts.device_cache"]
    assert (dc.capacity, dc.demand) == (max(4096, 64), ceiling)  # the capturer is still sized from the chunk
    # the plugin's sizing (capturer.device_rows) counts the chunk too, so this one is the operator's to fix
    assert dc.blocking
    assert dc.fix == "drop --enable-dynamic-chunking (PP chunks grow past --chunked-prefill-size)"


# DP n x EAGLE w x --chunked-prefill-size, with --max-running-requests 4096, context 32768, max_prefill_tokens 16384.
# Per rank: chunk 8192/n, requests 4096/n. capacity = n * max(chunk, requests); demand = n * max(P, requests * w),
# P = chunk, or max(16384, 32768) = 32768 with chunking off (capacity then n * requests = 4096).
MATRIX = [
    # n, w, flag, capacity, demand
    (1, 1, 8192, 8192, 8192),  # max(8192, 4096) | max(8192, 4096*1)
    (1, 4, 8192, 8192, 16384),  # max(8192, 4096*4)
    (1, 8, 8192, 8192, 32768),  # 4096*8
    (2, 1, 8192, 8192, 8192),  # 2*max(4096, 2048) | 2*max(4096, 2048*1)
    (2, 4, 8192, 8192, 16384),  # 2*(2048*4)
    (2, 8, 8192, 8192, 32768),  # 2*(2048*8)
    (8, 1, 8192, 8192, 8192),  # 8*max(1024, 512) | 8*max(1024, 512*1)
    (8, 4, 8192, 8192, 16384),  # 8*(512*4)
    (8, 8, 8192, 8192, 32768),  # 8*(512*8)
    (1, 1, -1, 4096, 32768),  # 1*4096 | max(32768, 4096)
    (1, 8, -1, 4096, 32768),  # max(32768, 4096*8 = 32768)
    (2, 4, -1, 4096, 65536),  # 2*2048 | 2*max(32768, 8192)
    (8, 8, -1, 4096, 262144),  # 8*512 | 8*max(32768, 4096)
]


@pytest.mark.parametrize(("n", "w", "flag", "capacity", "demand"), MATRIX)
def test_device_cache_matrix(n, w, flag, capacity, demand):
    spec = eagle(w) if w > 1 else {"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 1}
    per_rank_chunk = flag // n if flag > 0 else flag
    inputs = dp(n, chunked_prefill_size=per_rank_chunk, max_running_requests=4096, context_length=32768, **spec)
    dc = rows_by_name(inputs)["routed_experts.device_cache"]
    assert (dc.capacity, dc.demand, dc.ok) == (capacity, demand, capacity >= demand)
    assert not dc.blocking  # the capture hooks size N * max(P, max(requests, graph bs) * w) themselves
