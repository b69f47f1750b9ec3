"""Where each proven SGLang keeps what the hooks patch and read, as data: targets, settings, helpers.

Why: the hooks are written in 0.5.23's spelling, and the trainers pin older SGLangs (docs/versions.md) whose
settings sit on other objects and whose helpers have other names. A version's `Layout` lists only what
differs from 0.5.23; `use(version)` makes it this process's layout before any hook is registered, and the
hook bodies read through `target`, `read` and `function`, so they hold no version check of their own.
A setting is spelled `module.getter().attribute.attribute`: the getter is imported at its first read.
"""

from __future__ import annotations

import operator
import pkgutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NEWEST = "0.5.23"  # the release the hooks are spelled for: its layout is empty
_RC = "sglang.srt.runtime_context"
_DP = "sglang.srt.layers.dp_attention"
_SA = "sglang.srt.server_args.get_global_server_args()"  # ≤ 0.5.16: the settings are the global ServerArgs
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_MIX = "sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin"  # ≤ 0.5.12
_SHIMS = "engine_ext.sglang.compat_shims"  # what older SGLangs lack, written here
# Granian's server constructor (2.6-2.8: `granian.Granian` is a subclass that keeps it), which stores the target
# its spawned workers import; SGLang's `--enable-http2` extra requires granian>=2.6.0
_GRANIAN_INIT = "granian.server.common.AbstractServer.__init__"

# 0.5.23: the settings the hooks read, by the name the hooks use.
READS: Mapping[str, str] = {
    "chunked_prefill_size": f"{_RC}.get_schedule().chunked_prefill_size",
    "max_prefill_tokens": f"{_RC}.get_schedule().max_prefill_tokens",
    "speculative_algorithm": f"{_RC}.get_spec().speculative_algorithm",
    "speculative_num_draft_tokens": f"{_RC}.get_spec().speculative_num_draft_tokens",
    "speculative_eagle_topk": f"{_RC}.get_spec().speculative_eagle_topk",
    "cuda_graph_config": f"{_RC}.get_exec().graph.cuda_graph_config",
    "weight_version": f"{_RC}.get_serving().weight_version",
    "tokenizer_worker_num": f"{_RC}.get_serving().tokenizer_worker_num",
    "disaggregation_mode": f"{_RC}.get_disagg().disaggregation_mode",
    "server_args": f"{_RC}.get_server_args()",
    "num_dp_ranks": f"{_RC}.get_parallel().num_dp_ranks",  # replicas × attention-DP groups
    "attn_tp_size": f"{_RC}.get_parallel().attn_tp_size",
    "attn_tp_rank": f"{_RC}.get_parallel().attn_tp_rank",
    "dp_rank": f"{_RC}.get_parallel().dp_rank",
    "attn_dp_rank": f"{_RC}.get_parallel().attn_dp_rank",
    "attn_dp_size": f"{_RC}.get_parallel().attn_dp_size",
    "rust_server": "sglang.srt.environ.envs.SGLANG_RUST_SERVER.get()",  # the Rust HTTP front end serves
}

# 0.5.23: the SGLang functions the hooks call, by the name the hooks use.
FUNCTIONS: Mapping[str, str] = {
    "dp_slot_in": f"{_DP}.dp_slot_in",  # this rank's entry in a per-DP-replica list
    "dp_gather_slot": f"{_DP}.dp_gather_slot",  # this rank's index in the DP gather
    "moe_input_scattered": "sglang.srt.layers.moe.utils.is_moe_input_scattered_across_dp_ranks",
    "resolving_view": "sglang.srt.arg_groups.overrides.resolving_view",  # ServerArgs fields as resolved so far
    "model_config_of": "sglang.srt.arg_groups.overrides.model_config_of",  # a ServerArgs' ModelConfig
    "capture_output_to_host": f"{_SHIMS}.host_copies_by_map",  # a TopkCaptureOutput's tensors to the host
}

# 0.5.23: the classes of the objects SGLang builds at run time that the hooks read attributes off, by role (a
# role with several classes: whichever SGLang puts there, e.g. the decode graph runner on CUDA and on the CPU).
_ME = "sglang.srt.model_executor"
_SC = "sglang.srt.state_capturer"
_MGR = "sglang.srt.managers"
CLASSES: Mapping[str, tuple[str, ...]] = {
    "model_runner": (f"{_ME}.model_runner.ModelRunner",),
    "decode_graph": (
        f"{_ME}.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
        f"{_ME}.cpu_graph_runner.CPUGraphRunner",
    ),
    "runner_output": (f"{_ME}.model_runner.ModelRunnerOutput",),
    "forward_batch": (f"{_ME}.forward_batch_info.ForwardBatch",),
    "forward_mode": (f"{_ME}.forward_batch_info.ForwardMode",),
    "device_cache": (f"{_SC}.base.BaseDeviceCache",),
    "host_cache": (f"{_SC}.base.BaseHostCache",),
    "capture_output": (f"{_SC}.base.TopkCaptureOutput",),
    "capturer": (f"{_SC}.routed_experts.RoutedExpertsCapturer",),
    "schedule_batch": (f"{_MGR}.schedule_batch.ScheduleBatch",),
    "req": (f"{_MGR}.schedule_batch.Req",),
    "batch_result": (f"{_MGR}.utils.GenerationBatchResult",),
    "scheduler": (f"{_MGR}.scheduler.Scheduler",),
    "result_processor": (_BRP,),  # what the batch-result hooks get as `self`
    "allocator": ("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator",),
    "req_to_token_pool": ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool",),
    "model_config": ("sglang.srt.configs.model_config.ModelConfig",),
    "tokenized_request": (f"{_MGR}.io_struct.TokenizedGenerateReqInput",),
    "batch_output": (f"{_MGR}.io_struct.BaseBatchReq",),
    "tokenizer_manager": (_TM,),
    "req_state": (f"{_MGR}.tokenizer_manager.ReqState",),
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
    *_reads("capture_output", "_around_forward_end", "finalize", "out_cache_loc", "topk"),
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
CUTEDSL = f"{_RC}.cutedsl_moe_max_num_tokens"
OUT_DICT = "sglang.srt.beam_search.output.try_build_beam_search_out_dict"
BATCH_OUTPUT = f"{_TM}._handle_batch_output"

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


# ≤ 0.5.16: every setting is a field of the global ServerArgs.
_SERVER_ARGS_READS: Mapping[str, str] = {
    name: f"{_SA}.{name}"
    for name in (
        "chunked_prefill_size",
        "max_prefill_tokens",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
        "speculative_eagle_topk",
        "weight_version",
        "tokenizer_worker_num",
        "disaggregation_mode",
    )
} | {
    "server_args": _SA,
    "num_dp_ranks": f"{_SA}.dp_size",  # their capturers size × server_args.dp_size
    "dp_rank": f"{_SHIMS}.no_replica_rank()",
    "rust_server": f"{_SHIMS}.no_rust_server()",
}
_OLD_FUNCTIONS: Mapping[str, str] = {
    "dp_slot_in": f"{_SHIMS}.slot_in_by_attention_dp_rank",
    "dp_gather_slot": f"{_DP}.get_attention_dp_rank",
    "moe_input_scattered": f"{_SHIMS}.moe_input_scattered_without_dwdp",
    "resolving_view": f"{_SHIMS}.server_args_as_resolved",
    "model_config_of": f"{_SHIMS}.model_config_from_server_args",
}

LAYOUTS: dict[str, Layout] = {
    layout.version: layout
    for layout in (
        Layout("0.5.23"),
        Layout(  # read from the 0.5.20 wheel: the capturer sizes × `dp_size`, slices by `get_attention_dp_rank()`
            "0.5.20",
            reads={"num_dp_ranks": f"{_RC}.get_parallel().dp_size"},
            functions={
                "dp_slot_in": f"{_SHIMS}.slot_in_by_attention_dp_rank",
                "dp_gather_slot": f"{_DP}.get_attention_dp_rank",
            },
            padded_counts="global_num_tokens_cpu",  # forward_batch_info.py: prepare_mlp_sync_batch's last line
            worker_app_env=None,  # http_server.py:2496, 2761: the workers' app path is a literal
            worker_app_call="uvicorn.run",  # … handed to uvicorn.run(workers=N) in the main process
            granian_app_call=_GRANIAN_INIT,  # … and to Granian(target=…, workers=N) (http_server.py:2496)
        ),
        Layout(  # read from the 0.5.16 wheel: no settings bags in runtime_context, no resolution pipeline
            "0.5.16",
            targets={
                # a ServerArgs method there (server_args.py:5729): the same bound, read off that ServerArgs
                CUTEDSL: ("sglang.srt.server_args.ServerArgs.cutedsl_moe_max_num_tokens", "_cutedsl_method"),
                # meta_info is built inline in _handle_batch_output: the pointer goes on each response instead
                OUT_DICT: (f"{_TM}._wait_one_response", "_around_wait_one_response"),
                BATCH_OUTPUT: None,  # … which needs no per-batch note of the rids
            },
            reads=_SERVER_ARGS_READS | {"cuda_graph_config": f"{_SA}.cuda_graph_config"},
            functions=_OLD_FUNCTIONS,
            padded_counts="global_num_tokens_cpu",
            req_pool_idx="req_pool_idx",
            budget_at_resolution=False,
            verify_stride=("speculative_num_draft_tokens",),  # managers/utils.py: no speculative_output_stride
            worker_app_env=None,  # http_server.py:2357, 2581: the workers' app path is a literal
            worker_app_call="uvicorn.run",  # … handed to uvicorn.run(workers=N) in the main process
            granian_app_call=_GRANIAN_INIT,  # … and to Granian(target=…, workers=N) (http_server.py:2357)
        ),
        Layout(  # read from the 0.5.12 wheel: no runtime_context at all; the Scheduler processes batch results
            "0.5.12",
            targets={
                f"{_BRP}._maybe_collect_routed_experts": f"{_MIX}.maybe_collect_routed_experts",
                f"{_BRP}.process_batch_result_prefill": f"{_MIX}.process_batch_result_prefill",
                f"{_BRP}.process_batch_result_decode": f"{_MIX}.process_batch_result_decode",
                # CuteDSL buffers are sized inside FlashInferCuteDslMoE's constructor (moe_runner/
                # flashinfer_cutedsl.py:248), no function of their own: upstream's sizing stays
                CUTEDSL: None,
                OUT_DICT: (f"{_TM}._wait_one_response", "_around_wait_one_response"),
                BATCH_OUTPUT: None,
            },
            reads=_SERVER_ARGS_READS
            | {
                "cuda_graph_config": f"{_SHIMS}.graph_config_from_flags()",
                "attn_tp_size": f"{_DP}.get_attention_tp_size()",
                "attn_tp_rank": f"{_DP}.get_attention_tp_rank()",
                "attn_dp_rank": f"{_DP}.get_attention_dp_rank()",
                "attn_dp_size": f"{_DP}.get_attention_dp_size()",
            },
            functions=_OLD_FUNCTIONS | {"capture_output_to_host": f"{_SHIMS}.host_copies_by_fields"},
            padded_counts="global_num_tokens_cpu",  # forward_batch_info.py:921
            req_pool_idx="req_pool_idx",
            budget_at_resolution=False,
            decode_graph_runner="graph_runner",  # model_runner.py:2949, in __init__ → init_device_graphs
            graph_req_width="num_tokens_per_bs",  # cuda_graph_runner.py:642-652, cpu_graph_runner.py:509
            graph_runner_set_in=(),
            graph_batch_set_in=("replay_prepare", "prepare_replay"),  # cuda_graph_runner.py:1312, cpu_…:783
            verify_stride=("speculative_num_draft_tokens",),
            result_processor=None,
            worker_app_env=None,  # http_server.py:2094, 2293: the workers' app path is a literal
            worker_app_call="uvicorn.run",  # … handed to uvicorn.run(workers=N) in the main process
            granian_app_call=_GRANIAN_INIT,  # … and to Granian(target=…, workers=1) (http_server.py:2094)
            granian_spawns_one=True,  # _run_granian_server: Granian's multi-process server, never embedded
            classes={
                "decode_graph": (f"{_ME}.cuda_graph_runner.CudaGraphRunner", f"{_ME}.cpu_graph_runner.CPUGraphRunner"),
                "result_processor": ("sglang.srt.managers.scheduler.Scheduler",),  # its mixin's methods
                "allocator": ("sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator",),
            },
        ),
    )
}

_layout: list[Layout] = [LAYOUTS[NEWEST]]
_getters: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {}
_functions: dict[str, Callable[..., Any]] = {}


def use(version: str) -> Layout:
    """Make `version`'s layout this process's (KeyError outside `LAYOUTS`: nothing is guessed)."""
    _layout[0] = LAYOUTS[version]
    _getters.clear()
    _functions.clear()
    _pool_idx.clear()
    return _layout[0]


def layout() -> Layout:
    return _layout[0]


def hook(hook_target: str, function: str) -> tuple[str, str] | None:
    """(target, hook function) for the 0.5.23 row `hook_target` → `function` here (None: not hooked here)."""
    where = _layout[0].targets.get(hook_target, hook_target)
    if where is None or isinstance(where, tuple):
        return where
    return where, function


def target(hook_target: str) -> str | None:
    """Where this version has the 0.5.23 hook target `hook_target` (None: it is not hooked here)."""
    where = hook(hook_target, "")
    return None if where is None else where[0]


_pool_idx: list[Callable[[Any], Any]] = []


def req_pool_idx(req: Any) -> Any:
    """A Req's `req_to_token` row, where this version keeps it."""
    if not _pool_idx:
        _pool_idx.append(operator.attrgetter(_layout[0].req_pool_idx))
    return _pool_idx[0](req)


@dataclass(frozen=True)
class ClassRead:
    """One read of `ATTRIBUTES` as this version spells it: the classes that may be read, the attribute."""

    classes: tuple[str, ...]
    attribute: str
    set_in: tuple[str, ...]


def attribute_reads(functions: Collection[str] | None = None) -> list[ClassRead]:
    """This layout's `ATTRIBUTES` read by `functions` (the hook functions registered here; None: all)."""
    layout, out = _layout[0], []
    for read in ATTRIBUTES:
        if functions is None or read.by in functions:
            classes, set_in = layout.classes_of(read.role), layout.set_in(read)
            out += [ClassRead(classes, attribute, set_in) for attribute in layout.attributes(read)]
    return out


def split_read(spec: str) -> tuple[str, tuple[str, ...]]:
    """`"m.get_x().a.b"` → `("m.get_x", ("a", "b"))`."""
    getter, _, attrs = spec.partition("()")
    return getter, tuple(a for a in attrs.split(".") if a)


def read(name: str) -> Any:
    """The setting `name` (a key of `READS`) as this version keeps it."""
    got = _getters.get(name)
    if got is None:
        getter, attrs = split_read(_layout[0].read_spec(name))
        got = _getters[name] = (pkgutil.resolve_name(getter), attrs)
    value = got[0]()
    for attr in got[1]:
        value = getattr(value, attr)
    return value


def function(name: str) -> Callable[..., Any]:
    """The SGLang function `name` (a key of `FUNCTIONS`) as this version names it."""
    fn = _functions.get(name)
    if fn is None:
        fn = _functions[name] = pkgutil.resolve_name(_layout[0].function_path(name))
    return fn


def unresolved(hook_targets: Sequence[str]) -> list[str]:
    """What of this layout does not import here: retargeted hook targets, getters, functions (a version check)."""
    names = [t for t in (target(h) for h in hook_targets) if t is not None]
    names += sorted({split_read(_layout[0].read_spec(n))[0] for n in READS})
    names += [_layout[0].function_path(n) for n in FUNCTIONS]
    names += [call for call in (_layout[0].worker_app_call,) if call is not None]
    return missing(names)


def missing(names: Sequence[str]) -> list[str]:
    """The dotted names that do not import here."""
    out = []
    for name in names:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError):
            out.append(name)
    return out
