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
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine_ext.sglang.capturer import (
    CORRECTED_BUFFERS as PLUGIN_CORRECTED,  # buffers the capture hooks size themselves
)
from engine_ext.sglang.capturer import CaptureLimits, device_rows

MRR_ESTIMATE = 4096  # upper end of SGLang's per-worker estimate when --max-running-requests is unset
DEEPEP_LL_HARD_CAP = 1024  # deepep.py:409 asserts the low-latency cap <= 1024 (FINISHED_SUM_TAG)
INT32_LIMIT = 2**31  # spec_utils.py:304 asserts num_seqs * topk * max_context_len < 2**31
EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "FROZEN_KV_MTP"})
SCATTERED_A2A = frozenset({"deepep", "deepep_v2"})  # routed_experts.py:25-28: tokens scattered over attn-TP


@dataclass(frozen=True)
class BudgetInputs:
    """The plain values the budget depends on; build with `budget_inputs.inputs_from_server_args` or by hand."""

    tp_size: int = 1
    dp_size: int = 1  # replicas (--dp-size without attention DP); each is its own scheduler
    attn_dp_size: int = 1  # attention-DP groups (--attn-dp-size)
    ep_size: int = 1
    attn_tp_size: int | None = None  # default tp_size // attn_dp_size
    # Per attention-DP rank, as the scheduler sees it: SGLang divides --chunked-prefill-size by
    # attn_dp_size (parallel_hook.py:326-331). <= 0 or None: chunked prefill disabled.
    chunked_prefill_size: int | None = 8192
    max_prefill_tokens: int = 16384
    pp_size: int = 1
    enable_dynamic_chunking: bool = False  # with pp_size > 1 a chunk may grow (overrides.py:1865-1883)
    max_running_requests: int | None = None  # global, as on the command line
    context_length: int | None = None
    max_total_tokens: int | None = None  # KV pool tokens per rank; known after memory profiling
    page_size: int = 1
    decode_graph_max_bs: int = 0  # 0: no decode CUDA graph
    prefill_graph_mode: str = "disabled"  # disabled | breakable | full | tc_piecewise
    prefill_graph_max_tokens: int = 0
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    moe_a2a_backend: str = "none"
    moe_runner_backend: str = "auto"
    deepep_mode: str = "auto"
    enable_return_routed_experts: bool = True
    # Environment caps (srt/environ.py), defaults as in 0.5.23.
    deepep_max_dispatch_tokens_per_rank: int = 128  # SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK
    deepep_v2_max_dispatch_tokens_per_rank: int = 128  # SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK
    mori_max_dispatch_tokens_per_rank: int = 4096  # SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK
    flashinfer_max_dispatch_tokens_per_rank: int | None = None  # SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK
    flashinfer_megamoe_max_tokens_per_rank: int = 0  # SGLANG_FLASHINFER_MEGAMOE_MAX_TOKENS_PER_RANK
    deepgemm_megamoe_max_tokens_per_rank: int = 8192  # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK
    # Model (optional: only byte counts and the indexer row need them).
    num_layers: int | None = None
    topk: int | None = None
    num_fused_shared_experts: int = 0
    num_indexer_layers: int = 0
    index_topk: int = 0
    enable_return_indexer_topk: bool = False
    hidden_size: int | None = None
    # FlashInfer's own byte count of its a2a workspace at `flashinfer_a2a_capacity` (None: not computed here,
    # FlashInfer not importable); `budget_inputs` asks FlashInfer, so this module stays arithmetic.
    flashinfer_a2a_workspace_bytes: int | None = None


ENV_CAPS: dict[str, str] = {
    "deepep_max_dispatch_tokens_per_rank": "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
    "deepep_v2_max_dispatch_tokens_per_rank": "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
    "mori_max_dispatch_tokens_per_rank": "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
    "flashinfer_max_dispatch_tokens_per_rank": "SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK",
    "flashinfer_megamoe_max_tokens_per_rank": "SGLANG_FLASHINFER_MEGAMOE_MAX_TOKENS_PER_RANK",
    "deepgemm_megamoe_max_tokens_per_rank": "SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK",
}


@dataclass(frozen=True)
class BudgetRow:
    """One buffer: capacity against the worst case one forward can need, and what fixes a shortfall."""

    buffer: str
    unit: str
    capacity: int
    demand: int
    formula: str
    ok: bool
    fix: str | None = None  # the exact flag or env var and value that makes `ok` true
    corrected: bool = False  # the plugin sizes this buffer itself, whatever the flags say

    @property
    def blocking(self) -> bool:
        """A shortfall nothing in this process will correct: the server would fail or corrupt rows."""
        return not self.ok and not self.corrected

    def as_contract(self) -> dict[str, Any]:
        """The engine file's `budget` entry (docs/design.md, Contract 1)."""
        return {k: v for k, v in asdict(self).items() if k in ("buffer", "unit", "capacity", "demand", "ok", "formula")}


def _at_least(buffer: str, unit: str, capacity: int, demand: int, formula: str, fix: str | None) -> BudgetRow:
    """A row whose one rule is capacity ≥ demand; `fix` is offered only when that fails."""
    ok = capacity >= demand
    return BudgetRow(buffer, unit, capacity, demand, formula, ok, None if ok else fix)


@dataclass(frozen=True)
class _Shape:
    """Quantities every row shares, derived once."""

    attn_dp: int
    attn_tp: int
    num_dp_ranks: int  # capacity multiplier of the routed-experts device cache (runtime_context.py:202-207)
    gathered: int  # N: ranks whose tokens one MoE forward sees (DP attention without DeepEP)
    w: int  # tokens per request in a decode/verify forward
    spec: bool
    mrr_worker: int  # per-rank request cap (kv_cache_configurator.py:3126-3132)
    mrr_known: bool
    cps: int  # per-rank chunk, <= 0 when chunked prefill is off
    p_eager: int  # largest eager prefill forward per rank
    p_graph: int  # largest prefill CUDA-graph bucket per rank
    graph_bs: int  # decode graph max bs, clamped to the per-rank request pool
    decode_reqs: int  # largest decode batch per rank (eager or graph)

    @property
    def p(self) -> int:
        return max(self.p_eager, self.p_graph)

    @property
    def d(self) -> int:
        return self.decode_reqs * self.w

    @property
    def t(self) -> int:
        return max(self.p, self.d)


def _prefill_buffer_tokens(i: BudgetInputs) -> int:
    """`max_prefill_buffer_tokens()` (overrides.py:1865-1883): the chunk, or PP dynamic chunking's ceiling; 0 if off."""
    chunk = i.chunked_prefill_size if i.chunked_prefill_size and i.chunked_prefill_size > 0 else 0
    if chunk and i.enable_dynamic_chunking and i.pp_size > 1:
        return max(chunk, i.max_prefill_tokens, -(-chunk * 5 // 4))
    return chunk


def _shape(i: BudgetInputs) -> _Shape:
    attn_dp = max(1, i.attn_dp_size)
    attn_tp = i.attn_tp_size or max(1, i.tp_size // attn_dp)
    spec = bool(i.speculative_algorithm)
    w = max(1, i.speculative_num_draft_tokens or 1) if spec else 1
    mrr_known = i.max_running_requests is not None
    mrr_worker = max(1, i.max_running_requests // attn_dp) if mrr_known else MRR_ESTIMATE
    cps = _prefill_buffer_tokens(i)
    # Without chunking one prefill forward takes a whole prompt: up to max(max_prefill_tokens, context).
    p_eager = cps if cps else max(i.max_prefill_tokens, i.context_length or 0)
    p_graph = i.prefill_graph_max_tokens if i.prefill_graph_mode != "disabled" else 0
    graph_bs = min(i.decode_graph_max_bs, mrr_worker) if mrr_known else i.decode_graph_max_bs
    decode_reqs = mrr_worker if mrr_known else max(graph_bs, MRR_ESTIMATE)
    gathered = attn_dp if attn_dp > 1 and i.moe_a2a_backend not in SCATTERED_A2A else 1
    return _Shape(
        attn_dp=attn_dp,
        attn_tp=attn_tp,
        num_dp_ranks=max(1, i.dp_size) * attn_dp,
        gathered=gathered,
        w=w,
        spec=spec,
        mrr_worker=mrr_worker,
        mrr_known=mrr_known,
        cps=cps,
        p_eager=p_eager,
        p_graph=p_graph,
        graph_bs=graph_bs,
        decode_reqs=decode_reqs,
    )


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _terms(s: _Shape) -> str:
    """The per-rank worst case in words, shared by most formulas."""
    prefill = f"P={s.p} (chunk {s.cps})" if s.cps else f"P={s.p} (no chunking: max(max_prefill_tokens, context))"
    if s.p_graph > s.p_eager:
        prefill = f"P={s.p} (prefill graph bucket)"
    mrr = f"{s.mrr_worker}" if s.mrr_known else f"{s.decode_reqs} (estimate: pin --max-running-requests)"
    return f"{prefill}; decode/verify D=reqs {mrr} x w {s.w} = {s.d}"


def _chunk_need(i: BudgetInputs, s: _Shape) -> int:
    """Per-rank chunk that makes `max(chunk, mrr)` cover every forward: decode/verify, prefill graph, the chunk.

    With chunking off, the operator's own prefill batch budget (`--max-prefill-tokens`) is the chunk offered.
    """
    return max(s.d, s.p_graph, s.cps or i.max_prefill_tokens)


def _chunk_fix(i: BudgetInputs, s: _Shape, need_rank: int) -> str:
    """`--chunked-prefill-size` (global flag value) that gives each rank `need_rank` tokens, plus the other knob.

    Under PP dynamic chunking a chunk outgrows any `--chunked-prefill-size` (x1.25), so the flag to drop is that.
    """
    if i.enable_dynamic_chunking and i.pp_size > 1 and s.cps > (i.chunked_prefill_size or 0):
        return "drop --enable-dynamic-chunking (PP chunks grow past --chunked-prefill-size)"
    fix = f"--chunked-prefill-size {need_rank * s.attn_dp}"
    if s.attn_dp > 1:
        fix += f" ({need_rank} per DP rank)"
    if s.w > 1 and s.cps and s.p_graph <= s.cps < s.d:  # verify alone overflows: fewer requests also fit
        fix += f", or --max-running-requests {max(1, s.cps // s.w) * s.attn_dp}"
    return fix


def _device_cache_rows(i: BudgetInputs, s: _Shape) -> list[BudgetRow]:
    rows_per_rank = max(i.chunked_prefill_size or 0, s.mrr_worker)  # max(cps*n, mrr*n) with cps possibly -1
    capacity = s.num_dp_ranks * rows_per_rank
    scattered = i.moe_a2a_backend in SCATTERED_A2A
    local = _ceil_to(s.t, s.attn_tp) if scattered else s.t
    demand = s.gathered * local
    width = (i.topk or 0) + i.num_fused_shared_experts
    nbytes = f"; {capacity * i.num_layers * width * 4} B int32" if i.num_layers and i.topk else ""
    fix = _chunk_fix(i, s, _chunk_need(i, s))
    rows = [
        _at_least(
            "routed_experts.device_cache",
            "tokens",
            capacity,
            demand,
            f"capacity num_dp_ranks {s.num_dp_ranks} x max(chunked_prefill {i.chunked_prefill_size}, "
            f"max_running_requests/rank {s.mrr_worker}) (routed_experts.py:80-83){nbytes}; "
            f"demand N {s.gathered} x max(P, D): {_terms(s)}"
            + (f", padded to attn_tp {s.attn_tp}" if scattered else ""),
            fix=fix,
        )
    ]
    if scattered:
        g_capacity = capacity * s.attn_tp
        g_demand = _ceil_to(s.t, s.attn_tp)
        rows.append(
            _at_least(
                "routed_experts.gather_buffer",
                "tokens",
                g_capacity,
                g_demand,
                f"capacity device rows {capacity} x attn_tp {s.attn_tp} (routed_experts.py:96-107); "
                f"demand ceil(max(P, D) / attn_tp) x attn_tp: {_terms(s)}",
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


def _indexer_row(i: BudgetInputs, s: _Shape) -> BudgetRow | None:
    if not (i.enable_return_indexer_topk and i.num_indexer_layers > 0):
        return None
    capacity = max(i.chunked_prefill_size or 0, s.mrr_worker)
    return _at_least(
        "indexer_topk.device_cache",
        "tokens",
        capacity,
        s.t,
        (
            f"capacity max(chunked_prefill {i.chunked_prefill_size}, max_running_requests/rank {s.mrr_worker}) "
            f"per rank (indexer_topk.py:37); demand max(P, D): {_terms(s)}"
        ),
        fix=_chunk_fix(i, s, _chunk_need(i, s)),
    )


def flashinfer_a2a_capacity(i: BudgetInputs) -> int:
    """Tokens per rank FlashInfer's a2a workspace is sized for: the env cap, else max(chunk, 4096)."""
    configured = i.flashinfer_max_dispatch_tokens_per_rank
    return configured if configured is not None else max(_prefill_buffer_tokens(i), 4096)


def _flashinfer_a2a_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["flashinfer_max_dispatch_tokens_per_rank"]
    configured = i.flashinfer_max_dispatch_tokens_per_rank
    capacity = flashinfer_a2a_capacity(i)
    source = f"{env}={configured}" if configured is not None else f"max(chunked_prefill {s.cps}, 4096)"
    nbytes = i.flashinfer_a2a_workspace_bytes
    byte_note = (
        f"; workspace {nbytes} B per rank (FlashInfer moe_a2a_get_workspace_size_per_rank, bf16 payload)"
        if nbytes is not None
        else "; byte count not computed (FlashInfer's moe_a2a_get_workspace_size_per_rank not importable here)"
    )
    if not s.cps:
        return BudgetRow(
            buffer="flashinfer_a2a.workspace",
            unit="tokens/rank",
            capacity=capacity,
            demand=s.p,
            formula=f"capacity {source} (overrides.py:1886-1894){byte_note}; chunked prefill is off, "
            "so one eager prefill sends a whole prompt (moe_hook.py:749-760 refuses it)",
            ok=False,
            fix=f"--chunked-prefill-size {max(capacity, 1) * s.attn_dp}",
        )
    demand = -(-s.t // s.attn_tp)
    return _at_least(
        "flashinfer_a2a.workspace",
        "tokens/rank",
        capacity,
        demand,
        (
            f"capacity {source} (overrides.py:1886-1894){byte_note}; demand ceil(max(P, D) / attn_tp {s.attn_tp}) "
            f"(flashinfer.py:512): {_terms(s)}"
        ),
        fix=f"{env}={demand}",
    )


def _cutedsl_bound(i: BudgetInputs, s: _Shape) -> int:
    """`cutedsl_moe_max_num_tokens()` of 0.5.23 (runtime_context.py:2050-2069), prefill graph as it counts it."""
    prefill = i.max_prefill_tokens
    if i.prefill_graph_mode == "tc_piecewise":
        prefill = max(prefill, i.prefill_graph_max_tokens)
    return max(prefill, i.decode_graph_max_bs * s.w)


def _cutedsl_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    bound = _cutedsl_bound(i, s)
    capacity = s.num_dp_ranks * bound
    demand = s.gathered * s.t
    return _at_least(
        "cutedsl_moe.wrapper",
        "tokens",
        capacity,
        demand,
        (
            f"capacity num_dp_ranks {s.num_dp_ranks} x max(max_prefill_tokens {i.max_prefill_tokens}, "
            f"decode graph bs {i.decode_graph_max_bs} x w {s.w}) (flashinfer_cutedsl.py:335-345; breakable/full "
            f"prefill graphs not counted, runtime_context.py:2066); demand N {s.gathered} x max(P, D): {_terms(s)}"
        ),
        fix=f"--max-prefill-tokens {s.t}",
    )


def _flashinfer_megamoe_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["flashinfer_megamoe_max_tokens_per_rank"]
    configured = i.flashinfer_megamoe_max_tokens_per_rank
    bound = _cutedsl_bound(i, s)
    capacity = configured if configured > 0 else (bound if bound > 0 else 1024)
    source = f"{env}={configured}" if configured > 0 else f"cutedsl_moe_max_num_tokens() = {bound}"
    return _at_least(
        "flashinfer_megamoe.symm_buffer",
        "tokens/rank",
        capacity,
        s.t,
        f"capacity {source} (flashinfer_megamoe.py:146-160); demand max(P, D): {_terms(s)}",
        fix=f"{env}={s.t}",
    )


def _deepgemm_megamoe_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["deepgemm_megamoe_max_tokens_per_rank"]
    capacity = i.deepgemm_megamoe_max_tokens_per_rank
    demand = max(_ceil_to(s.p, s.attn_tp), s.d)
    return _at_least(
        "deepgemm_megamoe.buffer",
        "tokens/rank",
        capacity,
        demand,
        (
            f"capacity {env}={capacity} (mega_moe_hook.py:161-257); demand max(P aligned to attn_tp {s.attn_tp}, D): "
            f"{_terms(s)}"
        ),
        fix=f"{env}={demand}",
    )


def _deepep_ll_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["deepep_max_dispatch_tokens_per_rank"]
    capacity = i.deepep_max_dispatch_tokens_per_rank
    demand = -(-s.d // s.attn_tp)
    ok = demand <= capacity <= DEEPEP_LL_HARD_CAP
    if ok:
        fix = None
    elif demand <= DEEPEP_LL_HARD_CAP:
        fix = f"{env}={demand}"
    else:
        reqs = max(1, DEEPEP_LL_HARD_CAP * s.attn_tp // s.w)
        fix = f"--max-running-requests {reqs * s.attn_dp} and {env}={DEEPEP_LL_HARD_CAP}"
    return BudgetRow(
        buffer="deepep.low_latency",
        unit="tokens/rank",
        capacity=capacity,
        demand=demand,
        formula=(
            f"capacity {env}={capacity}, at most {DEEPEP_LL_HARD_CAP} (deepep.py:404-409); demand ceil(D / attn_tp "
            f"{s.attn_tp}) for every decode/verify batch: {_terms(s)}"
        ),
        ok=ok,
        fix=fix,
    )


def _deepep_v2_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["deepep_v2_max_dispatch_tokens_per_rank"]
    capacity = i.deepep_v2_max_dispatch_tokens_per_rank
    prefill = -(-(s.cps or i.max_prefill_tokens) // s.attn_tp)
    demand = max(prefill, s.d)
    return _at_least(
        "deepep_v2.dispatch",
        "tokens/rank",
        capacity,
        demand,
        (
            f"capacity {env}={capacity} (moe_hook.py:679-706, deepep_v2.py:280-286); demand max(ceil(prefill "
            f"ceiling / attn_tp {s.attn_tp}) = {prefill}, D = {s.d})"
        ),
        fix=f"{env}={demand}",
    )


def _mori_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    env = ENV_CAPS["mori_max_dispatch_tokens_per_rank"]
    capacity = i.mori_max_dispatch_tokens_per_rank
    return _at_least(
        "mori.dispatch",
        "tokens/rank",
        capacity,
        s.t,
        (
            f"capacity {env}={capacity}; demand max(P, D) (upstream checks prefill only, moe_hook.py:566-572): "
            f"{_terms(s)}"
        ),
        fix=f"{env}={s.t}",
    )


def _decode_graph_row(i: BudgetInputs, s: _Shape) -> BudgetRow:
    capacity = i.decode_graph_max_bs * s.w
    demand = s.graph_bs * s.w
    return _at_least(
        "decode_graph.inputs",
        "tokens",
        capacity,
        demand,
        f"capacity max_bs {i.decode_graph_max_bs} x w {s.w} (runner_utils/buffers.py:160-174); demand padded "
        f"bs {s.graph_bs} x w; larger batches run eager (can_run_graph)",
        fix=None,
    )


def _eagle_kv_indices_row(i: BudgetInputs, s: _Shape) -> BudgetRow | None:
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
    s = _shape(inputs)
    rows: list[BudgetRow | None] = []
    if inputs.enable_return_routed_experts:
        rows += _device_cache_rows(inputs, s)
        rows.append(_host_cache_row(inputs))
    rows.append(_indexer_row(inputs, s))
    a2a = inputs.moe_a2a_backend
    if a2a == "flashinfer":
        rows.append(_flashinfer_a2a_row(inputs, s))
    if inputs.moe_runner_backend == "flashinfer_cutedsl" and a2a == "none":
        rows.append(_cutedsl_row(inputs, s))  # A2A path: bounded by the dispatcher, i.e. the row above
    if a2a == "flashinfer_megamoe" or inputs.moe_runner_backend == "flashinfer_megamoe":
        rows.append(_flashinfer_megamoe_row(inputs, s))
    if a2a == "megamoe":
        rows.append(_deepgemm_megamoe_row(inputs, s))
    if a2a == "deepep" and inputs.deepep_mode in ("auto", "low_latency"):
        rows.append(_deepep_ll_row(inputs, s))
    if a2a == "deepep_v2":
        rows.append(_deepep_v2_row(inputs, s))
    if a2a == "mori":
        rows.append(_mori_row(inputs, s))
    if inputs.decode_graph_max_bs:
        rows.append(_decode_graph_row(inputs, s))
    if s.spec:
        rows.append(_eagle_kv_indices_row(inputs, s))
    return [replace(r, corrected=_plugin_covers(r, inputs, s, fixed)) for r in rows if r is not None]


def _plugin_covers(row: BudgetRow, i: BudgetInputs, s: _Shape, fixed: frozenset[str]) -> bool:
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


def _plugin_device_rows(i: BudgetInputs, s: _Shape) -> int:
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
