"""Capture hooks (scheduler, every process that forwards): the device cache sized for the worst forward, sync-free
DP slicing, a write checked against its capacity, the routed layers, the forward's kind for the hook timers.

Bodies of the "capture" rows of `hooks.HOOKS`; plain arithmetic lives in `capturer` and `slicing`. The per-layer
check (`_checked_device_capture`) runs where Dynamo traces (piecewise CUDA graphs, torch.compile): a shape test
only, no clock, counter or flag.
"""

from __future__ import annotations

import logging

from torch.compiler import is_compiling as _compiling

from engine_ext.core import startup_line
from engine_ext.sglang import capturer, compat, slicing, timers
from engine_ext.sglang.timers import TIMERS, timed

_DECODE_EXTENT_ATTR = "r3_decode_graph_extent"  # set on each ForwardBatch by _record_forward_extent


SLICE_ATTR = "_r3_last_slice"  # the capturer's LocalSlice of the current forward, for occupancy


_GATHERED_ATTR = "_r3_gathered"  # on capturers built by _create_sized_capturer: MoE sees the DP-gathered batch


OCCUPANCY_ATTR = "_r3_occupancy"  # … and their device-cache Occupancy


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

    startup_line.say_kept()  # the scheduler has configured SGLang's logging by now
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
    setattr(created, OCCUPANCY_ATTR, capturer.track(capturer.DEVICE_CACHE, capacity))
    logging.getLogger("r3_sidecar").info(
        "r3-sidecar: routed-experts device cache %d rows (upstream %d): %s",
        capacity,
        capturer.upstream_device_rows(limits.chunked_prefill_size or 0, max_running_requests, num_dp_ranks),
        limits.formula(gathered),
    )
    return created


_kinds: dict = {}  # SGLang's ForwardMode → `timers` kind, built at the first forward


def forward_kind(mode) -> int:
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
    TIMERS.kind = forward_kind(forward_batch.forward_mode)
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
    setattr(self, SLICE_ATTR, where)
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
