"""Row buffers in torch memory, pinned for GPU-bound rows: where a same-node read lands its rows.

Why: a trainer that moves the rows to a GPU copies them host → device; from pageable memory CUDA first copies
them again into a pinned staging buffer, and the copy cannot overlap compute. Rows read straight into pinned
memory (`RoutedExpertsClient(url, local_buffers=pinned_buffers())`) go to the device with one DMA,
`r.to_torch().to(device, non_blocking=True)`. Applies to same-node reads (service.client.local.reads); rows that
come over HTTP land in the client's own body buffers.
"""

from __future__ import annotations

from service.client.errors import R3Error
from service.client.local.spool import Allocator

__all__ = ["pinned_buffers", "torch_buffers"]


def torch_buffers(*, pin_memory: bool = False) -> Allocator:
    """An allocator of uint8 torch tensors' memory: `to_torch()` of the rows shares it (no copy)."""
    try:
        import torch
    except ImportError as exc:
        raise R3Error("torch is not importable: torch_buffers needs it") from exc
    if pin_memory and not torch.cuda.is_available():
        raise R3Error("pinned host memory needs a CUDA device (torch.cuda.is_available() is False)")

    def alloc(nbytes: int):  # a numpy array over the tensor's memory
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory).numpy()

    return alloc


def pinned_buffers() -> Allocator:
    """`torch_buffers(pin_memory=True)`: page-locked host memory, for one-DMA copies to the GPU."""
    return torch_buffers(pin_memory=True)
