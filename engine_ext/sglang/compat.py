"""Where each SGLang release keeps what the hooks patch and read, as data: targets, settings, helpers.

Why: the hooks are written in 0.5.23's spelling (`layout`), and the trainers pin older SGLangs (docs/versions.md)
whose settings sit on other objects and whose helpers have other names. A release's `Layout` lists only what
differs from 0.5.23; which one a build gets is decided from its code (`fit`); `use(name)` makes it this
process's layout before any hook is registered, and the hook bodies read through `target`, `read` and
`function`, so they hold no version check of their own.
A setting is spelled `module.getter().attribute.attribute`: the getter is imported at its first read.
"""

from __future__ import annotations

import operator
import pkgutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine_ext.sglang.layout import (
    ATTRIBUTES,
    BATCH_OUTPUT,
    BRP,
    CLASSES,
    CUTEDSL,
    DP,
    FUNCTIONS,
    GRANIAN_INIT,
    ME,
    MIX,
    NEWEST,
    OUT_DICT,
    RC,
    READS,
    SA,
    SHIMS,
    TM,
    Layout,
    Read,
)

__all__ = [
    "ATTRIBUTES",
    "BATCH_OUTPUT",
    "CLASSES",
    "CUTEDSL",
    "FUNCTIONS",
    "NEWEST",
    "OUT_DICT",
    "READS",
    "Layout",
    "Read",
]

# ≤ 0.5.16: every setting is a field of the global ServerArgs.
_SERVER_ARGS_READS: Mapping[str, str] = {
    name: f"{SA}.{name}"
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
    "server_args": SA,
    "num_dp_ranks": f"{SA}.dp_size",  # their capturers size × server_args.dp_size
    "dp_rank": f"{SHIMS}.no_replica_rank()",
    "rust_server": f"{SHIMS}.no_rust_server()",
}
_OLD_FUNCTIONS: Mapping[str, str] = {
    "dp_slot_in": f"{SHIMS}.slot_in_by_attention_dp_rank",
    "dp_gather_slot": f"{DP}.get_attention_dp_rank",
    "moe_input_scattered": f"{SHIMS}.moe_input_scattered_without_dwdp",
    "resolving_view": f"{SHIMS}.server_args_as_resolved",
    "model_config_of": f"{SHIMS}.model_config_from_server_args",
}

LAYOUTS: dict[str, Layout] = {
    layout.version: layout
    for layout in (
        Layout("0.5.23"),
        Layout(  # read from the 0.5.20 wheel: the capturer sizes × `dp_size`, slices by `get_attention_dp_rank()`
            "0.5.20",
            reads={"num_dp_ranks": f"{RC}.get_parallel().dp_size"},
            functions={
                "dp_slot_in": f"{SHIMS}.slot_in_by_attention_dp_rank",
                "dp_gather_slot": f"{DP}.get_attention_dp_rank",
            },
            padded_counts="global_num_tokens_cpu",  # forward_batch_info.py: prepare_mlp_sync_batch's last line
            worker_app_env=None,  # http_server.py:2496, 2761: the workers' app path is a literal
            worker_app_call="uvicorn.run",  # … handed to uvicorn.run(workers=N) in the main process
            granian_app_call=GRANIAN_INIT,  # … and to Granian(target=…, workers=N) (http_server.py:2496)
        ),
        Layout(  # read from the 0.5.16 wheel: no settings bags in runtime_context, no resolution pipeline
            "0.5.16",
            targets={
                # a ServerArgs method there (server_args.py:5729): the same bound, read off that ServerArgs
                CUTEDSL: ("sglang.srt.server_args.ServerArgs.cutedsl_moe_max_num_tokens", "_cutedsl_method"),
                # meta_info is built inline in _handle_batch_output: the pointer goes on each response instead
                OUT_DICT: (f"{TM}._wait_one_response", "_around_wait_one_response"),
                BATCH_OUTPUT: None,  # … which needs no per-batch note of the rids
            },
            reads=_SERVER_ARGS_READS | {"cuda_graph_config": f"{SA}.cuda_graph_config"},
            functions=_OLD_FUNCTIONS,
            padded_counts="global_num_tokens_cpu",
            req_pool_idx="req_pool_idx",
            budget_at_resolution=False,
            verify_stride=("speculative_num_draft_tokens",),  # managers/utils.py: no speculative_output_stride
            worker_app_env=None,  # http_server.py:2357, 2581: the workers' app path is a literal
            worker_app_call="uvicorn.run",  # … handed to uvicorn.run(workers=N) in the main process
            granian_app_call=GRANIAN_INIT,  # … and to Granian(target=…, workers=N) (http_server.py:2357)
        ),
        Layout(  # read from the 0.5.12 wheel: no runtime_context at all; the Scheduler processes batch results
            "0.5.12",
            targets={
                f"{BRP}._maybe_collect_routed_experts": f"{MIX}.maybe_collect_routed_experts",
                f"{BRP}.process_batch_result_prefill": f"{MIX}.process_batch_result_prefill",
                f"{BRP}.process_batch_result_decode": f"{MIX}.process_batch_result_decode",
                # CuteDSL buffers are sized inside FlashInferCuteDslMoE's constructor (moe_runner/
                # flashinfer_cutedsl.py:248), no function of their own: upstream's sizing stays
                CUTEDSL: None,
                OUT_DICT: (f"{TM}._wait_one_response", "_around_wait_one_response"),
                BATCH_OUTPUT: None,
            },
            reads=_SERVER_ARGS_READS
            | {
                "cuda_graph_config": f"{SHIMS}.graph_config_from_flags()",
                "attn_tp_size": f"{DP}.get_attention_tp_size()",
                "attn_tp_rank": f"{DP}.get_attention_tp_rank()",
                "attn_dp_rank": f"{DP}.get_attention_dp_rank()",
                "attn_dp_size": f"{DP}.get_attention_dp_size()",
            },
            functions=_OLD_FUNCTIONS | {"capture_output_to_host": f"{SHIMS}.host_copies_by_fields"},
            host_copy=None,
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
            granian_app_call=GRANIAN_INIT,  # … and to Granian(target=…, workers=1) (http_server.py:2094)
            granian_spawns_one=True,  # _run_granian_server: Granian's multi-process server, never embedded
            classes={
                "decode_graph": (f"{ME}.cuda_graph_runner.CudaGraphRunner", f"{ME}.cpu_graph_runner.CPUGraphRunner"),
                "result_processor": ("sglang.srt.managers.scheduler.Scheduler",),  # its mixin's methods
                "allocator": ("sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator",),
            },
        ),
    )
}

# Between the proven releases: rows read from each wheel, that no real-server test has run yet. A build that fits
# one runs it as unproven (its first records checked against SGLang's own: `build_check`).
LAYOUTS["0.5.15"] = replace(  # 0.5.15, 0.5.15.post1: 0.5.16's, but the graph runners' tokens per request
    LAYOUTS["0.5.16"],
    version="0.5.15",
    graph_req_width="num_tokens_per_bs",  # decode_cuda_graph_runner.py:243
)
LAYOUTS["0.5.14"] = replace(  # … and before TopkCaptureOutput.map_device_tensors (state_capturer/base.py)
    LAYOUTS["0.5.15"],
    version="0.5.14",
    functions=LAYOUTS["0.5.15"].functions | {"capture_output_to_host": f"{SHIMS}.host_copies_by_fields"},
    host_copy=None,
)
LAYOUTS["0.5.13"] = replace(  # 0.5.13, 0.5.13.post1: 0.5.12's, but batch results go through the new processor
    LAYOUTS["0.5.12"],
    version="0.5.13",
    targets={t: where for t, where in LAYOUTS["0.5.12"].targets.items() if not t.startswith(BRP)},
    result_processor="batch_result_processor",  # scheduler.py:1740
    classes={"decode_graph": LAYOUTS["0.5.12"].classes["decode_graph"]},  # the allocator in allocator/base.py
)

LAYOUTS["0.5.17"] = replace(  # 0.5.20's settings bags in runtime_context, but 0.5.16's targets and helpers
    LAYOUTS["0.5.20"],
    version="0.5.17",
    targets=LAYOUTS["0.5.16"].targets,
    functions=_OLD_FUNCTIONS,
    req_pool_idx="req_pool_idx",  # schedule_batch.py: a Req field, no `kv` yet
    budget_at_resolution=False,
    verify_stride=("speculative_num_draft_tokens",),  # managers/utils.py: no speculative_output_stride
)
LAYOUTS["0.5.18"] = replace(  # … with runtime_context.cutedsl_moe_max_num_tokens, hooked as 0.5.23's
    LAYOUTS["0.5.17"],
    version="0.5.18",
    targets={t: where for t, where in LAYOUTS["0.5.17"].targets.items() if t != CUTEDSL},
)
LAYOUTS["0.5.19"] = replace(  # 0.5.20's, but no speculative_output_stride yet (managers/utils.py) and a resolution
    LAYOUTS["0.5.20"],  # pipeline with no arg_groups.resolution_hooks to register a step with (its real server)
    version="0.5.19",
    verify_stride=("speculative_num_draft_tokens",),
    budget_at_resolution=False,
)
LAYOUTS["0.5.21"] = replace(  # 0.5.20's, but with 0.5.23's DP helpers (dp_attention.dp_slot_in, dp_gather_slot)
    LAYOUTS["0.5.20"], version="0.5.21", functions={}
)
LAYOUTS["0.5.22"] = replace(  # 0.5.23's, but the workers' app path still a literal (http_server.py), as ≤ 0.5.21
    LAYOUTS[NEWEST],
    version="0.5.22",
    worker_app_env=None,
    worker_app_call="uvicorn.run",
    granian_app_call=GRANIAN_INIT,
)

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


# Where a layout with `budget_at_resolution` registers the budget check (`hooks.install_budget_hooks`).
RESOLUTION_HOOK = "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook"


def unresolved(hook_targets: Sequence[str]) -> list[str]:
    """What of this layout does not import here: retargeted hook targets, getters, functions (a version check)."""
    return missing(needed(hook_targets))


def needed(hook_targets: Sequence[str]) -> list[str]:
    """The dotted names this layout needs to import: retargeted hook targets, getters, functions, the literal app
    path's call, the resolution registrar (the release wheels' test reads the same list from each wheel)."""
    names = [t for t in (target(h) for h in hook_targets) if t is not None]
    names += sorted({split_read(_layout[0].read_spec(n))[0] for n in READS})
    names += [_layout[0].function_path(n) for n in FUNCTIONS]
    names += [call for call in (_layout[0].worker_app_call,) if call is not None]
    names += [RESOLUTION_HOOK] if _layout[0].budget_at_resolution else []
    return names


def missing(names: Sequence[str]) -> list[str]:
    """The dotted names that do not import here."""
    out = []
    for name in names:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError):
            out.append(name)
    return out
