"""Every selection answers whole (live sidecar, property-based): formats × routes × layer and row selections ×
records, dense+MoE included.

Each answer is decoded with code that shares nothing with the server's encoders: numpy's own `.npy` reader,
`json`, `base64` + numpy, and a frames parser written here from the wire description. An empty selection (a
pipeline stage of dense layers only, `start == end`) must be a well-formed empty array; a layer range past the
model a 422 naming the model's layers. httpx raises on a body shorter than its Content-Length or an unterminated
chunked body, so a cut answer fails the test too.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from helpers import live_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.server.settings import Settings
from service.spool import Spool


@dataclass(frozen=True)
class Stored:
    """A record as the test wrote it: its rows, stored layers and model layer count."""

    rid: str
    rows: np.ndarray  # (n, len(layers), topk), the record's dtype
    layers: list[int]
    num_hidden_layers: int
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.rows)


def _write(spool: Spool, rid: str, n: int, layers: list[int], model: int, experts: int, start: int) -> Stored:
    rng = np.random.default_rng(len(rid) + n)
    dtype = np.uint8 if experts <= 256 else np.uint16
    rows = rng.integers(0, experts, size=(n, len(layers), 4)).astype(dtype)
    writer = spool.writer(
        rid,
        num_experts=experts,
        topk=4,
        layers=layers,
        start=start,
        prompt_len=start + n,
        engine="t/dp0",
        num_hidden_layers=model,
    )
    if n:
        writer.append(rows)
    writer.finalize("ok")
    return Stored(rid, rows, layers, model, start)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, Stored]]]:
    root = tmp_path_factory.mktemp("spool")
    spool = Spool(root)
    records = [
        _write(spool, "moe", 37, list(range(6)), 6, 128, 0),  # every layer routed (Qwen3-MoE)
        _write(spool, "dsv3", 41, list(range(3, 9)), 9, 256, 5),  # layers 0-2 dense (DeepSeek-V3), a continuation
        _write(spool, "wide", 11, [1, 3, 4, 7], 8, 512, 0),  # dense layers between MoE ones, uint16 ids
        _write(spool, "empty", 0, list(range(2, 6)), 6, 64, 3),  # finished before its first row
    ]
    settings = Settings.model_validate({"spool_dir": root, "chunk_bytes": 4096, "rescan_s": 60})
    with live_server(settings) as base, httpx.Client(base_url=base, timeout=30) as client:
        yield client, {r.rid: r for r in records}


# ---- an independent reading of each answer -------------------------------------------------------------------
def parse_frames(body: bytes) -> list[tuple[dict, bytes]]:
    """`[u32 LE header length][JSON header][payload: prod(shape) × itemsize bytes when status is 200]`…"""
    frames, at = [], 0
    while at < len(body):
        (length,) = struct.unpack_from("<I", body, at)
        header = json.loads(body[at + 4 : at + 4 + length])
        at += 4 + length
        size = int(np.prod(header["shape"])) * np.dtype(header["dtype"]).itemsize if header["status"] == 200 else 0
        frames.append((header, body[at : at + size]))
        at += size
        assert at <= len(body), "frame payload cut"
    return frames


def sglang_payload(stored: Stored, rows: np.ndarray) -> np.ndarray:
    """SGLang's layout: one int32 slot per model layer, zeros where no router ran."""
    out = np.zeros((len(rows), stored.num_hidden_layers, rows.shape[2]), np.int32)
    for slot, layer in enumerate(stored.layers):
        out[:, layer, :] = rows[:, slot, :]
    return out


# ---- selections ------------------------------------------------------------------------------------------------
def _layer_text(draw: st.DrawFn, stored: Stored) -> str | None:
    kind = draw(st.sampled_from(["all", "indices", "range"]))
    if kind == "all":
        return None
    if kind == "indices":
        picked = draw(st.lists(st.sampled_from(stored.layers), min_size=1, unique=True)) if stored.layers else []
        return ",".join(map(str, picked)) if picked else None
    lo = draw(st.integers(0, stored.num_hidden_layers - 1))
    hi = draw(st.integers(lo, stored.num_hidden_layers - 1))
    return f"{lo}-{hi}"


def expected_layers(stored: Stored, text: str | None) -> list[int]:
    if text is None:
        return stored.layers
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return [x for x in stored.layers if lo <= x <= hi]
    return [int(x) for x in text.split(",")]


@st.composite
def cases(draw: st.DrawFn, names: list[str], all_records: dict[str, Stored]) -> tuple[Stored, str | None, int, int]:
    stored = all_records[draw(st.sampled_from(names))]
    text = _layer_text(draw, stored)
    lo = draw(st.integers(stored.start, stored.end))
    hi = draw(st.integers(lo, stored.end))
    return stored, text, lo, hi


ROUTES = ["npy", "raw", "json", "sglang_b64", "frames", "batch"]
NAMES = ["moe", "dsv3", "wide", "empty"]


def _answer(client: httpx.Client, route: str, stored: Stored, text: str | None, lo: int, hi: int) -> tuple:
    """(header-like dict, decoded int array) from one answer, read without the server's code."""
    params: dict[str, str] = {"start": str(lo), "end": str(hi)}
    if text is not None:
        params["layers"] = text
    if route == "batch":
        body = {"rids": [{"rid": stored.rid, "start": lo, "end": hi}], **({"layers": text} if text else {})}
        r = client.post("/routed_experts/batch", json=body)
        assert r.status_code == 200, r.text
        ((header, payload),) = parse_frames(r.content)
        assert header["status"] == 200, header
        return header, np.frombuffer(payload, header["dtype"]).reshape(header["shape"])
    if route == "frames":
        r = client.get(f"/routed_experts/{stored.rid}", params={**params, "stream": "true"})
        assert r.status_code == 200, r.text
        frames = parse_frames(r.content)
        assert frames and frames[-1][0]["final"] and all(h["status"] == 200 for h, _ in frames), frames
        parts = [np.frombuffer(p, h["dtype"]).reshape(h["shape"]) for h, p in frames]
        assert all(h["layers"] == frames[0][0]["layers"] for h, _ in frames)
        return frames[0][0], np.concatenate(parts) if parts else None
    r = client.get(f"/routed_experts/{stored.rid}", params={**params, "format": route})
    assert r.status_code == 200, r.text
    if "content-length" in r.headers:
        assert int(r.headers["content-length"]) == len(r.content)
    shape = [int(x) for x in r.headers["x-r3-shape"].split(",")]
    header = {"shape": shape, "layers": [int(x) for x in r.headers["x-r3-layers"].split(",") if x]}
    if route == "npy":
        return header, np.load(io.BytesIO(r.content), allow_pickle=False)
    if route == "raw":
        return header, np.frombuffer(r.content, r.headers["x-r3-dtype"]).reshape(shape)
    if route == "json":
        return header, json.loads(r.content)["data"]
    return header, np.frombuffer(base64.b64decode(r.content, validate=True), "<i4").reshape(shape)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), route=st.sampled_from(ROUTES))
def test_every_selection_answers_whole(sidecar: tuple[httpx.Client, dict[str, Stored]], data, route: str) -> None:
    client, records = sidecar
    stored, text, lo, hi = data.draw(cases(NAMES, records))
    header, got = _answer(client, route, stored, text, lo, hi)
    layers = expected_layers(stored, text)
    rows = stored.rows[lo - stored.start : hi - stored.start][:, [stored.layers.index(x) for x in layers], :]
    if route == "sglang_b64" and text is None:  # SGLang's own payload: every model layer, dense ones zero
        want = sglang_payload(stored, rows)
        assert header["layers"] == list(range(stored.num_hidden_layers))
    else:
        want = rows.astype(np.int32) if route == "sglang_b64" else rows
        assert header["layers"] == layers
    assert list(header["shape"]) == list(want.shape) or route == "frames"
    if route == "json":
        assert got == want.tolist()
    elif route == "frames" and got is None:
        assert want.size == 0
    else:
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(NAMES),
    past=st.integers(0, 50),
    width=st.integers(0, 5),
    route=st.sampled_from(["npy", "json", "sglang_b64", "frames", "batch"]),
)
def test_a_range_past_the_model_is_refused_naming_its_layers(
    sidecar: tuple[httpx.Client, dict[str, Stored]], name: str, past: int, width: int, route: str
) -> None:
    client, records = sidecar
    stored = records[name]
    lo = stored.num_hidden_layers + past
    text = f"{lo}-{lo + width}"
    if route == "batch":
        r = client.post("/routed_experts/batch", json={"rids": [stored.rid], "layers": text})
        assert r.status_code == 200
        ((header, payload),) = parse_frames(r.content)
        status, detail = header["status"], header["detail"]
        assert payload == b""
    else:
        params = {"layers": text, **({"stream": "true"} if route == "frames" else {"format": route})}
        r = client.get(f"/routed_experts/{stored.rid}", params=params)
        status, detail = r.status_code, r.json()["detail"]
    assert status == 422
    assert f"0-{stored.num_hidden_layers - 1}" in detail and text in detail


@pytest.mark.parametrize(
    ("query", "named"),
    [("fromat=json", "fromat (did you mean format?)"), ("layer=0-2", "layer (did you mean layers?)"), ("x=1", "x")],
)
def test_an_unknown_query_parameter_is_a_422_naming_it(
    sidecar: tuple[httpx.Client, dict[str, Stored]], query: str, named: str
) -> None:
    client, _ = sidecar
    for method, path in (("GET", "/routed_experts/moe"), ("GET", "/v1/engines"), ("DELETE", "/routed_experts/no")):
        r = client.request(method, f"{path}?{query}")
        assert r.status_code == 422, (method, path, r.text)
        assert r.json()["error"] == "unknown_parameter", r.text
        assert (named if path.endswith("moe") else query.split("=")[0]) in r.json()["detail"]
    assert client.get("/routed_experts/moe?format=json&end=1").status_code == 200  # the known ones still pass
