"""Where each proven SGLang keeps what the hooks patch and read, as data: targets, settings, helpers.

Why: `hooks.py` is written in 0.5.23's spelling, and the trainers pin older SGLangs (docs/versions.md) whose
settings sit on other objects and whose helpers have other names. A version's `Layout` lists only what
differs from 0.5.23; `use(version)` makes it this process's layout before any hook is registered, and the
hook bodies read through `target`, `read` and `function`, so they hold no version check of their own.
A setting is spelled `module.getter().attribute.attribute`: the getter is imported at its first read.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_RC = "sglang.srt.runtime_context"
_DP = "sglang.srt.layers.dp_attention"

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
}

# 0.5.23: the SGLang functions the hooks call, by the name the hooks use.
FUNCTIONS: Mapping[str, str] = {
    "dp_slot_in": f"{_DP}.dp_slot_in",  # this rank's entry in a per-DP-replica list
    "dp_gather_slot": f"{_DP}.dp_gather_slot",  # this rank's index in the DP gather
}


@dataclass(frozen=True)
class Layout:
    """One SGLang version's differences from 0.5.23 in what the hooks touch (empty: 0.5.23 itself)."""

    version: str
    targets: Mapping[str, str | None] = field(default_factory=dict)  # 0.5.23 hook target → here; None: not hooked
    reads: Mapping[str, str] = field(default_factory=dict)  # `READS` entries spelled differently here
    functions: Mapping[str, str] = field(default_factory=dict)  # `FUNCTIONS` entries named differently here
    # The ForwardBatch list `prepare_mlp_sync_batch` replaces with the per-rank padded token counts.
    padded_counts: str = "global_num_tokens_padded_cpu"

    def read_spec(self, name: str) -> str:
        return self.reads.get(name, READS[name])

    def function_path(self, name: str) -> str:
        return self.functions.get(name, FUNCTIONS[name])


def slot_in_by_attention_dp_rank(per_rank: Sequence[int]) -> int:
    """`dp_slot_in` where SGLang has none (≤ 0.5.20): a per-replica list's entry is the attention-DP rank's."""
    if len(per_rank) == 1:
        return 0
    from sglang.srt.layers.dp_attention import get_attention_dp_rank

    return get_attention_dp_rank()


LAYOUTS: dict[str, Layout] = {
    layout.version: layout
    for layout in (
        Layout("0.5.23"),
        Layout(  # read from the 0.5.20 wheel: the capturer sizes × `dp_size`, slices by `get_attention_dp_rank()`
            "0.5.20",
            reads={"num_dp_ranks": f"{_RC}.get_parallel().dp_size"},
            functions={
                "dp_slot_in": f"{__name__}.slot_in_by_attention_dp_rank",
                "dp_gather_slot": f"{_DP}.get_attention_dp_rank",
            },
            padded_counts="global_num_tokens_cpu",  # forward_batch_info.py: prepare_mlp_sync_batch's last line
        ),
    )
}

_layout: list[Layout] = [LAYOUTS["0.5.23"]]
_getters: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {}
_functions: dict[str, Callable[..., Any]] = {}


def use(version: str) -> Layout:
    """Make `version`'s layout this process's (KeyError outside `LAYOUTS`: nothing is guessed)."""
    _layout[0] = LAYOUTS[version]
    _getters.clear()
    _functions.clear()
    return _layout[0]


def layout() -> Layout:
    return _layout[0]


def target(hook_target: str) -> str | None:
    """Where this version has the 0.5.23 hook target `hook_target` (None: it is not hooked here)."""
    return _layout[0].targets.get(hook_target, hook_target)


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
    out = []
    for name in names:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError):
            out.append(name)
    return out
