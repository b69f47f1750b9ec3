"""`StepGather` on a real CUDA device, without SGLang: one non-blocking copy per step, no sync, right rows.

`test_collect_sync` checks the whole collection path on CUDA, but it needs SGLang 0.5.23 to import with
CUDA visible (`sgl_kernel` built for its torch). This checks the plugin's own per-step read on any CUDA
torch: `launch` under `set_sync_debug_mode("error")` and `ForbidHostReads("cuda")`, whose only allowed
device read is the batched non-blocking copy into pinned host memory; `drain` then gathers the same rows
`req_to_token` names. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from syncguard import ForbidHostReads, cuda_sync_errors

from engine_ext.sglang.gather import StepGather

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_aten = torch.ops.aten


class _CountStepCopies(ForbidHostReads):
    """ForbidHostReads("cuda"), except non-blocking device→host copies, recorded as `pinned` flags."""

    def __init__(self) -> None:
        super().__init__("cuda")
        self.copies: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if func is _aten.copy_.default and non_blocking and args[1].is_cuda and args[0].device.type == "cpu":
            self.copies.append(bool(args[0].is_pinned()))
            return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_launch_is_one_pinned_non_blocking_copy_and_drain_gathers_the_rows() -> None:
    torch.manual_seed(0)
    slots = 4096
    req_to_token = torch.randperm(slots, dtype=torch.int32, device="cuda")[: 8 * 256].reshape(8, 256)
    host = torch.arange(slots * 2 * 3, dtype=torch.int32).reshape(slots, 2, 3).pin_memory()
    wanted = [("a", 1, 0, 17), ("b", 5, 3, 200), ("c", 7, 0, 1), ("d", 2, 10, 10)]
    gather = StepGather()
    guard = _CountStepCopies()
    with guard, cuda_sync_errors():
        for ticket, idx, lo, hi in wanted:
            gather.add(ticket, idx, lo, hi)
        gather.launch(req_to_token)
    assert guard.copies == [True]  # one copy for the whole step, into pinned memory
    assert gather.launches == 1
    out = gather.drain(host, wait=True)
    assert [t for t, _ in out] == [t for t, *_ in wanted]
    expected = req_to_token.cpu()
    for (_, rows), (_, idx, lo, hi) in zip(out, wanted, strict=True):
        assert torch.equal(rows, host[expected[idx, lo:hi].long()])
    assert not gather.pending()
