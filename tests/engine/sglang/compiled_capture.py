"""Child of `test_capture_compiled.py`: the hooked capture path under `torch.compile(fullgraph=True)`, in whichever
SGLang venv runs it; prints one JSON line.

The plugin is installed by its real entry point (`engine_ext.sglang.register`: version check, layout, capture
hooks) through SGLang's real `HookRegistry`, so `BaseDeviceCache.capture` is SGLang's own method wrapped by the
plugin's per-layer hook, as in a server. A model-like body writes every layer's top-k through it, eager and
compiled (Inductor, as SGLang's CPU graph runner and piecewise graphs compile), static and dynamic token counts.
On 0.5.23 the body also goes through the real capture site (`capture_routed_experts_if_allowed` → the global
`RoutedExpertsCapturer`), as its MoE layers call it.
"""

from __future__ import annotations

import json
import sys

LAYERS, TOPK, ROWS = 4, 2, 16


def _topk(tokens: int, seed: int):
    import torch

    return torch.randint(0, 8, (tokens, TOPK), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))


def _state() -> dict:
    """The Python-side state a hook could change: it must not move while compiled code runs."""
    from engine_ext.sglang import capturer, timers

    return {
        "routed_seen": sorted(capturer.ROUTED_LAYERS.seen),
        "routed_known": capturer.ROUTED_LAYERS.known,
        "timer_calls": list(timers.TIMERS.calls),
    }


def _run(body, make, compile_kwargs: dict) -> dict:
    """`body(target, topk)` eager and compiled on fresh targets, over token counts that fit, then one that does not."""
    import torch

    eager_target, compiled_target = make(), make()
    compiled = torch.compile(body, fullgraph=True, **compile_kwargs)
    equal, state_moved = [], []
    for seed, tokens in enumerate((3, 8, ROWS, 5)):
        topk = _topk(tokens, seed)
        body(eager_target, topk)
        before = _state()
        compiled(compiled_target, topk)
        state_moved.append(_state() != before)
        equal.append(bool(torch.equal(buffer_of(eager_target), buffer_of(compiled_target))))
    overflow = "no error"
    try:
        compiled(compiled_target, _topk(ROWS + 1, 9))
    except Exception as exc:  # what a server would log
        overflow = f"{type(exc).__name__}: {exc}"
    return {"equal": equal, "state_moved": state_moved, "overflow": overflow}


def _graph(body, make, compile_kwargs: dict) -> list[str]:
    """The ops of the FX graph Dynamo hands the backend for `body` (one graph: `fullgraph=True`)."""
    import torch

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([f"{node.op}:{getattr(node.target, '__name__', node.target)}" for node in gm.graph.nodes])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(body, fullgraph=True, backend=backend, **compile_kwargs)(make(), _topk(5, 0))
    return graphs[0] if len(graphs) == 1 else [f"{len(graphs)} graphs"]


def buffer_of(target):
    return getattr(target, "device_cache", target).buffer


def main() -> dict:
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.state_capturer.base import BaseDeviceCache

    import engine_ext.sglang as plugin
    from engine_ext.sglang import capturer, compat

    HookRegistry.reset()
    plugin.register()  # R3_MODE=off: the capture hooks only
    HookRegistry.apply_hooks()
    hooked = getattr(BaseDeviceCache.capture, "__wrapped__", None) is not None
    capturer.ROUTED_LAYERS = capturer.RoutedLayers()

    def make_cache():
        return BaseDeviceCache(ROWS, LAYERS, TOPK, "cpu", "routed_experts")

    def per_layer(cache, topk):
        for layer in range(LAYERS):
            cache.capture(layer, topk + 10 * layer)

    out = {"sglang": compat.layout().version, "torch": torch.__version__, "hooked": hooked}
    eager_first = make_cache()
    per_layer(eager_first, _topk(2, 0))  # an eager forward first, as SGLang's warmup: it learns the layers
    capturer.ROUTED_LAYERS.close()
    out["learned_layers"] = list(capturer.ROUTED_LAYERS.known or ())
    upstream_capture = BaseDeviceCache.capture.__wrapped__  # SGLang's own method, as `HookRegistry` kept it

    def per_layer_upstream(cache, topk):
        for layer in range(LAYERS):
            upstream_capture(cache, layer, topk + 10 * layer)

    for name, kwargs in {"static": {"dynamic": False}, "dynamic": {"dynamic": True}}.items():
        torch._dynamo.reset()
        out[name] = _run(per_layer, make_cache, kwargs)
        out[name]["graph"] = _graph(per_layer, make_cache, kwargs)
        out[name]["upstream_graph"] = _graph(per_layer_upstream, make_cache, kwargs)
    if compat.layout().version == "0.5.23":
        torch._dynamo.reset()
        out["capture_site"] = _capture_site()
    return out


def _capture_site() -> dict:
    """0.5.23: the MoE layers' own capture call and the real `RoutedExpertsCapturer`, published as a server does.

    The capture site reads the capturer from SGLang's global: eager and compiled each set their own first."""
    import torch
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer
    from sglang_env import cpu_workarounds, publish_args, tiny_model_config

    cpu_workarounds()
    publish_args(tp_size=1, enable_return_routed_experts=True, chunked_prefill_size=ROWS, max_running_requests=4)
    model = torch.nn.Module()
    model.shared_experts_config = SharedExpertsConfig()
    config = TopKConfig(top_k=TOPK)

    def make():
        return RoutedExpertsCapturer.create(
            model=model, model_config=tiny_model_config(64), num_tokens=64, max_running_requests=4, device="cpu"
        )

    def run(topk):
        for layer in range(2):  # the tiny model's layers
            capture_routed_experts_if_allowed(config, layer, topk + 10 * layer)

    eager_cap, compiled_cap = make(), make()
    rows = eager_cap.device_cache.buffer.shape[0]
    compiled = torch.compile(run, fullgraph=True, dynamic=True)
    equal = []
    try:
        for seed, tokens in enumerate((3, rows, 7)):
            topk = _topk(tokens, seed)
            set_global_experts_capturer(eager_cap)
            run(topk)
            set_global_experts_capturer(compiled_cap)
            compiled(topk)
            equal.append(bool(torch.equal(eager_cap.device_cache.buffer, compiled_cap.device_cache.buffer)))
    finally:
        set_global_experts_capturer(None)
    return {"rows": rows, "equal": equal}


if __name__ == "__main__":
    print("R3-RESULT " + json.dumps(main()), flush=True)
    sys.exit(0)
