"""What every engine's records share: the model's shape, a finished record, its spec (built in one place), which
model layers a record holds, and the pointer a response carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

import numpy as np

from service.spool.record.meta import default_dtype, dtype_holds


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


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """Everything a record's metadata needs besides its rows."""

    rid: str
    num_experts: int
    topk: int
    layers: tuple[int, ...]
    start: int
    prompt_len: int
    dtype: str
    engine: str = ""
    weight_version: str | int | None = None
    weight_versions: tuple[tuple[int, str | int], ...] = ()  # (position, version) when the rows span an update
    num_hidden_layers: int | None = None  # the model's layer count: SGLang's payload has this many slots

    @property
    def row_bytes(self) -> int:
        return len(self.layers) * self.topk * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished record as plain values, whichever engine ran it: what the spool gets besides the model's shape.

    `rows` is the engine's array `(rows, num_hidden_layers, topk)` where the engine hands it over at finish
    (vLLM), None where the rows are gathered later (SGLang's host cache) or no forward ran.
    """

    rid: str
    rows: np.ndarray | None
    start: int  # first token position of the rows
    prompt_len: int
    status: str = "ok"  # ok | aborted | error (a record that starts: not final yet)
    weight_version: str | int | None = None
    weight_versions: tuple[tuple[int, str | int], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What every record of one engine shares: expert count, top-k, and which of the engine's layer slots route."""

    num_experts: int
    topk: int
    layers: tuple[int, ...]  # model layer index of each stored layer (Contract 1: dense layers are not stored)
    layer_slots: tuple[int, ...] | None = None  # SGLang's host-cache layer slots to keep (None: all, = layers)
    num_hidden_layers: int | None = None  # the engine's layer slots = the model's layers (its inline payload width)

    def spec(self, fin: Finished, *, dtype: str, engine: str) -> RecordSpec:
        """The one way a record's metadata is built, for both engines and every path (finish, reopen, live)."""
        return RecordSpec(
            rid=fin.rid,
            num_experts=self.num_experts,
            topk=self.topk,
            layers=self.layers,
            start=fin.start,
            prompt_len=fin.prompt_len,
            dtype=dtype,
            engine=engine,
            weight_version=fin.weight_version,
            weight_versions=fin.weight_versions,
            num_hidden_layers=self.num_hidden_layers,
        )


def spool_dtype(configured: str, num_experts: int) -> str:
    """The record dtype: `R3_DTYPE` when set and wide enough, else the smallest that holds every id."""
    if configured in ("", "auto"):
        return default_dtype(num_experts)
    if not dtype_holds(configured, num_experts):
        raise ValueError(f"R3_DTYPE={configured} cannot hold expert id {num_experts - 1}")
    return configured


def compact(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows `(n, layers, topk)` as a C-contiguous array of the spool dtype (a copy unless already so)."""
    return np.ascontiguousarray(rows, dtype=dtype)
