"""The older SGLangs' environments work: a real SGLang 0.5.16 / 0.5.12 CPU server (`make env-sglang-0.5.16`,
`make env-sglang-0.5.12`) starts from the harness, is that version, and returns inline routed experts that
the seeded weights route differently per layer.

What the per-version smoke tests (`test_sglang_0_5_*.py`) build on: if this fails, the venv or its CPU
workarounds (tests/sglang_cpu, `sglang_server.VERSION_ARGS`) are what broke, not the plugin. Upstream only.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from sglang_server import Config, sglang_version

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.5.16", "0.5.12")
PROMPT = np.random.default_rng(20).integers(3, 250, 200).tolist()  # 4 chunks of 64: chunked prefill too
NEW_TOKENS = 8

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


def python_of(version: str) -> Path:
    return REPO / f".venv-sglang-{version}" / "bin" / "python"


@pytest.mark.parametrize(
    "version",
    [
        pytest.param(v, marks=pytest.mark.skipif(not python_of(v).exists(), reason=f"needs `make env-sglang-{v}`"))
        for v in VERSIONS
    ],
)
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
