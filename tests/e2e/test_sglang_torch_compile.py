"""A real CPU server with `--enable-torch-compile`, plugin on, where SGLang can run one: decode through SGLang's
CPU graph runner (the model's forward `torch.compile`d per captured batch size, the plugin's per-layer hook
inside), every record equal to the same response's inline payload byte for byte.

Where SGLang can, on a CPU. `--enable-torch-compile` on `--device cpu` means `CPUGraphRunner` in every
supported version, and its constructor calls `attn_backend.init_cpu_graph_state` (0.5.12
`cpu_graph_runner.py:547`, 0.5.16 :632, 0.5.20 :647, 0.5.23 :680), which only `IntelAMXAttnBackend` defines:
SGLang's CPU engine, built on `sgl_kernel`'s CPU operators (`torch.ops.sgl_kernel.decode_attention_cpu`),
which PyPI's `sglang-kernel` wheels (CUDA builds) lack and which SGLang picks only on Intel AMX hosts. On
this CI machine (no AMX, no CPU build of `sgl_kernel`) SGLang falls back to `torch_native` attention, and:

- 0.5.12, 0.5.16, 0.5.20 build the CPU runner anyway and the scheduler dies at start (0.5.12, run here:
  `AttributeError: 'TorchNativeAttnBackend' object has no attribute 'init_cpu_graph_state'`), plugin or not;
- 0.5.23 builds it only where `current_platform.capabilities.graph_capture` holds, i.e. under
  `SGLANG_USE_CPU_ENGINE=1`, which imports `sgl_kernel`'s CPU operators at start (`ModuleNotFoundError:
  No module named 'sgl_kernel'` here); without it the server starts but captures nothing (eager decode).
- Piecewise CUDA graphs need CUDA on every version (0.5.16+ resolve them off on a CPU; 0.5.12 is told to).

So the server test runs on a host with SGLang's CPU engine (`R3_TEST_SGLANG_CPU_ENGINE=1`: Intel AMX and
`sgl_kernel` built for the CPU in each venv) and is skipped here with that reason; the check below keeps the
reason true for every installed version, and `tests/engine/sglang/test_capture_compiled.py` compiles the hooked
capture path itself (Inductor, `fullgraph=True`) on all four.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from sglang_server import Config, running

REPO = Path(__file__).resolve().parents[2]
VENVS = {"0.5.23": ".venv", "0.5.20": ".venv-sglang-0.5.20", "0.5.16": ".venv-sglang-0.5.16"}
VENVS["0.5.12"] = ".venv-sglang-0.5.12"
CPU_ENGINE = os.environ.get("R3_TEST_SGLANG_CPU_ENGINE") == "1"
MAX_NEW = 12

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]


def _python(version: str) -> Path:
    python = REPO / VENVS[version] / "bin" / "python"
    if not python.exists():
        pytest.skip(f"needs {VENVS[version]}")
    return python


@pytest.mark.parametrize("version", list(VENVS))
def test_the_cpu_graph_runner_needs_the_intel_amx_attention_backend(version: str) -> None:
    """What makes `--enable-torch-compile` need SGLang's CPU engine, read from each version's source."""
    code = """
import json
from engine_ext.sglang import attributes
attn = "sglang.srt.layers.attention"
runner = attributes.source_path("sglang.srt.model_executor.cpu_graph_runner").read_text()
print(json.dumps({
    "runner_calls": "attn_backend.init_cpu_graph_state(" in runner,
    "torch_native": attributes.defines(
        attributes.class_facts(f"{attn}.torch_native_backend.TorchNativeAttnBackend"), "init_cpu_graph_state"),
    "intel_amx": attributes.defines(
        attributes.class_facts(f"{attn}.intel_amx_backend.IntelAMXAttnBackend"), "init_cpu_graph_state"),
}))
"""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [str(_python(version)), "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"runner_calls": True, "torch_native": False, "intel_amx": True}, (version, found)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(700 + seed).integers(3, 250, size=n).tolist()


@pytest.fixture(scope="module", params=list(VENVS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not CPU_ENGINE:
        pytest.skip(
            "needs SGLang's CPU engine (Intel AMX, sgl_kernel built for the CPU: R3_TEST_SGLANG_CPU_ENGINE=1); "
            "every version's CPU graph runner needs IntelAMXAttnBackend (module docstring)"
        )
    version, tag = request.param, "tc" + request.param.replace(".", "")
    args = {"disable-cuda-graph": None, "enable-torch-compile": True, "decode-log-interval": 1}
    args |= {"attention-backend": "intel_amx", "torch-compile-max-bs": 4}
    env = {"R3_MODE": "mirror", "SGLANG_USE_CPU_ENGINE": "1"}
    config = Config(tag, env=env, sidecar=False, args=args, python=str(_python(version)))
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    with running(config, tmp_path_factory.mktemp(tag)) as stack:
        responses: dict[str, dict] = {}

        def send(name: str, ids: list[int], **extra) -> None:
            responses[name] = stack.generate(
                ids, rid=f"{tag}-{name}", return_routed_experts=True, sampling_params=params, **extra
            )

        send("one", _prompt(6, 1))
        threads = [threading.Thread(target=send, args=(f"batch{i}", _prompt(5 + i, 10 + i))) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        send("start", _prompt(20, 3), routed_experts_start_len=9)
        yield {"stack": stack, "responses": responses, "log": stack.server.log_text()}


def test_decode_ran_through_the_compiled_cpu_graph_with_the_plugin_on(server: dict) -> None:
    log = server["log"]
    assert "registering no hooks" not in log, log[-3000:]
    graphed = re.findall(r"Decode batch.*#running-req: (\d+).*cpu graph: True", log)
    assert graphed, log[-3000:]  # decode batches replayed the compiled forward
    assert "3" in graphed, graphed  # three concurrent requests in one padded graph (bs 3 → 4)


def test_every_record_is_the_inline_payload_byte_for_byte(server: dict) -> None:
    stack = server["stack"]
    assert set(server["responses"]) == {"one", "batch0", "batch1", "batch2", "start"}
    for name, response in server["responses"].items():
        inline = stack.inline_rows(response)
        start = 9 if name == "start" else 0
        assert inline.shape[0] == response["meta_info"]["prompt_tokens"] + MAX_NEW - 1 - start, name
        meta, stored = stack.final_record(f"{stack.config.name}-{name}")
        assert meta.status == "ok", name
        assert np.array_equal(stored.astype(np.int32), inline), name


def test_compiled_rows_differ_per_layer(server: dict) -> None:
    """The seeded weights route layers differently: a layer mix-up in the compiled capture would show."""
    rows = np.sort(server["stack"].inline_rows(server["responses"]["one"]), axis=2)
    assert np.all(rows[:, 0] == rows[:, 1], axis=1).mean() < 0.5
