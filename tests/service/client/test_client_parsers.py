"""The trainer client's pure parsers, no server: an `.npy` body parsed in place, the frames of a batch answer
however they are chunked, and a status mapped to its error."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest

from service.client import R3Error
from service.client.decoding import FrameDecoder, parse_npy, read_frames
from service.client.errors import BadRequest, RecordGone, RecordNotFound, error_for
from service.wire.frames import frame_header


def test_parse_npy_matches_numpy_load() -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint16).reshape(2, 3, 4)
    buf = io.BytesIO()
    np.save(buf, array)
    body = bytearray(buf.getvalue())
    parsed = parse_npy(body)
    np.testing.assert_array_equal(parsed, array)
    parsed[0, 0, 0] = 999  # a view of the buffer, not a copy
    assert np.load(io.BytesIO(bytes(body)))[0, 0, 0] == 999
    with pytest.raises(ValueError):
        parse_npy(b"not an npy payload")


def two_frames() -> tuple[np.ndarray, bytes]:
    a = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)
    frames = (
        frame_header(
            {
                "rid": "x",
                "status": 200,
                "dtype": "uint8",
                "shape": [3, 2, 2],
                "start": 4,
                "layers": [0, 1],
                "final": True,
            }
        )
        + a.tobytes()
        + frame_header(
            {
                "rid": "y",
                "status": 404,
                "dtype": "uint8",
                "shape": [0, 2, 2],
                "start": 0,
                "layers": [0, 1],
                "final": False,
                "detail": "no record 'y'",
            }
        )
    )
    return a, frames


def check_two_frames(out: list, a: np.ndarray) -> None:
    assert [f.status for f in out] == [200, 404]
    r = out[0].result()
    assert (r.rid, r.start, r.layers, r.final) == ("x", 4, (0, 1), True)
    np.testing.assert_array_equal(r.array, a)
    assert r.array.flags.writeable
    err = out[1].error()
    assert isinstance(err, RecordNotFound) and err.detail == "no record 'y'"


def test_frame_decoder_any_chunking() -> None:
    a, frames = two_frames()
    for size in (1, 3, 7, len(frames)):
        decoder = FrameDecoder()
        out = []
        for i in range(0, len(frames), size):
            out += decoder.feed(frames[i : i + size])
        assert not decoder.pending
        check_two_frames(out, a)


class Trickle(io.RawIOBase):
    """A readable body that hands out at most `size` bytes per read, as a socket may."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size, self.pos = data, size, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.size, len(self.data) - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def test_read_frames_reads_what_the_decoder_reads() -> None:
    a, frames = two_frames()
    for size in (1, 3, 7, len(frames)):
        check_two_frames(read_frames(Trickle(frames, size)), a)
    assert read_frames(Trickle(b"", 4)) == []
    for cut in (2, 4 + 5, len(frames) - 1):
        with pytest.raises(httpx.RemoteProtocolError, match="inside a frame"):
            read_frames(Trickle(frames[:cut], 5))
    with pytest.raises(R3Error, match=r"not an application/vnd\.r3\.frames"):
        read_frames(Trickle(b"\xff\xff\xff\x7f" + b"{}", 64))


def test_error_for_maps_statuses() -> None:
    assert isinstance(error_for(410, {"error": "gone", "detail": "aborted"}), RecordGone)
    assert isinstance(error_for(422, {"detail": "bad"}), BadRequest)
    server = error_for(503, "upstream down")
    assert server.status == 503 and server.detail == "upstream down"
