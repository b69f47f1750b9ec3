"""Scheduler-thread cost per finished request: SGLang's collection versus the spool hand-off.

Upstream (0.5.23): `BaseTopkCapturer.get_topk` gathers the request's rows from a real host cache through a
real `ReqToTokenPool`, and the int32 tensor is then encoded for the detokenizer by the scheduler's own
msgpack encoder (`io_struct._msgpack_encoder`, what `send_output` runs on the scheduler thread).
Ours: the plugin's real finish-time path, `engine_ext.sglang.collect.Collector`: `finish` (route + reservation),
then `end_step` (one batched slot read, the gather, compaction to the spool dtype and MoE layers, and the
hand-off to `engine_ext.core.writer.SpoolWriter`). The inline payload is dropped, so nothing O(seqlen) crosses
the IPC. With live rows (`engine_ext.sglang.live.LiveRows`) the scheduler hands one row per running request per
decode step, and only a final marker at finish.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.shapes import ModelShape, inline_layout, routing
from benchmarks.stats import samples, summary, timed


def _cpu_host_allocation() -> None:
    """SGLang pins its host cache with cudaHostRegister; on a CPU-only torch use the plain allocation.

    The same substitution the CPU server shim makes (`tests/sglang_cpu/_sglang_cpu_server_shim.py`, item 2); the cache
    is otherwise real.
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
        self.compact = compact_rows
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


def _collector(shape: ModelShape, spool_dir: Path):
    from engine_ext.core.records import ModelShape as EngineShape
    from engine_ext.core.settings import Mode
    from engine_ext.core.writer import SpoolWriter
    from engine_ext.sglang.collect import Collector

    writer = SpoolWriter(spool_dir, queue_bytes=1 << 30, engine="bench").start()
    moe = shape.moe_layers
    engine_shape = EngineShape(
        num_experts=shape.num_experts,
        topk=shape.topk,
        layers=moe,
        layer_slots=moe if len(moe) != shape.num_hidden_layers else None,
    )
    collector = Collector(writer, engine_shape, mode=Mode.SIDECAR, capture_all=False, dtype=shape.dtype, engine="bench")
    return writer, collector


def finish_cost(shape: ModelShape, collection: UpstreamCollection, seqlen: int, reps: int) -> dict:
    """Seconds on the scheduler thread per finished request of `seqlen` tokens, upstream and ours.

    Wall time and the thread's CPU time are both kept: on a shared machine the CPU time is the steadier one.
    """
    from engine_ext.sglang.collect import FinishedReq as Finished
    from engine_ext.sglang.collect import Route
    from service.spool import Spool

    expected = collection.get_topk(seqlen)
    assert expected.shape == (seqlen - 1, shape.num_hidden_layers, shape.topk)

    gather = samples(lambda: collection.get_topk(seqlen), reps)
    encode = samples(lambda: _ipc_encode(expected), reps)
    upstream = [timed(lambda: _ipc_encode(collection.get_topk(seqlen))) for _ in range(reps + 1)][1:]

    with tempfile.TemporaryDirectory(prefix="r3-bench-writer-", dir="/dev/shm") as tmp:
        writer, collector = _collector(shape, Path(tmp))
        req_to_token, host = collection.pool.req_to_token, collection.capturer.host_cache.buffer
        ours, routes = [], set()
        for rep in range(reps + 1):
            fin = Finished(
                rid=f"finish-{seqlen}-{rep}",
                wants_inline=True,
                start_len=0,
                prompt_len=seqlen // 2,
                seqlen=seqlen,
                pool_idx=1,
                aborted=False,
            )

            def handoff(fin: Finished = fin) -> None:
                routes.add(collector.finish(fin, publisher=True))
                collector.end_step(req_to_token, host)

            ours.append(timed(handoff))
            writer.flush(120)  # the writer thread's file I/O is not the scheduler's: wait outside the clock
        writer.close()
        assert routes == {Route.SPOOL} and writer.stats.write_errors == 0, (routes, writer.stats)
        spool = Spool(Path(tmp))
        meta = spool.read_meta(f"finish-{seqlen}-{reps}")
        assert meta is not None and meta.final, meta
        if not np.array_equal(spool.read_array(meta), collection.compact[: seqlen - 1]):
            raise AssertionError(f"{shape.name} {seqlen}: the spool record differs from the engine's rows")
    return {
        "model": shape.name,
        "tokens": seqlen,
        "upstream_gather": summary(gather),
        "upstream_ipc_encode": summary(encode),
        "upstream_total": summary([w for w, _ in upstream]),
        "upstream_total_cpu": summary([c for _, c in upstream]),
        "ours_total": summary([w for w, _ in ours[1:]]),
        "ours_total_cpu": summary([c for _, c in ours[1:]]),
        "spool_record_equal": True,
    }


def live_step_cost(shape: ModelShape, batch: int, steps: int) -> dict:
    """Per decode step with `batch` live requests (`LiveRows.feed_step`, one row each); at finish, the marker."""
    from engine_ext.sglang.collect import FinishedReq as Finished
    from engine_ext.sglang.live import LiveRows, StepRequest, decode_layout

    # Rows a router could write (distinct experts, zeros only on dense layers): random or zero ones are what the
    # row check flags, and the step would measure its suspect path instead of the one every step takes.
    step_rows = inline_layout(shape, routing(shape, batch, seed=1))
    prompt = 16
    prompt_rows = inline_layout(shape, routing(shape, prompt, seed=2))
    with tempfile.TemporaryDirectory(prefix="r3-bench-live-", dir="/dev/shm") as tmp:
        writer, collector = _collector(shape, Path(tmp))
        live = LiveRows(collector)
        rids = [f"live-{i}" for i in range(batch)]
        for i, rid in enumerate(rids):
            live.begin(rid, start=0, prompt_len=prompt, retractions=0, first_pos=0, pool_idx=i)
            live.feed(rid, 0, prompt_rows, limit=1 << 30)
        writer.flush(60)
        seq_lens = [prompt + 1] * batch

        def step() -> None:
            # As `hooks.live_step`: the batch's requests and layout as host integers, then `feed_step`.
            reqs = [StepRequest(rid, False, False, 0, False, 0, prompt, 1 << 30, i) for i, rid in enumerate(rids)]
            layout, total = decode_layout(seq_lens)
            live.feed_step("DECODE", layout, total, reqs, step_rows, first_extend=False)
            for i in range(batch):
                seq_lens[i] += 1

        per_step = [timed(step) for _ in range(steps)]
        writer.flush(120)
        seqlen = seq_lens[0]
        fin = Finished(rids[0], True, 0, prompt, seqlen, 0, False)

        def finish() -> None:
            live.note_finish(rids[0], fin)
            live.end(rids[0])

        at_finish = timed(finish)
        writer.flush(60)
        writer.close()
        assert live.stats.completed == 1 and live.stats.restarted == 0, live.stats
        assert writer.stats.write_errors == 0 and writer.stats.suspect_records == 0, writer.stats
    return {
        "model": shape.name,
        "batch": batch,
        "per_step": summary([w for w, _ in per_step]),
        "per_step_cpu": summary([c for _, c in per_step]),
        "finish_marker": summary([at_finish[0]]),
    }
