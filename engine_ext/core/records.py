"""What every engine's records share: which model layers a record holds, and the pointer a response carries."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import quote


def moe_layer_ids(
    num_layers: int,
    *,
    first_k_dense: int = 0,
    sparse_step: int = 1,
    mlp_only: Iterable[int] = (),
) -> tuple[int, ...]:
    """Model layers that route (DESIGN: dense layers are not stored), from the HF config's own fields.

    `first_k_dense` (DeepSeek `first_k_dense_replace`), `sparse_step` and `mlp_only` (Qwen-MoE
    `decoder_sparse_step`, `mlp_only_layers`): a layer is kept unless one of them makes it dense.
    """
    dense = set(mlp_only)
    step = max(int(sparse_step or 1), 1)
    return tuple(i for i in range(num_layers) if i >= first_k_dense and i not in dense and (i + 1) % step == 0)


def routed_experts_url(base: str, rid: str) -> str:
    """The pointer a response carries: `<R3_SIDECAR_URL>/routed_experts/<percent-encoded rid>`."""
    return f"{base.rstrip('/')}/routed_experts/{quote(rid, safe='')}"
