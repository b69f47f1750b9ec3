"""docs/trainers/, checked: each framework's expected array, rebuilt from its documented behaviour, equals what
the recipe's replacement code makes from the sidecar (live, over a real socket).

The expected arrays are built here from the descriptions on the trainer pages (row count, layer axis, dtype,
padding), starting from SGLang's inline payload as SGLang builds it: int32 rows of `num_hidden_layers` slots,
zero where a layer is dense. Nothing here is taken from the frameworks' code: slime and miles are not on PyPI,
so their adapters (`service.client.trainers.slime`, `.miles`) are checked here against their code as read
(docs/trainers/shared.md cites it). verl's and AReaL's adapters are also run through those frameworks' own ingest code
on a real SGLang server (tests/e2e/test_trainer_ingest.py).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import live_server

from service.client import RoutedExperts, RoutedExpertsClient, trainers
from service.server.settings import Settings
from service.spool import Spool

MODELS = {  # name: (num_hidden_layers, first dense layers, experts, topk)
    "qwen3-moe": (6, 0, 128, 8),
    "deepseek-v3": (8, 3, 256, 8),
}


def sglang_inline(routes: dict[int, np.ndarray], num_hidden_layers: int, rows: int, topk: int) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of int32 `(rows, num_hidden_layers, topk)`, zeros for dense."""
    full = np.zeros((rows, num_hidden_layers, topk), dtype="<i4")
    for layer, ids in routes.items():
        full[:, layer, :] = ids
    return base64.b64encode(full.tobytes()).decode()


def int32s(payload: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(payload), dtype=np.int32)


# ---- the frameworks' expected arrays, from docs/trainers/ -------------------------------------------------


def slime_expected(payload: str, tokens: int, start_len: int, num_layers: int, topk: int, existing=None):
    """`(len(tokens) - 1, num_layers, topk)` int32; a continuation's rows spliced after `existing[:start_len]`."""
    rows = int32s(payload).reshape(tokens - 1 - start_len, num_layers, topk)
    return rows if start_len == 0 else np.concatenate([existing[:start_len], rows])


def verl_expected(payload: str, num_hidden_layers: int, topk: int) -> np.ndarray:
    """`extract_routed_experts_from_meta_info(...).reshape(-1, num_hidden_layers, num_experts_per_tok)`."""
    return int32s(payload).reshape(-1, num_hidden_layers, topk)


def areal_expected(payload: str, prompt_tokens: int, completion_tokens: int) -> np.ndarray:
    """`(prompt_tokens + completion_tokens - 1, num_hidden_layers * topk)` int32."""
    return int32s(payload).reshape(prompt_tokens + completion_tokens - 1, -1)


def nemo_dtype(num_experts: int) -> np.dtype:
    """The narrowest signed dtype holding every expert id (and the -1 sentinel)."""
    return next(np.dtype(t) for t in ("int8", "int16", "int32") if np.iinfo(t).max >= num_experts - 1)


def nemo_expected(moe_routes: np.ndarray, valid_len: int, padded_len: int, num_experts: int) -> np.ndarray:
    """`[padded_len, num_moe_layers, topk]`: routes for `[0, valid_len - 1)`, `arange(topk)` after, -1 if missing."""
    dtype = nemo_dtype(num_experts)
    _, layers, topk = moe_routes.shape
    out = np.empty((padded_len, layers, topk), dtype=dtype)
    for row in range(padded_len):
        if row < min(valid_len - 1, moe_routes.shape[0]):
            out[row] = moe_routes[row]
        elif row < valid_len - 1:
            out[row] = -1
        else:
            out[row] = np.arange(topk)
    return out


# ---- the engine side: what SGLang would return, and the same rows in the spool -----------------------------


class Request:
    """One finished request of a model: its routing per MoE layer, SGLang's payload, and its record."""

    def __init__(self, spool: Spool, rid: str, model: str, prompt: int, output: int, start_len: int = 0, seed=0):
        self.num_hidden_layers, dense, self.experts, self.topk = MODELS[model]
        self.moe = list(range(dense, self.num_hidden_layers))
        self.prompt, self.output, self.start_len = prompt, output, start_len
        n = prompt + output - 1 - start_len
        rng = np.random.default_rng(seed)
        self.routes = {layer: rng.integers(0, self.experts, (n, self.topk)) for layer in self.moe}
        self.payload = sglang_inline(self.routes, self.num_hidden_layers, n, self.topk)
        writer = spool.writer(
            rid,
            num_experts=self.experts,
            topk=self.topk,
            layers=self.moe,
            start=start_len,
            prompt_len=prompt,
            engine="t/dp0",
            num_hidden_layers=self.num_hidden_layers,
        )
        if n:
            writer.append(np.stack([self.routes[x] for x in self.moe], axis=1))
        writer.finalize()

    @property
    def moe_rows(self) -> np.ndarray:
        return np.stack([self.routes[x] for x in self.moe], axis=1)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RoutedExpertsClient, Spool]]:
    root = tmp_path_factory.mktemp("spool")
    with live_server(Settings(spool_dir=root)) as base, RoutedExpertsClient(base) as client:
        yield client, Spool(root)


@pytest.mark.parametrize("model", list(MODELS))
def test_slime_and_miles(sidecar, model: str) -> None:
    client, spool = sidecar
    first = Request(spool, f"slime-{model}", model, prompt=40, output=25, seed=1)
    L, k = first.num_hidden_layers, first.topk
    r = client.get(f"slime-{model}", start=0)
    got = r.to_sglang_layout(L)  # the recipe
    want = slime_expected(first.payload, 65, 0, L, k)
    assert got.dtype == want.dtype == np.int32 and got.shape == want.shape == (64, L, k)
    np.testing.assert_array_equal(got, want)
    # a continuation (multi-turn, miles' Additional R3 patch) sent with start_len = len(checkpoint) - 1
    turn = Request(spool, f"slime-{model}-2", model, prompt=80, output=10, start_len=64, seed=2)
    r2 = client.get(f"slime-{model}-2", start=64)
    assert r2.start == r.end, "the patch starts where the last one ended (miles' merge check)"
    spliced = np.concatenate([got[:64], r2.to_sglang_layout(L)])
    np.testing.assert_array_equal(spliced, slime_expected(turn.payload, 90, 64, L, k, existing=want))
    for adapter in (trainers.slime, trainers.miles):  # the adapters: the same arrays, int32, every layer
        first_rows, patch = adapter(r, L), adapter(r2, L)
        assert first_rows.dtype == patch.dtype == np.int32 and first_rows.shape == (64, L, k)
        np.testing.assert_array_equal(first_rows, want)
        np.testing.assert_array_equal(np.concatenate([first_rows[:64], patch]), spliced)


@pytest.mark.parametrize("model", list(MODELS))
def test_verl(sidecar, model: str) -> None:
    client, spool = sidecar
    req = Request(spool, f"verl-{model}", model, prompt=33, output=17, seed=3)
    got = client.get(f"verl-{model}").to_sglang_layout(req.num_hidden_layers)
    np.testing.assert_array_equal(got, verl_expected(req.payload, req.num_hidden_layers, req.topk))
    assert got.shape[0] == 33 + 17 - 1
    r = client.get(f"verl-{model}")
    ours = trainers.verl(r)  # int32, as verl's server decode returns it
    assert ours.dtype == got.dtype == np.int32 and ours.shape == got.shape
    np.testing.assert_array_equal(ours, got)
    padded = trainers.verl_padded(r, 33 + 17)  # agent_loop.py:131-141: int16, zero rows up to prompt + response
    assert padded.dtype == np.int16 and padded.shape == (50, *got.shape[1:]) and not padded[49:].any()
    np.testing.assert_array_equal(padded[:49], got)


@pytest.mark.parametrize("model", list(MODELS))
def test_areal(sidecar, model: str) -> None:
    client, spool = sidecar
    req = Request(spool, f"areal-{model}", model, prompt=21, output=9, seed=4)
    r = client.get(f"areal-{model}")
    got = r.to_sglang_layout(req.num_hidden_layers).reshape(r.rows, -1)
    want = areal_expected(req.payload, 21, 9)
    assert got.shape == want.shape == (29, req.num_hidden_layers * req.topk)
    np.testing.assert_array_equal(got, want)
    ours = trainers.areal(r)
    assert ours.dtype == want.dtype == np.int32 and ours.shape == want.shape
    np.testing.assert_array_equal(ours, want)
    if req.moe != list(range(req.num_hidden_layers)):
        # why the layout matters: the MoE-only rows reshape without complaint to the wrong width
        moe_only = base64.b64encode(r.array.astype(np.int32).tobytes()).decode()
        assert areal_expected(moe_only, 21, 9).shape[1] != want.shape[1]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("valid", "padded", "delivered"), [(50, 64, 49), (50, 50, 49), (50, 56, 45)])
def test_nemo_rl(sidecar, model: str, valid: int, padded: int, delivered: int) -> None:
    client, spool = sidecar
    rid = f"nemo-{model}-{valid}-{padded}-{delivered}"
    req = Request(spool, rid, model, prompt=30, output=delivered + 1 - 30, seed=5)
    r = client.get(rid)
    dtype, topk = nemo_dtype(req.experts), req.topk
    # the recipe, as written in docs/trainers/nemo-rl.md
    full = np.broadcast_to(np.arange(topk, dtype=dtype), (padded, r.array.shape[1], topk)).copy()
    n = min(r.rows, valid - 1)
    full[:n] = r.array[:n]
    full[n : valid - 1] = -1
    want = nemo_expected(req.moe_rows, valid, padded, req.experts)
    assert full.dtype == want.dtype and full.dtype.kind == "i", "NeMo-RL carries a signed dtype"
    assert full.shape == (padded, len(req.moe), topk), "MoE layers only, one row per padded position"
    np.testing.assert_array_equal(full, want)
    if delivered < valid - 1:
        assert (full[delivered : valid - 1] == -1).all(), "missing routes are the -1 sentinel"
    assert (full[valid - 1 :] == np.arange(topk)).all(), "the final token and the padding take the default route"


def test_sglang_b64_is_int32_whatever_the_spool_dtype(sidecar) -> None:
    """What a decoder reading `routed_experts_dtype` must be told: int32, not the spool's uint8."""
    client, spool = sidecar
    req = Request(spool, "dtype", "deepseek-v3", prompt=5, output=3, seed=6)
    assert client.get("dtype").dtype == "uint8"
    body = client.fetch_bytes("dtype", fmt="sglang_b64")
    assert body.decode() == req.payload
    assert np.frombuffer(base64.b64decode(body), dtype=np.int32).size == 7 * 8 * 8


def rows_of(layers: list[int], num_hidden_layers: int | None, n: int = 7, topk: int = 4) -> RoutedExperts:
    data = np.random.default_rng(len(layers)).integers(0, 256, (n, len(layers), topk), dtype=np.uint8)
    return RoutedExperts("r", data, 0, 3, tuple(layers), True, "uint8", num_hidden_layers=num_hidden_layers)


@pytest.mark.parametrize(
    "layers", [[0, 1, 2, 3], [2, 3], [1, 3], []], ids=["all", "first-dense", "interleaved", "none"]
)
def test_adapters_put_each_layer_at_its_model_index(layers: list[int]) -> None:
    """Every adapter is SGLang's layout in its dtype: slot `j` of the record at model layer `layers[j]`."""
    r = rows_of(layers, 4)
    reference = np.zeros((7, 4, 4), dtype=np.int64)
    reference[:, layers, :] = r.array
    assert np.array_equal(trainers.slime(r), reference) and trainers.slime(r).dtype == np.int32
    assert np.array_equal(trainers.verl(r), reference) and trainers.verl(r).dtype == np.int32
    assert trainers.verl_padded(r, 9).dtype == np.int16 and np.array_equal(trainers.verl_padded(r, 9)[:7], reference)
    assert np.array_equal(trainers.areal(r), reference.reshape(7, 16)) and trainers.areal(r).dtype == np.int32
    assert trainers.slime(r).flags.c_contiguous and trainers.areal(r).base is not None  # areal: a view, no copy


def test_adapters_say_what_is_missing() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        trainers.verl(rows_of([0, 1], None))
    assert trainers.verl(rows_of([0, 1], None), num_hidden_layers=2).shape == (7, 2, 4)
    with pytest.raises(ValueError, match="record's model has 4"):
        trainers.slime(rows_of([0, 1], 4), num_layers=6)
    with pytest.raises(ValueError, match="does not fit"):
        trainers.areal(rows_of([0, 5], None), num_hidden_layers=4)


@pytest.mark.parametrize("layers", [[3, 4, 5, 6, 7], [1, 3, 5, 7]], ids=["first-dense", "interleaved"])
def test_dense_layers_and_padding_are_zero_in_reused_memory(layers: list[int]) -> None:
    """The adapters fill an unzeroed allocation: its dense layers and padding rows must still read 0 after the
    process's heap held other bytes there (the allocator hands freed blocks back; fresh pages would hide it)."""
    rows = np.full((20_000, len(layers), 8), 7, np.uint8)
    r = RoutedExperts("r", rows, 0, 3, tuple(layers), True, "uint8", num_hidden_layers=8)
    for _ in range(4):  # dirty blocks of the adapters' sizes, freed, so the next allocations may reuse them
        for shape, dtype in [((20_000, 8, 8), np.int32), ((20_100, 8, 8), np.int16)]:
            dirty = np.empty(shape, dtype)
            dirty.fill(-1)
            del dirty
        full, padded = trainers.verl(r), trainers.verl_padded(r, 20_100)
        dense = [i for i in range(8) if i not in layers]
        assert not full[:, dense].any() and (full[:, layers] == 7).all()
        assert not padded[20_000:].any() and not padded[:20_000, dense].any()
