"""The GPU recipe's graph evidence (`tests/engine/gpu/graph_evidence.py`) against each SGLang's own log lines.

The lines that say which graph sizes were captured are printed only on a GPU, so no CPU server shows them.
Here each pattern meets the line that version's source prints: the f-string in its installed package (found by
its constant text), rendered with sample values for its fields. The per-step lines (`Prefill batch …`,
`Decode batch … cpu graph: False`) the CPU rehearsal reads from real servers' logs (README there).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "engine" / "gpu"))

from graph_evidence import DECODE_SIZES, PREFILL_SIZES, evidence  # noqa: E402

# version → (pattern's name, file under sglang/, constant text of the f-string, what its first field says)
SOURCES = {
    "0.5.12": [
        ("decode", "srt/model_executor/cuda_graph_runner.py", "Capture cuda graph bs", None),
        ("prefill", "srt/model_executor/piecewise_cuda_graph_runner.py", "Capture cuda graph num tokens", None),
    ],
    "0.5.16": [
        (
            "decode",
            "srt/model_executor/model_runner_components/cuda_graph_setup.py",
            "num_tokens_per_req=",
            "target decode",
        ),
        ("prefill", "srt/model_executor/model_runner_components/cuda_graph_setup.py", "num_tokens=", "target prefill"),
    ],
}
SIZES = {"decode": [1, 2, 4, 8], "prefill": [4, 8, 3072]}


def package(version: str) -> Path | None:
    found = sorted((REPO / f".venv-sglang-{version}").glob("lib/python3*/site-packages/sglang"))
    return found[0] if found else None


def render(source: str, constant: str, sizes: list[int], first: str | None) -> str:
    """The f-string of `source` whose constant parts hold `constant`, with list fields as `sizes`."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.JoinedStr):
            continue
        parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
        if constant not in "".join(parts):
            continue
        out, fields = [], 0
        for value in node.values:
            if isinstance(value, ast.Constant):
                out.append(value.value)
                continue
            expr = ast.unparse(value.value)
            fields += 1
            if fields == 1 and first is not None:
                out.append(first)
            elif "graph_backend" in expr:
                out.append("CUDA graph")
            elif expr.endswith(("bs", "num_tokens")):
                out.append(str(sizes))
            else:
                out.append("1")
        return "".join(out)
    raise AssertionError(f"no f-string holding {constant!r}")


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_the_capture_lines_of_each_version_give_their_sizes(version):
    root = package(version)
    if root is None:
        pytest.skip(f"needs .venv-sglang-{version} (make env-sglang-{version})")
    patterns = {"decode": DECODE_SIZES, "prefill": PREFILL_SIZES}
    for name, path, constant, first in SOURCES[version]:
        line = render((root / path).read_text(), constant, SIZES[name], first)
        found = patterns[name].search(f"[2026-11-27 00:00:00] {line}")
        assert found is not None, (version, name, line)
        other = patterns["prefill" if name == "decode" else "decode"].search(line)
        assert other is None, (version, name, line)  # the two patterns never take each other's line


def test_evidence_keeps_the_flags_of_the_bs3_decode_and_the_long_prefill():
    log = "\n".join(
        [
            "Capture cuda graph bs [1, 2, 4, 8]",
            "Capture cuda graph num tokens [4, 8, 3072]",
            "Prefill batch, #new-seq: 1, #new-token: 3000, #cached-token: 0, cuda graph: True, input throughput",
            "Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 0, cuda graph: False, input throughput",
            "Decode batch, #running-req: 3, #token: 200, token usage: 0.01, cuda graph: True, gen throughput",
            "Decode batch, #running-req: 1, #token: 90, token usage: 0.01, cuda graph: False, gen throughput",
        ]
    )
    seen = evidence(log, 3000)
    assert seen["decode_sizes"] == [1, 2, 4, 8] and seen["prefill_sizes"] == [4, 8, 3072]
    assert seen["decode_at_3"] == [True] and seen["long_prefill"] == [True]
