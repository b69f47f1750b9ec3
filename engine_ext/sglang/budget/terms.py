"""The budget table's terms: what a configuration is (`BudgetInputs`), one row (`BudgetRow`), and the per-rank
shape of the worst forward every row's arithmetic starts from (`Shape`, `shape_of`).

Conventions: "per rank" means one attention-DP rank (one scheduler). Pure arithmetic over plain values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MRR_ESTIMATE = 4096  # upper end of SGLang's per-worker estimate when --max-running-requests is unset


DEEPEP_LL_HARD_CAP = 1024  # deepep.py:409 asserts the low-latency cap <= 1024 (FINISHED_SUM_TAG)


INT32_LIMIT = 2**31  # spec_utils.py:304 asserts num_seqs * topk * max_context_len < 2**31


EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "FROZEN_KV_MTP"})


SCATTERED_A2A = frozenset({"deepep", "deepep_v2"})  # routed_experts.py:25-28: tokens scattered over attn-TP


@dataclass(frozen=True)
class BudgetInputs:
    """The plain values the budget depends on; build with `budget.inputs.inputs_from_server_args` or by hand."""

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
    # FlashInfer not importable); `budget.inputs` asks FlashInfer, so this module stays arithmetic.
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


def at_least(buffer: str, unit: str, capacity: int, demand: int, formula: str, fix: str | None) -> BudgetRow:
    """A row whose one rule is capacity ≥ demand; `fix` is offered only when that fails."""
    ok = capacity >= demand
    return BudgetRow(buffer, unit, capacity, demand, formula, ok, None if ok else fix)


@dataclass(frozen=True)
class Shape:
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


def prefill_buffer_tokens(i: BudgetInputs) -> int:
    """`max_prefill_buffer_tokens()` (overrides.py:1865-1883): the chunk, or PP dynamic chunking's ceiling; 0 if off."""
    chunk = i.chunked_prefill_size if i.chunked_prefill_size and i.chunked_prefill_size > 0 else 0
    if chunk and i.enable_dynamic_chunking and i.pp_size > 1:
        return max(chunk, i.max_prefill_tokens, -(-chunk * 5 // 4))
    return chunk


def shape_of(i: BudgetInputs) -> Shape:
    attn_dp = max(1, i.attn_dp_size)
    attn_tp = i.attn_tp_size or max(1, i.tp_size // attn_dp)
    spec = bool(i.speculative_algorithm)
    w = max(1, i.speculative_num_draft_tokens or 1) if spec else 1
    mrr_known = i.max_running_requests is not None
    mrr_worker = max(1, i.max_running_requests // attn_dp) if mrr_known else MRR_ESTIMATE
    cps = prefill_buffer_tokens(i)
    # Without chunking one prefill forward takes a whole prompt: up to max(max_prefill_tokens, context).
    p_eager = cps if cps else max(i.max_prefill_tokens, i.context_length or 0)
    p_graph = i.prefill_graph_max_tokens if i.prefill_graph_mode != "disabled" else 0
    graph_bs = min(i.decode_graph_max_bs, mrr_worker) if mrr_known else i.decode_graph_max_bs
    decode_reqs = mrr_worker if mrr_known else max(graph_bs, MRR_ESTIMATE)
    gathered = attn_dp if attn_dp > 1 and i.moe_a2a_backend not in SCATTERED_A2A else 1
    return Shape(
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


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def terms(s: Shape) -> str:
    """The per-rank worst case in words, shared by most formulas."""
    prefill = f"P={s.p} (chunk {s.cps})" if s.cps else f"P={s.p} (no chunking: max(max_prefill_tokens, context))"
    if s.p_graph > s.p_eager:
        prefill = f"P={s.p} (prefill graph bucket)"
    mrr = f"{s.mrr_worker}" if s.mrr_known else f"{s.decode_reqs} (estimate: pin --max-running-requests)"
    return f"{prefill}; decode/verify D=reqs {mrr} x w {s.w} = {s.d}"


def chunk_need(i: BudgetInputs, s: Shape) -> int:
    """Per-rank chunk that makes `max(chunk, mrr)` cover every forward: decode/verify, prefill graph, the chunk.

    With chunking off, the operator's own prefill batch budget (`--max-prefill-tokens`) is the chunk offered.
    """
    return max(s.d, s.p_graph, s.cps or i.max_prefill_tokens)


def chunk_fix(i: BudgetInputs, s: Shape, need_rank: int) -> str:
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
