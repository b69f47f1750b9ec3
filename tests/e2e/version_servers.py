"""What the version suite (`version_suite.py`) runs on each older SGLang: the servers' configurations in that
version's venv (the thin module's `pytestmark` too), the requests every server answers, and what the suite reads
back from a server: its rows counted, two answers compared, its engine file and the build self-check's state.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from baseline import assert_same_rows
from sglang_server import Config, Stack, decode_inline
from test_sglang_front_doors import SLOW_WORKERS
from tiers import tier_marks
from tiny_model import GLM
from waiting import wait_until

from engine_ext.sglang import compat
from engine_ext.sglang.versions import RELEASES

REPO = Path(__file__).resolve().parents[2]


def venv_python(version: str) -> Path:
    return REPO / f".venv-sglang-{version}" / "bin" / "python"


def marks(version: str) -> list:
    """The thin module's `pytestmark`: a real-server test, skipped with the reason when the venv is missing."""
    return [
        *tier_marks("sglang", version),
        pytest.mark.sglang,
        pytest.mark.timeout(900),  # a server start counts in its module's first test
        pytest.mark.skipif(
            not venv_python(version).exists(), reason=f"needs .venv-sglang-{version} (make env-sglang-{version})"
        ),
    ]


def configs(version: str) -> dict[str, Config]:
    python, tag = str(venv_python(version)), "v" + version.replace(".", "")
    return {
        "upstream": Config(f"{tag}-upstream", plugin=False, sidecar=False, python=python),
        "mirror": Config(f"{tag}-mirror", env={"R3_MODE": "mirror"}, python=python),
        "sidecar": Config(f"{tag}-sidecar", env={"R3_MODE": "sidecar"}, python=python),
        "dense": Config(f"{tag}-glm-mirror", env={"R3_MODE": "mirror"}, model=GLM, python=python),
        "workers": Config(
            f"{tag}-workers-mirror",
            args={"tokenizer-worker-num": 2},
            env={"R3_MODE": "mirror"} | SLOW_WORKERS,
            tokenizer=True,  # the text and OpenAI doors
            python=python,
        ),
        # SGLang's HTTP/2 front door (Granian), sidecar mode. 0.5.12 serves even one tokenizer worker from a
        # process Granian spawns; 0.5.16-0.5.20 embed it in the main process for one, and spawn for several.
        "http2": Config(
            f"{tag}-http2-sidecar",
            args={"enable-http2": True} | ({} if spawns_one(version) else {"tokenizer-worker-num": 2}),
            env={"R3_MODE": "sidecar"} | SLOW_WORKERS,
            tokenizer=True,
            python=python,
        ),
    }


def spawns_one(version: str) -> bool:
    """Whether that release's Granian serves even one tokenizer worker from a process it spawns (0.5.12, 0.5.13)."""
    return compat.LAYOUTS[RELEASES[version]].granian_spawns_one


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(500 + seed).integers(3, 250, size=n).tolist()


# name → (input_ids, extra request fields); the same, in this order, on every server of the suite
REQUESTS: dict[str, tuple[list[int], dict]] = {
    "short": (prompt(6, 1), {}),
    "chunked": (prompt(150, 2), {}),  # three prefill chunks at --chunked-prefill-size 64
    "start_len": (prompt(40, 3), {"routed_experts_start_len": 17}),
}


def run_requests(stack: Stack) -> dict[str, dict]:
    return {
        name: stack.generate(ids, return_routed_experts=True, rid=f"{stack.config.name}-{name}", **extra)
        for name, (ids, extra) in REQUESTS.items()
    }


def assert_same_answer(name: str, stack: Stack, up: dict, on: dict) -> None:
    """Two servers answered one request alike: the same tokens and SGLang's inline rows slot for slot
    (`baseline.assert_same_rows` names the rows that differ). `stack` is the reference's."""
    assert up["output_ids"] == on["output_ids"], f"{name}: different tokens"
    reference = stack.inline_rows(up)
    rows = decode_inline(on["meta_info"].get("routed_experts"), stack.num_hidden_layers, stack.topk)
    assert_same_rows(name, reference, rows)


# `SpoolWriter.note_undelivered`'s line, logged before the response leaves (0.5.12's `n>1` prefix request, once)
NOT_DELIVERED = "not delivered to the spool"


def expected_rows(response: dict, start: int = 0) -> int:
    meta = response["meta_info"]
    return meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start


def engine_report(stack: Stack) -> dict:
    """The one engine file the sidecar reads, once the plugin has written it."""

    def reports() -> list[dict]:
        body = httpx.get(f"{stack.sidecar_url}/v1/engines", timeout=10).json()
        return body if isinstance(body, list) else body.get("engines", [])

    found = wait_until(reports, 20, "an engine file in /v1/engines", interval=0.5)
    assert len(found) == 1, found
    return found[0]


def check_state(stack: Stack) -> str | None:
    """The engine file's build self-check state (None: no check, a proven build)."""
    return (engine_report(stack)["build"].get("check") or {}).get("state")


def wait_agreed(stack: Stack) -> None:
    """Until an unproven build's self-check has agreed with SGLang's own rows (`build_check`)."""
    wait_until(lambda: check_state(stack) == "agreed", 30, f"the self-check's agreement ({check_state(stack)})")
