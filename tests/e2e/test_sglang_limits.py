"""Configurations where SGLang 0.5.23 itself sizes, slices or lays out rows in ways the plugin must handle.

- `--chunked-prefill-size -1` with a prompt longer than the device cache: upstream's scheduler dies on a
  shape mismatch (sgl-project/sglang#26860); with the plugin the cache is sized to the context and the rows
  are exact.
- A model with dense layers (GLM-4.5's `first_k_dense_replace`): SGLang's payload keeps a slot per model
  layer, dense ones zero; the record holds the MoE layers and `sglang_b64` rebuilds SGLang's bytes. And a
  config that names dense layers SGLang's model class ignores (Qwen3-MoE `mlp_only_layers`): the record
  holds the layers SGLang routed.
- Speculative decoding cannot run on a CPU-only SGLang 0.5.23: proven here, with the exact import that fails.
"""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import numpy as np
import pytest
from sglang_server import Config, server_env
from tiny_model import GLM

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # a server start counts in its first test

NO_CHUNKING = {"chunked-prefill-size": -1, "mem-fraction-static": 0.3}  # -1 leaves the default fraction < 0
CHUNKLESS = {
    "upstream": Config("chunkless-upstream", plugin=False, sidecar=False, args=NO_CHUNKING),
    "plugin": Config("chunkless-mirror", env={"R3_MODE": "mirror"}, args=NO_CHUNKING),
}
DENSE = {
    "upstream": Config("glm-upstream", plugin=False, sidecar=False, model=GLM),
    "plugin": Config("glm-mirror", env={"R3_MODE": "mirror"}, model=GLM),
}
# Qwen3-MoE's config names dense layers (`mlp_only_layers`), but SGLang 0.5.23's model routes every layer
# (qwen3_moe.py:877-878, "all layers are sparse"): the record must hold what SGLang routed, not what the
# config suggests.
QWEN_MLP_ONLY = Config("qwen-mlp-only-mirror", env={"R3_MODE": "mirror"}, model={"mlp_only_layers": [0, 2]})


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(200 + seed).integers(3, 250, size=n).tolist()


@pytest.mark.slow  # SGLang's own defect (sglang#26860), shown by one more server start: `make reliability`
def test_chunked_prefill_off_upstream_dies_on_a_long_prompt(sglang_stack):
    """sgl-project/sglang#26860: device cache `max(chunked_prefill_size, max_running_requests)` = 16 rows."""
    stack = sglang_stack(CHUNKLESS["upstream"])
    assert stack.generate(prompt(8, 0), return_routed_experts=True)["meta_info"]["routed_experts"]
    with pytest.raises(httpx.HTTPError):
        stack.generate(prompt(150, 1), return_routed_experts=True, timeout=60)
    stack.server.proc.wait(60)
    assert "must match the existing size (150)" in stack.server.log_text()


def test_chunked_prefill_off_plugin_sizes_the_cache_to_the_context(sglang_stack):
    stack = sglang_stack(CHUNKLESS["plugin"])
    sized = re.search(r"routed-experts device cache (\d+) rows \(upstream (\d+)\)", stack.server.log_text())
    assert sized and int(sized[2]) == 16 and int(sized[1]) >= 2048  # P = max_prefill_tokens: a whole prefill batch
    for i, n in enumerate((150, 1500)):
        rid = f"chunkless-{n}"
        response = stack.generate(prompt(n, i + 1), rid=rid, return_routed_experts=True, timeout=120)
        inline = stack.inline_rows(response)
        assert inline.shape[0] == n + 8 - 1
        meta, stored = stack.final_record(rid)
        assert (meta.status, meta.prompt_len) == ("ok", n)
        assert np.array_equal(stored.astype(np.int32), inline)


@pytest.fixture(scope="module")
def dense(sglang_stack) -> dict:
    out = {}
    for side, config in DENSE.items():
        stack = sglang_stack(config)
        responses = {
            n: stack.generate(prompt(n, n), rid=f"{config.name}-{n}", return_routed_experts=True) for n in (1, 2, 100)
        }
        out[side] = {"stack": stack, "responses": responses}
    return out


def test_dense_layers_are_zero_slots_in_sglang_payload(dense):
    for side in ("upstream", "plugin"):
        stack = dense[side]["stack"]
        for n, response in dense[side]["responses"].items():
            rows = stack.inline_rows(response)
            assert rows.shape == (n + 8 - 1, 3, 2)
            assert not rows[:, 0, :].any()  # nothing is routed in the dense layer
    for n in (1, 2, 100):  # the plugin changes nothing SGLang returns
        up, on = dense["upstream"]["responses"][n], dense["plugin"]["responses"][n]
        assert up["meta_info"]["routed_experts"] == on["meta_info"]["routed_experts"]


def test_dense_model_records_hold_the_moe_layers_and_serve_sglang_bytes(dense):
    stack = dense["plugin"]["stack"]
    for n, response in dense["plugin"]["responses"].items():
        rid = f"{stack.config.name}-{n}"
        meta, stored = stack.final_record(rid)
        assert (meta.layers, meta.num_hidden_layers) == ((1, 2), 3)
        assert np.array_equal(stored.astype(np.int32), stack.inline_rows(response)[:, [1, 2], :])
        served = httpx.get(f"{stack.sidecar_url}/routed_experts/{rid}", params={"format": "sglang_b64"}, timeout=30)
        assert served.status_code == 200, served.text
        assert served.text == response["meta_info"]["routed_experts"]  # byte for byte, dense slot included


def test_records_hold_the_layers_sglang_routes_not_the_ones_the_config_names(sglang_stack):
    stack = sglang_stack(QWEN_MLP_ONLY)
    response = stack.generate(prompt(50, 9), rid="mlp-only", return_routed_experts=True)
    inline = stack.inline_rows(response)
    assert inline[:, [0, 2], :].any()  # SGLang routed the layers the config calls dense
    meta, stored = stack.final_record("mlp-only")
    assert meta.layers == (0, 1, 2, 3)
    assert np.array_equal(stored.astype(np.int32), inline)
    served = httpx.get(f"{stack.sidecar_url}/routed_experts/mlp-only", params={"format": "sglang_b64"}, timeout=30)
    assert served.text == response["meta_info"]["routed_experts"]


def test_ngram_speculative_decoding_cannot_run_on_a_cpu_only_sglang(tmp_path):
    """NGRAM's worker imports reconstruct_tree.py, whose lines 49-50 import `sgl_kernel.speculative` on any
    device but CUDA, HIP and XPU; sgl-kernel's CPU build is not on PyPI. The sizing fix for
    `max_running_requests × num_draft_tokens > chunked_prefill_size` (sgl-project/sglang#38717) is proven on
    SGLang's real classes in tests/engine/sglang/test_capture_cases.py instead. If this starts to pass, add the
    real-server case (`--speculative-algorithm NGRAM`, no draft model needed)."""
    env = server_env(Config("spec-probe", sidecar=False), tmp_path / "spool")
    probe = subprocess.run(
        [sys.executable, "-c", "import sglang.srt.speculative.ngram_worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert probe.returncode != 0
    assert "No module named 'sgl_kernel'" in probe.stderr
    assert "sglang/kernels/ops/speculative/reconstruct_tree.py" in probe.stderr
