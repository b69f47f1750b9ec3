"""SGLang's next wire: `SGLANG_ROUTED_EXPERTS_DTYPE` and `meta_info["routed_experts_dtype"]` (SGLang main, after
0.5.23), honoured by refs, `format=sglang_b64` and the trainer adapters.

The payloads here are built the way SGLang main builds them (read at sgl-project/sglang a6463a10,
`python/sglang/srt/state_capturer/routed_experts_wire.py`, `encode_routed_experts_for_wire`, called per request
by `DetokenizerManager._b64_encode_routed_experts`): the host cache's int32 rows (one slot per model layer, dense
layers zero) cast to the configured dtype unless an id falls outside it (then int32 is kept), flattened C order,
base64; the dtype actually sent is what the response advertises. Written here from that reading, not imported.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import live_server

from service.client import RoutedExpertsClient, RoutedExpertsRef, trainers
from service.server.settings import Settings
from service.spool import Spool

TOPK = 4
# Loopback answers in about 0.1 s; a whole run beside engine servers once stalled one past httpx's default 5 s.
HTTP_TIMEOUT = 60.0


def sglang_main_payload(host_rows: np.ndarray, configured: str) -> tuple[str, str]:
    """(base64 payload, advertised dtype) as SGLang main's encoder makes them from its int32 host rows."""
    target = {"int32": np.int32, "uint16": np.uint16, "uint8": np.uint8}[configured]
    if np.dtype(target).kind == "u" and host_rows.size:
        info = np.iinfo(target)
        if host_rows.min() < info.min or host_rows.max() > info.max:
            target = np.int32
    wire = host_rows.astype(target)
    return base64.b64encode(wire.tobytes()).decode(), np.dtype(target).name


def host_layout(rows: np.ndarray, layers: list[int], num_hidden_layers: int) -> np.ndarray:
    out = np.zeros((rows.shape[0], num_hidden_layers, rows.shape[2]), np.int32)
    out[:, layers, :] = rows
    return out


CASES = {  # rid → (stored MoE layers, model layers, experts, largest id written)
    "dense3-uint8": (list(range(3, 8)), 8, 256, 255),  # DeepSeek-V3-like: 0-2 dense, ids fit uint8
    "wide-fits": (list(range(6)), 6, 512, 200),  # 512 experts, but this answer's ids all fit uint8
    "wide-overflows": (list(range(6)), 6, 512, 511),  # an id past 255: SGLang falls back to int32
    "big": (list(range(1, 4)), 4, 70000, 69999),  # past uint16 as well
}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    root = tmp_path_factory.mktemp("spool")
    spool = Spool(root)
    stored = {}
    for i, (rid, (layers, model, experts, top)) in enumerate(CASES.items()):
        scores = np.random.default_rng(i).random((9, len(layers), top + 1))
        rows = np.argsort(scores, axis=-1)[..., :TOPK]  # distinct ids per row: true routes (the client checks)
        if top not in rows[0, 0]:
            rows[0, 0, 0] = top
        writer = spool.writer(
            rid,
            num_experts=experts,
            topk=TOPK,
            layers=layers,
            prompt_len=5,
            engine="t/dp0",
            num_hidden_layers=model,
        )
        writer.append(rows)
        writer.finalize("ok")
        stored[rid] = rows
    with live_server(Settings.model_validate({"spool_dir": root, "chunk_bytes": 4096})) as base:
        yield base, stored


@pytest.mark.parametrize("configured", ["int32", "uint16", "uint8"])
@pytest.mark.parametrize("rid", list(CASES))
def test_sglang_b64_is_sglang_mains_payload_byte_for_byte(sidecar, rid: str, configured: str) -> None:
    base, stored = sidecar
    layers, model, _experts, _top = CASES[rid]
    payload, advertised = sglang_main_payload(host_layout(stored[rid], layers, model), configured)
    r = httpx.get(
        f"{base}/routed_experts/{rid}",
        params={"format": "sglang_b64", "sglang_dtype": configured},
        timeout=HTTP_TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.text == payload and r.headers["x-r3-dtype"] == advertised
    assert int(r.headers["content-length"]) == len(payload)
    legacy = httpx.get(f"{base}/routed_experts/{rid}", params={"format": "sglang_b64"}, timeout=HTTP_TIMEOUT)
    assert legacy.text == sglang_main_payload(host_layout(stored[rid], layers, model), "int32")[0]


def test_sglang_dtype_is_refused_where_it_means_nothing(sidecar) -> None:
    base, _ = sidecar
    for params in ({"format": "npy", "sglang_dtype": "uint8"}, {"stream": "true", "sglang_dtype": "uint8"}):
        r = httpx.get(f"{base}/routed_experts/dense3-uint8", params=params, timeout=HTTP_TIMEOUT)
        assert r.status_code == 422 and "sglang_b64" in r.json()["detail"]
    r = httpx.get(
        f"{base}/routed_experts/dense3-uint8",
        params={"format": "sglang_b64", "sglang_dtype": "int8"},
        timeout=HTTP_TIMEOUT,
    )
    assert r.status_code == 422


@pytest.mark.parametrize("configured", ["int32", "uint16", "uint8", None])
@pytest.mark.parametrize("rid", list(CASES))
def test_refs_decode_inline_rows_in_the_dtype_the_response_names(sidecar, rid: str, configured: str | None) -> None:
    """`from_response` on a response carrying SGLang main's inline payload (no pointer): the rows come back in the
    advertised dtype; without the field (every release to 0.5.23) they are int32, as before."""
    _, stored = sidecar
    layers, model, _experts, _top = CASES[rid]
    host = host_layout(stored[rid], layers, model)
    payload, advertised = sglang_main_payload(host, configured or "int32")
    meta = {"id": rid, "routed_experts": payload, "prompt_tokens": 5, "completion_tokens": 5}
    if configured is not None:
        meta["routed_experts_dtype"] = advertised
    (ref,) = RoutedExpertsRef.from_response({"meta_info": meta}, num_hidden_layers=model, topk=TOPK)
    got = ref.fetch()
    assert got.array.dtype == np.dtype(advertised) and np.array_equal(got.array, host)


def test_refs_refuse_a_dtype_sglang_never_sends() -> None:
    meta = {"id": "x", "routed_experts": base64.b64encode(bytes(8)).decode(), "routed_experts_dtype": "float32"}
    (ref,) = RoutedExpertsRef.from_response({"meta_info": meta}, num_hidden_layers=1, topk=2)
    with pytest.raises(Exception, match="routed_experts_dtype='float32'"):
        ref.fetch()


@pytest.mark.parametrize("configured", ["uint16", "uint8"])
@pytest.mark.parametrize("rid", list(CASES))
def test_trainer_adapters_build_what_their_decode_of_sglang_main_returns(sidecar, rid: str, configured: str) -> None:
    """verl, AReaL and slime decode SGLang's payload with the advertised dtype (SGLang main's
    `extract_routed_experts_from_meta_info`); given the field, each adapter's array equals that decode."""
    base, stored = sidecar
    layers, model, _experts, _top = CASES[rid]
    payload, advertised = sglang_main_payload(host_layout(stored[rid], layers, model), configured)
    decoded = np.frombuffer(base64.b64decode(payload), dtype=advertised).reshape(-1, model, TOPK)
    with RoutedExpertsClient(base) as client:
        rows = client.get(rid)
    for got in (
        trainers.verl(rows, routed_experts_dtype=advertised),
        trainers.slime(rows, routed_experts_dtype=advertised),
    ):
        assert got.dtype == decoded.dtype and np.array_equal(got, decoded)
    flat = trainers.areal(rows, routed_experts_dtype=advertised)
    assert flat.dtype == decoded.dtype and np.array_equal(flat, decoded.reshape(decoded.shape[0], -1))
    assert trainers.verl(rows).dtype == np.int32  # without the field: every release's int32
