"""What the hooks touch, in 0.5.23's spelling, and the shape of one release's differences from it (`Layout`).

Why a module of its own: the hook bodies are written against 0.5.23's names, and every other release is described
as differences from these (`compat.LAYOUTS`); this is the vocabulary both share. `READS` are the settings the
hooks read (`module.getter().attribute`), `FUNCTIONS` the SGLang helpers they call, `CLASSES` the run-time objects
they read attributes off, by role, and `ATTRIBUTES` each such read (checked against a build's source by
`attributes`). The dotted prefixes below name where SGLang keeps things, for the layouts to spell their rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NEWEST = "0.5.23"  # the release the hooks are spelled for: its layout is empty
RC = "sglang.srt.runtime_context"
DP = "sglang.srt.layers.dp_attention"
SA = "sglang.srt.server_args.get_global_server_args()"  # ≤ 0.5.16: the settings are the global ServerArgs
TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
MIX = "sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin"  # ≤ 0.5.12
SHIMS = "engine_ext.sglang.compat_shims"  # what older SGLangs lack, written here
# Granian's server constructor (2.6-2.8: `granian.Granian` is a subclass that keeps it), which stores the target
# its spawned workers import; SGLang's `--enable-http2` extra requires granian>=2.6.0
GRANIAN_INIT = "granian.server.common.AbstractServer.__init__"

# 0.5.23: the settings the hooks read, by the name the hooks use.
READS: Mapping[str, str] = {
    "chunked_prefill_size": f"{RC}.get_schedule().chunked_prefill_size",
    "max_prefill_tokens": f"{RC}.get_schedule().max_prefill_tokens",
    "speculative_algorithm": f"{RC}.get_spec().speculative_algorithm",
    "speculative_num_draft_tokens": f"{RC}.get_spec().speculative_num_draft_tokens",
    "speculative_eagle_topk": f"{RC}.get_spec().speculative_eagle_topk",
    "cuda_graph_config": f"{RC}.get_exec().graph.cuda_graph_config",
    "weight_version": f"{RC}.get_serving().weight_version",
    "tokenizer_worker_num": f"{RC}.get_serving().tokenizer_worker_num",
    "disaggregation_mode": f"{RC}.get_disagg().disaggregation_mode",
    "server_args": f"{RC}.get_server_args()",
    "num_dp_ranks": f"{RC}.get_parallel().num_dp_ranks",  # replicas × attention-DP groups
    "attn_tp_size": f"{RC}.get_parallel().attn_tp_size",
    "attn_tp_rank": f"{RC}.get_parallel().attn_tp_rank",
    "dp_rank": f"{RC}.get_parallel().dp_rank",
    "attn_dp_rank": f"{RC}.get_parallel().attn_dp_rank",
    "attn_dp_size": f"{RC}.get_parallel().attn_dp_size",
    "rust_server": "sglang.srt.environ.envs.SGLANG_RUST_SERVER.get()",  # the Rust HTTP front end serves
}

# 0.5.23: the SGLang functions the hooks call, by the name the hooks use.
FUNCTIONS: Mapping[str, str] = {
    "dp_slot_in": f"{DP}.dp_slot_in",  # this rank's entry in a per-DP-replica list
    "dp_gather_slot": f"{DP}.dp_gather_slot",  # this rank's index in the DP gather
    "moe_input_scattered": "sglang.srt.layers.moe.utils.is_moe_input_scattered_across_dp_ranks",
    "resolving_view": "sglang.srt.arg_groups.overrides.resolving_view",  # ServerArgs fields as resolved so far
    "model_config_of": "sglang.srt.arg_groups.overrides.model_config_of",  # a ServerArgs' ModelConfig
    "capture_output_to_host": f"{SHIMS}.host_copies_by_map",  # a TopkCaptureOutput's tensors to the host
}

# 0.5.23: the classes of the objects SGLang builds at run time that the hooks read attributes off, by role (a
# role with several classes: whichever SGLang puts there, e.g. the decode graph runner on CUDA and on the CPU).
ME = "sglang.srt.model_executor"
SC = "sglang.srt.state_capturer"
MGR = "sglang.srt.managers"
CLASSES: Mapping[str, tuple[str, ...]] = {
    "model_runner": (f"{ME}.model_runner.ModelRunner",),
    "decode_graph": (
        f"{ME}.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
        f"{ME}.cpu_graph_runner.CPUGraphRunner",
    ),
    "runner_output": (f"{ME}.model_runner.ModelRunnerOutput",),
    "forward_batch": (f"{ME}.forward_batch_info.ForwardBatch",),
    "forward_mode": (f"{ME}.forward_batch_info.ForwardMode",),
    "device_cache": (f"{SC}.base.BaseDeviceCache",),
    "host_cache": (f"{SC}.base.BaseHostCache",),
    "capture_output": (f"{SC}.base.TopkCaptureOutput",),
    "capturer": (f"{SC}.routed_experts.RoutedExpertsCapturer",),
    "schedule_batch": (f"{MGR}.schedule_batch.ScheduleBatch",),
    "req": (f"{MGR}.schedule_batch.Req",),
    "batch_result": (f"{MGR}.utils.GenerationBatchResult",),
    "scheduler": (f"{MGR}.scheduler.Scheduler",),
    "result_processor": (BRP,),  # what the batch-result hooks get as `self`
    "allocator": ("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator",),
    "req_to_token_pool": ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool",),
    "model_config": ("sglang.srt.configs.model_config.ModelConfig",),
    "tokenized_request": (f"{MGR}.io_struct.TokenizedGenerateReqInput",),
    "batch_output": (f"{MGR}.io_struct.BaseBatchReq",),
    "tokenizer_manager": (TM,),
    "req_state": (f"{MGR}.tokenizer_manager.ReqState",),
    "draft_backend": ("sglang.srt.layers.attention.triton_backend.TritonMultiStepDraftBackend",),
}


@dataclass(frozen=True)
class Read:
    """An attribute a hook function (`by`) reads off an object of `role` without a default.

    `attribute` is 0.5.23's name, or `@field`: the name(s) a `Layout` field holds for the version (None: not
    read there). `set_in`: the methods that assign it, where the object lacks it until one of them ran (before
    the hook's read), also as `@field`; empty: the object has it once built."""

    role: str
    attribute: str
    by: str
    set_in: str | tuple[str, ...] = ()


def _reads(role: str, by: str, *attributes: str) -> tuple[Read, ...]:
    return tuple(Read(role, attribute, by) for attribute in attributes)


_EXTENT, _SLICE, _RESULT = "_record_forward_extent", "_get_local_slice", "_around_process_result"
ATTRIBUTES: tuple[Read, ...] = (
    Read("model_runner", "@decode_graph_runner", _EXTENT, set_in="@graph_runner_set_in"),
    # no version assigns `bs` at construction: the hook reads it only after a decode-graph replay
    Read("decode_graph", "bs", _EXTENT, set_in="@graph_batch_set_in"),
    *_reads("decode_graph", _EXTENT, "@graph_req_width"),
    *_reads("runner_output", _EXTENT, "can_run_graph"),
    *_reads("forward_batch", _EXTENT, "forward_mode", "global_num_tokens_cpu", "@padded_counts"),
    *_reads("forward_mode", _EXTENT, "is_target_verify", "is_extend", "is_decode", "is_idle"),
    *_reads("forward_batch", _SLICE, "out_cache_loc", "global_num_tokens_cpu", "@padded_counts"),
    *_reads("capturer", _SLICE, "device_cache", "topk_size"),
    *_reads("device_cache", "_checked_device_capture", "buffer", "name"),
    *_reads("capturer", "_create_sized_capturer", "device_cache"),
    *_reads("device_cache", "_create_sized_capturer", "buffer"),
    *_reads("capture_output", "_around_forward_end", "finalize", "out_cache_loc", "topk", "@host_copy"),
    *_reads("forward_batch", "_around_forward_end", "out_cache_loc"),
    *_reads("capture_output", "_around_finalize", "host_cache"),
    *_reads("host_cache", "_around_finalize", "buffer"),
    *_reads("schedule_batch", _RESULT, "forward_mode", "reqs", "seq_lens_cpu", "prefix_lens", "extend_lens"),
    *_reads("batch_result", _RESULT, "@verify_stride", "accept_lens"),
    *_reads("capture_output", _RESULT, "topk"),
    *_reads(
        "req",
        _RESULT,
        "origin_input_ids",
        "rid",
        "return_routed_experts",
        "sampling_params",
        "finished",
        "retraction_count",
        "is_retracted",
        "routed_experts_start_len",
        "output_ids",
        "output_ids_through_stop",
        "@req_pool_idx",
    ),
    *_reads("result_processor", _RESULT, "req_to_token_pool", "token_to_kv_pool_allocator", "model_config"),
    *_reads("req_to_token_pool", _RESULT, "req_to_token"),
    *_reads("allocator", _RESULT, "size", "available_size"),
    *_reads("model_config", _RESULT, "hf_text_config"),
    *_reads("capturer", _RESULT, "host_cache", "num_layers", "topk_size"),
    *_reads("host_cache", _RESULT, "buffer", "num_tokens"),
    *_reads("req", "_around_collect", "return_routed_experts", "rid", "routed_experts", "finished_reason"),
    *_reads("tokenized_request", "_around_arrival", "return_routed_experts", "rid", "input_ids"),
    *_reads("tokenized_request", "_around_arrival", "routed_experts_start_len"),
    *_reads("scheduler", "_around_disagg_prefill_done", "@result_processor"),
    *_reads("tokenizer_manager", "_around_handle_batch_output", "rid_to_state"),
    *_reads("req_state", "_around_handle_batch_output", "obj"),
    *_reads("batch_output", "_around_handle_batch_output", "rids"),
    *_reads("forward_batch", "_checked_draft_kv_indices", "seq_lens_sum", "batch_size"),
    *_reads("draft_backend", "_checked_draft_kv_indices", "topk", "speculative_num_steps"),
)

# 0.5.23 hook targets that older versions keep elsewhere (the names the layouts below retarget).
CUTEDSL = f"{RC}.cutedsl_moe_max_num_tokens"
OUT_DICT = "sglang.srt.beam_search.output.try_build_beam_search_out_dict"
BATCH_OUTPUT = f"{TM}._handle_batch_output"

# A retarget: the same hook function on another target (a str), another function of `hooks` on another
# target (target, function), or None: not hooked on that version (docs/versions.md says what that leaves).
Retarget = str | tuple[str, str] | None


@dataclass(frozen=True)
class Layout:
    """One SGLang version's differences from 0.5.23 in what the hooks touch (empty: 0.5.23 itself)."""

    version: str
    targets: Mapping[str, Retarget] = field(default_factory=dict)  # 0.5.23 hook target → here (`Retarget`)
    reads: Mapping[str, str] = field(default_factory=dict)  # `READS` entries spelled differently here
    functions: Mapping[str, str] = field(default_factory=dict)  # `FUNCTIONS` entries named differently here
    classes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # `CLASSES` entries elsewhere here
    # The ForwardBatch list `prepare_mlp_sync_batch` replaces with the per-rank padded token counts.
    padded_counts: str = "global_num_tokens_padded_cpu"
    req_pool_idx: str = "kv.req_pool_idx"  # a Req's slot in req_to_token
    # What a TopkCaptureOutput offers to copy its tensors to the host (`capture_output_to_host`; None: nothing, its
    # two tensor fields are copied one by one)
    host_copy: str | None = "map_device_tensors"
    budget_at_resolution: bool = True  # `arg_groups.resolution_hooks` exists: the budget check runs at start
    decode_graph_runner: str = "decode_cuda_graph_runner"  # the ModelRunner's decode/verify CUDA graph runner
    graph_req_width: str = "captured_req_width"  # … and its tokens per request
    graph_runner_set_in: tuple[str, ...] = ("init_cuda_graphs",)  # what assigns the ModelRunner that runner
    graph_batch_set_in: tuple[str, ...] = ("load_batch", "prepare_replay")  # … its `bs` (CUDA, CPU runner)
    # A GenerationBatchResult's tokens per request in a verify forward: the first that is set
    verify_stride: tuple[str, ...] = ("speculative_output_stride", "speculative_num_draft_tokens")
    result_processor: str | None = "batch_result_processor"  # the Scheduler's batch-result processor (None: itself)
    # The environment variable naming the app SGLang's tokenizer worker processes import (`http_worker`); None
    # where that path is written into SGLang (≤ 0.5.20: "sglang.srt.entrypoints.http_server:app")
    worker_app_env: str | None = "SGLANG_HTTP_SERVER_APP_PATH"
    # Where no setting names it: the call SGLang hands that literal path to, with `workers=N` (`worker_app`)
    worker_app_call: str | None = None
    # … and the call its HTTP/2 server (Granian, `--enable-http2`) gets it from, whose workers import it too
    granian_app_call: str | None = None
    # Granian serves even one tokenizer worker from a process it spawns (0.5.12: never embedded), so the
    # responses of `--enable-http2` are built where SGLang loads no plugins
    granian_spawns_one: bool = False

    def read_spec(self, name: str) -> str:
        return self.reads.get(name, READS[name])

    def function_path(self, name: str) -> str:
        return self.functions.get(name, FUNCTIONS[name])

    def classes_of(self, role: str) -> tuple[str, ...]:
        return self.classes.get(role, CLASSES[role])

    def attributes(self, read: Read) -> tuple[str, ...]:
        """The attribute(s) `read` names on this version (none: not read here)."""
        return self._named(read.attribute)

    def set_in(self, read: Read) -> tuple[str, ...]:
        return self._named(read.set_in)

    def _named(self, spec: str | tuple[str, ...]) -> tuple[str, ...]:
        value = getattr(self, spec[1:]) if isinstance(spec, str) and spec.startswith("@") else spec
        return (value,) if isinstance(value, str) else tuple(value or ())
