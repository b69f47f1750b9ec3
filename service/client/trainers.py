"""Each RL trainer's routed-experts tensor, built in one copy from the sidecar's compact rows.

Why: every trainer decodes SGLang's inline payload (base64 of int32 rows, `num_hidden_layers` slots, dense
layers as zeros) into an array of its own dtype and layout, and the rest of the trainer only sees that array.
Starting from the spool's `uint8` MoE-only rows, the trainer's array is one zero-filled allocation and one
casting write of the MoE layers, instead of a base64 decode, an int32 array and the trainer's own cast.

Plain numpy (`torch.from_numpy` of the result shares its memory); no trainer is imported. Each function's
docstring names the trainer code it replaces; each trainer's page (docs/trainers/) says what was checked
against that code.
`rows` is a `service.client.RoutedExperts` (or anything with `array`, `layers`, `num_hidden_layers`).

`routed_experts_dtype`: where the trainer's SGLang is new enough to send `meta_info["routed_experts_dtype"]`
(main, `SGLANG_ROUTED_EXPERTS_DTYPE=uint8|uint16`), its decode returns the rows in that dtype (int32 when an id
does not fit, as SGLang's encoder falls back); pass the field and the adapter builds the same array.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from service.wire.formats import sglang_sent_dtype


class Rows(Protocol):
    """What the adapters read of `RoutedExperts`: `array` `(rows, len(layers), topk)`, model layer per slot."""

    @property
    def array(self) -> np.ndarray: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def num_hidden_layers(self) -> int | None: ...


def full_layers(rows: Rows, dtype: np.dtype | str, num_hidden_layers: int | None = None, length: int | None = None):
    """`(max(rows, length), num_hidden_layers, topk)` of `dtype`: the MoE rows at their model layers, zeros elsewhere.

    SGLang's inline layout when `dtype` is int32 and `length` is None. One allocation left unfilled, then each
    byte written once: the MoE rows by one write that casts (a slice when the MoE layers are contiguous, as in
    every all-MoE model), zeros only in the dense layers and the padding rows. Why not `np.zeros`: its calloc
    hands out fresh pages that fault in one by one as the rows land, 5x slower than the cast itself
    (BENCHMARKS.md, "Trainer ingest").
    """
    width = rows.num_hidden_layers if num_hidden_layers is None else num_hidden_layers
    if width is None:
        raise ValueError("the record does not say the model's num_hidden_layers: pass num_hidden_layers=")
    if rows.num_hidden_layers is not None and width != rows.num_hidden_layers:
        raise ValueError(f"num_hidden_layers={width}, but the record's model has {rows.num_hidden_layers}")
    data, layers = rows.array, tuple(rows.layers)
    if layers and max(layers) >= width:
        raise ValueError(f"layer {max(layers)} does not fit num_hidden_layers={width}")
    n = data.shape[0]
    total = n if length is None else max(n, length)
    out = np.empty((total, width, data.shape[2]), dtype=dtype)
    out[n:] = 0
    first = layers[0] if layers else width
    if layers == tuple(range(first, first + len(layers))):
        out[:n, :first] = 0
        out[:n, first : first + len(layers)] = data
        out[:n, first + len(layers) :] = 0
    else:
        dense = np.ones(width, dtype=bool)
        dense[list(layers)] = False
        out[:n, dense] = 0
        out[:n, list(layers)] = data
    return out


def wire_dtype(rows: Rows, routed_experts_dtype: str | None) -> np.dtype:
    """The dtype a trainer's decode of SGLang's payload yields for these rows: int32 without the field."""
    data = rows.array
    return sglang_sent_dtype(routed_experts_dtype, int(data.max()) if data.size else 0)


def verl(rows: Rows, num_hidden_layers: int | None = None, routed_experts_dtype: str | None = None) -> np.ndarray:
    """verl 0.9.1: `(rows, num_hidden_layers, topk)` int32, dense layers as zeros: what its server decode returns.

    Replaces the decode in `SGLangHttpServer.generate` (`verl/workers/rollout/sglang_rollout/
    async_sglang_server.py:681-699`), whose result verl keeps as `TokenOutput.routed_experts`; the resume
    loop (`llm_server.py:308-313`) concatenates those, and `AgentLoopOutput.as_dict` (`agent_loop.py:129-141`)
    casts to int16 and zero-pads to prompt + response. Kept int32 (not int16 at once): `as_dict`'s
    `torch.tensor(array, dtype=torch.int16)` copies an int32 array about twice as fast as an int16 one
    (BENCHMARKS.md, "Trainer ingest").
    """
    return full_layers(rows, wire_dtype(rows, routed_experts_dtype), num_hidden_layers)


def verl_padded(rows: Rows, total_length: int, num_hidden_layers: int | None = None) -> np.ndarray:
    """verl 0.9.1's final tensor: `as_dict`'s `(prompt + response, num_hidden_layers, topk)` int16, zero tail."""
    out = full_layers(rows, np.int16, num_hidden_layers, total_length)
    return out[:total_length]


def areal(rows: Rows, num_hidden_layers: int | None = None, routed_experts_dtype: str | None = None) -> np.ndarray:
    """AReaL 1.0.4: `(rows, num_hidden_layers * topk)` int32, the layer and top-k axes flattened.

    Replaces `SGLangBackend.parse_generation_response`'s decode (`areal/engine/sglang_remote.py:101-110`).
    """
    out = full_layers(rows, wire_dtype(rows, routed_experts_dtype), num_hidden_layers)
    return out.reshape(out.shape[0], -1)


def slime(rows: Rows, num_layers: int | None = None, routed_experts_dtype: str | None = None) -> np.ndarray:
    """slime and miles: `(rows, num_layers, topk)` int32, every layer (Megatron's `args.num_layers`).

    Replaces `decode_int32_meta_array(meta_info, "routed_experts")` and its reshape in slime's
    `Sample._apply_meta_info` (`slime/utils/types.py:352-375`, 624b824), and miles'
    `get_routed_experts_from_response` (`miles/rollout/generate_utils/generate_endpoint_utils.py:115-128`,
    31f1ca9). slime splices a continuation after `existing[:routed_experts_start_len]` itself.
    """
    return full_layers(rows, wire_dtype(rows, routed_experts_dtype), num_layers)


miles = slime
