"""The one module that names SGLang internals (in 0.5.23's spelling): hook targets, attributes, argument names.

How it works. SGLang's `HookRegistry` (`srt/plugins/hook_registry.py`) patches a dotted target in every
process that loads plugins: an AROUND hook is called as `hook(original, *args, **kwargs)` and decides when to
call `original`; a REPLACE hook takes the target's place. `install(settings)` registers the rows of `HOOKS`
below that the settings ask for, one hook per target; SGLang applies them right after (`register()` in
`engine_ext/sglang/__init__.py` is the entry point). Hooks read SGLang's objects into plain values; everything they
compute is plain functions of those (`capturer`, `slicing`, `budget`, `collect`, `live`, `writer`,
`frontdoors`), testable without SGLang, and the process's delivery state is one object (`delivery.PROCESS`).
Older SGLangs keep some of these elsewhere: targets, settings and helpers go through `compat` (a `Layout`
per proven version, as data), so no hook body checks a version.

Usage, e.g. to see what a launch registers:

    from engine_ext.sglang import hooks
    for hook in hooks.HOOKS: print(hook.groups, hook.type.name, hook.target)

The budget check is not a `HookRegistry` target: it runs at the last ServerArgs resolution step
(`register_resolution_hook`, see `install_budget_hooks`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from torch.compiler import is_compiling as _compiling

from engine_ext.core.degraded import ON_THREAD_FAILURE
from engine_ext.core.promised import Promised
from engine_ext.core.records import moe_layer_ids
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.sglang import capturer, compat, frontdoors, guard, slicing, timers, worker_app
from engine_ext.sglang.collect import Finished, ModelShape, Route
from engine_ext.sglang.delivery import PROCESS, Delivery, HostCache, Placement
from engine_ext.sglang.live import StepRequest, decode_layout, extend_layout, verify_layout
from engine_ext.sglang.timers import TIMERS, timed
from engine_ext.sglang.worker_app import SGLANG_APP, WORKER_APP

_RE = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer"
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_OPENAI = "sglang.srt.entrypoints.openai"


@dataclass(frozen=True)
class Hook:
    """One row of the table: where, what (a function of this module, by name), how, and when it is wanted."""

    target: str
    function: str
    type: HookType
    # capture: always · hip: ROCm only · delivery, inline: R3_MODE not off · pointer: R3_SIDECAR_URL
    groups: tuple[str, ...]
    settle: str | None = None  # calls the original with other arguments: how the guard ends SGLang's call (`guard`)


AROUND, REPLACE = HookType.AROUND, HookType.REPLACE
HOOKS: tuple[Hook, ...] = (
    # capture: sizing, sync-free DP slicing, overflow checks, occupancy (scheduler)
    Hook(f"{_RE}.create", "_create_sized_capturer", AROUND, ("capture",)),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
        "_record_forward_extent",
        AROUND,
        ("capture",),
    ),
    Hook(f"{_RE}._get_local_slice", "_get_local_slice", REPLACE, ("capture",)),
    Hook(  # occupancy; host rows
        f"{_RE}.on_forward_end", "_around_forward_end", AROUND, ("capture", "delivery"), "_settle_forward_end"
    ),
    Hook("sglang.srt.state_capturer.base.BaseDeviceCache.capture", "_checked_device_capture", AROUND, ("capture",)),
    Hook("sglang.srt.runtime_context.cutedsl_moe_max_num_tokens", "_cutedsl_moe_max_num_tokens", REPLACE, ("capture",)),
    Hook(
        "sglang.srt.layers.attention.triton_backend.TritonMultiStepDraftBackend.common_template",
        "_checked_draft_kv_indices",
        AROUND,
        ("capture",),
    ),
    Hook(  # aiter_backend imports only where aiter is installed
        "sglang.srt.layers.attention.aiter_backend.AiterMultiStepDraftBackend.common_template",
        "_checked_draft_kv_indices",
        AROUND,
        ("hip",),
    ),
    # delivery: finished and live rows to the spool, off the scheduler thread (scheduler)
    Hook(f"{_BRP}._maybe_collect_routed_experts", "_around_collect", AROUND, ("delivery",)),
    Hook(f"{_BRP}.process_batch_result_prefill", "_around_process_result", AROUND, ("delivery",)),
    Hook(f"{_BRP}.process_batch_result_decode", "_around_process_result", AROUND, ("delivery",)),
    Hook(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
        "_around_disagg_prefill_done",
        AROUND,
        ("delivery",),
    ),
    Hook("sglang.srt.state_capturer.base.TopkCaptureOutput.finalize", "_around_finalize", AROUND, ("delivery",)),
    Hook("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", "_around_arrival", AROUND, ("delivery",)),
    # pointer: `routed_experts_url` in meta_info and in the OpenAI responses' `sglext` (main process);
    # inline: the shape and start of rows a response carries inline (`frontdoors.inline_shape`)
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
        "_around_handle_batch_output",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        "sglang.srt.beam_search.output.try_build_beam_search_out_dict",
        "_around_build_out_dict",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_completions.OpenAIServingCompletion._build_completion_response",
        "_around_openai_response",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_chat.OpenAIServingChat._build_chat_response",
        "_around_openai_response",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_completions.OpenAIServingCompletion._generate_completion_stream",
        "_around_openai_stream",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook(
        f"{_OPENAI}.serving_chat.OpenAIServingChat._generate_chat_stream",
        "_around_openai_stream",
        AROUND,
        ("pointer", "inline"),
    ),
    Hook("sglang.srt.entrypoints.engine.Engine.shutdown", "_around_engine_shutdown", AROUND, ("pointer",)),
)


def install(settings: EngineSettings) -> None:
    """Register every hook this plugin needs for `settings`, each behind its guard (`guard.py`)."""
    _step_aside_on_failure(settings)
    install_capture_hooks(settings)
    install_budget_hooks(settings)
    if settings.mode is not Mode.OFF:
        install_delivery_hooks(settings)


_registered: set[Hook] = set()  # a row wanted by two groups (on_forward_end) is registered once


def _register(*groups: str) -> None:
    for hook in HOOKS:
        if hook not in _registered and set(hook.groups) & set(groups):
            where = compat.hook(hook.target, hook.function)  # this version's target and function for the row
            if where is not None:
                target, name = where
                fn, settle = timers.untimed(globals()[name]), globals()[hook.settle] if hook.settle else None
                fn = guard.wrap(name, target, fn, replace=hook.type is REPLACE, settle=settle)
                HookRegistry.register(target, fn, AROUND)  # behind its guard: SGLang's own code if ours fails
            _registered.add(hook)


def degraded_report(settings: EngineSettings):
    """The engine file of a process whose hooks fell back to SGLang's own and that writes none otherwise: its
    `degraded` part says which hook failed and how (a started `telemetry.Telemetry`)."""
    import os
    from importlib.metadata import version

    from engine_ext.core.telemetry import Sources, Telemetry

    try:
        publisher, dp_rank = _attention_ranks()
    except Exception:  # a process without SGLang's parallel state (the main process): it names itself
        publisher, dp_rank = True, None
    engine = settings.engine_name(dp_rank)  # without DP it names this process (`/pid<pid>`)
    if dp_rank is not None and not publisher:  # the group's name is its publishing rank's file
        engine = f"{engine}/pid{os.getpid()}"
    return Telemetry(
        spool_dir=settings.spool_dir,
        engine=engine,
        dp_rank=dp_rank,
        sources=Sources(),
        interval_s=settings.telemetry_interval_s,
        sglang=version("sglang"),
    ).start()


def _step_aside_on_failure(settings: EngineSettings) -> None:
    """What a failed hook or plugin thread makes of this process: every hook runs SGLang's own code, loudly."""
    guard.Guard.on_step_aside[:] = [lambda: PROCESS.step_aside(lambda: degraded_report(settings))]
    ON_THREAD_FAILURE[:] = [guard.thread_failed]


def install_capture_hooks(settings: EngineSettings) -> None:
    """Correct capturer sizing and sync-free DP slicing, check writes against capacities, track occupancy."""
    from sglang.srt.utils import is_hip

    timers.configure(settings.hook_timers)
    _register("capture", *(("hip",) if is_hip() else ()))


# ---- capture: capturer sizing, DP slicing, runtime assertions, occupancy --------------------------------

_DECODE_EXTENT_ATTR = "r3_decode_graph_extent"  # set on each ForwardBatch by _record_forward_extent
_SLICE_ATTR = "_r3_last_slice"  # the capturer's LocalSlice of the current forward, for occupancy
_GATHERED_ATTR = "_r3_gathered"  # on capturers built by _create_sized_capturer: MoE sees the DP-gathered batch
_OCCUPANCY_ATTR = "_r3_occupancy"  # … and their device-cache Occupancy


def capture_limits(model_config, max_running_requests: int):
    """The published settings that bound one forward's rows on one DP rank (`capturer.CaptureLimits`)."""
    read = compat.read
    graphs = read("cuda_graph_config")
    decode_max_bs = prefill_max_tokens = 0
    if graphs is not None:
        if graphs.decode.backend != _GRAPH_OFF:
            decode_max_bs = max([graphs.decode.max_bs or 0, *(graphs.decode.bs or ())])
        if graphs.prefill.backend != _GRAPH_OFF:  # BREAKABLE, FULL (and the legacy TC_PIECEWISE)
            prefill_max_tokens = max([graphs.prefill.max_bs or 0, *(graphs.prefill.bs or ())])
    return capturer.CaptureLimits(
        max_running_requests=max_running_requests,
        chunked_prefill_size=read("chunked_prefill_size"),
        context_len=int(getattr(model_config, "context_len", 0) or 0),
        max_prefill_tokens=read("max_prefill_tokens") or 0,
        prefill_graph_max_tokens=prefill_max_tokens,
        decode_graph_max_bs=decode_max_bs,
        tokens_per_req=_tokens_per_req(),
        attn_tp_size=read("attn_tp_size"),
    )


_GRAPH_OFF = "disabled"  # `cuda_graph_config.Backend.DISABLED` (a str constant; ≤ 0.5.12 has no such module)


def _tokens_per_req() -> int:
    """Tokens one request adds to a decode/verify forward: the draft tokens under speculative decoding."""
    if compat.read("speculative_algorithm"):
        return compat.read("speculative_num_draft_tokens") or 1
    return 1


def _moe_sees_gathered_batch() -> bool:
    """DP attention whose MoE routes the DP-gathered batch (no all-to-all backend, FP4 all-gather or DWDP).

    0.5.23's capturer exempts only DeepEP; under the other all-to-all backends (Mooncake, MORI, FlashInfer,
    MegaMoE, …) TopK also routes the DP-local shard, so their rows sit at offset 0, not at the rank's offset.
    """
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    return is_dp_attention_enabled() and not compat.function("moe_input_scattered")()


def _create_sized_capturer(original, *args, **kwargs):
    """`RoutedExpertsCapturer.create` with the device cache sized `N · max(P, graph_max_bs · w)`.

    0.5.23 sizes it `num_dp_ranks · max(chunked_prefill_size, max_running_requests)`; raising the
    `max_running_requests` it is given to the per-rank worst case makes its own constructor allocate the
    corrected size (nothing else reads that argument), so DeepEP gather buffers and the host cache stay upstream's.
    """
    import logging

    model_config, max_running_requests = kwargs["model_config"], kwargs["max_running_requests"]
    limits = capture_limits(model_config, max_running_requests)
    num_dp_ranks = compat.read("num_dp_ranks")
    gathered = num_dp_ranks if _moe_sees_gathered_batch() else 1
    rows = capturer.device_rows(limits, gathered)
    kwargs["max_running_requests"] = max(max_running_requests, -(-rows // num_dp_ranks))
    created = original(*args, **kwargs)
    if created is None:  # enable_return_routed_experts is off
        return None
    capacity = created.device_cache.buffer.shape[0]
    created._r3_remedy = (
        f"sized {limits.formula(gathered)} = {rows} rows; lower --chunked-prefill-size, --max-running-requests, "
        "--cuda-graph-max-bs or --speculative-num-draft-tokens"
    )
    setattr(created, _GATHERED_ATTR, gathered > 1)
    setattr(created, _OCCUPANCY_ATTR, capturer.track(capturer.DEVICE_CACHE, capacity))
    logging.getLogger("r3_sidecar").info(
        "r3-sidecar: routed-experts device cache %d rows (upstream %d): %s",
        capacity,
        capturer.upstream_device_rows(limits.chunked_prefill_size or 0, max_running_requests, num_dp_ranks),
        limits.formula(gathered),
    )
    return created


_kinds: dict = {}  # SGLang's ForwardMode → `timers` kind, built at the first forward


def _forward_kind(mode) -> int:
    """The `timers` kind of a ForwardMode: extend (prefill, mixed chunks), decode, verify, idle, other."""
    kind = _kinds.get(mode)
    if kind is None:
        if mode.is_target_verify():
            kind = timers.VERIFY
        elif mode.is_extend():
            kind = timers.EXTEND
        elif mode.is_decode():
            kind = timers.DECODE
        elif mode.is_idle():
            kind = timers.IDLE
        else:
            kind = timers.OTHER
        _kinds[mode] = kind
    return kind


@timed(timers.FORWARD_EXTENT)
def _record_forward_extent(original, runner, forward_batch, *args, **kwargs):
    """Stamp the ForwardBatch with the decode/verify graph extent when that graph is what ran.

    Only a forward with per-rank token counts (DP attention, where `_get_local_slice` places rows by the
    extent) can tell which graph ran: the decode-graph path of `_forward_raw` returns before
    `_prepare_eager_forward_batch`, whose `prepare_mlp_sync_batch` is the only writer of the padded counts
    (always a new list), while the prefill-graph (piecewise) path also reports `can_run_graph`, after that
    padding. Identity, not None-ness, so a re-run on the same batch is told apart too. Without counts both
    paths leave them None, and the graph runner's `bs` exists only once it replayed (`replay_prepare`, every
    version): reading it after a piecewise prefill, before any decode replay, was 0.5.12's first-forward crash.
    """
    TIMERS.kind = _forward_kind(forward_batch.forward_mode)
    setattr(forward_batch, _DECODE_EXTENT_ATTR, None)
    layout = compat.layout()
    padded = layout.padded_counts
    counted = forward_batch.global_num_tokens_cpu is not None
    padded_before = getattr(forward_batch, padded)
    output = original(runner, forward_batch, *args, **kwargs)
    if counted and output.can_run_graph and getattr(forward_batch, padded) is padded_before:
        graph = getattr(runner, layout.decode_graph_runner)
        ragged = getattr(graph, "_ragged_graph_size", None) if getattr(graph, "ragged_verify_mode", False) else None
        setattr(
            forward_batch,
            _DECODE_EXTENT_ATTR,
            slicing.DecodeGraphExtent(graph.bs, getattr(graph, layout.graph_req_width), ragged),
        )
    return output


_dp_slot_cache: list = []


def _dp_slot_functions():
    """`dp_slot_in`, `dp_gather_slot` as this version names them, looked up once (this runs once per forward)."""
    if not _dp_slot_cache:
        _dp_slot_cache.extend((compat.function("dp_slot_in"), compat.function("dp_gather_slot")))
    return _dp_slot_cache


def _get_local_slice(self, forward_batch, can_run_graph, cuda_graph_batch):
    """This rank's device-cache rows, offsets from `slicing.local_slice` (host integers only)."""
    local_tokens = forward_batch.out_cache_loc.shape[0]
    gathered = getattr(self, _GATHERED_ATTR, None)
    if gathered is None:  # a capturer this plugin did not build
        gathered = _moe_sees_gathered_batch()
    if gathered:
        dp_slot_in, dp_gather_slot = _dp_slot_functions()
        padded = getattr(forward_batch, compat.layout().padded_counts)
        counts = forward_batch.global_num_tokens_cpu
        per_rank = padded if padded is not None else counts
        extent = getattr(forward_batch, _DECODE_EXTENT_ATTR, None) if can_run_graph else None
        if can_run_graph and extent is None and padded is None:
            raise ValueError(
                "r3-sidecar: a CUDA-graph forward under DP attention with neither a recorded decode-graph extent "
                "(ModelRunner._forward_raw hook) nor ForwardBatch.global_num_tokens_padded_cpu: cannot place rows"
            )
        rank = dp_slot_in(per_rank) if per_rank is not None else dp_gather_slot()
        where = slicing.local_slice(
            rank=rank, local_tokens=local_tokens, decode_graph=extent, padded_counts=padded, counts=counts
        )
    else:
        where = slicing.LocalSlice(0, local_tokens, local_tokens)
    rows = self.device_cache.buffer.shape[0]
    if where.stop > rows or where.gathered_rows > rows:
        capturer.check_fits(
            max(where.stop, where.gathered_rows),
            rows,
            what="routed-experts device cache",
            remedy=getattr(self, "_r3_remedy", "r3-sidecar did not size this capturer"),
        )
    setattr(self, _SLICE_ATTR, where)
    return self.device_cache.buffer[where.start : where.stop, :, : self.topk_size]


def _checked_device_capture(original, self, layer_id, topk_indices):
    """Fail with the setting to change, instead of a shape-mismatch RuntimeError, when a write overflows.

    It runs inside the model's forward, which SGLang's piecewise CUDA graphs and `--enable-torch-compile` trace
    with Dynamo (`fullgraph=True`): a shape test and nothing else there, so the compiled graph is upstream's
    (a static shape folds the test away; a dynamic one becomes a guard). No clock, counter or flag: what Dynamo
    would freeze at trace time, or skip. Eager forwards (the warmup, every CUDA-graph capture) also note the
    routed layers until they are known (`capturer.ROUTED_LAYERS`); compiled code never sees that branch.
    """
    if topk_indices.shape[0] > self.buffer.shape[0]:
        _overflow(self, layer_id, topk_indices.shape[0])
    if not _compiling():
        _note_routed_layer(self, layer_id)
    return original(self, layer_id, topk_indices)


def _note_routed_layer(cache, layer_id) -> None:
    if capturer.ROUTED_LAYERS.known is None and cache.name == "routed_experts":
        capturer.ROUTED_LAYERS.note(layer_id)


def _overflow(cache, layer_id, rows: int) -> None:
    capturer.check_fits(
        rows,
        cache.buffer.shape[0],
        what=f"{cache.name} device cache (layer {layer_id})",
        remedy="lower --chunked-prefill-size, --max-running-requests, --cuda-graph-max-bs or "
        "--speculative-num-draft-tokens, or install r3-sidecar's capturer sizing (sglang.srt.plugins)",
    )


def _cutedsl_moe_max_num_tokens() -> int:
    """`runtime_context.cutedsl_moe_max_num_tokens` counting BREAKABLE and FULL prefill graphs too."""
    return _cutedsl_tokens(compat.read("cuda_graph_config"), compat.read("max_prefill_tokens"), _tokens_per_req())


def _cutedsl_method(server_args) -> int:
    """The same bound where it is a `ServerArgs` method (≤ 0.5.16), read off that (maybe unpublished) ServerArgs."""
    spec = server_args.speculative_num_draft_tokens if server_args.speculative_algorithm else 1
    return _cutedsl_tokens(server_args.cuda_graph_config, server_args.max_prefill_tokens, spec or 1)


def _cutedsl_tokens(graphs, max_prefill_tokens: int, tokens_per_req: int) -> int:
    prefill_graph = decode_max_bs = 0
    if graphs is not None:
        if graphs.prefill.backend != _GRAPH_OFF:
            prefill_graph = max([graphs.prefill.max_bs or 0, *(graphs.prefill.bs or ())])
        decode_max_bs = graphs.decode.max_bs or 0
    return capturer.cutedsl_moe_tokens(
        max_prefill_tokens=max_prefill_tokens,
        prefill_graph_max_tokens=prefill_graph,
        decode_graph_max_bs=decode_max_bs,
        tokens_per_req=tokens_per_req,
    )


def _checked_draft_kv_indices(original, self, forward_batch, kv_indices_buffer, call_fn, *args, **kwargs):
    """The EAGLE draft kv_indices bound FlashInfer asserts, for the Triton and AITER multi-step backends."""
    buffer = kv_indices_buffer if kv_indices_buffer is not None else getattr(self, "cuda_graph_kv_indices", None)
    if buffer is not None:
        capturer.draft_kv_indices_fits(
            seq_lens_sum=forward_batch.seq_lens_sum,
            topk=self.topk,
            num_seqs=forward_batch.batch_size,
            num_steps=self.speculative_num_steps,
            width=buffer.shape[1],
        )
    return original(self, forward_batch, kv_indices_buffer, call_fn, *args, **kwargs)


# ---- budget: pre-launch check ----------------------------------------------------------------------------


# The last resolution step (pipeline.py): speculative, CUDA-graph and MoE settings are final by then.
# A dummy/none model path returns from the pipeline before it; the offline CLI covers that case.
BUDGET_RESOLUTION_STEP = "validate_deepep_v2_dispatch_token_budget"
_budget_hook_registered: list[bool] = []  # one registration per process, however often register() runs


def install_budget_hooks(settings: EngineSettings) -> None:
    """Check every buffer's budget once the server arguments are final (main process, at resolution)."""
    from functools import partial

    if _budget_hook_registered:
        return
    if not compat.layout().budget_at_resolution:
        import logging

        logging.getLogger("r3_sidecar").info(
            "r3-sidecar: sglang==%s has no resolution hooks: no buffer budget check at start (r3-budget prints it)",
            compat.layout().version,
        )
        _budget_hook_registered.append(True)
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook(BUDGET_RESOLUTION_STEP)(partial(_check_budget_at_resolution, settings))
    _budget_hook_registered.append(True)


def _check_budget_at_resolution(settings: EngineSettings, server_args, previous) -> None:
    """Run the built-in step, then log the table; under `R3_BUDGET=enforce` refuse a blocking shortfall."""
    import logging

    from engine_ext.core.settings import BudgetPolicy
    from engine_ext.sglang.budget import blocking_rows, format_table, refusal_message

    previous(server_args)
    log = logging.getLogger("r3_sidecar")
    try:
        rows = budget_table(server_args)
    except Exception:  # a defect in the check itself must not stop a launch SGLang accepted
        log.exception("r3-sidecar: the buffer budget check failed; starting without it")
        return
    blocking = blocking_rows(rows)
    log.log(logging.WARNING if blocking else logging.INFO, "r3-sidecar buffer budget:\n%s", format_table(rows))
    if blocking and settings.budget is BudgetPolicy.ENFORCE:
        raise ValueError(refusal_message(rows))
    _check_layout(settings, server_args)


def _check_layout(settings: EngineSettings, server_args) -> None:
    """Refuse (under enforce) or warn about a process layout where no rows and no pointer can reach a trainer."""
    import logging

    from engine_ext.core.settings import BudgetPolicy
    from engine_ext.sglang.frontdoors import layout_refusal

    workers = int(getattr(compat.function("resolving_view")(server_args), "tokenizer_worker_num", 1) or 1)
    refusal = layout_refusal(
        mode=settings.mode, capture_all=settings.capture_all, unreachable=_pointer_unreachable(settings, workers)
    )
    if refusal is None:
        return
    if settings.budget is BudgetPolicy.ENFORCE:
        raise ValueError(refusal)
    logging.getLogger("r3_sidecar").warning("%s (R3_BUDGET=warn: starting anyway)", refusal)


def _pointer_unreachable(settings: EngineSettings, tokenizer_worker_num: int | None = None) -> str | None:
    """Why this launch's responses cannot carry `routed_experts_url` (None: they can, or none is configured)."""
    from engine_ext.sglang.frontdoors import pointer_unreachable

    if not settings.sidecar_url:  # no pointer anywhere: trainers fetch by rid from a sidecar they know
        return None
    if tokenizer_worker_num is None:
        tokenizer_worker_num = int(compat.read("tokenizer_worker_num") or 1)
    return pointer_unreachable(tokenizer_worker_num=tokenizer_worker_num, rust_server=bool(compat.read("rust_server")))


def rust_server_note(settings: EngineSettings) -> str | None:
    """What still works under SGLang's Rust front end (`SGLANG_RUST_SERVER`), or None when it is off."""
    from engine_ext.sglang.frontdoors import rust_server_note as note

    return note(bool(compat.read("rust_server")), settings.mode)


def budget_table(server_args) -> list:
    """Budget rows of a `ServerArgs` under resolution or resolved (model config read when the path has one)."""
    from engine_ext.sglang.budget import budget_rows
    from engine_ext.sglang.budget_inputs import inputs_from_server_args

    return budget_rows(inputs_from_server_args(server_args, _budget_model_config(server_args)))


def _budget_model_config(server_args):
    if str(compat.function("resolving_view")(server_args).model_path).lower() in ("dummy", "none"):
        return None
    try:
        return compat.function("model_config_of")(server_args)
    except Exception:  # the table does without layers/topk/context; resolution reports a bad model itself
        return None


# ---- delivery: collection, writer, live rows, telemetry, pointer -----------------------------------------


def install_delivery_hooks(settings: EngineSettings) -> None:
    """Deliver finished (and, when asked, live) rows to the spool without blocking the scheduler.

    Scheduler process: the `Delivery` of `engine_ext/sglang/delivery.py`, built at the first batch result (other
    processes never build it). Main process: the `routed_experts_url` pointer in `meta_info` and `sglext`
    when `R3_SIDECAR_URL` is set, and the shape and start of rows a response carries inline.
    """
    PROCESS.configure(settings)
    _register("delivery", "inline", *(("pointer",) if settings.sidecar_url else ()))
    point_workers_here(compat.layout().worker_app_env)
    worker_app.register(compat.layout().worker_app_call)  # ≤ 0.5.20: the literal app path, retargeted


def point_workers_here(env_name: str | None, environ: MutableMapping[str, str] = os.environ) -> bool:
    """Have SGLang's tokenizer worker processes (`--tokenizer-worker-num > 1`) import `http_worker`'s app, which
    applies the "inline" hooks there (True); not where this SGLang names no such setting (`env_name` None), nor
    where the launch set it to an app of its own, which it keeps (False, said in the log at start)."""
    if env_name is None:
        return False
    current = environ.get(env_name)
    if current in (None, "", SGLANG_APP, WORKER_APP):
        environ[env_name] = WORKER_APP
        return True
    logging.getLogger("r3_sidecar").warning(
        "r3-sidecar: %s=%s is the launch's own: with --tokenizer-worker-num > 1 the inline rows of responses do "
        "not say their shape and start (routed_experts_shape, routed_experts_start_len)",
        env_name,
        current,
    )
    return False


def install_worker_hooks(settings: EngineSettings) -> None:
    """In a tokenizer worker process (`http_worker`): the "inline" hooks only. No pointer: none can be attached
    there (`frontdoors.MULTI_TOKENIZER`), so the worker's settings have no sidecar URL."""
    _step_aside_on_failure(settings)
    PROCESS.configure(settings.model_copy(update={"sidecar_url": None}))
    _register("inline")


def _delivery_for(processor) -> Delivery | None:
    """This process's delivery, built at the first batch result that has a capturer."""
    return PROCESS.current(lambda settings: _build_delivery(settings, processor))


def _build_delivery(settings: EngineSettings, processor) -> Delivery | None:
    """Read the plain values a `Delivery` needs off the capturer, the model config and the runtime context."""
    from importlib.metadata import version

    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    from engine_ext.sglang.capturer import occupancy_snapshot

    experts = get_global_experts_capturer()
    if experts is None:
        return None
    publisher, dp_rank = _attention_ranks()
    placement = Placement(
        publisher=publisher,
        dp_rank=dp_rank,
        spec_tree=_eagle_topk() > 1,
        unreachable=_pointer_unreachable(settings),
        sglang=version("sglang"),
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


def _attention_ranks() -> tuple[bool, int | None]:
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


def _finished_of(req) -> Finished:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    prompt_len = len(req.origin_input_ids)
    return Finished(
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
        PROCESS.delivery.collector.mirror(req.rid, req.routed_experts)
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
    TIMERS.kind = _forward_kind(batch.forward_mode)
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
    setattr(self, _SLICE_ATTR, None)
    if capturer.ROUTED_LAYERS.known is None:
        capturer.ROUTED_LAYERS.close()
    out = _forward_end_rows(original, self, params)
    where = getattr(self, _SLICE_ATTR, None)
    occupancy = getattr(self, _OCCUPANCY_ATTR, None)
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


# ---- delivery, main process: the pointer ---------------------------------------------------------------

_pointer_rids: ContextVar[frozenset[str] | None] = ContextVar("r3_pointer_rids", default=None)
_inline_shapes: ContextVar[dict[str, dict] | None] = ContextVar("r3_inline_shapes", default=None)
PROMISED = Promised()


async def _around_handle_batch_output(original, self, recv_obj, *args, **kwargs):
    """Note which rids of this batch get a pointer (the meta_info hook has no `self`): those that asked, less
    those whose rows the spool refused in sidecar mode (`frontdoors.pointer_rids`); and the shape and start of
    each output's inline rows (`frontdoors.inline_shape`)."""
    settings = PROCESS.settings
    states, rids = self.rid_to_state, list(recv_obj.rids)
    asked = [
        (settings is not None and settings.capture_all)
        or ((state := states.get(rid)) is not None and bool(getattr(state.obj, "return_routed_experts", False)))
        for rid in rids
    ]
    mode = settings.mode if settings is not None else Mode.OFF
    inline = getattr(recv_obj, "routed_experts", None)
    refused = frontdoors.refused_rids(rids, asked, inline, mode)
    wanted = frontdoors.pointer_rids(rids, asked, refused)
    if settings is not None and settings.sidecar_url:  # their `error` records, for the shutdown wait
        for rid in refused:
            PROMISED.add(rid)
    shapes = _inline_shapes_of(self, list(recv_obj.rids), getattr(recv_obj, "routed_experts", None))
    token, shapes_token = _pointer_rids.set(wanted), _inline_shapes.set(shapes)
    try:
        return await original(self, recv_obj, *args, **kwargs)
    finally:
        _pointer_rids.reset(token)
        _inline_shapes.reset(shapes_token)


def _inline_shapes_of(manager, rids: list[str], inline: list | None, obj=None) -> dict[str, dict]:
    """rid → `meta_info` fields saying the shape and start of the rows this batch carries inline for it (the start
    from the request `obj` when given, else from the request state the manager still holds)."""
    if not inline:
        return {}
    layers, topk = _model_numbers(manager)
    shapes = {}
    for rid, payload in zip(rids, inline, strict=False):
        state = manager.rid_to_state.get(rid) if obj is None else None
        request = obj if obj is not None else getattr(state, "obj", None)
        start = getattr(request, "routed_experts_start_len", 0)
        fields = frontdoors.inline_shape(
            payload, num_hidden_layers=layers, topk=topk, start_len=start if isinstance(start, int) else 0
        )
        if fields:
            shapes[rid] = fields
    return shapes


def _model_numbers(manager) -> tuple[int, int]:
    """(num_hidden_layers, topk) of the served model, off a tokenizer manager: the width of SGLang's inline rows."""
    hf = manager.model_config.hf_text_config
    return int(hf.num_hidden_layers), int(getattr(hf, "num_experts_per_tok", 0) or 0)


def _around_build_out_dict(original, recv_obj, i, meta_info, *args, **kwargs):
    """Runs once per output right after `meta_info` is complete: add `routed_experts_url`, and the shape and
    start of inline rows."""
    from engine_ext.core.records import routed_experts_url

    settings = PROCESS.settings
    wanted = _pointer_rids.get()
    rid = meta_info.get("id") if isinstance(meta_info, dict) else None
    if settings is not None and settings.sidecar_url and wanted is not None and rid in wanted:
        meta_info["routed_experts_url"] = routed_experts_url(settings.sidecar_url, rid)
        PROMISED.add(rid)
    shape = (_inline_shapes.get() or {}).get(rid) if rid is not None else None
    if shape and meta_info.get("routed_experts") is not None:
        meta_info.update(shape)
    return original(recv_obj, i, meta_info, *args, **kwargs)


async def _around_wait_one_response(original, self, obj, *args, **kwargs):
    """Where meta_info is built inline (≤ 0.5.16): add `routed_experts_url` to each response of a request that
    asked, less those whose rows the spool refused in sidecar mode (they still carry the inline payload); and
    the shape and start of inline rows."""
    from engine_ext.core.records import routed_experts_url

    settings = PROCESS.settings
    asked = settings is not None and bool(settings.sidecar_url)
    asked = asked and (settings.capture_all or bool(getattr(obj, "return_routed_experts", False)))
    async for out in original(self, obj, *args, **kwargs):
        meta = out.get("meta_info") if isinstance(out, dict) else None
        rid = meta.get("id") if isinstance(meta, dict) else None
        if asked:
            inline = [meta.get("routed_experts")] if isinstance(meta, dict) else None
            refused = rid is not None and rid in frontdoors.refused_rids([rid], [True], inline, settings.mode)
            if rid is not None and not refused:
                meta["routed_experts_url"] = routed_experts_url(settings.sidecar_url, rid)
            if rid is not None:  # a pointer's record, or the refused rows' `error` record
                PROMISED.add(rid)
        if rid is not None and meta.get("routed_experts") is not None:
            meta.update(_inline_shapes_of(self, [rid], [meta["routed_experts"]], obj).get(rid) or {})
        yield out


def _around_engine_shutdown(original, self, *args, **kwargs):
    """`sglang.Engine.shutdown` kills the scheduler (SIGKILL): first let the records that this process's responses
    promised become final, for at most `R3_SHUTDOWN_WAIT_S` (`core.promised`)."""
    settings = PROCESS.settings
    if settings is not None and settings.sidecar_url and settings.mode is not Mode.OFF:
        PROMISED.settle(settings.spool_dir, settings.shutdown_wait_s)
    return original(self, *args, **kwargs)


# ---- delivery, main process: the pointer in the OpenAI-compatible responses' `sglext` -------------------

_sglext_models: dict[type, type] = {}


def _with_pointer_model(response_cls: type) -> type:
    """`response_cls` whose `sglext` also has `routed_experts_url(s)` (SGLang's `SglExt` drops unknown fields)."""
    cls = _sglext_models.get(response_cls)
    if cls is None:
        from typing import Optional

        from pydantic import create_model
        from sglang.srt.entrypoints.openai.protocol import SglExt

        ext = _sglext_models.get(SglExt)
        if ext is None:
            ext = create_model(
                "SglExt",
                __base__=SglExt,
                routed_experts_url=(Optional[str], None),  # noqa: UP045 (pydantic field spelling)
                routed_experts_urls=(Optional[list[Optional[str]]], None),  # noqa: UP045
                routed_experts_shape=(Optional[list[int]], None),  # noqa: UP045
                routed_experts_start_len=(Optional[int], None),  # noqa: UP045
            )
            _sglext_models[SglExt] = ext
        cls = create_model(response_cls.__name__, __base__=response_cls, sglext=(Optional[ext], None))  # noqa: UP045
        _sglext_models[response_cls] = cls
    return cls


def _around_openai_response(original, self, request, ret, *args, **kwargs):
    """Non-streaming `/v1/completions`, `/v1/chat/completions`: copy the choices' pointers into `sglext`, and the
    shape and start of the first choice's inline rows (upstream's `sglext.routed_experts`)."""
    response = original(self, request, ret, *args, **kwargs)
    from sglang.srt.entrypoints.openai.protocol import SglExt

    urls = [(item.get("meta_info") or {}).get("routed_experts_url") for item in ret]
    pointer = frontdoors.sglext_pointer(urls) or {}
    old = getattr(response, "sglext", None)
    if old is not None and getattr(old, "routed_experts", None) is not None and ret:
        first = ret[0].get("meta_info") or {}
        pointer |= {k: first[k] for k in ("routed_experts_shape", "routed_experts_start_len") if k in first}
    if not pointer or not hasattr(response, "sglext"):  # an ORJSONResponse (e.g. return_meta_info)
        return response
    cls = _with_pointer_model(type(response))
    ext_cls = _sglext_models[SglExt]
    old = response.sglext
    fields = {name: getattr(old, name) for name in SglExt.model_fields} if old is not None else {}
    values = {name: getattr(response, name) for name in type(response).model_fields}
    values["sglext"] = ext_cls(**fields, **pointer)
    return cls.model_construct(**values)


async def _around_openai_stream(original, self, adapted_request, request, raw_request, *args, **kwargs):
    """Streaming `/v1/completions`, `/v1/chat/completions`: the choices' pointers in an `sglext` chunk, and the
    shape and start of the inline rows in the chunk that carries them (SGLang's own `sglext` chunk)."""
    settings = PROCESS.settings
    stream = None
    if settings is not None and (getattr(request, "return_routed_experts", False) or settings.capture_all):
        layers, topk = _model_numbers(self.tokenizer_manager)
        start = getattr(request, "routed_experts_start_len", 0)
        stream = frontdoors.PointerStream(
            base_url=settings.sidecar_url,
            n=int(getattr(request, "n", 1) or 1),
            object_name="chat.completion.chunk" if hasattr(request, "messages") else "text_completion",
            model=getattr(request, "model", None),
            shape_of=partial(
                frontdoors.inline_shape,
                num_hidden_layers=layers,
                topk=topk,
                start_len=start if isinstance(start, int) else 0,
            ),
        )
    async for chunk in original(self, adapted_request, request, raw_request, *args, **kwargs):
        if stream is None:
            yield chunk
            continue
        for piece in stream.feed(chunk):  # fails: the guard passes this chunk and the rest on as SGLang made them
            yield piece
