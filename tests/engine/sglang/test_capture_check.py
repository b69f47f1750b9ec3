"""The per-layer capture check on a real 0.5.23 `RoutedExpertsCapturer` on CPU: every layer, no state.

`_checked_device_capture` runs inside the model's forward, which Dynamo traces under piecewise CUDA graphs and
`--enable-torch-compile`, so it keeps no per-forward state (no "proved once" flag a compiled graph would freeze):
each capture tests its own shape. What that must still give: an overflowing forward after fitting ones names
the setting before any write, every layer of a fitting forward is written, and the first (eager) forward
learns the routed layers. Three forwards through `ModelRunner._forward_raw` and `on_forward_end` through the
real `HookRegistry`: fitting, fitting, overflowing. (Compiled: `test_capture_compiled.py`.)
"""

from __future__ import annotations

import pytest
from sglang_env import run_sglang

LAYERS, TOPK = 2, 2  # tests/sglang_cpu/tiny_qwen3moe
_BODY: dict = {}


def _model_body(runner, forward_batch, pp_proxy_tensors=None, *args, **kwargs):
    """`_forward_raw`'s model: every layer routes `_BODY["tokens"]` tokens (ids: layer·1000 + row·10 + k)."""
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    for layer in range(LAYERS):
        capture_routed_experts_if_allowed(TopKConfig(top_k=TOPK), layer, _topk(_BODY["tokens"], layer))
    return ModelRunnerOutput(logits_output=None, can_run_graph=False)


def _topk(tokens: int, layer: int):
    import torch

    rows = torch.arange(tokens, dtype=torch.int32).unsqueeze(1) * 10 + torch.arange(TOPK, dtype=torch.int32)
    return rows + layer * 1000


def child_main() -> dict:
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import publish_args, tiny_model_config

    from engine_ext.core.settings import EngineSettings
    from engine_ext.sglang import capturer
    from engine_ext.sglang.hooks import table

    HookRegistry.reset()
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _model_body, HookType.REPLACE
    )
    table.install_capture_hooks(EngineSettings())
    HookRegistry.apply_hooks()
    publish_args(tp_size=1, enable_return_routed_experts=True, chunked_prefill_size=16, max_running_requests=4)
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    cap = RoutedExpertsCapturer.create(
        model=model, model_config=tiny_model_config(64), num_tokens=256, max_running_requests=4, device="cpu"
    )
    set_global_experts_capturer(cap)
    runner = ModelRunner.__new__(ModelRunner)
    runner.decode_cuda_graph_runner = None
    rows = cap.device_cache.buffer.shape[0]

    def forward(tokens: int) -> str:
        _BODY["tokens"] = tokens
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=torch.zeros(tokens, dtype=torch.int64),
            req_pool_indices=torch.zeros(1, dtype=torch.int64),
            seq_lens=torch.full((1,), tokens, dtype=torch.int64),
            out_cache_loc=torch.arange(tokens, dtype=torch.int64),
            seq_lens_sum=tokens,
        )
        try:
            out = runner._forward_raw(fb, None)
            cap.on_forward_end(forward_batch=fb, can_run_graph=out.can_run_graph, cuda_graph_batch=None)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    capturer.ROUTED_LAYERS = capturer.RoutedLayers()
    first = forward(8)
    learned = capturer.ROUTED_LAYERS.known
    second = forward(rows)  # exactly fills the buffer
    written = cap.device_cache.buffer[:rows, :LAYERS, :TOPK].clone()
    want = torch.stack([_topk(rows, layer) for layer in range(LAYERS)], dim=1)
    cap.device_cache.buffer.fill_(-7)
    third = forward(rows + 1)  # one row too many, after forwards that fit
    return {
        "rows": rows,
        "results": [first, second, third],
        "learned": list(learned or ()),
        "second_rows_right": bool(torch.equal(written, want)),
        "third_wrote_nothing": bool((cap.device_cache.buffer == -7).all()),
    }


pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def outcome() -> dict:
    (result,) = run_sglang("import test_capture_check as t\nemit(t.child_main())")
    return result


def test_fitting_forwards_pass_and_the_first_learns_the_routed_layers(outcome: dict) -> None:
    assert outcome["results"][:2] == ["ok", "ok"], outcome
    assert outcome["learned"] == list(range(LAYERS)), outcome


def test_every_layer_of_a_full_forward_is_written(outcome: dict) -> None:
    assert outcome["second_rows_right"], outcome


def test_an_overflowing_forward_after_a_fitting_one_names_the_setting_before_any_write(outcome: dict) -> None:
    message = outcome["results"][2]
    assert message.startswith("CaptureOverflowError"), message
    assert f"needs {outcome['rows'] + 1} rows but the buffer holds {outcome['rows']}" in message, message
    assert "--chunked-prefill-size" in message, message
    assert outcome["third_wrote_nothing"], outcome
