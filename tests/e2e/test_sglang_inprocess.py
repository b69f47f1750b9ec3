"""SGLang launched inside the caller's process, as verl launches it: the caller gets rows or a pointer, never nothing.

verl 0.9.1 starts SGLang with `Engine._launch_subprocesses` in its Ray actor and sends requests through
`tokenizer_manager.generate_request` (`inprocess_launch.py` does the same). SGLang loads plugins in that
launch (engine.py:1157-1159), so the pointer hook runs in the caller's process. In sidecar mode with a tiny
`R3_SPOOL_MAX_BYTES`, a request the spool takes carries a pointer (and no rows), one the spool refuses carries
SGLang's inline rows (and no pointer): with `--skip-tokenizer-init` (verl's `skip_tokenizer_init` branch) and
without it.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from child_process import Process, free_port, spawn
from sglang_server import BASE_ARGS, REPO, Config, server_env
from tiny_model import write_model, write_tokenizer

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

SMALL, LARGE = 6, 400  # prompt lengths: 11 rows x 8 bytes fit a 3000-byte spool, 405 rows x 8 do not


def launch(root, *, skip_tokenizer_init: bool) -> tuple[list[dict], Process]:
    """Run inprocess_launch.py with a sidecar beside it: its results, and the sidecar (still running)."""
    model_dir = write_model(root / "model")
    if not skip_tokenizer_init:
        write_tokenizer(model_dir)
    config = Config("inprocess", env={"R3_MODE": "sidecar", "R3_SPOOL_MAX_BYTES": "3000"})
    env = server_env(config, root / "spool")
    port = free_port()
    sidecar = spawn(
        [sys.executable, "-m", "service.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        {**env, "R3_TEST_SGLANG_CPU": "0"},
        root / "sidecar.log",
        f"http://127.0.0.1:{port}",
    )
    env["R3_SIDECAR_URL"] = sidecar.url
    args = {name.replace("-", "_"): value for name, value in BASE_ARGS.items()}
    args |= {"model_path": str(model_dir), "skip_tokenizer_init": skip_tokenizer_init, "port": free_port()}
    rng = np.random.default_rng(11)
    requests = [(f"inproc-{n}", rng.integers(8, 250, size=n).tolist()) for n in (SMALL, LARGE)]
    caller = spawn(
        [
            sys.executable,
            str(REPO / "tests/e2e/inprocess_launch.py"),
            json.dumps({"server_args": args, "requests": requests}),
        ],
        env,
        root / "caller.log",
        "",
    )
    try:
        sidecar.wait_http("/readyz", 60, "r3-sidecar")
        try:
            caller.proc.wait(400)
        except subprocess.TimeoutExpired:
            pytest.fail(f"in-process launch did not finish:\n{caller.log_text()[-4000:]}")
        lines = [json.loads(line[7:]) for line in caller.log_text().splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 2, caller.log_text()[-4000:]
        return lines, sidecar
    except BaseException:
        sidecar.stop()
        raise
    finally:
        caller.stop()


@pytest.mark.parametrize("skip_tokenizer_init", [True, False], ids=["skip-tokenizer-init", "tokenizer"])
def test_inprocess_caller_gets_rows_or_a_pointer(sglang_exclusive, skip_tokenizer_init):
    root = sglang_exclusive() / f"inprocess-{skip_tokenizer_init}"
    (small, large), sidecar = launch(root, skip_tokenizer_init=skip_tokenizer_init)
    sidecar_url = sidecar.url
    try:
        # The spool took the small request: a pointer, no rows (verl's `meta_info["routed_experts"]` is absent).
        assert small["inline"] is None and small["inline_type"] == "NoneType"
        assert small["url"] == f"{sidecar_url}/routed_experts/inproc-{SMALL}"
        fetched = httpx.get(small["url"], params={"format": "npy", "wait": 30}, timeout=60)
        assert fetched.status_code == 200, fetched.text
        assert fetched.headers["X-R3-Shape"] == f"{small['prompt_tokens'] + small['completion_tokens'] - 1},4,2"
        # The spool refused the large one: SGLang's rows inline, no pointer, and its rid answers 410 at once.
        assert large["url"] is None
        assert large["inline_type"] == "str"  # base64 even in-process and with skip_tokenizer_init (0.5.23)
        rows = np.frombuffer(base64.b64decode(large["inline"]), dtype=np.int32).reshape(-1, 4, 2)
        assert rows.shape[0] == large["prompt_tokens"] + large["completion_tokens"] - 1
        gone = httpx.get(f"{sidecar_url}/routed_experts/inproc-{LARGE}?wait=20", timeout=30)
        assert gone.status_code == 410 and gone.json()["error"] == "record_error", gone.text  # at once, not a wait
    finally:
        sidecar.stop()
