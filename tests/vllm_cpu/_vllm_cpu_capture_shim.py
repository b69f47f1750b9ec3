"""Give vLLM 0.24-0.29's routed-experts capture a path on a CPU-only machine: test support only.

Loaded from a `.pth` file in the venvs of those versions (`make env-vllm-<version>`) so that the worker
process gets it; inert unless `R3_TEST_VLLM_CPU=1` (`tests/e2e/vllm_server.py` sets it) and on any other vLLM.

Why it is needed: on these versions vLLM's capture is Model Runner V1's `RoutedExpertsCapturer`, bound to each
MoE layer's router (`GPUModelRunner._bind_routed_experts_capturer` sets `BaseRouter.capture_fn`, which
`BaseRouter.select_experts` calls with the chosen ids). On CPU the unquantized MoE is "monolithic"
(`UnquantizedFusedMoEMethod.is_monolithic`: "Escape hatch for CPU"): `MoERunner._apply_quant_method` hands the
router logits to `cpu_fused_moe.CPUFusedMOE`, which picks the experts itself (`cpu_fused_moe.select_experts`)
and never calls the router. So 0.24-0.26 return rows of zeros (the capturer's buffer is never written) and
0.27 refuses `--enable-return-routed-experts` at start ("not supported with monolithic MoE kernel NoneType").
0.28-0.29 bind the capturer in `routed_experts_capturer.bind_routed_experts_capturer`: a monolithic layer's
experts get it (`FusedMoEExpertsMonolithic.set_capture_fn`) only when they say they support routing replay, and
the CPU experts (`experts.cpu_moe.CPUUnquantizedExperts`, monolithic: they pick the experts themselves) say no,
so the start fails ("Routed-experts capture is not supported with monolithic MoE kernel
X86CPUUnquantizedExperts"). 0.30 on route the CPU MoE through a `CPURouter`, whose `select_experts` calls the
capture function itself, and need none of this.

0.24's CPU MoE cannot even start on a CPU without AVX-512: its AVX2 kernel library has no
`prepack_moe_weight`, so `CPUFusedMOE` takes its torch path, whose SiLU entry in `cpu_fused_moe._CPU_MOE_ACT_FN`
builds a `SiluAndMul` CustomOp per call; a CustomOp reads the current vLLM config, which is unset in a forward,
so the worker's warm-up dies with "Current vLLM config is not set" (with or without this shim and the plugin).
vLLM fixed it in vllm-project/vllm#45961 (issue #45447), in 0.25.1 and later: the entry is the static
`SiluAndMul.forward_native`, the same arithmetic without the CustomOp.

What it does:

1. `MoERunner._apply_quant_method`: on a monolithic CPU layer whose router has a capture function, the ids
   of `cpu_fused_moe.select_experts` with the very arguments `UnquantizedFusedMoEMethod.apply_monolithic`
   gives `CPUFusedMOE` (the same function on the same logits: the same ids the kernel then uses) go to that
   capture function, as `BaseRouter.select_experts` would hand them on a GPU. vLLM's own path then runs.
2. Where `_CPU_MOE_ACT_FN`'s SiLU entry is not `SiluAndMul.forward_native` (0.24), it becomes that, as
   vLLM's own fix made it: the experts compute `silu(gate) * up` exactly as before, and the warm-up lives.
3. 0.27 only: `GPUModelRunner._bind_routed_experts_capturer` binds each MoE layer's router, as 0.24-0.26
   bind it, instead of refusing the CPU layers (everything after the bind is vLLM's own).
4. 0.28-0.29: `CPUUnquantizedExperts` says it supports routing replay, so vLLM's own bind hands it the capture
   function, and its `_select_experts` (the CPU top-k whose ids its kernel then uses) gives that function those
   very ids, as a replay-capable GPU kernel hands its `routing_replay_out`.

Test-only, and inert unless `R3_TEST_ZERO_LAYER=<layer>:<flag file>` is set too (issue 40): while the flag
file exists, the ids item 1 hands that layer's capture function are zeros, as a kernel that routes inside itself
leaves the capture buffer (what 0.24-0.26 do on this CPU without this shim, for every layer).

Everything downstream is vLLM's: the capturer's buffer, the slot-indexed store in the scheduler, prefix-cache
rows, the per-step output, the API server's join. The plugin's production code carries none of this.
"""

import importlib.abc
import importlib.util
import os
import sys
import types

ENV_FLAG = "R3_TEST_VLLM_CPU"
ZERO_LAYER_FLAG = "R3_TEST_ZERO_LAYER"
VERSIONS = ("0.24.", "0.25.", "0.26.", "0.27.", "0.28.", "0.29.")  # 0.30 on: the CPURouter captures itself
_MOE = "vllm.model_executor.layers.fused_moe"


def _vllm_version() -> str:
    from vllm.version import __version__

    return __version__


def _cpu_topk_ids(runner, router_logits, hidden_states):
    """The expert ids vLLM's CPU MoE kernel picks for these logits (`CPUFusedMOE.__call__`'s own call)."""
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe

    layer = runner.routed_experts
    _, topk_ids = cpu_fused_moe.select_experts(
        hidden_states=hidden_states,
        router_logits=router_logits,
        top_k=layer.top_k,
        use_grouped_topk=layer.use_grouped_topk,
        renormalize=layer.renormalize,
        topk_group=layer.topk_group,
        num_expert_group=layer.num_expert_group,
        custom_routing_function=layer.custom_routing_function,
        scoring_func=layer.scoring_func,
        routed_scaling_factor=layer.routed_scaling_factor,
        e_score_correction_bias=layer.e_score_correction_bias,
    )
    return topk_ids


def _zeroed(runner, topk_ids):
    """Zeros for the layer `ZERO_LAYER_FLAG` names while its flag file exists (test-only), else the ids."""
    layer, _, flag = os.environ.get(ZERO_LAYER_FLAG, "").partition(":")
    if layer and getattr(runner, "layer_id", None) == int(layer) and os.path.exists(flag):
        return topk_ids.new_zeros(topk_ids.shape)
    return topk_ids


def _moe_runner(module) -> None:
    original = module.MoERunner._apply_quant_method

    def _apply_quant_method(self, hidden_states, router_logits, *args, **kwargs):
        capture = getattr(self.router, "capture_fn", None)
        method = self.routed_experts.quant_method
        if capture is not None and method.is_monolithic and hasattr(method, "cpu_fused_moe"):
            capture(_zeroed(self, _cpu_topk_ids(self, router_logits, hidden_states)))
        return original(self, hidden_states, router_logits, *args, **kwargs)

    module.MoERunner._apply_quant_method = _apply_quant_method


def _cpu_fused_moe(module) -> None:
    """0.24's SiLU entry as vLLM's fix made it: no CustomOp built inside a forward (a no-op where it is already)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table = module._CPU_MOE_ACT_FN
    if table.get(MoEActivation.SILU) is not SiluAndMul.forward_native:
        table[MoEActivation.SILU] = SiluAndMul.forward_native


def _cpu_moe_experts(module) -> None:
    """0.28-0.29: the CPU experts capture the ids they select (a no-op where they have no `_select_experts`)."""
    experts = module.CPUUnquantizedExperts
    original = getattr(experts, "_select_experts", None)
    if original is None:
        return

    def _select_experts(self, *args, **kwargs):
        topk_weights, topk_ids = original(self, *args, **kwargs)
        if self.routing_replay_capture_fn is not None:
            self.routing_replay_capture_fn(topk_ids)
        return topk_weights, topk_ids

    experts._select_experts = _select_experts
    experts.supports_routing_replay_capture = lambda self: True


def _gpu_model_runner(module) -> None:
    def _bind_routed_experts_capturer(self, capturer) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        for layer in self.model.modules():
            if isinstance(layer, MoERunner) and isinstance(layer.router, BaseRouter):
                layer.router.set_capture_fn(lambda ids, _id=layer.layer_id: capturer.capture(_id, ids))

    if _vllm_version().startswith("0.27."):
        module.GPUModelRunner._bind_routed_experts_capturer = _bind_routed_experts_capturer


_PATCHES = {
    f"{_MOE}.runner.moe_runner": _moe_runner,
    f"{_MOE}.cpu_fused_moe": _cpu_fused_moe,
    f"{_MOE}.experts.cpu_moe": _cpu_moe_experts,
    "vllm.v1.worker.gpu_model_runner": _gpu_model_runner,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Find the real spec, then wrap its loader so the patch runs once the module has executed."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None or not _vllm_version().startswith(VERSIONS):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec) -> types.ModuleType | None:
                return real.create_module(spec)

            def exec_module(self, module) -> None:
                real.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


if os.environ.get(ENV_FLAG) == "1":
    sys.meta_path.insert(0, _PatchAfterImport())
