"""The per-forward capture path reads no device value on the host, with r3-sidecar's hooks in it.

The capturer runs on the `meta` device (values do not exist there, so any host read is a would-be CUDA sync)
under `syncguard.ForbidHostReads`, through each forward layout of `capture_cases.py`: the model body's
captures, `_forward_raw`'s extent record, slicing, overflow checks and occupancy, and `on_forward_end` in
overlap mode (SGLang's default: it returns device clones for the async copy). The guard itself is shown to
catch upstream's non-overlap `.cpu()`. With CUDA the same runs on "cuda" under `set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import pytest
import torch
from capture_cases import CASES
from sglang_env import run_sglang

pytestmark = pytest.mark.sglang


def child_main(device: str) -> dict:
    import contextlib

    import synthetic_forward as synthetic
    from sglang.srt.state_capturer.routed_experts import destroy_global_experts_capturer
    from syncguard import ForbidHostReads, cuda_sync_errors

    def guard():
        stack = contextlib.ExitStack()
        stack.enter_context(ForbidHostReads(device))
        if device == "cuda":
            stack.enter_context(cuda_sync_errors())
        return stack

    def attempt(case, *, patched: bool, no_copy_to_cpu: bool) -> dict:
        cap, runner, fb, _ = synthetic.setup_case(case, device)
        try:
            with guard():
                out = synthetic.forward(case, cap, runner, fb, patched=patched, no_copy_to_cpu=no_copy_to_cpu)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            destroy_global_experts_capturer()
        return {"topk_shape": list(out.topk.shape), "topk_device": out.topk.device.type}

    verify = next(c for c in CASES if c.name == "verify_graph_rank1_offset")
    results = {"upstream_non_overlap": attempt(verify, patched=False, no_copy_to_cpu=False)}
    synthetic.apply_capture_hooks()
    for case in CASES:
        results[case.name] = attempt(case, patched=True, no_copy_to_cpu=True)
    return results


def _outcomes(device: str) -> dict:
    (results,) = run_sglang(f"import test_capture_sync as t\nemit(t.child_main({device!r}))")
    return results


@pytest.fixture(scope="module")
def on_meta() -> dict:
    return _outcomes("meta")


def test_the_guard_catches_upstreams_non_overlap_copy(on_meta: dict) -> None:
    assert on_meta["upstream_non_overlap"]["error"].startswith("HostReadError: aten._to_copy"), on_meta


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_per_forward_path_reads_no_device_value(on_meta: dict, case) -> None:
    outcome = on_meta[case.name]
    assert "error" not in outcome, outcome
    real = case.raw[case.rank]
    local = real if case.graph == "decode" else case.blocks[case.rank]
    assert outcome == {"topk_shape": [local, 2, 2], "topk_device": "meta"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_forward_path_has_no_cuda_sync() -> None:
    results = _outcomes("cuda")
    for case in CASES:
        assert "error" not in results[case.name], results[case.name]
