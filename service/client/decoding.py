"""What the sidecar's answers decode to: `RoutedExperts`, and the pure parsers both clients share.

`.npy` bodies and frames are parsed over the buffer they were read into (no copy); `Reply` is one whole answer.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httpx
import numpy as np
from numpy.lib import format as npy_format

from service.client.connections import fill
from service.client.errors import R3Error, error_for, json_or_text
from service.wire import frames as wire

if TYPE_CHECKING:
    import torch

__all__ = ["Frame", "FrameDecoder", "Reply", "RoutedExperts", "parse_npy", "read_frames"]


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """Rows of one record: `array[i, j, :]` are the experts of token `start + i` at model layer `layers[j]`."""

    rid: str
    array: np.ndarray
    start: int
    prompt_len: int
    layers: tuple[int, ...]
    final: bool
    dtype: str
    status: str = "ok"  # the record's status: `aborted` rows are the request's rows up to its abort
    num_hidden_layers: int | None = None  # the model's layer count, when the record says it
    clamped: bool = False  # `clamp=True` cut the range asked for to the rows the record holds
    created: float | None = None  # the record's creation time: which request wrote these rows (a rid can be reused)
    weight_version: str | int | None = None  # the engine's weight version that routed the last row
    weight_versions: tuple[tuple[int, str | int], ...] = ()  # (position, version) when the rows span an update
    source: str = "http"  # how the rows came: `http` (through the sidecar), `spool` (read here), `inline`

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def end(self) -> int:
        """One past the last token position held."""
        return self.start + self.rows

    def to_torch(self) -> torch.Tensor:
        """The rows as a torch tensor sharing this array's memory (`torch.from_numpy`, no copy)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is optional for trainers that use numpy
            raise R3Error("torch is not importable; use .array (numpy)") from exc
        return torch.from_numpy(self.array)

    def to_sglang_layout(self, num_hidden_layers: int | None = None) -> np.ndarray:
        """`(rows, num_hidden_layers, topk)` int32 with zeros for dense layers: SGLang's inline layout.

        For code written against `meta_info["routed_experts"]`: `base64(to_sglang_layout().tobytes())` is the
        server's `format=sglang_b64` body for the same rows. `num_hidden_layers` defaults to the record's
        (records of older engine plugins do not carry it: pass the model's `num_hidden_layers` then).
        """
        width = self.num_hidden_layers if num_hidden_layers is None else num_hidden_layers
        if width is None:
            raise R3Error(
                "this record does not say the model's num_hidden_layers (an older engine plugin wrote it): "
                "pass to_sglang_layout(num_hidden_layers=hf_config.num_hidden_layers)",
                rid=self.rid,
            )
        if self.num_hidden_layers is not None and width != self.num_hidden_layers:
            raise R3Error(f"num_hidden_layers={width}; the record's model has {self.num_hidden_layers}", rid=self.rid)
        if self.layers and max(self.layers) >= width:
            raise R3Error(f"layer {max(self.layers)} does not fit num_hidden_layers={width}", rid=self.rid)
        out = np.zeros((self.rows, width, self.array.shape[2]), dtype=np.int32)
        out[:, list(self.layers), :] = self.array
        return out

    def to_vllm_layout(self, num_hidden_layers: int | None = None) -> np.ndarray:
        """`(rows, num_hidden_layers, topk)` with zeros for dense layers in the record's `uint8`/`uint16`: vLLM's
        inline layout, byte for byte the array vLLM puts in `CompletionOutput.routed_experts` (and, base64 of its
        `.npy`, in each choice's `routed_experts`) for the same request."""
        layout = self.to_sglang_layout(num_hidden_layers)
        if self.array.dtype in (np.uint8, np.uint16):
            return layout.astype(self.array.dtype)
        return layout.astype(np.uint8 if layout.size == 0 or layout.max() < 256 else np.uint16)


def parse_npy(buf: bytes | bytearray | memoryview) -> np.ndarray:
    """An array over `buf`'s own memory: `numpy.lib.format` reads the header, `np.frombuffer` the rest (no copy)."""
    view = memoryview(buf)
    major, _ = npy_format.read_magic(io.BytesIO(view[:8]))
    if major not in (1, 2):
        raise ValueError(f"unsupported .npy version {major}")
    width = 2 if major == 1 else 4
    (hlen,) = struct.unpack_from("<H" if major == 1 else "<I", view, 8)
    offset = 8 + width + hlen
    read_header = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(io.BytesIO(view[8:offset]), max_header_size=max(10_000, hlen + 1))
    if fortran_order:
        raise ValueError("Fortran-ordered .npy is not a routed-experts payload")
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)


def meta_from_headers(rid: str, headers: httpx.Headers) -> dict[str, Any]:
    layers = headers.get("x-r3-layers", "")
    return {
        "rid": rid,
        "start": int(headers.get("x-r3-start", "0")),
        "prompt_len": int(headers.get("x-r3-prompt-len", "0")),
        "layers": tuple(int(x) for x in layers.split(",") if x.strip()),
        "final": headers.get("x-r3-final", "true").lower() in ("1", "true"),
        "dtype": headers.get("x-r3-dtype", ""),
        "status": headers.get("x-r3-status", "ok"),
        "num_hidden_layers": int(n) if (n := headers.get("x-r3-num-hidden-layers")) else None,
        "clamped": headers.get("x-r3-clamped", "false").lower() == "true",
        "created": float(c) if (c := headers.get("x-r3-created")) else None,
        "weight_version": unquote(v) if (v := headers.get("x-r3-weight-version")) is not None else None,
        "weight_versions": tuple(
            (int(pos), unquote(ver))
            for pos, _, ver in (p.partition(":") for p in headers.get("x-r3-weight-versions", "").split(",") if p)
        ),
    }


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of `application/vnd.r3.frames`: its JSON header and its payload bytes (writable)."""

    header: dict[str, Any]
    payload: bytearray | memoryview

    @property
    def status(self) -> int:
        return int(self.header.get("status", 200))

    def result(self, prompt_len: int = 0) -> RoutedExperts:
        """The frame's rows (status 200 only); the array views the payload, no copy."""
        h = self.header
        shape = tuple(int(x) for x in h["shape"])
        array = np.frombuffer(self.payload, dtype=np.dtype(h["dtype"])).reshape(shape)
        return RoutedExperts(
            rid=h["rid"],
            array=array,
            start=int(h.get("start", 0)),
            prompt_len=int(h.get("prompt_len", prompt_len) or prompt_len),
            layers=tuple(int(x) for x in h.get("layers", ())),
            final=bool(h.get("final", True)),
            dtype=h["dtype"],
            status=str(h.get("record_status") or "ok"),
            num_hidden_layers=h.get("num_hidden_layers"),
            clamped=bool(h.get("clamped", False)),
            created=h.get("created"),
            weight_version=h.get("weight_version"),
            weight_versions=tuple((int(p), v) for p, v in h.get("weight_versions", ())),
        )

    def error(self) -> R3Error:
        return error_for(self.status, self.header, rid=self.header.get("rid"))


class FrameDecoder:
    """`service.wire.frames.FrameDecoder` yielding client `Frame`s; a stream that is not frames raises `R3Error`."""

    def __init__(self) -> None:
        self._decoder = wire.FrameDecoder()

    def feed(self, chunk: bytes) -> list[Frame]:
        try:
            return [Frame(header, payload) for header, payload in self._decoder.feed(chunk)]
        except wire.FrameError as exc:
            raise R3Error(str(exc)) from None

    @property
    def pending(self) -> bool:
        """Whether a partial frame is buffered (the stream ended mid-frame when this is true at EOF)."""
        return self._decoder.pending


def read_frames(body: io.RawIOBase | Any) -> list[Frame]:
    """Every frame of a body read with `readinto`: each payload lands in its own buffer with one copy."""
    try:
        decoded = wire.read_frames(lambda buf: fill(body, buf))
    except wire.FrameTruncated:
        raise httpx.RemoteProtocolError("batch response ended inside a frame") from None
    except wire.FrameError as exc:
        raise R3Error(str(exc)) from None
    return [Frame(header, payload) for header, payload in decoded]


@dataclass(frozen=True, slots=True)
class Reply:
    """A fully read response: status, headers, and the body in a writable buffer."""

    status: int
    headers: httpx.Headers
    body: bytearray | memoryview

    def checked(self, rid: str | None) -> Reply:
        """Self on a 2xx with content; else the matching `R3Error` (202 means not final yet)."""
        if self.status >= 300 or self.status == 202:
            raise error_for(self.status, json_or_text(bytes(self.body)), rid)
        return self


def record_of(rid: str, resp: Reply) -> RoutedExperts:
    array = parse_npy(resp.body)
    meta = meta_from_headers(rid, resp.headers)
    return RoutedExperts(array=array, **{**meta, "dtype": meta["dtype"] or array.dtype.name})
