"""Fail on any host read of a device value: the implicit syncs the per-forward and collection paths must not do.

`ForbidHostReads(device)` is a `TorchDispatchMode` that raises `HostReadError` on `aten::_local_scalar_dense`
(`.item()`, `int(t)`, `.tolist()`, `if t:`), and on any copy whose source lives on `device` and whose result
lives on the CPU (`.cpu()`, `.to("cpu")`, `.numpy()` after a copy, `cpu_tensor.copy_(device_tensor)`).

On a machine without a GPU run the capturer on the `meta` device: a meta tensor has a shape and no values, so
shape arithmetic works and any value read, which would be a device sync on CUDA, is caught here (and could not
produce a value anyway). With CUDA, `cuda_sync_errors()` adds `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.item.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.to.dtype_layout, _aten.to.device}


class HostReadError(AssertionError):
    """The guarded code read a device value on the host."""


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from _tensors(value)


class ForbidHostReads(TorchDispatchMode):
    """Raise on host reads of tensors on `device` ("cuda", or "meta" to stand in for it on a CPU machine)."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors([*args, *kwargs.values()]))
        on_device = [t for t in inputs if t.device.type == self.device_type]
        if func in _SCALAR_READS and on_device:
            self._fail(func, "reads a device scalar on the host")
        if func in _COPIES and on_device:
            target = kwargs.get("device")
            if func is _aten.copy_.default:
                target = args[0].device if args[1].device.type == self.device_type else None
            if target is not None and torch.device(target).type == "cpu":
                self._fail(func, "copies a device tensor to the host")
        return func(*args, **kwargs)

    def _fail(self, func, what: str) -> None:
        self.seen.append(str(func))
        raise HostReadError(f"{func} {what} (device {self.device_type}): an implicit device sync")


@contextlib.contextmanager
def cuda_sync_errors() -> Iterator[None]:
    """`torch.cuda.set_sync_debug_mode("error")` for the block: CUDA raises on every synchronizing call."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
