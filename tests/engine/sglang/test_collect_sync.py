"""The collection path reads no device value on the host: per request none, per step one non-blocking copy.

`req_to_token` and the capturer's device cache live on the `meta` device (no values: any host read there is a
would-be CUDA sync) under `syncguard.ForbidHostReads`, with one exception counted by `StepCopy`: the batched,
`non_blocking` copy of a step's slot ids into (on CUDA, pinned) host memory, which does not wait for the
stream. On meta that copy cannot move values, so the destination is zeroed: this test is about reads, not
rows (those are `test_collect`'s). The guard is shown to catch upstream's `get_topk`. With CUDA the same
runs on "cuda" under `set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import pytest
import torch
from sglang_env import run_sglang

pytestmark = pytest.mark.sglang


def child_main(device: str, spool: str) -> dict:
    import contextlib
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.state_capturer.base import TopkCaptureOutput
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args, tiny_model_config
    from syncguard import ForbidHostReads, HostReadError, cuda_sync_errors

    from engine_ext.core.settings import EngineSettings
    from engine_ext.sglang.delivery import PROCESS
    from engine_ext.sglang.hooks import delivery as delivery_hooks
    from engine_ext.sglang.hooks import table

    aten = torch.ops.aten

    class StepCopy(ForbidHostReads):
        """ForbidHostReads, except non-blocking device→host copies into host memory, which are counted."""

        def __init__(self) -> None:
            super().__init__(device)
            self.async_copies: list[bool] = []  # one entry per copy: destination pinned

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if (
                func is aten.copy_.default
                and non_blocking
                and args[1].device.type == self.device_type
                and args[0].device.type == "cpu"
            ):
                self.async_copies.append(bool(args[0].is_pinned()) if device == "cuda" else True)
                return args[0].zero_() if device == "meta" else func(*args, **kwargs)
            return super().__torch_dispatch__(func, types_, args, kwargs)

    def guarded(guard):
        stack = contextlib.ExitStack()
        stack.enter_context(guard)
        if device == "cuda":
            stack.enter_context(cuda_sync_errors())
        return stack

    publish_args(chunked_prefill_size=64, max_running_requests=8, enable_return_routed_experts=True)
    table.install_delivery_hooks(EngineSettings(spool_dir=spool, live_rows=True))
    HookRegistry.apply_hooks()
    mc = tiny_model_config()
    mc.hf_text_config.num_experts = 8
    cap = RoutedExpertsCapturer(mc, num_tokens=512, max_running_requests=8, num_fused_shared_experts=0, device=device)
    set_global_experts_capturer(cap)
    pool = ReqToTokenPool(size=8, max_context_len=128, device=device, enable_memory_saver=False)
    fields = dict.fromkeys(SchedulerBatchResultProcessor.__dataclass_fields__)
    proc = SchedulerBatchResultProcessor(
        **fields | {"req_to_token_pool": pool, "model_config": mc, "is_generation": True}
    )

    def req(rid, idx, prompt, out, **kw):
        r = Req(rid, "", array("l", range(1, prompt + 1)), SamplingParams(max_new_tokens=out), **kw)
        r.kv.req_pool_idx = idx
        r.output_ids = array("l", range(100, 100 + out))
        r.finished_reason = FINISH_LENGTH(out)
        return r

    results: dict = {}
    # Upstream's per-request read trips the guard: the guard is live.
    try:
        with ForbidHostReads(device):
            cap.get_topk(1, 10, pool)
        results["upstream_get_topk"] = "no error"
    except HostReadError as exc:
        results["upstream_get_topk"] = f"HostReadError: {str(exc)[:80]}"

    finished = [req(f"f{i}", i + 1, 9 + i, 3 + i, return_routed_experts=True) for i in range(5)]
    # A running live request that hit the prefix cache: its cached rows are read in the same step copy.
    live = Req("live", "", array("l", range(1, 13)), SamplingParams(max_new_tokens=8), return_routed_experts=True)
    live.kv.req_pool_idx = 7
    live.output_ids = array("l", [100])
    batch = ScheduleBatch(reqs=[live], prefix_lens=[4], extend_lens=[8], forward_mode=ForwardMode.EXTEND)
    step_rows = TopkCaptureOutput(
        out_cache_loc=torch.arange(8, dtype=torch.int64),
        topk=torch.zeros(8, 2, 2, dtype=torch.int32),
        host_cache=cap.host_cache,
    )

    guard = StepCopy()
    try:
        with guarded(guard):
            for r in finished:  # the finish hook, per request
                proc._maybe_collect_routed_experts(r)
            results["per_request_copies"] = len(guard.async_copies)
            step_rows.finalize()  # the host-cache write, with its drain in front
            delivery_hooks.after_batch_result(proc, batch, GenerationBatchResult(), step_rows)  # live rows + step copy
            results["per_step_copies"] = guard.async_copies
            next_step = TopkCaptureOutput(
                out_cache_loc=torch.arange(8, 9, dtype=torch.int64),
                topk=torch.zeros(1, 2, 2, dtype=torch.int32),
                host_cache=cap.host_cache,
            )
            next_step.finalize()  # the next step's host-cache write drains the finished rows first
        results["error"] = None
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    delivery = PROCESS.delivery
    delivery.writer.flush()
    results["records_written"] = delivery.writer.snapshot()["records_written"]
    results["inline"] = [r.routed_experts is not None for r in finished]
    results["live_rows"] = delivery.live.stats.rows
    results["launches"] = delivery.collector.gather.launches
    return results


def _run(device: str, tmp_path) -> dict:
    code = f"import test_collect_sync as t\nemit(t.child_main({device!r}, {str(tmp_path / 'spool')!r}))"
    (results,) = run_sglang(code)
    return results


def _check(res: dict) -> None:
    assert res["upstream_get_topk"].startswith("HostReadError"), res
    assert res["error"] is None, res["error"]
    assert res["per_request_copies"] == 0  # five finished requests: no device read at all
    assert res["per_step_copies"] == [True]  # one batched non-blocking copy for the whole step
    assert res["launches"] == 1
    assert res["records_written"] == 5 and res["inline"] == [False] * 5
    assert res["live_rows"] == 12  # 4 cached prefix rows + 8 extend rows reached the spool


def test_collection_reads_no_device_value_on_meta(tmp_path):
    _check(_run("meta", tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_collection_reads_no_device_value_on_cuda(tmp_path):
    _check(_run("cuda", tmp_path))
