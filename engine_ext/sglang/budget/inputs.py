"""SGLang's launch settings as budget inputs: `ServerArgs` fields, `SGLANG_*` caps and FlashInfer's byte count.

Why apart from `table`: the budget is arithmetic over plain values, testable without SGLang; this module is
where those values come from in a real launch (field names of 0.5.23's `ServerArgs`, its environment caps,
the model config, FlashInfer's own workspace formula), so a change in SGLang's names changes this file only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine_ext.sglang.budget.table import ENV_CAPS, BudgetInputs, flashinfer_a2a_capacity


def flashinfer_workspace_bytes(i: BudgetInputs, max_num_tokens: int) -> int | None:
    """FlashInfer's own byte count (bf16 dispatch payload, flashinfer.py:220-259), when FlashInfer imports."""
    if not (i.hidden_size and i.topk):
        return None
    try:
        from flashinfer.comm import moe_a2a_get_workspace_size_per_rank
    except Exception:  # not installed, or no CUDA build: tokens only
        return None
    return int(
        moe_a2a_get_workspace_size_per_rank(
            ep_size=i.ep_size,
            max_num_tokens=max_num_tokens,
            total_dispatch_payload_size_per_token=i.hidden_size * 2 + i.topk * 8,
            combine_payload_size_per_token=i.hidden_size * 2,
        )
    )


def _get(source: Any, name: str, default: Any = None) -> Any:
    if isinstance(source, Mapping):
        return source.get(name, default)
    return getattr(source, name, default)


def _env_int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return int(raw)


def _graph_phase(server_args: Any, phase: str) -> tuple[str, int]:
    """(backend, max_bs) of one CUDA-graph phase: the resolved config, else the per-phase CLI flags."""
    config = _get(server_args, "cuda_graph_config")
    if config is not None:
        phase_cfg = _get(config, phase)
        backend = str(_get(phase_cfg, "backend") or "disabled")
        largest = max([int(_get(phase_cfg, "max_bs") or 0), *(_get(phase_cfg, "bs") or ())])
        return backend, largest if backend != "disabled" else 0
    backend = _get(server_args, f"cuda_graph_backend_{phase}")
    max_bs = int(_get(server_args, f"cuda_graph_max_bs_{phase}") or 0)
    if _get(server_args, f"disable_{phase}_cuda_graph") or _get(server_args, "disable_cuda_graph"):
        backend = "disabled"
    if backend is None:  # unresolved: the phase runs a graph only when a size was given (CUDA default otherwise)
        backend = ("full" if phase == "decode" else "breakable") if max_bs else "disabled"
    return str(backend), max_bs if backend != "disabled" else 0


def inputs_from_server_args(
    server_args: Any, model_config: Any = None, environ: Mapping[str, str] | None = None
) -> BudgetInputs:
    """Budget inputs from SGLang's public ServerArgs fields (a resolved record, its `resolved_dict()`, or any
    object with those attributes) and the env caps from `environ` (default `os.environ`)."""
    env = os.environ if environ is None else environ
    if hasattr(server_args, "resolved_dict") and callable(server_args.resolved_dict):
        server_args = server_args.resolved_dict()
    values: dict[str, Any] = {
        **_parallelism(server_args),
        **_batching(server_args, model_config),
        **_graphs(server_args),
        **_speculative_and_moe(server_args),
        **_model_fields(getattr(model_config, "hf_text_config", None)),
    }
    defaults = BudgetInputs()
    for field, var in ENV_CAPS.items():
        values[field] = _env_int(env, var, getattr(defaults, field))
    inputs = BudgetInputs(**values)
    if inputs.moe_a2a_backend == "flashinfer":
        nbytes = flashinfer_workspace_bytes(inputs, flashinfer_a2a_capacity(inputs))
        inputs = replace(inputs, flashinfer_a2a_workspace_bytes=nbytes)
    return inputs


def _int(server_args: Any, name: str, default: int) -> int:
    """An integer setting; unset (None, 0) reads as `default`."""
    return int(_get(server_args, name, default) or default)


def _str(server_args: Any, name: str, default: str) -> str:
    return str(_get(server_args, name, default) or default)


def _parallelism(server_args: Any) -> dict[str, Any]:
    """TP/DP/EP/PP sizes; DP attention in its legacy spelling too (`enable_dp_attention` with `dp_size`).

    `model_path` dummy/none stops SGLang's resolution before DP handling, so there the per-rank chunk is
    divided here as `parallel_hook.py:326-331` would.
    """
    attn_dp = _int(server_args, "attn_dp_size", 1)
    if _get(server_args, "enable_dp_attention") and attn_dp == 1:
        attn_dp = _int(server_args, "dp_size", 1)  # legacy spelling, unresolved
    cps = _get(server_args, "chunked_prefill_size")
    dummy = str(_get(server_args, "model_path", "")).lower() in ("dummy", "none")
    if dummy and cps is not None and cps > 0 and attn_dp > 1:
        cps = cps // attn_dp
    tp = _int(server_args, "tp_size", 1)
    return {
        "tp_size": tp,
        "dp_size": _int(server_args, "dp_size", 1) if attn_dp == 1 else 1,
        "attn_dp_size": attn_dp,
        "ep_size": _int(server_args, "ep_size", 1),
        "attn_tp_size": max(1, tp // attn_dp // _int(server_args, "attn_cp_size", 1)),
        "chunked_prefill_size": cps,
        "pp_size": _int(server_args, "pp_size", 1),
    }


def _batching(server_args: Any, model_config: Any) -> dict[str, Any]:
    """What bounds one forward's and the pool's tokens."""
    context = getattr(model_config, "context_len", None) or _get(server_args, "context_length")
    return {
        "max_prefill_tokens": _int(server_args, "max_prefill_tokens", 16384),
        "enable_dynamic_chunking": bool(_get(server_args, "enable_dynamic_chunking", False)),
        "max_running_requests": _get(server_args, "max_running_requests"),
        "context_length": context,
        "max_total_tokens": _get(server_args, "max_total_tokens"),
        "page_size": _int(server_args, "page_size", 1),
    }


def _graphs(server_args: Any) -> dict[str, Any]:
    """The CUDA-graph extents: decode batch size, prefill backend and tokens."""
    _, decode_bs = _graph_phase(server_args, "decode")
    prefill_backend, prefill_bs = _graph_phase(server_args, "prefill")
    return {
        "decode_graph_max_bs": decode_bs,
        "prefill_graph_mode": prefill_backend,
        "prefill_graph_max_tokens": prefill_bs,
    }


def _speculative_and_moe(server_args: Any) -> dict[str, Any]:
    """Speculative decoding's draft shape, the MoE backends, and which captures are on."""
    return {
        "speculative_algorithm": _get(server_args, "speculative_algorithm"),
        "speculative_num_draft_tokens": _get(server_args, "speculative_num_draft_tokens"),
        "speculative_num_steps": _get(server_args, "speculative_num_steps"),
        "speculative_eagle_topk": _get(server_args, "speculative_eagle_topk"),
        "moe_a2a_backend": _str(server_args, "moe_a2a_backend", "none"),
        "moe_runner_backend": _str(server_args, "moe_runner_backend", "auto"),
        "deepep_mode": _str(server_args, "deepep_mode", "auto"),
        "enable_return_routed_experts": bool(_get(server_args, "enable_return_routed_experts", False)),
        "enable_return_indexer_topk": bool(_get(server_args, "enable_return_indexer_topk", False)),
    }


def _model_fields(hf: Any) -> dict[str, Any]:
    """Layers, top-k, hidden size and the indexer's top-k from the HF text config (none: the table does without)."""
    if hf is None:
        return {}
    index_topk = int(getattr(hf, "index_topk", 0) or 0)
    values = {
        "num_layers": getattr(hf, "num_hidden_layers", None),
        "topk": getattr(hf, "num_experts_per_tok", None),
        "hidden_size": getattr(hf, "hidden_size", None),
        "index_topk": index_topk,
    }
    if index_topk:
        values["num_indexer_layers"] = values["num_layers"] or 0
    return values


__all__ = ["flashinfer_workspace_bytes", "inputs_from_server_args"]
