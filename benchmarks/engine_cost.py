"""Scheduler-thread cost per finished request: SGLang's collection versus the spool hand-off.

Upstream (0.5.23): `BaseTopkCapturer.get_topk` gathers the request's rows from a real host cache through a
real `ReqToTokenPool`, and the int32 tensor is then encoded for the detokenizer by the scheduler's own
msgpack encoder (`io_struct._msgpack_encoder`, what `send_output` runs on the scheduler thread).
Ours: the same gather, compaction to the spool dtype (MoE layers only), `SpoolWriter.reserve` and
`SpoolWriter.submit`; the inline payload is dropped, so nothing O(seqlen) crosses the IPC.
With live rows the scheduler hands one row per running request per step, and only a final marker at finish.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.shapes import ModelShape, inline_layout
from benchmarks.stats import samples, summary, timed


def _cpu_host_allocation() -> None:
    """SGLang pins its host cache with cudaHostRegister; on a CPU-only torch use the plain allocation.

    The same substitution SGLang's CPU test setup makes (`sglang-cpu/README.md`); the cache is otherwise real.
    """
    from sglang.srt.mem_cache.pool_host import common as host_common

    host_common.ALLOC_MEMORY_FUNCS["cpu"] = (
        lambda dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None: allocator.allocate(
            dims, dtype=dtype, device=device
        )
    )


class UpstreamCollection:
    """A real `BaseTopkCapturer` host cache and `ReqToTokenPool` holding one request's rows at scattered slots."""

    def __init__(self, shape: ModelShape, compact_rows: np.ndarray, seed: int = 0) -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.state_capturer.base import BaseTopkCapturer

        _cpu_host_allocation()
        tokens = compact_rows.shape[0] + 1
        slots = tokens + 1024
        self.shape = shape
        self.capturer = BaseTopkCapturer(
            num_tokens=slots,
            max_batch_size=256,
            num_layers=shape.num_hidden_layers,
            topk_size=shape.topk,
            device="cpu",
            name="routed_experts",
        )
        self.pool = ReqToTokenPool(size=4, max_context_len=tokens + 8, device="cpu", enable_memory_saver=False)
        order = torch.from_numpy(np.random.default_rng(seed).permutation(np.arange(1, slots))[:tokens])
        self.pool.req_to_token[1, :tokens] = order.to(self.pool.req_to_token.dtype)
        self.capturer.host_cache.buffer[order[:-1]] = inline_layout(shape, compact_rows)

    def get_topk(self, seqlen: int) -> torch.Tensor:
        return self.capturer.get_topk(req_pool_idx=1, seqlen=seqlen, req_to_token_pool=self.pool, start_len=0)


def _ipc_encode(rows: torch.Tensor) -> bytes:
    from sglang.srt.managers import io_struct

    return io_struct._msgpack_encoder.encode([rows])


def finish_cost(shape: ModelShape, collection: UpstreamCollection, seqlen: int, reps: int) -> dict:
    """Seconds on the scheduler thread per finished request of `seqlen` tokens, upstream and ours."""
    from engine_ext.writer import Op, RecordSpec, SpoolWriter, compact

    moe = list(range(shape.first_moe_layer, shape.num_hidden_layers))
    expected = collection.get_topk(seqlen)
    assert expected.shape == (seqlen - 1, shape.num_hidden_layers, shape.topk)

    gather = samples(lambda: collection.get_topk(seqlen), reps)
    encode = samples(lambda: _ipc_encode(expected), reps)
    upstream = [timed(lambda: _ipc_encode(collection.get_topk(seqlen))) for _ in range(reps + 1)][1:]

    with tempfile.TemporaryDirectory(prefix="r3-bench-writer-", dir="/dev/shm") as tmp:
        writer = SpoolWriter(Path(tmp), queue_bytes=1 << 30).start()
        counter = iter(range(1 << 30))

        def ours_handoff(rows: torch.Tensor) -> None:
            data = compact(rows.numpy()[:, shape.first_moe_layer :, :], shape.dtype)
            spec = RecordSpec(
                rid=f"finish-{next(counter)}",
                num_experts=shape.num_experts,
                topk=shape.topk,
                layers=tuple(moe),
                start=0,
                prompt_len=seqlen // 2,
                dtype=shape.dtype,
            )
            if writer.reserve(data.nbytes) is not None:
                raise RuntimeError("spool refused the reservation: the measurement would be of the fallback")
            writer.submit(Op(spec.rid, spec=spec, rows=data, status="ok"), reserved=True)

        handoff, ours = [], []
        for _ in range(reps + 1):
            rows = collection.get_topk(seqlen)
            handoff.append(timed(lambda rows=rows: ours_handoff(rows)))
            writer.flush(60)  # the writer thread's I/O is not the scheduler's: wait for it outside the clock
            ours.append(timed(lambda: ours_handoff(collection.get_topk(seqlen))))
            writer.flush(60)
        writer.close()
        assert writer.stats.write_errors == 0, writer.stats
    return {
        "model": shape.name,
        "tokens": seqlen,
        "upstream_gather": summary(gather),
        "upstream_ipc_encode": summary(encode),
        "upstream_total": summary([w for w, _ in upstream]),
        "upstream_total_cpu": summary([c for _, c in upstream]),
        "ours_compact_handoff": summary([w for w, _ in handoff[1:]]),
        "ours_total": summary([w for w, _ in ours[1:]]),
        "ours_total_cpu": summary([c for _, c in ours[1:]]),
    }


def live_step_cost(shape: ModelShape, batch: int, steps: int) -> dict:
    """Per decode step with `batch` running requests: hand one row each to the writer; finish: a final marker."""
    from engine_ext.writer import Op, RecordSpec, SpoolWriter, compact

    rng = np.random.default_rng(1)
    step_rows = torch.from_numpy(
        rng.integers(0, shape.num_experts, (batch, shape.num_hidden_layers, shape.topk), dtype=np.int32)
    )
    with tempfile.TemporaryDirectory(prefix="r3-bench-live-", dir="/dev/shm") as tmp:
        writer = SpoolWriter(Path(tmp), queue_bytes=1 << 30).start()
        rids = [f"live-{i}" for i in range(batch)]
        for rid in rids:
            spec = RecordSpec(
                rid=rid,
                num_experts=shape.num_experts,
                topk=shape.topk,
                layers=tuple(range(shape.first_moe_layer, shape.num_hidden_layers)),
                start=0,
                prompt_len=1,
                dtype=shape.dtype,
            )
            writer.submit(Op(rid, spec=spec))
        writer.flush(60)

        def step() -> None:
            data = compact(step_rows.numpy()[:, shape.first_moe_layer :, :], shape.dtype)
            for i, rid in enumerate(rids):
                writer.submit(Op(rid, rows=data[i : i + 1]))

        per_step = samples(step, steps)
        writer.flush(120)
        finish = samples(lambda: writer.submit(Op(rids[0], status="ok")), 1, warmup=0)
        writer.flush(60)
        writer.close()
        assert writer.stats.write_errors == 0, writer.stats
    return {"model": shape.name, "batch": batch, "per_step": summary(per_step), "finish_marker": summary(finish)}
