"""Model shapes and realistic routing: top-k of seeded router logits over random hidden states.

Pure functions of their arguments (a seed in, the same rows out), so the inline and sidecar paths, the
server processes and the tests all see the same experts without shipping arrays between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.spool.record.meta import default_dtype

ROUTER_DIM = 32  # small hidden size: the top-k statistics are those of a router, the cost is not a model's


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What routed-experts delivery depends on: layer count, which layers route, experts, top-k."""

    name: str
    num_hidden_layers: int
    first_moe_layer: int
    num_experts: int
    topk: int

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_moe_layer, self.num_hidden_layers))

    @property
    def dtype(self) -> str:
        return default_dtype(self.num_experts)

    def compact_row_bytes(self) -> int:
        return len(self.moe_layers) * self.topk * np.dtype(self.dtype).itemsize

    def inline_row_bytes(self) -> int:
        """SGLang's int32 row over every hidden layer, dense ones as zeros."""
        return self.num_hidden_layers * self.topk * 4


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("Qwen3-30B-A3B", num_hidden_layers=48, first_moe_layer=0, num_experts=128, topk=8),
        ModelShape("DeepSeek-V3", num_hidden_layers=61, first_moe_layer=3, num_experts=256, topk=8),
        ModelShape("Kimi-K2", num_hidden_layers=61, first_moe_layer=1, num_experts=384, topk=8),
    )
}


def routing(shape: ModelShape, rows: int, seed: int) -> np.ndarray:
    """`(rows, moe_layers, topk)` expert ids in the shape's compact dtype, ordered by router score.

    Each layer's router is a seeded `(ROUTER_DIM, experts)` matrix with a per-expert bias (load imbalance);
    the hidden state drifts from layer to layer like a residual stream, so layers are correlated.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, ROUTER_DIM, generator=gen)
    out = np.empty((rows, len(shape.moe_layers), shape.topk), dtype=shape.dtype)
    for j in range(len(shape.moe_layers)):
        weight = torch.randn(ROUTER_DIM, shape.num_experts, generator=gen)
        bias = 0.5 * torch.randn(shape.num_experts, generator=gen)
        hidden = hidden + 0.3 * torch.randn(rows, ROUTER_DIM, generator=gen)
        top = torch.topk(hidden @ weight + bias, shape.topk, dim=1).indices
        out[:, j, :] = top.numpy()
    return out


def relabel(rows: np.ndarray, shape: ModelShape, offset: int) -> np.ndarray:
    """Another record with the same routing statistics: expert ids shifted by `offset` modulo the count."""
    table = ((np.arange(shape.num_experts) + offset) % shape.num_experts).astype(rows.dtype)
    return table[rows]


def inline_layout(shape: ModelShape, compact: np.ndarray) -> torch.Tensor:
    """SGLang's `req.routed_experts`: int32 `(rows, num_hidden_layers, topk)`, zeros for dense layers."""
    out = torch.zeros((compact.shape[0], shape.num_hidden_layers, shape.topk), dtype=torch.int32)
    out[:, shape.first_moe_layer :, :] = torch.from_numpy(compact.astype(np.int32))
    return out
