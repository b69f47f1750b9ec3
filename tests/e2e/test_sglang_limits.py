"""Configurations where SGLang 0.5.23 itself sizes, slices or lays out rows in ways the plugin must handle.

- `--chunked-prefill-size -1` with a prompt longer than the device cache: upstream's scheduler dies on a
  shape mismatch (sgl-project/sglang#26860); with the plugin the cache is sized to the context and the rows
  are exact.
- A model with dense layers (Qwen3-MoE `mlp_only_layers`): SGLang's payload keeps a slot per model layer,
  dense ones zero; the record holds the MoE layers and `sglang_b64` rebuilds SGLang's bytes.
- Speculative decoding cannot run on a CPU-only SGLang 0.5.23: proven here, with the exact import that fails.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
from sglang_server import Config, server_env

pytestmark = pytest.mark.sglang

NO_CHUNKING = {"chunked-prefill-size": -1, "mem-fraction-static": 0.3}  # -1 leaves the default fraction < 0
CHUNKLESS = {
    "upstream": Config("chunkless-upstream", plugin=False, sidecar=False, args=NO_CHUNKING),
    "plugin": Config("chunkless-mirror", env={"R3_MODE": "mirror"}, args=NO_CHUNKING),
}
DENSE_LAYERS = [0, 2]  # 4 layers: 0 and 2 dense, 1 and 3 MoE
DENSE = {
    "upstream": Config("dense-upstream", plugin=False, sidecar=False, model={"mlp_only_layers": DENSE_LAYERS}),
    "plugin": Config("dense-mirror", env={"R3_MODE": "mirror"}, model={"mlp_only_layers": DENSE_LAYERS}),
}


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(200 + seed).integers(3, 250, size=n).tolist()


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
    assert "routed-experts device cache 2048 rows (upstream 16)" in stack.server.log_text()
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
            assert rows.shape == (n + 8 - 1, 4, 2)
            assert not rows[:, DENSE_LAYERS, :].any()  # nothing is routed in a dense layer
    for n in (1, 2, 100):
        up, on = dense["upstream"]["responses"][n], dense["plugin"]["responses"][n]
        assert up["meta_info"]["routed_experts"] == on["meta_info"]["routed_experts"]


def test_dense_model_records_hold_the_moe_layers_and_serve_sglang_bytes(dense):
    stack = dense["plugin"]["stack"]
    for n, response in dense["plugin"]["responses"].items():
        rid = f"{stack.config.name}-{n}"
        meta, stored = stack.final_record(rid)
        assert meta.layers == (1, 3)
        assert np.array_equal(stored.astype(np.int32), stack.inline_rows(response)[:, [1, 3], :])
        served = httpx.get(f"{stack.sidecar_url}/routed_experts/{rid}", params={"format": "sglang_b64"}, timeout=30)
        assert served.status_code == 200, served.text
        assert served.text == response["meta_info"]["routed_experts"]


@pytest.mark.parametrize(
    ("module", "where"),
    [
        # NGRAM: reconstruct_tree.py:49-50 imports sgl_kernel.speculative when the device is not CUDA/HIP/XPU
        ("sglang.srt.speculative.ngram_worker", "sglang/kernels/ops/speculative/reconstruct_tree.py"),
        # EAGLE / standalone (a draft model): eagle.py:9-10 imports sgl_kernel's *_cpu ops on CPU
        ("sglang.kernels.ops.speculative.eagle", "sglang/kernels/ops/speculative/eagle.py"),
    ],
)
def test_speculative_decoding_cannot_run_on_a_cpu_only_sglang(module, where, tmp_path):
    """Verify forwards need sgl_kernel's CPU build, which PyPI does not carry: the sizing fix for
    `max_running_requests × num_draft_tokens > chunked_prefill_size` (sgl-project/sglang#38717) is proven
    on SGLang's real classes in tests/engine instead. If this starts to pass, add the real-server case."""
    env = server_env(Config("spec-probe", sidecar=False), tmp_path / "spool")
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True, timeout=180
    )
    assert probe.returncode != 0
    assert "No module named 'sgl_kernel'" in probe.stderr
    assert where in probe.stderr
