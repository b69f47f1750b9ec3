"""Delivery hooks (scheduler process): finished rows to the spool without blocking the scheduler.

A finished request is routed (`collect.Collector`), its rows gathered once per step (`gather.StepGather`) before
any host-cache write could reuse its slot (`_around_finalize`, `_around_forward_end`), and a reused rid's old
record replaced at arrival (`_around_arrival`). The process's delivery state is one object (`delivery.PROCESS`),
built at the first batch result from plain values read off SGLang here.
"""

from __future__ import annotations

from engine_ext.core.records import ModelShape, moe_layer_ids
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.sglang import capturer, compat, timers
from engine_ext.sglang.collect import FinishedReq, Route
from engine_ext.sglang.delivery import PROCESS, Delivery, HostCache, Placement
from engine_ext.sglang.hooks.budget import budget_table
from engine_ext.sglang.hooks.capture import OCCUPANCY_ATTR, SLICE_ATTR, forward_kind
from engine_ext.sglang.hooks.frontdoor import rust_server_note, why_no_pointer
from engine_ext.sglang.hooks.live import live_step
from engine_ext.sglang.timers import TIMERS, timed


def _delivery_for(processor) -> Delivery | None:
    """This process's delivery, built at the first batch result that has a capturer."""
    return PROCESS.current(lambda settings: _build_delivery(settings, processor))


def _build_delivery(settings: EngineSettings, processor) -> Delivery | None:
    """Read the plain values a `Delivery` needs off the capturer, the model config and the runtime context."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    from engine_ext.sglang import fit
    from engine_ext.sglang.capturer import occupancy_snapshot

    experts = get_global_experts_capturer()
    if experts is None:
        return None
    publisher, dp_rank = attention_ranks()
    placement = Placement(
        publisher=publisher,
        dp_rank=dp_rank,
        spec_tree=_eagle_topk() > 1,
        unreachable=why_no_pointer(settings),
        sglang=fit.installed().version or "",
        layout=compat.layout().version,
        proven=fit.installed().proven,
        front_door=rust_server_note(settings),
    )
    host_cache, allocator = experts.host_cache, processor.token_to_kv_pool_allocator

    def host_tokens() -> tuple[int, int]:
        used = 0 if allocator is None else int(allocator.size) - int(allocator.available_size())
        return int(host_cache.num_tokens), max(used, 0)

    def budget() -> list[dict]:
        return [row.as_contract() for row in budget_table(compat.read("server_args"))]

    return Delivery(
        settings,
        _model_shape(processor.model_config.hf_text_config, experts),
        HostCache(rows=host_cache.buffer, tokens=host_tokens),
        placement,
        budget=budget,
        occupancy=occupancy_snapshot,
    )


def _model_shape(hf, experts) -> ModelShape:
    """Experts, top-k and the routed layers (seen at the first forward; the HF config is the fallback)."""
    num_experts = next(
        int(v) for n in ("num_experts", "n_routed_experts", "num_local_experts") if (v := getattr(hf, n, None))
    )
    num_slots = int(experts.num_layers)  # the capturer's slots are hf_text_config.num_hidden_layers
    layers = capturer.ROUTED_LAYERS.known or moe_layer_ids(
        num_slots,
        first_k_dense=int(getattr(hf, "first_k_dense_replace", 0) or 0),
        sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
        mlp_only=getattr(hf, "mlp_only_layers", None) or (),
    )
    return ModelShape(
        num_experts=num_experts,
        topk=int(experts.topk_size),
        layers=layers,
        layer_slots=None if layers == tuple(range(num_slots)) else layers,
        num_hidden_layers=num_slots,
    )


def _eagle_topk() -> int:
    try:
        return int(compat.read("speculative_eagle_topk") or 1)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return 1


def attention_ranks() -> tuple[bool, int | None]:
    """(publishes: attn-tp rank 0 of its DP group, the DP rank naming this engine: replica × groups + group)."""

    def read(name: str) -> int | None:
        try:
            value = compat.read(name)
        except (RuntimeError, ValueError, AttributeError):
            return None
        return None if value is None else int(value)

    attn_tp_rank = read("attn_tp_rank")
    replica, group, groups = read("dp_rank"), read("attn_dp_rank"), read("attn_dp_size") or 1
    if replica is None and group is None:
        return attn_tp_rank in (None, 0), None
    return attn_tp_rank in (None, 0), (replica or 0) * groups + (group or 0)


def _finished_of(req) -> FinishedReq:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    prompt_len = len(req.origin_input_ids)
    return FinishedReq(
        rid=req.rid,
        wants_inline=bool(req.return_routed_experts),
        start_len=int(req.routed_experts_start_len or 0),
        prompt_len=prompt_len,
        seqlen=prompt_len + len(req.output_ids_through_stop),
        pool_idx=int(compat.req_pool_idx(req)),
        aborted=isinstance(req.finished_reason, FINISH_ABORT),
        first_pos=prompt_len if _pd_decode_server() else 0,
        **_weight_versions(req),
    )


def _weight_versions(req) -> dict:
    """The serving weight version and the request's spans, by SGLang's own span function (plain tuples)."""
    current = compat.read("weight_version")
    events = getattr(req, "weight_version_events", None)
    if not events:
        return {"weight_version": current}
    from sglang.srt.utils.weight_versions import compute_weight_version_spans

    spans = compute_weight_version_spans(
        events, current_version=current, num_output_tokens=len(req.output_ids_through_stop)
    )
    return {"weight_version": current, "version_spans": tuple((s.version, s.start, s.end) for s in spans)}


_pd_mode: list[bool] = []


def _pd_decode_server() -> bool:
    """A PD decode server: the prompt's KV arrives by transfer, so its host cache never holds prompt rows.

    0.5.23 still returns `[start_len, seqlen-1)` from the decode server's host cache (its prompt slots hold
    whatever an earlier request left there, zeros at first); the prompt's rows are on the prefill server,
    collected at `disaggregation/prefill.py:1223-1224`.
    """
    if not _pd_mode:
        mode = compat.read("disaggregation_mode")
        _pd_mode.append(str(mode) in ("decode", "DisaggregationMode.DECODE"))
    return _pd_mode[0]


@timed(timers.COLLECT)
def _around_collect(original, self, req):
    """Finished request: spool (no inline payload), inline (refused or not captured), or both (mirror)."""
    settings = PROCESS.settings
    if settings is None or not (req.return_routed_experts or settings.capture_all):
        return original(self, req)
    route = _route_finished(self, req)  # fails: the guard runs SGLang's own collection of this request
    if route in (Route.INLINE, Route.BOTH):
        original(self, req)
    if route == Route.BOTH:
        past_stop = len(req.output_ids) - len(req.output_ids_through_stop)
        PROCESS.delivery.collector.mirror(req.rid, req.routed_experts, past_stop=past_stop)
    return None


def _route_finished(processor, req) -> str:
    delivery = _delivery_for(processor)
    if delivery is None:
        return Route.INLINE
    fin = _finished_of(req)
    if delivery.live.note_finish(req.rid, fin):
        # The live record ends this request after the step's rows; mirror mode still builds the inline payload.
        return Route.INLINE if req.return_routed_experts and delivery.mode is Mode.MIRROR else Route.SKIP
    return delivery.collector.finish(fin, publisher=delivery.publisher)


def end_delivery_step(processor) -> None:
    """After one batch result: launch the step's batched slot read (also the tests' step boundary)."""
    delivery = _delivery_for(processor)
    if delivery is None:
        return
    delivery.collector.end_step(processor.req_to_token_pool.req_to_token, delivery.host_rows)


@timed(timers.BATCH_RESULT)
def _around_process_result(original, self, batch, result, *args, **kwargs):
    TIMERS.kind = forward_kind(batch.forward_mode)
    captured = getattr(result, "routed_experts_output", None)  # finalize() clears the field, not the object
    out = original(self, batch, result, *args, **kwargs)
    after_batch_result(self, batch, result, captured)
    return out


def after_batch_result(processor, batch, result, captured) -> None:
    """Once a batch result is processed: its rows to live records, then the step's batched slot read."""
    delivery = _delivery_for(processor)
    if delivery is not None and captured is None and delivery.inline_rows is not None:
        key, rows = delivery.inline_rows  # non-overlap: this batch's forward kept its host rows
        delivery.inline_rows = None
        captured = rows if key is getattr(batch, "out_cache_loc", None) else None
    if delivery is not None and captured is not None:
        live_step(delivery, batch, result, captured.topk)
    if delivery is not None:
        delivery.live.end_step()
    end_delivery_step(processor)


def _around_arrival(original, self, recv_req, *args, **kwargs):
    """A request arrives: under a rid this process already wrote, its old record is replaced now (`reopen`)."""
    delivery = PROCESS.delivery
    asked = delivery is not None and (recv_req.return_routed_experts or delivery.settings.capture_all)
    if asked and delivery.publisher:
        delivery.collector.reopen(
            recv_req.rid,
            prompt_len=len(recv_req.input_ids or ()),
            start_len=int(recv_req.routed_experts_start_len or 0),
        )
    return original(self, recv_req, *args, **kwargs)


def _around_disagg_prefill_done(original, self, *args, **kwargs):
    """PD prefill collects at KV-transfer completion (a Scheduler method): end that step like a batch result."""
    out = original(self, *args, **kwargs)
    if PROCESS.delivery is not None:
        attr = compat.layout().result_processor
        end_delivery_step(getattr(self, attr) if attr else self)
    return out


@timed(timers.FINALIZE)
def _around_finalize(original, self):
    """Overlap path: gather finished rows before this forward's rows land in the host cache."""
    delivery = PROCESS.delivery
    if delivery is not None and self.host_cache.buffer is delivery.host_rows:
        delivery.collector.drain(wait=True)
    return original(self)


@timed(timers.FORWARD_END)
def _around_forward_end(original, self, *args, **kwargs):
    """Occupancy of the device cache; under delivery, the finished rows' gather and this forward's host rows.

    Non-overlap scheduling: upstream writes the host cache inline here (`.cpu()` of `out_cache_loc` and of the
    slice: its own syncs). Delivery runs the same write through `TopkCaptureOutput` so the host rows stay at
    hand for live rows; the batch result that follows picks them up by its `out_cache_loc` (no match: no live
    rows for that step). Occupancy reads host-side shape integers only.
    """
    params = dict(zip(("forward_batch", "can_run_graph", "cuda_graph_batch", "no_copy_to_cpu"), args, strict=False))
    params.update(kwargs)
    setattr(self, SLICE_ATTR, None)
    if capturer.ROUTED_LAYERS.known is None:
        capturer.ROUTED_LAYERS.close()
    out = _forward_end_rows(original, self, params)
    where = getattr(self, SLICE_ATTR, None)
    occupancy = getattr(self, OCCUPANCY_ATTR, None)
    if occupancy is not None:
        occupancy.record(where.gathered_rows if where is not None else params["forward_batch"].out_cache_loc.shape[0])
    return out


def _settle_forward_end(out, self, *args, **kwargs):
    """SGLang's own end of `on_forward_end` when our hook failed after its original returned: the delivery path
    asks the original for the rows without the host copy, so make the copy the caller asked for, as upstream does
    (`base.py` `on_forward_end`: the rows into the host cache at `out_cache_loc`, return None). Idempotent."""
    params = dict(zip(("forward_batch", "can_run_graph", "cuda_graph_batch", "no_copy_to_cpu"), args, strict=False))
    if out is None or (params | kwargs).get("no_copy_to_cpu", False):
        return out
    out.host_cache.buffer[out.out_cache_loc.cpu()] = out.topk.cpu()
    return None


def _forward_end_rows(original, self, params: dict):
    delivery = PROCESS.delivery
    if delivery is None or params.get("no_copy_to_cpu", False):
        return original(self, **params)
    delivery.collector.drain(wait=True)
    out = original(self, **(params | {"no_copy_to_cpu": True}))
    if out is None:
        return None
    compat.function("capture_output_to_host")(out)  # the two host copies upstream's inline path makes
    out.finalize()
    delivery.inline_rows = (params["forward_batch"].out_cache_loc, out)
    return None
