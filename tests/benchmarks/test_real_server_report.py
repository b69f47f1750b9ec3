"""The real-server benchmark's section survives both writers of BENCHMARKS.md, and renders from its results.

No server starts here (a real run takes minutes: `make bench-sglang`); synthetic results stand in for one, and
no timing is asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.real_server import runner, section, workloads
from benchmarks.report import document as report  # the module that writes BENCHMARKS.md

BEGIN, END = report.REAL_SERVER_BEGIN, report.REAL_SERVER_END


@pytest.mark.parametrize(
    "document",
    [
        "# Benchmarks\n\n## 6. x\n\n## Findings\nf\n",
        f"# Benchmarks\n\n{BEGIN}\nold section\n{END}\n\n## Findings\nf\n",
        "# Benchmarks\n\nno findings\n",
    ],
)
def test_splice_puts_one_section_between_the_markers(document: str) -> None:
    out = section.splice(document, "## Real SGLang server\nnew")
    assert out.count(BEGIN) == out.count(END) == 1
    assert f"{BEGIN}\n## Real SGLang server\nnew\n{END}" in out
    assert "old section" not in out
    assert out.startswith("# Benchmarks")
    if "## Findings" in document:
        assert out.index(END) < out.index("## Findings")
    assert section.splice(out, "## Real SGLang server\nnew") == out  # idempotent


def _synthetic_results() -> dict:
    env = {"date_utc": "2026-01-01 00:00:00", "commit": "abc1234", "cpus": 2, "loadavg": [1.0, 1.0, 1.0]}
    reps = []
    for rep in range(3):
        row: dict = {"order": workloads.MODES, "throughput": {}, "itl": {}, "lags": {}}
        for k, mode in enumerate(workloads.MODES):
            row["throughput"][mode] = {
                "tok_s": 100.0 + rep + k,
                "tok_per_cpu_s": 50.0 + k,
                "server_cpu_ms_per_token": 5.0,
                "sidecar_cpu_ms_per_token": 0.1,
            }
            gaps = [{"s": 0.05 + 0.001 * i, "at_finish": i % 10 == 0} for i in range(100)]
            long_done = [{"tokens": 4120, "inline_b64_bytes": 1_400_000}]
            row["itl"][mode] = {"gaps": gaps, "finishes": [1.0, 2.0], "long_finished": long_done}
        row["lags"] = {"sidecar": [-0.01, 0.002], "live": [0.001, 0.003]}
        reps.append(row)
    results = {
        "bench": workloads.Bench().__dict__,
        "environment": env,
        "environment_after": {"loadavg": [2.0, 1.5, 1.0]},
        "reps": reps,
        "start_s": 60.0,
        "wall_s": 500.0,
    }
    results["summary"] = runner.summarize(results)
    return results


def test_section_renders_targets_and_every_mode() -> None:
    text = section.render_section(_synthetic_results())
    assert text.startswith("## Real SGLang server")
    assert "make bench-sglang" in text and "abc1234" in text
    assert text.count("≥ 0.99") == 4 and "≤ 1.2" in text
    for mode in workloads.MODES:
        assert f"| {mode} |" in text


def test_report_keeps_the_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "real_server.md").write_text("## Real SGLang server\nkept\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    env = {
        "date_utc": "x",
        "commit": "c",
        "cpus": 2,
        "mem_total": 2**30,
        "shm_total": 2**30,
        "python": "3",
        "numpy": "2",
        "torch": "t",
        "sglang": "s",
        "loadavg": [1.0, 1.0, 1.0],
    }
    text = report.render({"environment": env, "config": {}}, [], "plots")
    assert f"{BEGIN}\n## Real SGLang server\nkept\n{END}" in text


def test_regenerating_keeps_every_section_it_does_not_write(tmp_path: Path) -> None:
    """Sections 1-6 are the run's; every other section of the real BENCHMARKS.md survives, verbatim."""
    document = (Path(__file__).resolve().parents[2] / "BENCHMARKS.md").read_text()
    kept = report.kept_sections(document)
    assert kept is not None
    for heading in ("## 7. Trainer API", "## Real SGLang server", "## Hook costs", "### On a GPU", "## Findings"):
        assert heading in kept
    assert kept.count(BEGIN) == kept.count(END) == 1
    assert "## Plots" not in kept and "## 1. Delivery" not in kept
    assert kept in document, "BENCHMARKS.md's per-rank table differs from benchmarks/ranks.md"
