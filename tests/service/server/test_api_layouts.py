"""SGLang's payload layout for every model, layer ranges, clamped ranges and per-rid batch ranges (live sidecar).

Records here are DeepSeek-V3-shaped where it matters (first layers dense, not stored): the case where
`format=sglang_b64` must rebuild the dense layers as zero rows to match SGLang's `meta_info["routed_experts"]`.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import httpx
import numpy as np
import pybase64
import pytest
from helpers import live_server, random_rows

from service.client import AsyncRoutedExpertsClient, BatchItem, R3Error, RoutedExperts, RoutedExpertsClient
from service.client.errors import BadRequest, RangeNotSatisfiable
from service.server.settings import Settings
from service.spool import Spool
from service.wire.frames import parse_frames

DENSE = 3
NUM_LAYERS = 8  # a small DeepSeek-V3: layers 0-2 dense, 3-7 MoE
MOE = list(range(DENSE, NUM_LAYERS))
TOPK = 4


def sglang_layout(rows: np.ndarray, layers: list[int], num_hidden_layers: int) -> np.ndarray:
    """SGLang's host-cache rows: one slot per model layer, zero where no router ran (built independently here)."""
    out = np.zeros((rows.shape[0], num_hidden_layers, rows.shape[2]), dtype=np.int32)
    for slot, layer in enumerate(layers):
        out[:, layer, :] = rows[:, slot, :]
    return out


def put(
    spool: Spool,
    rid: str,
    n: int,
    *,
    layers: list[int] = MOE,
    num_hidden_layers: int | None = NUM_LAYERS,
    start: int = 0,
    status: str = "ok",
    seed: int = 0,
) -> np.ndarray:
    rows = random_rows(n, layers=len(layers), topk=TOPK, num_experts=256, seed=seed).astype(np.uint8)
    writer = spool.writer(
        rid,
        num_experts=256,
        topk=TOPK,
        layers=layers,
        start=start,
        prompt_len=start + n,
        engine="t/dp0",
        num_hidden_layers=num_hidden_layers,
    )
    if n:
        writer.append(rows)
    writer.finalize(status)
    return rows


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Spool]]:
    root = tmp_path_factory.mktemp("spool")
    with live_server(Settings.model_validate({"spool_dir": root, "chunk_bytes": 4096, "rescan_s": 60})) as base:
        yield base, Spool(root)


def get(base: str, rid: str, **params: object) -> httpx.Response:
    return httpx.get(f"{base}/routed_experts/{rid}", params=params, timeout=30)


# ---- sglang_b64: SGLang's own layout ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1000])
def test_sglang_b64_rebuilds_dense_layers_as_zeros(sidecar: tuple[str, Spool], n: int) -> None:
    base, spool = sidecar
    rows = put(spool, f"dsv3-{n}", n, start=5, seed=n)
    r = get(base, f"dsv3-{n}", format="sglang_b64")
    assert r.status_code == 200, r.text
    want = sglang_layout(rows, MOE, NUM_LAYERS)
    assert r.content == pybase64.b64encode(want.tobytes())
    assert r.headers["x-r3-shape"] == f"{n},{NUM_LAYERS},{TOPK}" and r.headers["x-r3-dtype"] == "int32"
    assert r.headers["x-r3-layers"] == ",".join(map(str, range(NUM_LAYERS)))
    assert r.headers["x-r3-num-hidden-layers"] == str(NUM_LAYERS)
    assert int(r.headers["content-length"]) == len(r.content)
    decoded = np.frombuffer(pybase64.b64decode(r.content), dtype=np.int32).reshape(-1, NUM_LAYERS, TOPK)
    assert not decoded[:, :DENSE].any(), "dense layers are zero rows, as SGLang's capturer leaves them"
    if n > 4:  # every start and end inside the record: a slice of the same layout
        part = get(base, f"dsv3-{n}", format="sglang_b64", start=7, end=9 + n // 2)
        assert part.content == pybase64.b64encode(want[2 : 4 + n // 2].tobytes())


def test_client_layout_equals_server_layout(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    put(spool, "agree", 301, seed=7)
    with RoutedExpertsClient(base) as client:
        r = client.get("agree")
        assert r.num_hidden_layers == NUM_LAYERS and r.layers == tuple(MOE)
        body = client.fetch_bytes("agree", fmt="sglang_b64")
        assert pybase64.b64encode(r.to_sglang_layout().tobytes()) == body
        assert np.array_equal(r.to_sglang_layout(NUM_LAYERS), r.to_sglang_layout())
        with pytest.raises(R3Error, match="num_hidden_layers"):
            r.to_sglang_layout(NUM_LAYERS + 1)


def test_old_records_without_num_hidden_layers(sidecar: tuple[str, Spool]) -> None:
    """Records of older plugins: all-MoE ones still give SGLang's layout; dense+MoE ones say why they cannot."""
    base, spool = sidecar
    all_moe = put(spool, "old-all-moe", 10, layers=[0, 1, 2, 3], num_hidden_layers=None)
    r = get(base, "old-all-moe", format="sglang_b64")
    assert r.status_code == 200 and r.content == pybase64.b64encode(all_moe.astype(np.int32).tobytes())
    assert r.headers["x-r3-num-hidden-layers"] == "4"

    dense = put(spool, "old-dense", 10, num_hidden_layers=None)
    r = get(base, "old-dense", format="sglang_b64")
    assert r.status_code == 422 and r.json()["error"] == "sglang_layout_unknown"
    assert "num_hidden_layers" in r.json()["detail"] and "to_sglang_layout" in r.json()["detail"]
    assert "x-r3-num-hidden-layers" not in get(base, "old-dense").headers
    narrowed = get(base, "old-dense", format="sglang_b64", layers="3,5")  # what it can still do
    assert narrowed.content == pybase64.b64encode(dense[:, [0, 2]].astype(np.int32).tobytes())
    with RoutedExpertsClient(base) as client:
        old = client.get("old-dense")
        with pytest.raises(R3Error, match="num_hidden_layers"):
            old.to_sglang_layout()
        assert np.array_equal(old.to_sglang_layout(NUM_LAYERS), sglang_layout(dense, MOE, NUM_LAYERS))


# ---- layer ranges (pipeline stages) ------------------------------------------------------------------------


def test_layer_range_returns_the_moe_layers_inside(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    rows = put(spool, "stages", 20, seed=3)
    cases = {  # query → model layers returned
        "0-4": [3, 4],  # a first pipeline stage: dense 0-2 plus MoE 3-4
        "5-7": [5, 6, 7],
        "0-100": MOE,
        "6-6": [6],
        "0-4,7": [3, 4, 7],
        "7,0-3": [7, 3],  # order as asked
    }
    for query, want in cases.items():
        r = get(base, "stages", format="raw", layers=query)
        assert r.status_code == 200, (query, r.text)
        assert r.headers["x-r3-layers"] == ",".join(map(str, want))
        assert r.content == rows[:, [MOE.index(x) for x in want]].tobytes(), query
    with RoutedExpertsClient(base) as client:
        stage = client.get("stages", layers="0-4", start=2, end=9)
        assert stage.layers == (3, 4) and stage.start == 2
        np.testing.assert_array_equal(stage.array, rows[2:9, :2])


def test_layer_range_without_moe_layers_is_an_empty_answer(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    put(spool, "dense-stage", 6)
    r = get(base, "dense-stage", layers="0-2")
    assert r.status_code == 200 and r.headers["x-r3-layers"] == "" and r.headers["x-r3-shape"] == f"6,0,{TOPK}"
    got = np.load(io.BytesIO(r.content))
    assert got.shape == (6, 0, TOPK)
    with RoutedExpertsClient(base) as client:
        assert client.get("dense-stage", layers="0-2").array.shape == (6, 0, TOPK)


@pytest.mark.parametrize(
    ("query", "what"),
    [
        ("1", "not in this record"),  # a dense layer named explicitly: a typo must not pass
        ("3,9", "not in this record"),
        ("5-3", "backwards"),
        ("3-5,4", "twice"),
        ("3,3", "repeats"),
        ("0-2,x", "ranges"),
        ("-1", "ranges"),
        ("1-", "ranges"),
    ],
)
def test_bad_layer_queries_say_what_is_wrong(sidecar: tuple[str, Spool], query: str, what: str) -> None:
    base, spool = sidecar
    if spool.read_meta("bad-layers") is None:
        put(spool, "bad-layers", 2)
    r = get(base, "bad-layers", layers=query)
    assert r.status_code == 422 and set(r.json()) == {"error", "detail"}
    assert what in r.json()["detail"], r.json()


# ---- clamp (context parallelism) ---------------------------------------------------------------------------


def test_clamp_returns_the_rows_that_exist(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    rows = put(spool, "cp", 10, start=4, seed=9)  # positions [4, 14)
    assert get(base, "cp", start=8, end=20).status_code == 416, "strict by default"
    assert "clamp=true" in get(base, "cp", start=8, end=20).json()["detail"]
    for (lo, hi), (want_lo, want_hi) in {
        (8, 20): (8, 14),
        (0, 6): (4, 6),
        (0, 100): (4, 14),
        (16, 24): (14, 14),  # a CP rank whose chunk lies wholly past the end: zero rows, well formed
        (5, 9): (5, 9),
    }.items():
        r = get(base, "cp", start=lo, end=hi, clamp="true", format="raw")
        assert r.status_code == 200, r.text
        assert r.headers["x-r3-start"] == str(want_lo) and r.headers["x-r3-shape"] == f"{want_hi - want_lo},5,{TOPK}"
        assert r.headers["x-r3-clamped"] == ("true" if (lo, hi) != (want_lo, want_hi) else "false")
        assert r.content == rows[want_lo - 4 : want_hi - 4].tobytes()
    assert get(base, "cp", start=9, end=8, clamp="true").status_code == 416, "end before start is still wrong"
    r = get(base, "cp", stream="true", clamp="true")
    assert r.status_code == 422 and "clamp" in r.json()["detail"]
    with RoutedExpertsClient(base) as client:
        got = client.get("cp", start=12, end=16, clamp=True)
        assert got.clamped and got.start == 12 and got.rows == 2
        np.testing.assert_array_equal(got.array, rows[8:])
        assert not client.get("cp", start=5, end=6, clamp=True).clamped
        with pytest.raises(RangeNotSatisfiable):
            client.get("cp", start=12, end=16)


# ---- batch: per-rid ranges ---------------------------------------------------------------------------------


def test_batch_per_rid_ranges(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    a = put(spool, "turn-a", 12, seed=1)
    b = put(spool, "turn-b", 30, start=10, seed=2)
    body = {
        "rids": ["turn-a", {"rid": "turn-b", "start": 15, "end": 20}, {"rid": "turn-a", "start": 4}, {"rid": "turn-b"}],
        "layers": "0-4",
    }
    r = httpx.post(f"{base}/routed_experts/batch", json=body)
    assert r.status_code == 200, r.text
    frames = parse_frames(r.content)
    assert [h["status"] for h, _ in frames] == [200, 200, 200, 200]
    assert [(h["start"], h["shape"][0]) for h, _ in frames] == [(0, 12), (15, 5), (4, 8), (10, 30)]
    assert all(h["layers"] == [3, 4] and h["num_hidden_layers"] == NUM_LAYERS for h, _ in frames)
    assert frames[1][1] == b[5:10, :2].tobytes() and frames[2][1] == a[4:, :2].tobytes()

    out = {"rids": [{"rid": "turn-a", "start": 5, "end": 40}, {"rid": "turn-a", "start": 5, "end": 40}]}
    frames = parse_frames(httpx.post(f"{base}/routed_experts/batch", json=out).content)
    assert frames[0][0]["status"] == 416 and "[0, 12)" in frames[0][0]["detail"] and frames[0][1] == b""
    frames = parse_frames(httpx.post(f"{base}/routed_experts/batch", json={**out, "clamp": True}).content)
    assert frames[0][0]["status"] == 200 and frames[0][0]["clamped"] and frames[0][0]["shape"][0] == 7


@pytest.mark.parametrize(
    ("rids", "where"),
    [
        ([{"rid": "x", "start": -1}], "start"),
        ([{"rid": "x", "begin": 1}], "begin"),
        ([{"start": 1}], "rid"),
        ([{"rid": "", "start": 1}], "rid"),
        ([{"rid": "x", "start": "1"}], "start"),
        ([7], "rids"),
    ],
)
def test_batch_bad_items_are_422(sidecar: tuple[str, Spool], rids: list, where: str) -> None:
    base, _ = sidecar
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": rids})
    assert r.status_code == 422 and set(r.json()) == {"error", "detail"} and where in r.json()["detail"], r.json()
    r = httpx.post(f"{base}/routed_experts/batch", json={"rids": ["x"], "layers": "2-1"})
    assert r.status_code == 422 and "backwards" in r.json()["detail"]
    assert httpx.get(f"{base}/healthz").status_code == 200


def test_client_get_many_with_ranges_sync_and_async(sidecar: tuple[str, Spool]) -> None:
    base, spool = sidecar
    a = put(spool, "many-r-a", 9, seed=4)
    b = put(spool, "many-r-b", 9, start=3, seed=5)
    items = ["many-r-a", BatchItem("many-r-b", start=5), ("many-r-a", 2, 4), {"rid": "many-r-b", "end": 20}]
    want = [(a, 0), (b[2:], 5), (a[2:4], 2)]

    def check(results: list[RoutedExperts | R3Error]) -> None:
        for got, (rows, start) in zip(results[:3], want, strict=True):
            assert isinstance(got, RoutedExperts) and got.start == start and got.status == "ok"
            np.testing.assert_array_equal(got.array, rows)
        assert isinstance(results[3], RangeNotSatisfiable)

    with RoutedExpertsClient(base) as client:
        check(client.get_many(items))
        clamped = client.get_many(items[3:], clamp=True, layers=[4])
        assert isinstance(clamped[0], RoutedExperts) and clamped[0].clamped
        np.testing.assert_array_equal(clamped[0].array, b[:, [1]])
        with pytest.raises(BadRequest):
            client.get_many(["many-r-a"], layers="9-1")

    async def main() -> None:
        async with AsyncRoutedExpertsClient(base) as client:
            check(await client.get_many(items))
            r = await client.get("many-r-b", start=10, end=14, clamp=True, layers="0-3")
            assert r.clamped and r.rows == 2 and r.layers == (3,)

    asyncio.run(main())
