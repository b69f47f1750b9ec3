"""Which engine releases CI runs, and which only `make test-matrix` runs (pytest's `matrix` marker).

Why two tiers: CI has 90 minutes on 2 cores, and this project keeps it within half of that (2,700 s, so a slower
machine still lands); every release's real servers together take longer than the whole 90 (the run that tried
them all was stopped at 66%). CI starts real servers of both ends of SGLang's range, 0.5.23 (the CI suite)
and 0.5.12 (verl's pin, the oldest layout: the version suite), one server of every other layout
(`LAYOUT_SMOKE`, `LAYOUTS_SERVED_ELSEWHERE`), and of vLLM 0.32.0 and 0.27.1 (OpenRLHF's pin, on the torch CI
already has); every SGLang release's classes, compiled capture
path and run-time attributes stay in CI (those tests take no tier mark), and so does every release's own wheel
read against the layout (SGLang) or row (vLLM, all 12) it gets (`tests/engine/sglang/test_release_wheels.py`,
`tests/engine/vllm/test_vllm_release_wheels.py`). The SGLang servers between (0.5.20,
0.5.16) and vLLM 0.24.0-0.26.0 (each release's three server starts take 5-7 minutes here, and they need
PyPI's 4.6 GB CUDA torch 2.11 as a layer too; 0.33.0's classes stay in CI), and the vLLM releases no trainer
pins (0.25.0, 0.27.0 and 0.28.0-0.31.0: each as long again, its classes included) run the same tests under
`make test-matrix`; docs/testing.md records its last run. Tests that repeat a configuration CI proves on another
release carry `matrix` themselves.
"""

from __future__ import annotations

from typing import Any

import pytest

MATRIX_ONLY = frozenset(
    {
        ("sglang", "0.5.20"),
        ("sglang", "0.5.16"),
        ("vllm", "0.24.0"),
        ("vllm", "0.25.1"),
        ("vllm", "0.26.0"),
        # the releases between the trainers' pins: their own venvs, built by `make env-vllm-old` only
        ("vllm", "0.25.0"),
        ("vllm", "0.27.0"),
        ("vllm", "0.28.0"),
        ("vllm", "0.29.0"),
        ("vllm", "0.30.0"),
        ("vllm", "0.31.0"),
    }
)


# Every SGLang layout (`compat.LAYOUTS`) runs in a real server in CI, each from one release: these three in modules
# of their own, the rest in `tests/e2e/test_sglang_layouts.py` (one mirror server each, beside a plugin-off one).
# A layout added to `compat.LAYOUTS` fails `tests/test_tiers.py` until it is in one of the two tables.
LAYOUTS_SERVED_ELSEWHERE: dict[str, str] = {
    "0.5.23": "the CI suite (tests/e2e/test_sglang_*.py)",
    "0.5.12": "tests/e2e/test_sglang_0_5_12.py (verl's pin)",
    "0.5.16": "tests/e2e/test_sglang_build_check.py (0.5.16's code as miles' dev build)",
}
LAYOUT_SMOKE: dict[str, str] = {  # layout → the release that serves it; a trainer's pin where one has the layout
    "0.5.13": "0.5.13.post1",
    "0.5.14": "0.5.14",
    "0.5.15": "0.5.15.post1",  # slime's image
    "0.5.17": "0.5.17",
    "0.5.18": "0.5.18",
    "0.5.19": "0.5.19",
    "0.5.20": "0.5.20",
    "0.5.21": "0.5.21",
    "0.5.22": "0.5.22",
}


def tier_marks(engine: str, version: str) -> list[pytest.MarkDecorator]:
    """The marks a test of this release carries for its tier: `matrix` where CI does not run it."""
    return [pytest.mark.matrix] if (engine, version) in MATRIX_ONLY else []


def param(engine: str, version: str, *values: Any, marks: tuple = (), id: str | None = None) -> Any:
    """`pytest.param` for one release (its value `version` unless `values` are given), marked for its tier."""
    return pytest.param(*(values or (version,)), marks=[*marks, *tier_marks(engine, version)], id=id)


def part(releases: list[str], spec: str | None) -> list[str]:
    """The `k`-th of `n` consecutive, near-equal parts of `releases` for `spec` "k/n" (None: all of them). Why:
    11 releases of 5-8 minutes each pass 90 minutes on a loaded 2-core machine; `make test-matrix-releases-1`
    and `-2` each run a part, and `make test-matrix-vllm-1` and `-2` a part of the vLLM releases (all of them in
    one run took 89 minutes at load 5-17)."""
    if not spec:
        return releases
    k, n = (int(x) for x in spec.split("/"))
    if not 1 <= k <= n:
        raise ValueError(f"R3_TEST_RELEASE_PART={spec!r}: want k/n with 1 <= k <= n")
    return releases[(k - 1) * len(releases) // n : k * len(releases) // n]
