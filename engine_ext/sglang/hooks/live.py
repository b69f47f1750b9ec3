"""Live-rows hook body (scheduler): one batch's layout and requests as host integers for `LiveRows.feed_step`.

SGLang's forward modes decide the layout (`live.extend_layout`, `decode_layout`, `verify_layout`); nothing here
reads a device tensor.
"""

from __future__ import annotations

from engine_ext.sglang import compat, timers
from engine_ext.sglang.delivery import Delivery
from engine_ext.sglang.live import StepRequest, decode_layout, extend_layout, verify_layout
from engine_ext.sglang.timers import timed


@timed(timers.LIVE_STEP, around=False)
def live_step(delivery: Delivery, batch, result, topk) -> None:
    """The batch's layout and requests as host integers, for `LiveRows.feed_step` (nothing to do: no read)."""
    live = delivery.live
    mode = batch.forward_mode
    first_extend = mode.is_extend() and not mode.is_target_verify()  # where a live record may begin
    if not live.records and not first_extend:
        return
    reqs = [_step_request(delivery, req, first_extend) for req in batch.reqs]
    if not live.records and not any(req.wants for req in reqs):
        return
    if mode.is_target_verify():
        stride = _verify_stride(result)
        if result.accept_lens is None or not stride or delivery.placement.spec_tree:
            layout, total = [], -1
        else:
            layout, total = verify_layout(batch.seq_lens_cpu.tolist(), int(stride), result.accept_lens.tolist())
    elif mode.is_extend():
        layout, total = extend_layout(batch.prefix_lens, batch.extend_lens)
    elif mode.is_decode():
        layout, total = decode_layout(batch.seq_lens_cpu.tolist())
    else:
        return
    live.feed_step(mode.name, layout, total, reqs, topk, first_extend=first_extend)


def _verify_stride(result) -> int | None:
    """A verify forward's tokens per request, from the first of the layout's result fields that is set."""
    for name in compat.layout().verify_stride:
        value = getattr(result, name)
        if value:
            return int(value)
    return None


def _step_request(delivery: Delivery, req, first_extend: bool) -> StepRequest:
    prompt_len = len(req.origin_input_ids)
    return StepRequest(
        rid=req.rid,
        wants=first_extend
        and delivery.wants_live(bool(req.return_routed_experts), getattr(req.sampling_params, "custom_params", None)),
        finished=req.finished(),
        retractions=int(req.retraction_count),
        retracted=bool(req.is_retracted),
        start=int(req.routed_experts_start_len or 0),
        prompt_len=prompt_len,
        limit=prompt_len + len(req.output_ids_through_stop) - 1,
        pool_idx=compat.req_pool_idx(req),
    )
