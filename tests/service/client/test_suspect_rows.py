"""Issue 40: a `suspect` record (rows no true route has) is served only on request, and the client raises.

A real sidecar on loopback over a real spool: GET, batch and stream answer 422 `record_suspect` naming the first
bad row, its layer and why, unless asked with `suspect=allow`; `r3_records{state="suspect"}` counts it; the
trainer client raises `SuspectRows` unless `allow_suspect=True`. Inline rows (SGLang's base64, vLLM's `.npy`)
get the same check in the client.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from helpers import live_server, random_rows

from service.client import AsyncRoutedExpertsClient, RoutedExpertsClient, RoutedExpertsRef
from service.client.errors import R3Error, SuspectRows
from service.server.settings import Settings
from service.spool import Spool
from service.spool.record.meta import Suspect

LAYERS = (1, 2, 4)  # MoE layers of a 6-layer model
FINDING = Suspect(row=3, layer=2, reason="repeated", detail="ids [0, 0, 0, 0] repeat an expert")


def put(spool: Spool, rid: str, *, suspect: bool, final: bool = True) -> np.ndarray:
    rows = random_rows(8, len(LAYERS), 4, 64).astype(np.uint8)
    if suspect:
        rows[3:, 1] = 0
    writer = spool.writer(rid, num_experts=64, topk=4, layers=LAYERS, start=10, prompt_len=12, num_hidden_layers=6)
    if suspect:
        writer.mark_suspect(FINDING)
    writer.append(rows)
    if final:
        writer.finalize("ok")
    return rows


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    spool = Spool(tmp_path_factory.mktemp("spool"))
    rows = {"bad": put(spool, "bad", suspect=True), "good": put(spool, "good", suspect=False)}
    rows["live"] = put(spool, "live", suspect=True, final=False)
    with live_server(Settings(spool_dir=spool.root)) as base:
        yield base, rows


def test_the_finding_reads_as_row_position_layer_and_why() -> None:
    words = "row 3 (token position 13), layer 2: repeated (ids [0, 0, 0, 0] repeat an expert)"
    assert FINDING.describe(10) == words


def test_get_refuses_a_suspect_record_unless_asked(sidecar) -> None:
    base, rows = sidecar
    r = httpx.get(f"{base}/routed_experts/bad", timeout=10)
    assert r.status_code == 422 and r.json()["error"] == "record_suspect"
    assert "row 3 (token position 13), layer 2: repeated" in r.json()["detail"]
    r = httpx.get(f"{base}/routed_experts/bad", params={"suspect": "allow", "format": "raw"}, timeout=10)
    assert r.status_code == 200 and r.headers["X-R3-Status"] == "suspect" and r.content == rows["bad"].tobytes()
    assert httpx.get(f"{base}/routed_experts/good", params={"format": "raw"}, timeout=10).status_code == 200
    assert httpx.get(f"{base}/routed_experts/bad", params={"suspect": "yes"}, timeout=10).status_code == 422


def test_batch_and_stream_refuse_it_too(sidecar) -> None:
    base, _ = sidecar
    with RoutedExpertsClient(base) as client:
        bad, good = client.get_many(["bad", "good"])
        assert isinstance(bad, SuspectRows) and "layer 2" in str(bad) and good.rows == 8
        allowed, _ = client.get_many(["bad", "good"], allow_suspect=True)
        assert allowed.status == "suspect" and allowed.rows == 8
        with pytest.raises(SuspectRows, match="row 3"):
            list(client.stream("bad"))
        with pytest.raises(SuspectRows):  # marked while open: refused before the headers
            next(iter(client.stream("live")))
        assert sum(block.rows for block in client.stream("bad", allow_suspect=True)) == 8


def test_client_raises_naming_the_row_unless_asked(sidecar) -> None:
    base, rows = sidecar
    with RoutedExpertsClient(base) as client:
        with pytest.raises(SuspectRows, match=r"bad: record 'bad' is suspect: row 3 .*layer 2") as caught:
            client.get("bad")
        assert isinstance(caught.value, R3Error) and caught.value.status == 422
        got = client.get("bad", allow_suspect=True)
        np.testing.assert_array_equal(got.array, rows["bad"])
        assert got.status == "suspect"
        assert client.fetch_bytes("bad", "raw", allow_suspect=True) == rows["bad"].tobytes()

    async def run() -> None:
        async with AsyncRoutedExpertsClient(base) as client:
            with pytest.raises(SuspectRows):
                await client.get("bad")
            assert (await client.get("bad", allow_suspect=True)).rows == 8

    asyncio.run(run())


def test_refs_pass_the_opt_in(sidecar) -> None:
    base, _ = sidecar
    resp = {"text": "", "meta_info": {"id": "bad", "routed_experts_url": f"{base}/routed_experts/bad"}}
    (ref,) = RoutedExpertsRef.from_response(resp)
    with pytest.raises(SuspectRows):
        ref.fetch()
    assert ref.fetch(allow_suspect=True).rows == 8


def test_metrics_count_suspect_records(sidecar) -> None:
    base, _ = sidecar
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'r3_records{state="suspect"} 1.0' in text


# ---- inline rows: the same check in the client -------------------------------------------------------------


def sglang_response(array: np.ndarray) -> dict:
    """SGLang's `/generate` with inline rows (int32 base64 over every layer) and the plugin's shape."""
    data = base64.b64encode(array.astype(np.int32).tobytes()).decode()
    shape = list(array.shape)
    meta = {"id": "inl", "routed_experts": data, "routed_experts_shape": shape, "routed_experts_start_len": 0}
    return {"text": "", "meta_info": meta}


def sglang_rows(zero_from: int | None = None) -> np.ndarray:
    out = np.zeros((6, 6, 4), dtype=np.int32)  # layers 0, 3, 5 dense: zero slots
    out[:, list(LAYERS)] = random_rows(6, len(LAYERS), 4, 64)
    if zero_from is not None:
        out[zero_from:, 2] = 0
    return out


def test_inline_sglang_rows_are_checked() -> None:
    (good,) = RoutedExpertsRef.from_response(sglang_response(sglang_rows()))
    assert good.fetch().rows == 6  # dense zero slots are no fault
    (bad,) = RoutedExpertsRef.from_response(sglang_response(sglang_rows(zero_from=4)))
    with pytest.raises(SuspectRows, match="row 4, layer 2: repeated") as caught:
        bad.fetch()
    assert caught.value.suspect.row == 4
    assert bad.fetch(allow_suspect=True).rows == 6

    async def run() -> None:
        with pytest.raises(SuspectRows):
            await bad.afetch()

    asyncio.run(run())


def test_every_layer_routing_to_expert_zero_is_suspect() -> None:
    """The Blackwell FlashInfer case: a correctly shaped array, every token "routed to expert 0"."""
    (ref,) = RoutedExpertsRef.from_response(sglang_response(np.zeros((5, 6, 4), np.int32)))
    with pytest.raises(SuspectRows, match="row 0, layer 0: repeated"):
        ref.fetch()


def test_inline_range_needs_the_expert_count() -> None:
    rows = sglang_rows()
    rows[2, 1, 0] = 100  # past 64 experts: only the caller knows
    (unknown,) = RoutedExpertsRef.from_response(sglang_response(rows))
    assert unknown.fetch().rows == 6
    (known,) = RoutedExpertsRef.from_response(sglang_response(rows), num_experts=64)
    with pytest.raises(SuspectRows, match="row 2, layer 1: out_of_range"):
        known.fetch()


def test_inline_vllm_npy_rows_are_checked() -> None:
    array = sglang_rows(zero_from=1).astype(np.uint8)
    buf = io.BytesIO()
    np.save(buf, array)
    resp = {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "", "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
    }
    (ref,) = RoutedExpertsRef.from_response(resp)
    with pytest.raises(SuspectRows, match="row 1, layer 2"):
        ref.fetch()
    np.testing.assert_array_equal(ref.fetch(allow_suspect=True).array, array)
