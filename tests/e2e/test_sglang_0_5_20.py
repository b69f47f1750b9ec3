"""Smoke test on a real SGLang 0.5.20 CPU server (`make env-sglang-0.5.20`): the plugin says it is not proven
there, registers nothing, and SGLang's own rows, routed per layer by the real weights, are untouched.

0.5.20 pins the torch 0.5.23 does, and runs on the CPU with 0.5.23's shims. The plugin's hooks are not yet
proven on it (docs/versions.md), so what is checked is the loud, inert path, against the upstream baseline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sglang_server import Config, Stack

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-sglang-0.5.20" / "bin" / "python"

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not PYTHON.exists(), reason="needs `make env-sglang-0.5.20`"),
]

UPSTREAM = Config("v0520-upstream", plugin=False, sidecar=False, python=str(PYTHON))
PLUGIN = Config("v0520-mirror", env={"R3_MODE": "mirror"}, sidecar=False, python=str(PYTHON))
PROMPTS = {"short": np.arange(10, 16).tolist(), "chunked": np.random.default_rng(20).integers(3, 250, 200).tolist()}


def run(stack: Stack) -> dict[str, dict]:
    return {
        name: stack.generate(ids, return_routed_experts=True, rid=f"{stack.config.name}-{name}")
        for name, ids in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def upstream(sglang_stack) -> tuple[Stack, dict]:
    stack = sglang_stack(UPSTREAM)
    return stack, run(stack)


@pytest.fixture(scope="module")
def plugin(upstream, sglang_stack) -> tuple[Stack, dict]:
    stack = sglang_stack(PLUGIN)
    return stack, run(stack)


def test_the_server_is_0_5_20_and_routes_differently_per_layer(upstream):
    stack, responses = upstream
    assert stack.generate([5, 6, 7])["meta_info"]  # alive
    rows = np.sort(stack.inline_rows(responses["chunked"]), axis=2)
    assert rows.shape[0] == 200 + 8 - 1
    for b in range(1, rows.shape[1]):
        assert np.all(rows[:, 0] == rows[:, b], axis=1).mean() < 0.5


def test_the_plugin_says_once_per_process_it_is_not_proven_and_changes_nothing(upstream, plugin):
    (stack, on), (_, up) = plugin, upstream
    lines = [line for line in stack.server.log_text().splitlines() if "r3-sidecar: sglang==0.5.20" in line]
    assert lines and all("registering no hooks" in line for line in lines)
    for name in PROMPTS:
        assert on[name]["output_ids"] == up[name]["output_ids"], name
        assert on[name]["meta_info"]["routed_experts"] == up[name]["meta_info"]["routed_experts"], name
        assert "routed_experts_url" not in on[name]["meta_info"]
    assert not any(stack.spool.glob("**/*.json"))  # nothing half-installed: no record, no engine file
