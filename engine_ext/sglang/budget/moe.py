"""The budget table's MoE rows: the buffers an all-to-all dispatcher or a fused MoE runner sizes at start
(FlashInfer A2A, CuteDSL, FlashInfer and DeepGEMM MegaMoE, DeepEP low-latency and v2, MORI), each against the
tokens one forward can dispatch per rank. Only the selected backend's buffer exists in a server.
"""

from __future__ import annotations

from engine_ext.sglang.budget.terms import (
    DEEPEP_LL_HARD_CAP,
    ENV_CAPS,
    BudgetInputs,
    BudgetRow,
    Shape,
    at_least,
    ceil_to,
    prefill_buffer_tokens,
    terms,
)


def moe_rows(i: BudgetInputs, s: Shape) -> list[BudgetRow]:
    """The rows of the MoE backends this configuration selects (its dispatcher, its runner)."""
    a2a, runner = i.moe_a2a_backend, i.moe_runner_backend
    rows = []
    if a2a == "flashinfer":
        rows.append(_flashinfer_a2a_row(i, s))
    if runner == "flashinfer_cutedsl" and a2a == "none":
        rows.append(_cutedsl_row(i, s))  # A2A path: bounded by the dispatcher, i.e. the row above
    if "flashinfer_megamoe" in (a2a, runner):
        rows.append(_flashinfer_megamoe_row(i, s))
    if a2a == "deepep" and i.deepep_mode in ("auto", "low_latency"):
        rows.append(_deepep_ll_row(i, s))
    by_backend = {"megamoe": _deepgemm_megamoe_row, "deepep_v2": _deepep_v2_row, "mori": _mori_row}
    if a2a in by_backend:
        rows.append(by_backend[a2a](i, s))
    return rows


def flashinfer_a2a_capacity(i: BudgetInputs) -> int:
    """Tokens per rank FlashInfer's a2a workspace is sized for: the env cap, else max(chunk, 4096)."""
    configured = i.flashinfer_max_dispatch_tokens_per_rank
    return configured if configured is not None else max(prefill_buffer_tokens(i), 4096)


def _flashinfer_a2a_row(i: BudgetInputs, s: Shape) -> BudgetRow:
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
    return at_least(
        "flashinfer_a2a.workspace",
        "tokens/rank",
        capacity,
        demand,
        (
            f"capacity {source} (overrides.py:1886-1894){byte_note}; demand ceil(max(P, D) / attn_tp {s.attn_tp}) "
            f"(flashinfer.py:512): {terms(s)}"
        ),
        fix=f"{env}={demand}",
    )


def _cutedsl_bound(i: BudgetInputs, s: Shape) -> int:
    """`cutedsl_moe_max_num_tokens()` of 0.5.23 (runtime_context.py:2050-2069), prefill graph as it counts it."""
    prefill = i.max_prefill_tokens
    if i.prefill_graph_mode == "tc_piecewise":
        prefill = max(prefill, i.prefill_graph_max_tokens)
    return max(prefill, i.decode_graph_max_bs * s.w)


def _cutedsl_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    bound = _cutedsl_bound(i, s)
    capacity = s.num_dp_ranks * bound
    demand = s.gathered * s.t
    return at_least(
        "cutedsl_moe.wrapper",
        "tokens",
        capacity,
        demand,
        (
            f"capacity num_dp_ranks {s.num_dp_ranks} x max(max_prefill_tokens {i.max_prefill_tokens}, "
            f"decode graph bs {i.decode_graph_max_bs} x w {s.w}) (flashinfer_cutedsl.py:335-345; breakable/full "
            f"prefill graphs not counted, runtime_context.py:2066); demand N {s.gathered} x max(P, D): {terms(s)}"
        ),
        fix=f"--max-prefill-tokens {s.t}",
    )


def _flashinfer_megamoe_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    env = ENV_CAPS["flashinfer_megamoe_max_tokens_per_rank"]
    configured = i.flashinfer_megamoe_max_tokens_per_rank
    bound = _cutedsl_bound(i, s)
    capacity = configured if configured > 0 else (bound if bound > 0 else 1024)
    source = f"{env}={configured}" if configured > 0 else f"cutedsl_moe_max_num_tokens() = {bound}"
    return at_least(
        "flashinfer_megamoe.symm_buffer",
        "tokens/rank",
        capacity,
        s.t,
        f"capacity {source} (flashinfer_megamoe.py:146-160); demand max(P, D): {terms(s)}",
        fix=f"{env}={s.t}",
    )


def _deepgemm_megamoe_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    env = ENV_CAPS["deepgemm_megamoe_max_tokens_per_rank"]
    capacity = i.deepgemm_megamoe_max_tokens_per_rank
    demand = max(ceil_to(s.p, s.attn_tp), s.d)
    return at_least(
        "deepgemm_megamoe.buffer",
        "tokens/rank",
        capacity,
        demand,
        (
            f"capacity {env}={capacity} (mega_moe_hook.py:161-257); demand max(P aligned to attn_tp {s.attn_tp}, D): "
            f"{terms(s)}"
        ),
        fix=f"{env}={demand}",
    )


def _deepep_ll_row(i: BudgetInputs, s: Shape) -> BudgetRow:
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
            f"{s.attn_tp}) for every decode/verify batch: {terms(s)}"
        ),
        ok=ok,
        fix=fix,
    )


def _deepep_v2_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    env = ENV_CAPS["deepep_v2_max_dispatch_tokens_per_rank"]
    capacity = i.deepep_v2_max_dispatch_tokens_per_rank
    prefill = -(-(s.cps or i.max_prefill_tokens) // s.attn_tp)
    demand = max(prefill, s.d)
    return at_least(
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


def _mori_row(i: BudgetInputs, s: Shape) -> BudgetRow:
    env = ENV_CAPS["mori_max_dispatch_tokens_per_rank"]
    capacity = i.mori_max_dispatch_tokens_per_rank
    return at_least(
        "mori.dispatch",
        "tokens/rank",
        capacity,
        s.t,
        (
            f"capacity {env}={capacity}; demand max(P, D) (upstream checks prefill only, moe_hook.py:566-572): "
            f"{terms(s)}"
        ),
        fix=f"{env}={s.t}",
    )
