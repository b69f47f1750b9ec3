"""The capture path inside a real CUDA graph, r3-sidecar's hooks applied: captured once, replayed with new routing.

SGLang captures decode (and verify) forwards into CUDA graphs at start, and a replay runs no Python. So the
plugin's per-layer hook runs only while a graph is captured: it must read no device value there (under
`set_sync_debug_mode("error")`), and the graph must go on writing each replay's own rows, which the plugin's
forward-end slicing then hands back for this DP rank. Each decode-graph case of `capture_cases.py` is
captured with the router's output set to -1, then replayed after the real routing is copied into the same
tensors: a row is right only if the replay wrote it. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from capture_cases import CASES, LAYERS, TOPK, expected_value
from sglang_env import run_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GRAPH_CASES = [c for c in CASES if c.graph == "decode"]


def child_main(names: list[str]) -> dict:
    import synthetic_forward as synthetic
    from sglang.srt.layers.moe.topk import TopKConfig, capture_routed_experts_if_allowed
    from sglang.srt.state_capturer.routed_experts import destroy_global_experts_capturer
    from syncguard import cuda_sync_errors

    synthetic.apply_capture_hooks()
    results = {}
    for case in (c for c in CASES if c.name in names):
        cap, runner, fb, _ = synthetic.setup_case(case, "cuda")
        static = synthetic.CURRENT["topk"]
        routed = [t.clone() for t in static]
        for t in static:
            t.fill_(-1)  # what the router "returns" while the graph is captured
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph), cuda_sync_errors():  # the guard inside: capture's own setup syncs
                for layer, topk in enumerate(static):
                    capture_routed_experts_if_allowed(TopKConfig(top_k=TOPK), layer, topk)
            with cuda_sync_errors():
                for t, new in zip(static, routed, strict=True):
                    t.copy_(new)  # this step's routing, in the tensors the graph reads
                synthetic.CURRENT["graph"] = graph
                out = synthetic.forward(case, cap, runner, fb, patched=True, no_copy_to_cpu=True)
            results[case.name] = {"shape": list(out.topk.shape), "rows": out.topk.tolist()}
        except Exception as exc:
            results[case.name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            synthetic.CURRENT.pop("graph", None)
            destroy_global_experts_capturer()
    return results


@pytest.fixture(scope="module")
def replayed() -> dict:
    names = [c.name for c in GRAPH_CASES]
    (results,) = run_sglang(f"import test_capture_graph_cuda as t\nemit(t.child_main({names!r}))")
    return results


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.name)
def test_a_replayed_graph_writes_this_steps_rows(replayed: dict, case) -> None:
    outcome = replayed[case.name]
    assert "error" not in outcome, outcome
    real = case.raw[case.rank]
    assert outcome["shape"] == [real, LAYERS, TOPK]
    want = [
        [[expected_value(case.rank, i, layer, k) for k in range(TOPK)] for layer in range(LAYERS)] for i in range(real)
    ]
    assert outcome["rows"] == want
