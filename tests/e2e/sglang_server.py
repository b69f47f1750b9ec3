"""A real SGLang 0.5.23 server on this CPU machine, with or without the plugin, and a real sidecar beside it.

What the real-engine suite (`tests/e2e/test_sglang_*.py`), `make demo-sglang` and the real-server benchmark
share: a tiny Qwen3-MoE written by the test, `config.json` plus seeded random real weights
(`tiny_weights.py`: routing differs per layer and per token, which `--load-format dummy` does not give; other
architectures still load dummy weights), `--skip-tokenizer-init` (requests carry `input_ids`),
`python -m sglang.launch_server` in its own process group, `r3-sidecar serve` on the same spool, free
loopback ports, and teardown by pid (the whole group: tokenizer manager, scheduler and detokenizer go with
it), also when a test fails.

The plugin is loaded through its entry point; `plugin=False` sets `SGLANG_PLUGINS=__none__`, the upstream
baseline on the same install. The CPU workarounds are `tests/sglang_cpu/_sglang_cpu_server_shim.py`,
armed by `R3_TEST_SGLANG_CPU=1` in the server's environment only; `Config.python` picks another SGLang's
venv, and the launch flags that version needs on the CPU (`VERSION_ARGS`) follow from its code's version.
`Config(gpu=True)` launches on CUDA at SGLang's GPU defaults instead (`GPU_ARGS`, CPU shims off): the GPU
recipe, tests/engine/gpu/servers.py. The model's files are `tiny_model.py`'s; the child processes, their logs
and their ports `child_process.py`'s.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from baseline import assert_plugin_off
from child_process import Process, free_port, spawn
from tiny_model import load_format, write_model, write_tokenizer

from service.spool import Spool
from service.spool.record.meta import RecordMeta

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tests") not in sys.path:  # the shared waiting helper, also for callers outside pytest (benchmarks)
    sys.path.append(str(REPO / "tests"))
from waiting import wait_until  # noqa: E402

START_TIMEOUT_S = 600.0  # a hang guard: two servers start side by side in CI's server tier (-n 2)
# What SGLang logs once a tokenizer worker's warmup request has answered (every release 0.5.12-0.5.23).
WARMED_UP = "The server is fired up and ready to roll!"

# The launch every configuration starts from (sglang-cpu facts: a small KV cache, no CUDA graphs on CPU).
# float32 on the CPU: in bfloat16 two servers given the same request routed a few rows differently (near ties
# that another batch shape tips: 3 of 47 rows between a plugin-off and a plugin-on DP-attention server), so rows
# of two servers could not be compared exactly; in float32 none differed (docs/testing.md, "Baselines").
# `sleep-on-idle`: an idle scheduler waits on its sockets instead of spinning a core in its event loop (SGLang's
# default, made for a GPU), so a server a module keeps up between its tests leaves the cores to the other
# worker's server start; SGLang's own flag (0.5.12-0.5.23), and it changes only what the loop does with nothing
# to run. A CUDA launch keeps SGLang's default (GPU_ARGS).
BASE_ARGS: dict[str, Any] = {
    "skip-tokenizer-init": True,
    "device": "cpu",
    "dtype": "float32",
    "enable-return-routed-experts": True,
    "max-total-tokens": 8192,
    "max-running-requests": 16,
    "chunked-prefill-size": 64,
    "disable-cuda-graph": True,
    "sleep-on-idle": True,
    "log-level": "info",
}

# What older SGLangs need on top of BASE_ARGS on the CPU: (versions before this, flags). 0.5.12 turns
# piecewise CUDA graphs on unless its `is_cpu()` (SGLang's own CPU engine, sgl_kernel's CPU build) says CPU.
VERSION_ARGS: list[tuple[tuple[int, ...], dict[str, Any]]] = [
    ((0, 5, 16), {"disable-piecewise-cuda-graph": True}),
]

# What a CUDA launch (`Config(gpu=True)`, tests/engine/gpu/servers.py) changes in BASE_ARGS: SGLang's own device,
# chunking, CUDA graphs, piecewise graphs and overlap (None drops a flag). Triton attention, PyTorch sampling and
# no grammar backend because the recipe carries no FlashInfer or FlashAttention kernels. Several servers share
# the one GPU: SGLang sizes its KV pool as a share of the memory free at its start, so each gets a high share
# and a token cap (`max-total-tokens`) that bounds what it takes.
GPU_ARGS: dict[str, Any] = {
    "device": None,
    "sleep-on-idle": None,
    "dtype": "bfloat16",
    "disable-cuda-graph": None,
    "chunked-prefill-size": None,
    "attention-backend": "triton",
    "sampling-backend": "pytorch",
    "grammar-backend": "none",
    "mem-fraction-static": 0.85,
    "max-total-tokens": 32768,
}


@functools.cache
def sglang_version_string(python: str) -> str:
    """The version of the SGLang code `python` imports, as it spells it (`0.5.15.post1`): its `sglang/_version.py`,
    read without importing sglang (the dist-info first on the path can say otherwise, as `test_sglang_versions.py`
    arranges on purpose)."""
    code = (
        "import importlib.util, runpy; (d,) = importlib.util.find_spec('sglang').submodule_search_locations; "
        "print(runpy.run_path(d + '/_version.py')['__version__'])"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def sglang_version(python: str) -> tuple[int, ...]:
    """`sglang_version_string` as the release's numbers (`(0, 5, 15)`), for comparing with a release."""
    return tuple(int(part) for part in sglang_version_string(python).split(".")[:3] if part.isdigit())


def version_args(python: str) -> dict[str, Any]:
    """The launch flags `VERSION_ARGS` adds for the SGLang that `python` runs."""
    version = sglang_version(python)
    args: dict[str, Any] = {}
    for before, flags in VERSION_ARGS:
        if version < before:
            args |= flags
    return args


def cli_args(args: dict[str, Any]) -> list[str]:
    """`{"tp": 2, "disable-cuda-graph": True, "x": None}` → `--tp 2 --disable-cuda-graph` (None drops a flag)."""
    out: list[str] = []
    for name, value in args.items():
        if value is None or value is False:
            continue
        out.append(f"--{name}")
        if value is not True:
            out.append(str(value))
    return out


@dataclass
class Config:
    """One server configuration: launch arguments over `BASE_ARGS`, plugin settings, model overrides."""

    name: str
    plugin: bool = True
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # R3_* and SGLANG_* for the server's processes
    model: dict[str, Any] = field(default_factory=dict)  # config.json overrides
    sidecar: bool = True  # start `r3-sidecar serve` on the same spool
    tokenizer: bool = False  # write `write_tokenizer` into the model dir and drop --skip-tokenizer-init
    python: str = sys.executable  # another SGLang's venv (`make env-sglang-<version>`) runs another version
    gpu: bool = False  # launch on CUDA at SGLang's defaults (`GPU_ARGS`), CPU shims off


@dataclass
class Stack:
    """A running SGLang server (and its sidecar): what a test talks to."""

    config: Config
    server: Process
    sidecar: Process | None
    spool: Path
    model_dir: Path
    num_hidden_layers: int
    topk: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def sidecar_url(self) -> str:
        assert self.sidecar is not None, f"{self.config.name} runs no sidecar"
        return self.sidecar.url

    def generate(self, input_ids: list[int], *, timeout: float = 120.0, **body: Any) -> dict[str, Any]:
        """POST /generate; greedy unless `sampling_params` says otherwise; a baseline's answers are checked."""
        body.setdefault("sampling_params", {"max_new_tokens": 8, "temperature": 0.0})
        response = httpx.post(f"{self.url}/generate", json={"input_ids": input_ids, **body}, timeout=timeout)
        response.raise_for_status()
        answer = response.json()
        for each in answer if isinstance(answer, list) else [answer]:
            self.assert_plugin_off(each.get("meta_info", {}))
        return answer

    def inline_rows(self, response: dict[str, Any]) -> np.ndarray | None:
        """SGLang's `meta_info["routed_experts"]` as (rows, num_hidden_layers, topk) int32, or None if absent
        (a plugin-off baseline's, once it proved it ran no plugin)."""
        self.assert_plugin_off(response["meta_info"])
        return decode_inline(response["meta_info"].get("routed_experts"), self.num_hidden_layers, self.topk)

    def assert_plugin_off(self, meta_info: dict[str, Any]) -> None:
        """On a plugin-off baseline: its spool empty, no pointer in its answer (`baseline`); else a no-op."""
        if not self.config.plugin:
            assert_plugin_off(self.config.name, self.spool, meta_info)

    def record(self, rid: str) -> tuple[RecordMeta | None, np.ndarray | None]:
        """The spool's record of `rid` read straight from its files: (metadata, rows as stored), or Nones."""
        spool = Spool(self.spool, create=False)
        meta = spool.read_meta(rid)
        return (None, None) if meta is None else (meta, spool.read_array(meta))

    def suspect_rids(self) -> list[str]:
        """Rids of the spool's records the row check marked `suspect` (issue 40): none, for true routes."""
        spool = Spool(self.spool, create=False)
        metas = (spool.read_meta_file(spool.records_dir / f"{name}.json") for name in spool.record_names())
        return sorted(meta.rid for meta in metas if meta.status == "suspect")

    def final_record(self, rid: str, timeout: float = 30.0) -> tuple[RecordMeta, np.ndarray]:
        """The record once final: the writer thread publishes it shortly after SGLang answers."""

        def final() -> tuple[RecordMeta, np.ndarray] | None:
            meta, rows = self.record(rid)
            return (meta, rows) if meta is not None and meta.final else None

        return wait_until(final, timeout, lambda: f"a final record of {rid} (now {self.record(rid)[0]})")

    def stop(self) -> None:
        for process in (self.sidecar, self.server):
            if process is not None:
                process.stop()


def decode_inline(payload: str | None, num_layers: int, topk: int) -> np.ndarray | None:
    """SGLang's inline layout: base64 of int32 C-order rows of `num_hidden_layers × topk`."""
    if payload is None:
        return None
    return np.frombuffer(base64.b64decode(payload), dtype=np.int32).reshape(-1, num_layers, topk)


def server_env(config: Config, spool: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "SGLANG_"))}
    env.update(
        {
            "R3_TEST_SGLANG_CPU": "0" if config.gpu else "1",
            "R3_SPOOL_DIR": str(spool),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
    )
    if not config.plugin:
        env["SGLANG_PLUGINS"] = "__none__"
    env.update(config.env)
    return env


def start(config: Config, workdir: Path) -> Stack:
    """Start the server (and sidecar) of `config` under `workdir`; raise with the log tail if it fails."""
    workdir.mkdir(parents=True, exist_ok=True)
    # Weights only where they are read: a `--load-format dummy` launch (the benchmarks', up to Qwen3-30B-A3B's
    # layer shape on a GPU: gigabytes) would only wait for them
    model_dir = write_model(workdir / "model", weights=config.args.get("load-format") != "dummy", **config.model)
    if config.tokenizer:
        write_tokenizer(model_dir, int(json.loads((model_dir / "config.json").read_text())["vocab_size"]))
    model = json.loads((model_dir / "config.json").read_text())
    spool = workdir / "spool"
    port = free_port()
    env = server_env(config, spool)
    if sglang_version(config.python) < (0, 5, 16):
        # 0.5.12 validates a gRPC port of `port + 10000` at start (never bound unless SGLANG_ENABLE_GRPC) and
        # refuses one above 65535: an ephemeral port over 55535 failed the start. Give it a real one; not 0.5.16
        # on, which derive that port only in legacy gRPC mode and where a set SGLANG_GRPC_PORT turns native gRPC
        # on (refused with several tokenizer workers: server_args.py `_handle_deprecated_args`).
        env.setdefault("SGLANG_GRPC_PORT", str(free_port()))
    sidecar = None
    if config.sidecar:
        sidecar_port = free_port()
        sidecar = spawn(
            [sys.executable, "-m", "service.server.cli", "serve", "--host", "127.0.0.1", "--port", str(sidecar_port)],
            {**env, "R3_TEST_SGLANG_CPU": "0"},
            workdir / "sidecar.log",
            f"http://127.0.0.1:{sidecar_port}",
        )
        env.setdefault("R3_SIDECAR_URL", sidecar.url)
    args = BASE_ARGS | (GPU_ARGS if config.gpu else version_args(config.python))
    args |= {"model-path": str(model_dir), "load-format": load_format(model_dir), "host": "127.0.0.1", "port": port}
    args |= config.args
    if config.tokenizer:
        args["skip-tokenizer-init"] = None
    server = spawn(
        [config.python, "-m", "sglang.launch_server", *cli_args(args)],
        env,
        workdir / "server.log",
        f"http://127.0.0.1:{port}",
    )
    stack = Stack(
        config, server, sidecar, spool, model_dir, int(model["num_hidden_layers"]), int(model["num_experts_per_tok"])
    )
    try:
        if sidecar is not None:
            sidecar.wait_http("/readyz", 120, "r3-sidecar")
        server.wait_http("/health", START_TIMEOUT_S, f"SGLang ({config.name})")
        workers = int(args.get("tokenizer-worker-num") or 1)
        if workers > 1 and "enable-http2" not in args:
            # Each uvicorn tokenizer worker runs SGLang's warmup request, and /health answers for the one that
            # answered it: a test request sent before the others are done can share a batch with one. 0.5.12's
            # scheduler lists routed experts only for the requests that asked for them, and its detokenizer,
            # splitting that batch per worker, then fails (IndexError) and every later request hangs: the
            # warmups are done first (docs/testing.md, flaky tests; docs/versions.md, 0.5.12).
            server.wait_log(WARMED_UP, workers, START_TIMEOUT_S, f"SGLang ({config.name}) warmups")
    except BaseException:
        stack.stop()
        raise
    return stack


@contextlib.contextmanager
def running(config: Config, workdir: Path) -> Iterator[Stack]:
    stack = start(config, workdir)
    try:
        yield stack
    finally:
        stack.stop()
