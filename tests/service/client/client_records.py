"""The records the client tests write through the real spool writer: one layout (`LAYERS`, `TOPK`) and seeded
random rows, which each test compares with what the client returns."""

from __future__ import annotations

import numpy as np

from service.spool import Spool

LAYERS = (1, 3, 5, 7)
TOPK = 4


def put(spool: Spool, rid: str, rows: int = 12, *, start: int = 0, final: bool = True, status: str = "ok", seed=0):
    """Write one record through the real spool writer; returns (rows array, writer)."""
    array = np.random.default_rng(seed).integers(0, 64, (rows, len(LAYERS), TOPK), dtype=np.uint8)
    writer = spool.writer(
        rid, num_experts=64, topk=TOPK, layers=LAYERS, start=start, prompt_len=start + rows // 2, engine="t/dp0"
    )
    if rows:
        writer.append(array)
    if final:
        writer.finalize(status)
    return array, writer
