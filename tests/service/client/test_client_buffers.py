"""Body buffers allocated off the GIL (`service.wire.buffers`): writable, shared by the arrays over them, freed
after."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from service.wire.buffers import uninitialized


@pytest.mark.parametrize("n", [0, 100, 64 << 10, 12_582_912 + 7])
def test_a_buffer_is_writable_and_arrays_over_it_share_it(n: int) -> None:
    buf = uninitialized(n)
    assert len(buf) == n and not buf.readonly and buf.format == "B"
    a = np.frombuffer(buf, dtype=np.uint8)
    a[:] = 7
    assert bytes(buf[-3:]) == (b"\x07" * 3)[: min(3, n)]
    assert a.flags.writeable


def test_a_large_buffer_is_freed_when_the_last_array_over_it_dies() -> None:
    buf = uninitialized(12_582_912)
    block = buf.obj  # the ctypes block the finalizer frees
    freed = weakref.ref(block)
    array = np.frombuffer(buf, dtype=np.uint8).reshape(-1, 48, 8)[10:20]
    array[:] = 1
    del buf, block
    assert freed() is not None and int(array.sum()) == 10 * 48 * 8  # still alive through the view
    del array
    assert freed() is None  # at once, by reference count: no cycle keeps 12 MB alive until a collection


def test_torch_takes_the_array_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    array = np.frombuffer(uninitialized(1 << 20), dtype=np.uint8)
    t = torch.from_numpy(array)
    t[0] = 9
    assert array[0] == 9
