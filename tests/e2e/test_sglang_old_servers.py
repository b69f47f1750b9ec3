"""The older SGLangs' environments work: a real SGLang 0.5.16 / 0.5.12 CPU server (`make env-sglang-0.5.16`,
`make env-sglang-0.5.12`) starts from the harness, is that version, and returns inline routed experts that
the seeded weights route differently per layer.

What the per-version smoke tests (`test_sglang_0_5_*.py`) build on: if this fails, the venv or its CPU
workarounds (tests/sglang_cpu, `sglang_server.VERSION_ARGS`) are what broke, not the plugin. Upstream only.
The CPU shim's per-version patches are checked by their effects in each installed SGLang's own processes,
the newer two included (their patches must stay what they were).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from sglang_server import Config, sglang_version
from tiers import param

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.5.16", "0.5.12")
PROMPT = np.random.default_rng(20).integers(3, 250, 200).tolist()  # 4 chunks of 64: chunked prefill too
NEW_TOKENS = 8

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


def python_of(version: str) -> Path:
    return REPO / (".venv" if version == "0.5.23" else f".venv-sglang-{version}") / "bin" / "python"


def installed(*versions: str, tiered: bool = True) -> list:
    """`versions` as parameters, each skipped where its venv is not built (and, `tiered`, marked for its tier)."""
    make = {v: "make env" if v == "0.5.23" else f"make env-sglang-{v}" for v in versions}
    return [
        param(
            "sglang" if tiered else "any",
            v,
            marks=(pytest.mark.skipif(not python_of(v).exists(), reason=f"needs `{make[v]}`"),),
        )
        for v in versions
    ]


# What the shim does in a server process, read back: the patched names, and the two allocations it makes work.
SHIM_EFFECTS = """
import inspect, json, sys
import sglang.srt.layers.rotary_embedding.base as rotary
import sglang.srt.layers.dp_attention as dp
import sglang.srt.state_capturer.base as capturer
import sglang.srt.mem_cache.memory_pool_host
device = {"device": "cpu"} if "device" in inspect.signature(capturer.BaseHostCache).parameters else {}
cache = capturer.BaseHostCache(4, 2, 2, "probe", **device)  # 0.5.20 on: allocated for a device's host
# a forward's rows handed to the overlap scheduler, then the next forward writing the capture buffer first
buffer = capturer.torch.ones(3, 2, 2, dtype=capturer.torch.int32)
out = capturer.TopkCaptureOutput(out_cache_loc=capturer.torch.tensor([1]), topk=buffer[:1], host_cache=cache)
if hasattr(out, "map_device_tensors"):  # 0.5.15 on: the caller's copy (`_async_d2h`: `.to("cpu")` off CUDA)
    out.map_device_tensors(lambda t: t.to("cpu", non_blocking=True))
elif hasattr(out, "copy_to_cpu"):
    out.copy_to_cpu()
buffer[:1] = 2
out.finalize()
print(json.dumps({
    "overlap_rows_kept": int(cache.buffer[1, 0, 0]) == 1,
    "rotary_is_cpu": rotary._is_cpu,
    "dp_memcpy_cpu": getattr(dp, "memcpy_func", None) is getattr(dp, "memcpy_cpu", False),
    "host_cache_pinned": cache.buffer.is_pinned(),
    "sgl_kernel_left": "sgl_kernel" in sys.modules,
}))
"""


@pytest.mark.parametrize("version", installed("0.5.23", "0.5.20", *VERSIONS, tiered=False))
def test_the_cpu_shim_patches_what_each_version_needs(version):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "SGLANG_"))} | {"R3_TEST_SGLANG_CPU": "1"}
    done = subprocess.run(
        [str(python_of(version)), "-c", SHIM_EFFECTS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    effects = json.loads(done.stdout.strip().splitlines()[-1])
    newer = version in ("0.5.23", "0.5.20")
    assert effects == {
        # the capture's "copy to CPU" copies (0.5.18 on: SGLang clones before it, in `on_forward_end`, which this
        # probe skips, so 0.5.20 and 0.5.23 show the bare class; their servers never hand it a bare view)
        "overlap_rows_kept": not newer,
        "rotary_is_cpu": True,
        "dp_memcpy_cpu": newer,  # the older ones have no CPU row copy, and run no DP attention here
        "host_cache_pinned": False,  # 0.5.23 / 0.5.20 allocate unpinned through ALLOC_MEMORY_FUNCS, older via `torch`
        "sgl_kernel_left": False,  # 0.5.12's kvcacheio stub is gone once its module has imported
    }


@pytest.mark.matrix  # CI's 0.5.12 suite (test_sglang_0_5_12.py) starts the same upstream server and checks the same
@pytest.mark.parametrize("version", installed(*VERSIONS))
def test_the_real_server_is_that_version_and_routes_per_layer(version, sglang_stack):
    python = str(python_of(version))
    assert sglang_version(python) == tuple(int(p) for p in version.split("."))
    stack = sglang_stack(Config(f"v{version.replace('.', '')}-upstream", plugin=False, sidecar=False, python=python))
    assert httpx.get(f"{stack.url}/server_info", timeout=30).json()["version"] == version  # what the server runs
    info = stack.generate(
        PROMPT,
        rid=f"old-{version}",
        return_routed_experts=True,
        sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0},
    )
    assert len(info["output_ids"]) == NEW_TOKENS
    rows = stack.inline_rows(info)
    assert rows is not None, "no inline routed experts"
    assert rows.shape == (len(PROMPT) + NEW_TOKENS - 1, stack.num_hidden_layers, stack.topk)
    experts = json.loads((stack.model_dir / "config.json").read_text())["num_experts"]
    assert rows.min() >= 0 and rows.max() < experts
    per_token = np.sort(rows, axis=2)
    for layer in range(1, per_token.shape[1]):
        agree = np.all(per_token[:, 0] == per_token[:, layer], axis=1).mean()
        assert agree < 0.5, f"layer {layer} picks layer 0's experts for {agree:.0%} of the tokens"
    assert len(np.unique(per_token[:, 0], axis=0)) > 1, "every token routed alike"
