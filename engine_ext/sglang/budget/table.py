"""Buffer budget table: every fixed-size buffer the routed-experts path depends on, its capacity and worst case.

Pure arithmetic over plain values (no SGLang import), so the pre-launch check, the offline CLI and the
telemetry file all print the same numbers. Each formula mirrors the sizing code of SGLang 0.5.23 (file and
line in the row's `formula`); the worst-case demand is what one forward can put into that buffer.

Conventions (see `BudgetInputs`): "per rank" means one attention-DP rank (one scheduler). Rows that do not
apply to a configuration (a backend that is not selected, no speculative decoding, no decode graph) are
omitted, not shown as n/a: the table lists only buffers that exist in that server.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from engine_ext.sglang.budget.moe import flashinfer_a2a_capacity, moe_rows
from engine_ext.sglang.budget.terms import (
    EAGLE_FAMILY,
    ENV_CAPS,
    INT32_LIMIT,
    SCATTERED_A2A,
    BudgetInputs,
    BudgetRow,
    Shape,
    at_least,
    ceil_to,
    chunk_fix,
    chunk_need,
    shape_of,
    terms,
)
from engine_ext.sglang.capturer import (
    CORRECTED_BUFFERS as PLUGIN_CORRECTED,  # buffers the capture hooks size themselves
)
from engine_ext.sglang.capturer import CaptureLimits, device_rows


def _device_cache_rows(i: BudgetInputs, s: Shape) -> list[BudgetRow]:
    rows_per_rank = max(i.chunked_prefill_size or 0, s.mrr_worker)  # max(cps*n, mrr*n) with cps possibly -1
    capacity = s.num_dp_ranks * rows_per_rank
    scattered = i.moe_a2a_backend in SCATTERED_A2A
    local = ceil_to(s.t, s.attn_tp) if scattered else s.t
    demand = s.gathered * local
    width = (i.topk or 0) + i.num_fused_shared_experts
    nbytes = f"; {capacity * i.num_layers * width * 4} B int32" if i.num_layers and i.topk else ""
    fix = chunk_fix(i, s, chunk_need(i, s))
    rows = [
        at_least(
            "routed_experts.device_cache",
            "tokens",
            capacity,
            demand,
            f"capacity num_dp_ranks {s.num_dp_ranks} x max(chunked_prefill {i.chunked_prefill_size}, "
            f"max_running_requests/rank {s.mrr_worker}) (routed_experts.py:80-83){nbytes}; "
            f"demand N {s.gathered} x max(P, D): {terms(s)}"
            + (f", padded to attn_tp {s.attn_tp}" if scattered else ""),
            fix=fix,
        )
    ]
    if scattered:
        g_capacity = capacity * s.attn_tp
        g_demand = ceil_to(s.t, s.attn_tp)
        rows.append(
            at_least(
                "routed_experts.gather_buffer",
                "tokens",
                g_capacity,
                g_demand,
                f"capacity device rows {capacity} x attn_tp {s.attn_tp} (routed_experts.py:96-107); "
                f"demand ceil(max(P, D) / attn_tp) x attn_tp: {terms(s)}",
                fix=fix,
            )
        )
    return rows


def _host_cache_row(i: BudgetInputs) -> BudgetRow | None:
    if i.max_total_tokens is None:
        return None  # sized from the KV pool after memory profiling; nothing to check before it
    capacity = i.max_total_tokens + i.page_size
    nbytes = f"; pinned {capacity * i.num_layers * i.topk * 4} B on every TP rank" if i.num_layers and i.topk else ""
    return BudgetRow(
        buffer="routed_experts.host_cache",
        unit="tokens",
        capacity=capacity,
        demand=capacity,
        formula=(
            f"capacity max_total_tokens {i.max_total_tokens} + page_size {i.page_size} "
            f"(kv_index_translator.py:268, base.py:63-75){nbytes}; demand max(out_cache_loc)+1 <= the same"
        ),
        ok=True,
    )


def _indexer_row(i: BudgetInputs, s: Shape) -> BudgetRow | None:
    if not (i.enable_return_indexer_topk and i.num_indexer_layers > 0):
        return None
    capacity = max(i.chunked_prefill_size or 0, s.mrr_worker)
    return at_least(
        "indexer_topk.device_cache",
        "tokens",
        capacity,
        s.t,
        (
            f"capacity max(chunked_prefill {i.chunked_prefill_size}, max_running_requests/rank {s.mrr_worker}) "
            f"per rank (indexer_topk.py:37); demand max(P, D): {terms(s)}"
        ),
        fix=chunk_fix(i, s, chunk_need(i, s)),
    )


def _decode_graph_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    capacity = i.decode_graph_max_bs * s.w
    demand = s.graph_bs * s.w
    return at_least(
        "decode_graph.inputs",
        "tokens",
        capacity,
        demand,
        f"capacity max_bs {i.decode_graph_max_bs} x w {s.w} (runner_utils/buffers.py:160-174); demand padded "
        f"bs {s.graph_bs} x w; larger batches run eager (can_run_graph)",
        fix=None,
    )


def _eagle_kv_indices_row(i: BudgetInputs, s: Shape) -> BudgetRow | None:
    algorithm = (i.speculative_algorithm or "").upper()
    if algorithm not in EAGLE_FAMILY or not i.decode_graph_max_bs or not i.context_length:
        return None
    topk = max(1, i.speculative_eagle_topk or 1)
    steps = max(1, i.speculative_num_steps or 1)
    ctx = i.context_length
    capacity = i.decode_graph_max_bs * topk * ctx
    # A request ends at context - 2 tokens (max_req_len = context - 1, tp_worker.py:568-571, and max_new_tokens
    # <= max_req_len - input - 1, scheduler.py:2710-2716); all of them live in the KV pool when it is known.
    seq_lens_sum = s.graph_bs * (ctx - 2)
    if i.max_total_tokens is not None:
        seq_lens_sum = min(seq_lens_sum, i.max_total_tokens)
    demand = seq_lens_sum * topk + s.graph_bs * topk * steps
    ok = demand <= capacity < INT32_LIMIT
    fix = None
    if capacity >= INT32_LIMIT:
        fix = f"--cuda-graph-max-bs-decode {(INT32_LIMIT - 1) // (topk * ctx)}"
    elif demand > capacity:  # fits iff seq_lens_sum <= bs * (context - num_steps)
        fix = f"--max-total-tokens {s.graph_bs * (ctx - steps)}"
    pool = "bs x (context - 2)"
    if i.max_total_tokens is not None:
        pool = f"min({pool}, max_total_tokens {i.max_total_tokens})"
    return BudgetRow(
        buffer="eagle.draft_kv_indices",
        unit="kv indices/step",
        capacity=capacity,
        demand=demand,
        formula=(
            f"capacity max_bs {i.decode_graph_max_bs} x topk {topk} x context {ctx}, must stay < 2^31 "
            f"(spec_utils.py:298-309, #27338); demand seq_lens_sum x topk + bs {s.graph_bs} x topk x num_steps "
            f"{steps} (spec_utils.py:312-320), seq_lens_sum <= {pool}: sequences within num_steps of the "
            "context overflow the row unless the KV pool is smaller"
        ),
        ok=ok,
        fix=fix,
    )


def budget_rows(inputs: BudgetInputs, corrected: Iterable[str] | None = None) -> list[BudgetRow]:
    """One row per buffer that exists in this configuration, in the research table's order."""
    fixed = frozenset(PLUGIN_CORRECTED if corrected is None else corrected)
    s = shape_of(inputs)
    rows: list[BudgetRow | None] = []
    if inputs.enable_return_routed_experts:
        rows += _device_cache_rows(inputs, s)
        rows.append(_host_cache_row(inputs))
    rows.append(_indexer_row(inputs, s))
    rows += moe_rows(inputs, s)
    if inputs.decode_graph_max_bs:
        rows.append(_decode_graph_row(inputs, s))
    if s.spec:
        rows.append(_eagle_kv_indices_row(inputs, s))
    return [replace(r, corrected=_plugin_covers(r, inputs, s, fixed)) for r in rows if r is not None]


def _plugin_covers(row: BudgetRow, i: BudgetInputs, s: Shape, fixed: frozenset[str]) -> bool:
    """Whether the plugin resizes this buffer and its size reaches the demand (else the operator must act).

    The capture hooks size the device cache (and so the DeepEP gather buffer, device rows x attn_tp) with
    `capturer.device_rows`; the CuteDSL bound they install adds the breakable/full prefill graph but not
    eager decode or unchunked prompts.
    """
    if row.buffer not in fixed:
        return False
    bound = max(i.max_prefill_tokens, s.p_graph, i.decode_graph_max_bs * s.w)  # the hooks' CuteDSL bound
    if row.buffer == "cutedsl_moe.wrapper":
        return s.num_dp_ranks * bound >= row.demand
    if row.buffer == "flashinfer_megamoe.symm_buffer":  # derived from the same bound unless the env var pins it
        return i.flashinfer_megamoe_max_tokens_per_rank <= 0 and bound >= row.demand
    if row.buffer in ("routed_experts.device_cache", "routed_experts.gather_buffer"):
        rows = _plugin_device_rows(i, s)
        scale = s.attn_tp if row.buffer == "routed_experts.gather_buffer" else 1
        return scale * rows >= row.demand
    return True


def _plugin_device_rows(i: BudgetInputs, s: Shape) -> int:
    """Device-cache rows the capture hooks allocate (`num_dp_ranks x max(chunk, mrr, rows / num_dp_ranks)`)."""
    limits = CaptureLimits(
        max_running_requests=s.mrr_worker,
        chunked_prefill_size=i.chunked_prefill_size,
        context_len=i.context_length or 0,
        max_prefill_tokens=i.max_prefill_tokens,
        prefill_graph_max_tokens=s.p_graph,
        decode_graph_max_bs=i.decode_graph_max_bs,
        tokens_per_req=s.w,
        attn_tp_size=s.attn_tp,
    )
    rows = device_rows(limits, s.num_dp_ranks if s.gathered > 1 else 1)
    return s.num_dp_ranks * max(i.chunked_prefill_size or 0, s.mrr_worker, -(-rows // s.num_dp_ranks))


def blocking_rows(rows: Iterable[BudgetRow]) -> list[BudgetRow]:
    """Rows that fail and that the plugin does not correct: what `R3_BUDGET=enforce` refuses."""
    return [r for r in rows if r.blocking]


def refusal_message(rows: Iterable[BudgetRow]) -> str:
    """One line per blocking buffer with the setting that fixes it (seed #26696's style)."""
    lines = [
        f"{r.buffer}: demand {r.demand} {r.unit} > capacity {r.capacity}. Set {r.fix or 'n/a'}. ({r.formula})"
        for r in blocking_rows(rows)
    ]
    return "r3-sidecar (R3_BUDGET=enforce) refuses to start:\n  " + "\n  ".join(lines)


def format_table(rows: Iterable[BudgetRow]) -> str:
    """Plain-text table for logs (the CLI renders the same rows with rich)."""
    header = f"{'buffer':34} {'unit':16} {'capacity':>12} {'demand':>12}  status     fix"
    out = [header]
    for r in rows:
        status = "ok" if r.ok else ("corrected" if r.corrected else "FAIL")
        out.append(f"{r.buffer:34} {r.unit:16} {r.capacity:>12} {r.demand:>12}  {status:10} {r.fix or ''}")
    return "\n".join(out)


__all__ = [
    "ENV_CAPS",
    "PLUGIN_CORRECTED",
    "BudgetInputs",
    "BudgetRow",
    "blocking_rows",
    "budget_rows",
    "flashinfer_a2a_capacity",
    "format_table",
    "refusal_message",
]
