"""The frames wire format (`application/vnd.r3.frames`, Contract 2): the one definition, used by API and client.

A body is repeated `[4-byte little-endian header length][UTF-8 JSON header][payload]`; the payload is
exactly `prod(shape) * itemsize` bytes when the header's `status` is 200 and empty otherwise. Why one
module: the server writes frames and the client reads them, and a change to either side must change both.
Everything here is pure (bytes in, bytes out); the client maps `FrameError` and truncation to its own errors.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from service.wire.buffers import uninitialized

FRAMES_MEDIA_TYPE = "application/vnd.r3.frames"
MAX_HEADER_BYTES = 1 << 20
"""A longer header length means the body is not a frames stream (a reader must not buffer it)."""

_LEN = struct.Struct("<I")
LENGTH_BYTES = _LEN.size

Buffer = bytearray | memoryview
Decoded = tuple[dict[str, Any], Buffer]
"""One decoded frame: its header and its payload, in a buffer of its own (arrays over it are writable)."""


class FrameError(ValueError):
    """Bytes that are not a frames stream."""


class FrameTruncated(FrameError):
    """The body ended inside a frame."""


def frame_header(header: dict[str, Any]) -> bytes:
    """`[u32 LE header length][UTF-8 JSON header]`; the payload follows, `prod(shape) * itemsize` bytes."""
    data = orjson.dumps(header)
    return _LEN.pack(len(data)) + data


def payload_size(header: dict[str, Any]) -> int:
    """Bytes of the payload that follows `header`: none unless its status is 200."""
    if int(header.get("status", 200)) != 200 or not header.get("shape"):
        return 0
    return int(np.prod([int(x) for x in header["shape"]], dtype=np.int64)) * np.dtype(header["dtype"]).itemsize


def _header_length(data: bytes | bytearray | memoryview, pos: int = 0) -> int:
    (hlen,) = _LEN.unpack_from(data, pos)
    if hlen > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {hlen} bytes: not an {FRAMES_MEDIA_TYPE} stream")
    return hlen


def parse_frames(body: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """Split a whole frames body into `(header, payload)` pairs (the inverse of `frame_header` + payload)."""
    frames = []
    pos = 0
    while pos < len(body):
        if pos + LENGTH_BYTES > len(body):
            raise FrameTruncated(f"frames: {len(body) - pos} stray bytes at {pos}")
        hlen = _header_length(body, pos)
        header = orjson.loads(body[pos + LENGTH_BYTES : pos + LENGTH_BYTES + hlen])
        pos += LENGTH_BYTES + hlen
        size = payload_size(header)
        if pos + size > len(body):
            raise FrameTruncated(f"frames: payload of {header.get('rid')!r} cut short")
        frames.append((header, body[pos : pos + size]))
        pos += size
    return frames


class FrameDecoder:
    """Incremental decoder for frames fed in any chunking (a network stream).

    Each payload is copied once, from the chunk into its own buffer, so arrays over it are writable.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._header: dict[str, Any] | None = None
        self._payload: bytearray | None = None
        self._filled = 0

    def feed(self, chunk: bytes) -> list[Decoded]:
        """The frames `chunk` completes, in order; the rest is kept for the next call."""
        frames: list[Decoded] = []
        view = memoryview(chunk)
        while view:
            if self._payload is not None:
                n = min(len(view), len(self._payload) - self._filled)
                self._payload[self._filled : self._filled + n] = view[:n]
                self._filled += n
                view = view[n:]
                if self._filled == len(self._payload):
                    frames.append(self._finish())
                continue
            self._buf += view
            view = memoryview(b"")
            while self._payload is None and len(self._buf) >= LENGTH_BYTES:
                hlen = _header_length(self._buf)
                if len(self._buf) < LENGTH_BYTES + hlen:
                    break
                header = orjson.loads(bytes(self._buf[LENGTH_BYTES : LENGTH_BYTES + hlen]))
                rest = self._buf[LENGTH_BYTES + hlen :]
                self._buf = bytearray()
                self._header = header
                self._payload = bytearray(payload_size(header))
                self._filled = 0
                if not self._payload:
                    frames.append(self._finish())
                    self._buf = rest
                else:
                    view = memoryview(rest)
                    break
        return frames

    @property
    def pending(self) -> bool:
        """Whether a partial frame is buffered (the stream ended mid-frame when this is true at EOF)."""
        return bool(self._buf) or self._payload is not None

    def _finish(self) -> Decoded:
        assert self._header is not None and self._payload is not None
        frame = (self._header, self._payload)
        self._header, self._payload, self._filled = None, None, 0
        return frame


def read_frames(fill: Callable[[Buffer], int]) -> list[Decoded]:
    """Every frame of a body read through `fill(buf)` (fills `buf`, returns the bytes read; fewer at its end).

    Each payload lands in its own buffer with one copy (`readinto`), no intermediate chunk.
    """
    frames: list[Decoded] = []
    while True:
        head = bytearray(LENGTH_BYTES)
        filled = fill(head)
        if filled == 0:  # the body may end between frames, nowhere else
            return frames
        if filled < LENGTH_BYTES:
            raise FrameTruncated("body ended inside a frame")
        header = orjson.loads(_read_exact(fill, bytearray(_header_length(head))))
        # left unfilled: `fill` writes every byte (no zeroing pass under the GIL)
        frames.append((header, _read_exact(fill, uninitialized(payload_size(header)))))


def _read_exact(fill: Callable[[Buffer], int], buf: Buffer) -> Buffer:
    if buf and fill(buf) < len(buf):
        raise FrameTruncated("body ended inside a frame")
    return buf


__all__ = [
    "FRAMES_MEDIA_TYPE",
    "FrameDecoder",
    "FrameError",
    "FrameTruncated",
    "frame_header",
    "parse_frames",
    "payload_size",
    "read_frames",
]
