"""DP attention with two ranks on CPU (`--tp 2 --dp 2 --enable-dp-attention`): requests land on both ranks.

The MoE routes the DP-gathered batch, so rank 1's rows sit at rank 0's token count in the gathered device
cache. With eager forwards (no CUDA graphs on CPU) upstream's host-integer slice is right, so here both
sides must be exact; the graph-only offset defect (`r · graph_bs · w`, not a request count) is proven on
SGLang's real classes in tests/engine. What this adds: the plugin inside two real DP schedulers, one spool
record per request whichever rank served it, byte-identical to SGLang's inline rows, and those rows match the
same server run without the plugin (which proves it ran none: `baseline.assert_plugin_off`), slot for slot.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from baseline import assert_same_rows
from sglang_server import Config

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # a server start counts in its first test

DP = {"tp": 2, "dp": 2, "enable-dp-attention": True}
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (SGLang asks for it past one NUMA node)
CONFIGS = {
    "upstream": Config("dp-upstream", plugin=False, sidecar=False, args=DP, env=BIND),
    "plugin": Config("dp-mirror", args=DP, env=BIND | {"R3_MODE": "mirror"}),
}
LENGTHS = [5, 40, 90, 17, 66, 8]  # concurrent: the ranks' batches differ in size, so offsets matter


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(300 + seed).integers(3, 250, size=n).tolist()


@pytest.fixture(scope="module")
def served(sglang_stack) -> dict:
    out = {}
    for side, config in CONFIGS.items():
        stack = sglang_stack(config)

        def send(i: int, stack=stack, config=config) -> dict:
            return stack.generate(prompt(LENGTHS[i], i), rid=f"{config.name}-{i}", return_routed_experts=True)

        with ThreadPoolExecutor(len(LENGTHS)) as pool:
            out[side] = {"stack": stack, "responses": list(pool.map(send, range(len(LENGTHS))))}
    return out


def test_both_ranks_serve_and_return_complete_rows(served):
    for side in CONFIGS:
        stack, responses = served[side]["stack"], served[side]["responses"]
        assert {r["meta_info"]["dp_rank"] for r in responses} == {0, 1}, side
        for n, response in zip(LENGTHS, responses, strict=True):
            assert stack.inline_rows(response).shape == (n + 8 - 1, 4, 2), side


def test_records_of_both_ranks_equal_sglang_rows_and_match_the_plugin_off_server(served):
    """Byte for byte, each record is the plugin-on server's inline payload, and those rows are the plugin-off
    server's (its DP slice SGLang's own, not the plugin's `_get_local_slice`) for the same tokens. In bfloat16 the
    two servers routed 0-3 rows of a 12-97-row request differently (near ties the other rank's batch tips); the
    servers run in float32, where none differed (docs/testing.md, "Baselines")."""
    upstream, stack = served["upstream"]["stack"], served["plugin"]["stack"]
    engines = set()
    pairs = zip(served["upstream"]["responses"], served["plugin"]["responses"], strict=True)
    for i, (theirs, ours) in enumerate(pairs):
        reference, inline = upstream.inline_rows(theirs), stack.inline_rows(ours)
        assert ours["output_ids"] == theirs["output_ids"], i
        assert_same_rows(f"request {i}", reference, inline)
        meta, stored = stack.final_record(f"dp-mirror-{i}")
        engines.add(meta.engine)
        assert np.array_equal(stored.astype(np.int32), inline), i
    assert len(engines) == 2  # one engine (writer) per DP rank


def test_the_plugin_sizes_the_gathered_device_cache(served):
    log = served["plugin"]["stack"].server.log_text()
    assert "routed-experts device cache" in log and "2 DP ranks" in log
