"""Body encoders for Contract 2: pure functions from row bytes to response bytes, chunk by chunk.

Every encoder takes an iterator of whole-row chunks (C order, the record's dtype, already narrowed to
the requested layers) and yields body chunks, so a large record is never held whole in memory. The
callers (`service.server.fetch`, `service.server.stream`, `service.server.batch`) own the I/O; nothing here
touches a file or a socket.
"""

from __future__ import annotations

import binascii
import functools
import io
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import orjson

try:  # SIMD base64 (SGLang's own choice) when installed; the stdlib gives the same bytes, slower
    from pybase64 import b64encode as _b64encode
except ImportError:  # pragma: no cover - depends on the environment

    def _b64encode(data: bytes | memoryview) -> bytes:
        return binascii.b2a_base64(data, newline=False)


Format = Literal["npy", "raw", "json", "sglang_b64"]
FORMATS: tuple[str, ...] = ("npy", "raw", "json", "sglang_b64")
MEDIA_TYPES: dict[str, str] = {
    "npy": "application/x-npy",
    "raw": "application/octet-stream",
    "json": "application/json",
    "sglang_b64": "text/plain; charset=utf-8",
}
SGLANG_DTYPE = np.dtype("<i4")
SGLANG_WIRE_DTYPES: dict[str, np.dtype] = {"int32": SGLANG_DTYPE, "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
"""SGLang's `SGLANG_ROUTED_EXPERTS_DTYPE` choices (main, after 0.5.23): `meta_info["routed_experts_dtype"]` names
the one a payload was sent in; a payload without it is int32 (every release up to 0.5.23)."""


def sglang_wire_dtype(name: str | None) -> np.dtype:
    """The numpy dtype of an SGLang payload whose `routed_experts_dtype` is `name` (None: int32)."""
    key = "int32" if name is None else str(name).strip().lower()
    if key not in SGLANG_WIRE_DTYPES:
        raise ValueError(f"routed_experts_dtype={name!r}: SGLang sends {', '.join(SGLANG_WIRE_DTYPES)}")
    return SGLANG_WIRE_DTYPES[key]


def sglang_sent_dtype(asked: str | None, max_id: int) -> np.dtype:
    """The dtype SGLang's encoder actually sends for ids up to `max_id` when `asked` is configured: the unsigned
    one when every id fits it, else int32 (its fallback, so no id is ever wrapped)."""
    dtype = sglang_wire_dtype(asked)
    return dtype if dtype.kind != "u" or max_id <= np.iinfo(dtype).max else SGLANG_DTYPE


# ---- layers -----------------------------------------------------------------------------------
LayerItem = int | tuple[int, int]
"""One item of a `layers` query: a model layer index, or an inclusive model-layer range `(lo, hi)`."""


def parse_layers(text: str) -> list[LayerItem]:
    """`"0,3,5"` → `[0, 3, 5]`; `"0-15"` → `[(0, 15)]` (a pipeline stage's model-layer range, inclusive).

    Raises ValueError with a message a client can act on.
    """
    items: list[LayerItem] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or not lo.isascii() or (dash and (not hi.isdigit() or not hi.isascii())):
            raise ValueError(
                f"layers={text!r}: want a comma list of model layer indices or inclusive ranges, e.g. 0,1,5 or 0-15"
            )
        if not dash:
            items.append(int(lo))
        elif int(lo) > int(hi):
            raise ValueError(f"layers={text!r}: range {part} is backwards (want lo-hi with lo <= hi)")
        else:
            items.append((int(lo), int(hi)))
    if len(set(items)) != len(items):
        raise ValueError(f"layers={text!r}: an item repeats")
    return items


def resolve_layers(
    record_layers: Sequence[int], items: Sequence[LayerItem], num_hidden_layers: int | None = None
) -> list[int]:
    """The model layers a query names in a record: each index as given, each range as the stored layers inside it.

    An index must be a layer the record holds (a typo must not pass silently); a range may hold none (a pipeline
    stage of dense layers only gets an empty answer) but must start inside the model: `100-200` on a 48-layer model
    names another model, not an empty stage (`40-63`, a last stage split evenly, keeps layers 40-47). The model's
    layers are `num_hidden_layers` when the record says so, else those up to its last stored one. Raises
    ValueError naming what is wrong.
    """
    held = set(record_layers)
    missing = [x for x in items if isinstance(x, int) and x not in held]
    if missing:
        raise ValueError(f"layers {missing} are not in this record (it holds {_layer_text(record_layers)})")
    model = num_hidden_layers if num_hidden_layers is not None else max(record_layers, default=-1) + 1
    outside = [x for x in items if isinstance(x, tuple) and x[0] >= model]
    if outside:
        raise ValueError(
            f"layers {format_layer_items(outside)} lie outside the model's layers 0-{model - 1} "
            f"(this record holds {_layer_text(record_layers)})"
        )
    out: list[int] = []
    for item in items:
        out.extend([item] if isinstance(item, int) else [x for x in record_layers if item[0] <= x <= item[1]])
    if len(set(out)) != len(out):
        raise ValueError(f"layers {format_layer_items(items)} name a layer twice (the items overlap)")
    return out


def format_layer_items(items: Sequence[LayerItem]) -> str:
    """The query text of `items` (the inverse of `parse_layers`)."""
    return ",".join(str(x) if isinstance(x, int) else f"{x[0]}-{x[1]}" for x in items)


def _layer_text(layers: Sequence[int]) -> str:
    """`[0, 1, 2, 3, 7]` → `0-3,7`: a record's layers, short enough for an error message."""
    runs: list[list[int]] = []
    for x in layers:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def layer_slots(record_layers: Sequence[int], wanted: Sequence[int] | None) -> list[int] | None:
    """Slot index of each wanted model layer in a row, or None for all of them (no gather needed).

    Raises ValueError naming the layers the record does not hold.
    """
    if wanted is None:
        return None
    position = {layer: slot for slot, layer in enumerate(record_layers)}
    missing = [layer for layer in wanted if layer not in position]
    if missing:
        raise ValueError(f"layers {missing} are not in this record (it holds {list(record_layers)})")
    slots = [position[layer] for layer in wanted]
    return None if slots == list(range(len(record_layers))) else slots


def as_bytes(array: np.ndarray) -> memoryview | bytes:
    """A C-contiguous array's bytes without a copy (`memoryview.cast` refuses a shape with a zero in it)."""
    return array.data.cast("B") if array.size else b""


def select_layers(
    chunks: Iterable[bytes], dtype: np.dtype, num_layers: int, topk: int, slots: list[int] | None
) -> Iterator[bytes]:
    """Narrow each chunk of whole rows to the given layer slots (one numpy gather per chunk)."""
    if slots is None:
        yield from chunks
        return
    first, count = slots[0] if slots else 0, len(slots)
    # A contiguous run (a pipeline stage's layers) is a strided copy, ~2x faster than a gather by index.
    index: slice | np.ndarray = (
        slice(first, first + count) if list(slots) == list(range(first, first + count)) else np.asarray(slots, np.intp)
    )
    for chunk in chunks:
        rows = np.frombuffer(chunk, dtype=dtype).reshape(-1, num_layers, topk)
        yield as_bytes(np.ascontiguousarray(rows[:, index, :]))


# ---- encoders ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The `.npy` preamble for a C-order array; the raw rows follow it unchanged (cached: numpy's writer
    costs tens of µs, and every fetch of a record asks for the same one twice)."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def encode_npy(chunks: Iterable[bytes], dtype: np.dtype, shape: tuple[int, ...]) -> Iterator[bytes]:
    yield npy_header(dtype, shape)
    yield from chunks


def to_int32(chunks: Iterable[bytes], dtype: np.dtype, out: np.dtype = SGLANG_DTYPE) -> Iterator[bytes | memoryview]:
    """Cast to `out`, SGLang's wire dtype for `meta_info["routed_experts"]`: little-endian int32 unless
    `SGLANG_ROUTED_EXPERTS_DTYPE` chose a narrower one (one copy per chunk; none when the dtypes agree)."""
    dtype = np.dtype(dtype)
    if dtype == out:
        yield from chunks
        return
    for chunk in chunks:
        yield as_bytes(np.frombuffer(chunk, dtype=dtype).astype(out))


def to_sglang_rows(
    chunks: Iterable[bytes],
    dtype: np.dtype,
    layers: Sequence[int],
    num_hidden_layers: int,
    topk: int,
    out_dtype: np.dtype = SGLANG_DTYPE,
) -> Iterator[bytes | memoryview]:
    """SGLang's host-cache layout: int32 rows of `num_hidden_layers` slots, stored layers in place, zeros elsewhere.

    SGLang's capturer has one slot per model layer and never writes a dense layer's slot (zero-filled), so
    this is exactly the array its `meta_info["routed_experts"]` encodes.
    """
    dtype = np.dtype(dtype)
    if tuple(layers) == tuple(range(num_hidden_layers)):
        yield from to_int32(chunks, dtype, out_dtype)
        return
    index = np.asarray(layers, dtype=np.intp)
    for chunk in chunks:
        rows = np.frombuffer(chunk, dtype=dtype).reshape(-1, len(layers), topk)
        out = np.zeros((rows.shape[0], num_hidden_layers, topk), dtype=out_dtype)
        out[:, index, :] = rows
        yield as_bytes(out)


def b64_chunk_rows(rows: int) -> int:
    """Round a chunk's row count down to a multiple of 3, so int32 chunks encode without a carry."""
    return max(3, rows - rows % 3)


def encode_b64(chunks: Iterable[bytes | memoryview]) -> Iterator[bytes]:
    """Standard base64 of the concatenated chunks, emitted per chunk.

    Each piece encodes a multiple of 3 bytes (the remainder is carried), so the concatenated output is
    byte-identical to `base64.b64encode(b"".join(chunks))`.
    """
    carry = b""
    for chunk in chunks:
        data = memoryview(carry + chunk if carry else chunk).cast("B")
        cut = len(data) - len(data) % 3
        carry = bytes(data[cut:])
        if cut:
            yield _b64encode(data[:cut] if cut < len(data) else data)
    if carry:
        yield _b64encode(carry)


def b64_length(nbytes: int) -> int:
    return 4 * ((nbytes + 2) // 3)


def encode_json(
    chunks: Iterable[bytes], dtype: np.dtype, shape: tuple[int, int, int], head: dict[str, Any]
) -> Iterator[bytes]:
    """`{...head, "data": [[[e, …], …], …]}`, streamed row chunk by row chunk (for debugging).

    Rows of no layers carry no bytes, so their count comes from `shape`: each is an empty list.
    """
    yield orjson.dumps(head)[:-1] + (b',"data":[' if head else b'"data":[')
    rows_count, num_layers, topk = shape
    if num_layers * topk == 0:
        yield b",".join([b"[]"] * rows_count)
        yield b"]}"
        return
    first = True
    for chunk in chunks:
        rows = np.frombuffer(chunk, dtype=dtype).reshape(-1, num_layers, topk)
        if not len(rows):
            continue
        body = orjson.dumps(rows, option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
        yield body if first else b"," + body
        first = False
    yield b"]}"


def encode(
    fmt: str,
    chunks: Iterable[bytes],
    *,
    dtype: np.dtype,
    shape: tuple[int, int, int],
    head: dict[str, Any] | None = None,
    wire: np.dtype = SGLANG_DTYPE,
) -> Iterator[bytes]:
    """Dispatch to the encoder for `fmt`; `shape` is `(rows, layers, topk)` of what `chunks` hold; `wire` is
    `sglang_b64`'s dtype."""
    dtype = np.dtype(dtype)
    if fmt == "raw":
        return iter(chunks)
    if fmt == "npy":
        return encode_npy(chunks, dtype, shape)
    if fmt == "sglang_b64":
        return encode_b64(to_int32(chunks, dtype, wire))
    if fmt == "json":
        return encode_json(chunks, dtype, shape, head or {})
    raise ValueError(f"format={fmt!r}: one of {', '.join(FORMATS)}")


def body_length(fmt: str, dtype: np.dtype, shape: tuple[int, int, int], wire: np.dtype = SGLANG_DTYPE) -> int | None:
    """Exact body size when it is known before encoding (all but `json`)."""
    n = int(np.prod(shape))
    if fmt == "raw":
        return n * np.dtype(dtype).itemsize
    if fmt == "npy":
        return len(npy_header(dtype, shape)) + n * np.dtype(dtype).itemsize
    if fmt == "sglang_b64":
        return b64_length(n * wire.itemsize)
    return None


def payload_dtype(fmt: str, dtype: str, wire: np.dtype = SGLANG_DTYPE) -> str:
    """The dtype of the numbers a response carries (SGLang's base64: int32, or the narrower wire asked for)."""
    return wire.name if fmt == "sglang_b64" else dtype
