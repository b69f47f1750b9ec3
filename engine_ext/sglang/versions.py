"""The support matrix: per SGLang version, what differs for the plugin and what it may run there, as data.

Why data: the trainers pin different SGLangs (verl 0.9.1: 0.5.12, miles: 0.5.16, AReaL 1.0.4: 0.5.10.post1),
and a hook whose target or imported name is missing either crashes the server at start or, worse, patches
half a data path. `hooks.py` asks `support(version)` which hook groups it may register; every difference
read from a version's wheel is a row here, not a version check scattered in the hooks. Read from the wheels
(`pip download --no-deps sglang==V`, unzip); docs/versions.md is this table in prose, checked by a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine_ext.core.release_files import shown
from engine_ext.sglang.compat import NEWEST as NEWEST  # the release the matrix starts at

FIRST_WITH_PLUGINS = "0.5.12"  # `sglang.srt.plugins` and `HookRegistry`

GROUPS = ("capture", "hip", "delivery", "pointer")  # the hook groups of `hooks.HOOKS`

_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"


class Seed(StrEnum):
    """The five upstream routed-experts/buffer fixes the plugin was built around (sgl-project/sglang PRs)."""

    DP_BUFFER = "#26123"  # routed-experts device buffer × DP ranks
    SYNC_FREE_SLICE = "#24550"  # CPU DP slicing, no implicit sync
    CUTEDSL_WORST_CASE = "#26696"  # CuteDSL MoE buffers sized for the worst-case forward
    FLASHINFER_WORKSPACE = "#26643"  # FlashInfer dispatcher workspace + set_dp_buffer_len global tokens
    EAGLE_KV_INDICES = "#27338"  # EAGLE draft kv_indices × topk


class Upstream(StrEnum):
    """Whether a version's own code carries a seed fix."""

    PRESENT = "present"
    PARTIAL = "partial"
    ABSENT = "absent"


@dataclass(frozen=True)
class Version:
    """One SGLang version as the plugin sees it."""

    version: str
    plugin_mechanism: bool  # `sglang.srt.plugins` entry points + `HookRegistry`
    missing_targets: tuple[str, ...]  # `hooks.HOOKS` targets absent from this version
    missing_names: tuple[str, ...]  # names the hook bodies import or read, absent here (those that stop a start)
    seeds: dict[Seed, Upstream]  # each seed fix as upstream ships it in this version
    evidence: str  # where the seed column was read, so a reader can check it
    not_run: tuple[str, ...] = ()  # what the plugin does on 0.5.23 but cannot on this version, and why
    # Attributes the hooks read off SGLang's run-time objects that this version's source lacks
    # (`engine_ext.sglang.attributes.missing`, checked per venv in CI): the plugin is refused there, naming them.
    missing_attributes: tuple[str, ...] = ()


MATRIX: dict[str, Version] = {
    v.version: v
    for v in (
        Version(
            "0.5.23",
            plugin_mechanism=True,
            missing_targets=(),
            missing_names=(),
            seeds=dict.fromkeys(Seed, Upstream.PRESENT),
            evidence="state_capturer/routed_experts.py sizes × num_dp_ranks; dp_attention.get_dp_local_slice_cpu; "
            "runtime_context.cutedsl_moe_max_num_tokens; set_dp_buffer_len(global_num_tokens); "
            "spec_utils.draft_kv_indices_buffer_width",
        ),
        Version(
            "0.5.20",
            plugin_mechanism=True,
            missing_targets=(),
            missing_names=(
                "sglang.srt.runtime_context.ParallelContext.num_dp_ranks",
                "sglang.srt.layers.dp_attention.dp_gather_slot",
                "sglang.srt.layers.dp_attention.dp_slot_in",
            ),
            seeds=dict.fromkeys(Seed, Upstream.PRESENT),
            evidence="state_capturer/routed_experts.py sizes × dp_size; dp_attention.get_dp_local_slice_cpu; "
            "runtime_context.cutedsl_moe_max_num_tokens; set_dp_buffer_len(global_num_tokens); "
            "spec_utils.draft_kv_indices_buffer_width",
        ),
        Version(
            "0.5.16",
            plugin_mechanism=True,
            missing_targets=(
                "sglang.srt.runtime_context.cutedsl_moe_max_num_tokens",
                "sglang.srt.beam_search.output.try_build_beam_search_out_dict",
            ),
            missing_names=(
                "sglang.srt.arg_groups.resolution_hooks",
                "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
                "sglang.srt.runtime_context.get_exec",
                "sglang.srt.runtime_context.get_schedule",
                "sglang.srt.runtime_context.get_spec",
                "sglang.srt.runtime_context.get_serving",
                "sglang.srt.runtime_context.get_disagg",
                "sglang.srt.runtime_context.ParallelContext.num_dp_ranks",
                "sglang.srt.layers.dp_attention.dp_gather_slot",
                "sglang.srt.layers.dp_attention.dp_slot_in",
                "sglang.srt.layers.moe.utils.is_moe_input_scattered_across_dp_ranks",
            ),
            seeds=dict.fromkeys(Seed, Upstream.PRESENT),
            evidence="as 0.5.20, cutedsl_moe_max_num_tokens in server_args.py",
            not_run=("budget check at start (no arg_groups.resolution_hooks)",),
        ),
        Version(
            "0.5.12",
            plugin_mechanism=True,
            missing_targets=(
                f"{_BRP}._maybe_collect_routed_experts",
                f"{_BRP}.process_batch_result_prefill",
                f"{_BRP}.process_batch_result_decode",
                "sglang.srt.runtime_context.cutedsl_moe_max_num_tokens",
                "sglang.srt.beam_search.output.try_build_beam_search_out_dict",
            ),
            missing_names=(
                "sglang.srt.runtime_context",
                "sglang.srt.runtime_context.get_exec",
                "sglang.srt.runtime_context.get_schedule",
                "sglang.srt.runtime_context.get_spec",
                "sglang.srt.runtime_context.get_serving",
                "sglang.srt.runtime_context.get_disagg",
                "sglang.srt.runtime_context.ParallelContext.num_dp_ranks",
                "sglang.srt.arg_groups.overrides",
                "sglang.srt.arg_groups.resolution_hooks",
                "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
                "sglang.srt.model_executor.cuda_graph_config",
                "sglang.srt.layers.dp_attention.dp_gather_slot",
                "sglang.srt.layers.dp_attention.dp_slot_in",
                "sglang.srt.layers.moe.utils.is_moe_input_scattered_across_dp_ranks",
            ),
            seeds=dict.fromkeys(Seed, Upstream.PRESENT)
            | {Seed.CUTEDSL_WORST_CASE: Upstream.PARTIAL, Seed.EAGLE_KV_INDICES: Upstream.ABSENT},
            evidence="CuteDSL sized max(cuda_graph_max_bs, chunked_prefill_size), no fail-fast "
            "(moe_runner/flashinfer_cutedsl.py:248); no spec_utils.draft_kv_indices_buffer_width",
            not_run=(
                "budget check at start (no arg_groups.resolution_hooks)",
                "CuteDSL buffer sizing (sized in FlashInferCuteDslMoE's constructor: upstream's stays)",
            ),
        ),
        Version(
            "0.5.10.post1",
            plugin_mechanism=False,
            missing_targets=(),
            missing_names=("sglang.srt.plugins",),
            seeds={},
            evidence="no sglang.srt.plugins; capturer at srt/layers/moe/routed_experts_capturer.py",
        ),
    )
}


# Every release from 0.5.12 to 0.5.23: the layout its own code fits, None where it fits none. CI reads each
# release's wheel against its row (`tests/engine/sglang/test_release_wheels.py`, `make release-wheels`: its
# line in requirements/sglang-release-wheels.txt); `make test-matrix` runs `fit` itself in a venv holding it
# (`make env-sglang-releases`, `tests/e2e/test_sglang_releases.py`).
# Only the `PROVEN` releases are proven by a real server; the rest run as unproven builds.
RELEASES: dict[str, str | None] = {
    "0.5.12": "0.5.12",
    "0.5.12.post1": "0.5.12",
    "0.5.13": "0.5.13",
    "0.5.13.post1": "0.5.13",
    "0.5.14": "0.5.14",
    "0.5.15": "0.5.15",
    "0.5.15.post1": "0.5.15",
    "0.5.16": "0.5.16",
    "0.5.17": "0.5.17",
    "0.5.18": "0.5.18",
    "0.5.19": "0.5.19",
    "0.5.20": "0.5.20",
    "0.5.21": "0.5.21",
    "0.5.22": "0.5.22",
    "0.5.23": "0.5.23",
}


# The releases whose real CPU server a test ran with the layout `RELEASES` gives them, the plugin taking delivery
# over at once: records equal to SGLang's own inline rows in every delivery mode (the version suite, in
# `test_sglang_0_5_12.py`, `_16`, `_20`, the CI suite for 0.5.23, and `test_sglang_release_servers.py` for the
# rest). docs/versions.md gives each one's last run. Any other build runs as unproven (`build_check`).
PROVEN: frozenset[str] = frozenset(
    {"0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17"}
    | {"0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"}
)


@dataclass(frozen=True)
class Support:
    """What the plugin does on one found build: the groups it registers, the layout, and why not more."""

    version: str | None  # the build's version string, as its metadata says
    groups: tuple[str, ...]
    reason: str | None  # None: the whole plugin runs
    layout: str | None = None  # the `compat` layout applied (`fit`), None where nothing is registered
    proven: bool = False  # a test ran this very release's real server with that layout
    changed: tuple[str, ...] = ()  # a proven release string whose files are not the release's (`release_files`)

    @property
    def full(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        """The start-up line: the build, the layout applied, and whether a test proved that build."""
        if not self.full:
            return f"r3-sidecar: {self.reason}"
        how = "proven by its real-server tests" if self.proven else UNPROVEN
        if self.changed:
            how = f"{how}; its files are not the release's: {shown(self.changed)}"
        return f"r3-sidecar: sglang=={self.version}: layout {self.layout} applied ({how})"


UNPROVEN = "fits, but no test ran this build: inline rows are kept until its records agree with SGLang's own"


def support(
    found: str | None,
    layout: str | None,
    lacking: dict[str, list[str]] | None = None,
    changed: list[str] | tuple[str, ...] = (),
) -> Support:
    """The plugin's plan for SGLang `found`, whose code fits `layout` (`fit.fit`; None: fits no layout): every
    group where it fits, none otherwise (never half-installed). `changed`: the files of a `PROVEN` release
    string that differ from that release's (`release_files`): a patched image under a proven name is unproven."""
    if lacks_plugins(found):
        reason = f"sglang=={found} has no plugin mechanism (sglang.srt.plugins); r3-sidecar needs sglang>=0.5.12"
    elif layout is None:
        reason = f"sglang=={found} fits none of the plugin's layouts{_nearest_gap(lacking or {})}"
    else:
        proven = found in PROVEN and layout == RELEASES[found] and not changed
        return Support(found, GROUPS, None, layout, proven, tuple(changed) if found in PROVEN else ())
    return Support(found, (), reason + "; registering no hooks (capture stays upstream's)")


def lacks_plugins(found: str | None) -> bool:
    """Whether SGLang `found` predates `sglang.srt.plugins` (its matrix row says so, or its version is older)."""
    from packaging.version import InvalidVersion, Version

    row = MATRIX.get(found or "")
    if row is not None:
        return not row.plugin_mechanism
    try:
        return found is not None and Version(found) < Version(FIRST_WITH_PLUGINS)
    except InvalidVersion:
        return False


def _nearest_gap(lacking: dict[str, list[str]]) -> str:
    if not lacking:
        return ""
    layout, gaps = next(iter(lacking.items()))  # the nearest candidate, tried first
    shown = ", ".join(gaps[:6]) + (f" and {len(gaps) - 6} more" if len(gaps) > 6 else "")
    return f" (the nearest, {layout}, lacks: {shown})"


def supported() -> list[str]:
    """The versions with a plugin mechanism, newest first."""
    rows = [v for v in MATRIX.values() if v.plugin_mechanism]
    return [v.version for v in sorted(rows, key=lambda v: tuple(int(p) for p in v.version.split(".")), reverse=True)]
