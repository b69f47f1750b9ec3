"""A tiny run of the benchmark harness, so it cannot rot: every section runs end to end on real servers.

It asserts the results are well formed and that the inline path's bytes decoded to the engine's rows
(the harness compares them and records `decoded_equal`); it never asserts a timing.
The harness imports SGLang and starts servers, so it runs in a child process (SGLang sets process env vars),
forked from the test process's SGLang zygote (`sglang_env.run_sglang`: SGLang imported once); it runs as
`python -m benchmarks.run` runs, its own CPU stand-in for pinned host memory applied as there.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "engine" / "sglang"))  # the SGLang zygote's side (`sglang_env`)

from sglang_env import run_sglang  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    argv = ["benchmarks.run", "--quick", "--no-report", "--out", str(out)]
    run_sglang(f"import runpy, sys\nsys.argv = {argv!r}\nrunpy.run_module('benchmarks.run', run_name='__main__')")
    return orjson.loads(out.read_bytes())


def _finite_positive(x: float) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_delivery_inline_bytes_decode_to_the_engine_rows(results: dict) -> None:
    cases = results["delivery"]
    assert {c["model"] for c in cases} == {"Qwen3-30B-A3B", "DeepSeek-V3", "Kimi-K2"}
    for c in cases:
        assert c["decoded_equal"] is True
        assert c["rows"] == c["tokens"] - 1
        # base64 of int32 over every hidden layer is far larger than the compact npy body
        assert c["ours_bytes"] < c["inline_bytes"]
        assert _finite_positive(c["inline_s"]["p50"]) and _finite_positive(c["ours_s"]["p50"])
        assert c["inline_s"]["n"] == c["ours_s"]["n"] >= 1


def test_concurrency_fetches_every_record_without_errors(results: dict) -> None:
    cfg = results["config"]
    modes = {(c["mode"], c["concurrency"]) for c in results["concurrency"]}
    assert modes == {(m, n) for m in ("get", "get_many", "lean_get") for n in cfg["concurrency"]}
    record_bytes = results["limits"]["record_bytes"]
    for c in results["concurrency"]:
        assert c["errors"] == 0, c["error_samples"]
        assert c["bytes"] == record_bytes * cfg["batch_records"]
        assert c["latency"]["n"] == math.ceil(cfg["batch_records"] / c["rids_per_request"])
        assert c["latency"]["p99"] >= c["latency"]["p50"] > 0


def test_limits_engine_and_memory_are_measured(results: dict) -> None:
    lim = results["limits"]
    assert lim["batch_bytes"] == lim["record_bytes"] * results["config"]["batch_records"]
    for key in ("memcpy_record", "memcpy_batch", "loopback"):
        assert _finite_positive(lim[key]["gbps"])
    finish = results["engine"]["finish"]
    assert len(finish) == len(results["config"]["models"]) * len(results["config"]["tokens"])
    for e in finish:
        assert e["spool_record_equal"] is True
        for key in ("upstream_gather", "upstream_ipc_encode", "upstream_total", "ours_total", "ours_total_cpu"):
            assert _finite_positive(e[key]["p50"])
    for m in results["memory"]:
        assert m["spool_bytes"] >= m["records"] * results["limits"]["record_bytes"]
        assert m["drain_errors"] == 0
        assert m["served"]["VmRSS"] > 0 and m["baseline"]["VmRSS"] > 0


def test_breakdown_compares_the_same_bytes(results: dict) -> None:
    stacks = results["breakdown"]["client_stacks"]["stacks"]
    assert set(stacks) == {
        "RoutedExpertsClient.get",
        "httpx.Client.get().content",
        "http.client readinto",
        "raw socket recv_into",
    }
    assert all(_finite_positive(v["p50"]) for v in stacks.values())
    comp = results["breakdown"]["compaction"]
    assert len(comp) == len(results["config"]["models"]) * len(results["config"]["tokens"])
    for c in comp:
        assert all(_finite_positive(c[k]) for k in ("upstream_gather_ms", "plugin_gather_compact_ms", "fused_numpy_ms"))
    live = results["breakdown"]["live_compaction"]
    assert [c["model"] for c in live] == results["config"]["models"]
    assert all(_finite_positive(c["per_request_us"]) and _finite_positive(c["per_step_us"]) for c in live)


def test_report_renders_every_section(results: dict, tmp_path: Path) -> None:
    from benchmarks.report import write_report

    md = tmp_path / "BENCHMARKS.md"
    write_report(results, md, tmp_path / "plots")
    text = md.read_text()
    headings = ("## Targets", "## 1. Delivery", "## 2. Throughput", "## 3.", "## 4.", "## 5. Sidecar memory", "## 6.")
    for heading in headings:
        assert heading in text
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == [
        "concurrency.png",
        "delivery_bytes.png",
        "delivery_seconds.png",
        "engine_cost.png",
        "memory.png",
    ]


def test_report_over_an_existing_document_keeps_its_other_sections(results: dict, tmp_path: Path) -> None:
    from benchmarks.report import write_report

    md = tmp_path / "BENCHMARKS.md"
    md.write_text(
        "# Benchmarks\n\n## 1. Delivery per request\nstale-delivery\n\n## By hand\nkept text\n\n## Plots\nstale-plots\n"
    )
    write_report(results, md, tmp_path / "plots")
    text = md.read_text()
    assert "## By hand\nkept text" in text and "stale-" not in text
    assert text.count("## 1. Delivery") == 1 and text.count("## Plots") == 1
