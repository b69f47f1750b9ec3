"""The pure encoders: each format decodes back to exactly the rows it was given."""

from __future__ import annotations

import base64
import io

import numpy as np
import orjson
import pybase64
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.wire import formats
from service.wire.frames import frame_header, parse_frames


def _chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos = [], 0
    for size in sizes:
        out.append(data[pos : pos + size])
        pos += size
    out.append(data[pos:])
    return out


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.lists(st.integers(0, 50), max_size=8))
def test_b64_chunked_equals_whole(data: bytes, sizes: list[int]) -> None:
    encoded = b"".join(formats.encode_b64(_chunks(data, sizes)))
    assert encoded == base64.b64encode(data)
    assert len(encoded) == formats.b64_length(len(data))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_sglang_b64_matches_sglang_encoding(dtype: str) -> None:
    """SGLang's detokenizer: `pybase64.b64encode(int32_tensor.numpy().tobytes())`."""
    rows = np.random.default_rng(1).integers(0, 120, size=(37, 5, 3)).astype(dtype)
    chunks = [rows[i : i + 4].tobytes() for i in range(0, 37, 4)]
    body = b"".join(formats.encode("sglang_b64", chunks, dtype=np.dtype(dtype), shape=rows.shape))
    assert body == pybase64.b64encode(rows.astype(np.int32).tobytes())
    assert len(body) == formats.body_length("sglang_b64", np.dtype(dtype), rows.shape)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
@pytest.mark.parametrize("n", [0, 1, 50])
def test_npy_loads_exact(dtype: str, n: int) -> None:
    rows = np.random.default_rng(n).integers(0, 100, size=(n, 4, 8)).astype(dtype)
    chunks = [rows[:10].tobytes(), rows[10:].tobytes()]
    body = b"".join(formats.encode("npy", chunks, dtype=rows.dtype, shape=rows.shape))
    got = np.load(io.BytesIO(body), allow_pickle=False)
    assert got.dtype == rows.dtype and got.shape == rows.shape
    np.testing.assert_array_equal(got, rows)
    assert len(body) == formats.body_length("npy", rows.dtype, rows.shape)


def test_json_streamed_is_valid_and_exact() -> None:
    rows = np.arange(3 * 2 * 2, dtype=np.uint16).reshape(3, 2, 2)
    chunks = [b"", rows[:1].tobytes(), b"", rows[1:].tobytes()]
    body = b"".join(formats.encode("json", chunks, dtype=rows.dtype, shape=rows.shape, head={"rid": "x"}))
    obj = orjson.loads(body)
    assert obj["rid"] == "x" and obj["data"] == rows.tolist()
    empty = orjson.loads(b"".join(formats.encode("json", [], dtype=rows.dtype, shape=(0, 2, 2), head={})))
    assert empty == {"data": []}


def test_layer_subset_gathers_slots_in_request_order() -> None:
    rows = np.random.default_rng(2).integers(0, 50, size=(20, 4, 3)).astype(np.uint8)
    slots = formats.layer_slots([2, 5, 9, 11], [11, 2])
    assert slots == [3, 0]
    got = b"".join(formats.select_layers([rows[:7].tobytes(), rows[7:].tobytes()], rows.dtype, 4, 3, slots))
    assert got == rows[:, [3, 0], :].tobytes()
    assert formats.layer_slots([2, 5], [2, 5]) is None
    with pytest.raises(ValueError, match=r"\[7\]"):
        formats.layer_slots([2, 5], [2, 7])


@pytest.mark.parametrize("text", ["", "1,,2", "a", "1,-2", "1,1", " ", "١"])
def test_parse_layers_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        formats.parse_layers(text)


def test_frames_roundtrip() -> None:
    payload = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    header = {
        "rid": "r",
        "status": 200,
        "dtype": "uint16",
        "shape": [2, 3, 4],
        "start": 5,
        "layers": [0, 1, 2],
        "final": True,
    }
    body = frame_header(header) + payload.tobytes()
    body += frame_header({**header, "status": 404, "shape": [0, 0, 0]})
    frames = parse_frames(body)
    assert frames[0] == (header, payload.tobytes())
    assert frames[1][0]["status"] == 404 and frames[1][1] == b""
    assert int.from_bytes(body[:4], "little") == len(orjson.dumps(header))
