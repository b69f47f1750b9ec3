"""A case of `capture_cases.py` put through SGLang's real capturer, in an SGLang child (`sglang_env.run_sglang`):
`setup_case` publishes the case's server config, builds the capturer through `create` and this rank's
`ForwardBatch`; `forward` runs the model body as `ModelRunner.forward` would, upstream's or with the plugin's
hooks (`apply_capture_hooks`), and calls `on_forward_end`. The model body is synthetic: it routes the case's
gathered rows (`CURRENT["topk"]`) through `capture_routed_experts_if_allowed`, layer by layer, or replays a CUDA
graph of that loop (`CURRENT["graph"]`, test_capture_graph_cuda.py).
"""

from __future__ import annotations

from capture_cases import LAYERS, SLOT0, TOPK, Case, expected_value


def _gathered_topk(case: Case, layer: int, device):
    import torch

    blocks = []
    for rank, rows in enumerate(case.blocks):
        if rank not in case.captured:
            continue
        if case.scattered:
            rows = case.raw[rank]  # the local batch as it is, no DP padding into a gathered layout
        block = torch.full((rows, TOPK), -7, dtype=torch.int32)  # padding rows
        for i in range(min(case.raw[rank], rows)):
            block[i] = torch.tensor([expected_value(rank, i, layer, k) for k in range(TOPK)], dtype=torch.int32)
        blocks.append(block)
    return torch.cat(blocks).to(device)


# What the synthetic model body reads: the case, the router's output per layer (`topk`), a CUDA graph to replay.
CURRENT: dict = {}


def _synthetic_forward_raw(runner, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    """Stand-in for the model body of `ModelRunner._forward_raw`: what each path leaves behind for the capturer."""
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    case: Case = CURRENT["case"]
    if case.graph != "decode":  # _prepare_eager_forward_batch → prepare_mlp_sync_batch
        forward_batch.global_num_tokens_padded_cpu = case.padded if len(case.raw) > 1 else None
        forward_batch.global_num_tokens_cpu = case.padded if len(case.raw) > 1 else None
    graph = CURRENT.get("graph")
    if graph is not None:  # a CUDA graph of the loop below (`test_capture_graph_cuda`): a replay runs no Python
        graph.replay()
    else:
        for layer in range(LAYERS):
            capture_routed_experts_if_allowed(TopKConfig(top_k=TOPK), layer, CURRENT["topk"][layer])
    if case.graph == "decode":
        runner.decode_cuda_graph_runner.bs = case.graph_bs  # set by the replay (`load_batch`)
    return ModelRunnerOutput(logits_output=None, can_run_graph=case.graph != "eager")


def setup_case(case: Case, device: str = "cpu"):
    """Publish the case's config, build the capturer (through `create`, hooked or not) and this rank's batch."""
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args, tiny_model_config

    server = dict(case.server)
    publish_args(world_rank=server.pop("world_rank", 0), **server)
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model,
        model_config=tiny_model_config(case.context_length),
        num_tokens=4096,
        max_running_requests=server["max_running_requests"],
        device=device,
    )
    set_global_experts_capturer(cap)
    runner = ModelRunner.__new__(ModelRunner)
    graph_runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)  # built, never replayed yet
    graph_runner.captured_req_width, graph_runner.ragged_verify_mode = case.w, False
    runner.decode_cuda_graph_runner = graph_runner

    real = case.raw[case.rank]
    local = case.blocks[case.rank] if case.graph != "decode" else real
    slots = torch.arange(SLOT0, SLOT0 + real)
    out_cache_loc = torch.cat([slots, torch.zeros(local - real, dtype=torch.int64)])  # DP padding → slot 0
    mode = ForwardMode.DECODE if case.graph == "decode" else ForwardMode.EXTEND
    mode = ForwardMode.TARGET_VERIFY if case.w > 1 else mode
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=max(1, real // case.w),
        input_ids=torch.zeros(local, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
        seq_lens=torch.ones(1, dtype=torch.int64, device=device),
        out_cache_loc=out_cache_loc.to(device),
        seq_lens_sum=real,
    )
    fb.global_num_tokens_cpu = list(case.raw) if len(case.raw) > 1 else None
    CURRENT["topk"] = [_gathered_topk(case, layer, device) for layer in range(LAYERS)]  # the router's output
    return cap, runner, fb, slots


def forward(case: Case, cap, runner, fb, *, patched: bool, no_copy_to_cpu: bool):
    """One forward and its `on_forward_end`, called as `ModelRunner.forward` calls it."""
    CURRENT["case"] = case
    out = runner._forward_raw(fb, None) if patched else _synthetic_forward_raw(runner, fb, None)
    return cap.on_forward_end(
        forward_batch=fb,
        can_run_graph=out.can_run_graph,
        cuda_graph_batch=getattr(runner.decode_cuda_graph_runner, "bs", None),
        no_copy_to_cpu=no_copy_to_cpu,
    )


def apply_capture_hooks() -> None:
    """The plugin's capture hooks through the real `HookRegistry`, over the synthetic model body."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from engine_ext.core.settings import EngineSettings
    from engine_ext.sglang.hooks import table

    HookRegistry.reset()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _synthetic_forward_raw, HookType.REPLACE
    )
    table.install_capture_hooks(EngineSettings())
    HookRegistry.apply_hooks()
