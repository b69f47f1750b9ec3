"""Helpers a `compat.Layout` names where SGLang has no function of its own (mostly older SGLangs), in 0.5.23's terms.

Each is named by a version's row in `compat.LAYOUTS` (as data) and looked up through `compat.function` or
`compat.read`; no hook body calls one directly, so none holds a version check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def slot_in_by_attention_dp_rank(per_rank: Sequence[int]) -> int:
    """`dp_slot_in` where SGLang has none (≤ 0.5.20): a per-replica list's entry is the attention-DP rank's."""
    if len(per_rank) == 1:
        return 0
    from sglang.srt.layers.dp_attention import get_attention_dp_rank

    return get_attention_dp_rank()


def server_args_as_resolved(server_args: Any) -> Any:
    """`resolving_view` where there is no resolution pipeline (≤ 0.5.16): a ServerArgs is resolved when built."""
    return server_args


def model_config_from_server_args(server_args: Any) -> Any:
    """`model_config_of` where SGLang has none (≤ 0.5.16)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(server_args)


def host_copies_by_map(out: Any) -> None:
    """A `TopkCaptureOutput`'s device tensors to the host, synchronously (`map_device_tensors`, ≥ 0.5.16)."""
    out.map_device_tensors(lambda t: t.cpu())


def host_copies_by_fields(out: Any) -> None:
    """The same where `TopkCaptureOutput` has only its two tensor fields (≤ 0.5.12)."""
    out.out_cache_loc = out.out_cache_loc.cpu()
    out.topk = out.topk.cpu()


def graph_config_from_flags() -> Any:
    """0.5.23's `cuda_graph_config` shape (per phase: backend, max_bs, bs) from ≤ 0.5.12's flat flags: decode
    graphs unless `disable_cuda_graph`, piecewise prefill graphs up to `piecewise_cuda_graph_max_tokens`."""
    from types import SimpleNamespace

    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    decode_on, prefill_on = not args.disable_cuda_graph, not args.disable_piecewise_cuda_graph
    return SimpleNamespace(
        decode=SimpleNamespace(
            backend="full" if decode_on else "disabled", max_bs=args.cuda_graph_max_bs, bs=args.cuda_graph_bs
        ),
        prefill=SimpleNamespace(
            backend="tc_piecewise" if prefill_on else "disabled",
            max_bs=args.piecewise_cuda_graph_max_tokens,
            bs=args.piecewise_cuda_graph_tokens,
        ),
    )


def no_replica_rank() -> None:
    """The DP replica rank where SGLang publishes none to the model process (≤ 0.5.16): unknown."""
    return None


def no_rust_server() -> bool:
    """Where SGLang has no Rust HTTP front end (≤ 0.5.16): the Python tokenizer manager always serves."""
    return False


def moe_input_scattered_without_dwdp() -> bool:
    """`is_moe_input_scattered_across_dp_ranks` where SGLang has none (≤ 0.5.16, which has no DWDP either)."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend, should_use_flashinfer_cutlass_moe_fp4_allgather

    return not get_moe_a2a_backend().is_none() or bool(should_use_flashinfer_cutlass_moe_fp4_allgather())
