"""Run SGLang 0.5.23 internals on a CPU-only machine, each group of checks in a process of its own.

SGLang sets process environment variables and global state (published config, applied hooks) on import and
publish, so engine tests run their code through `run_sglang(code)`: a new process with the CPU workarounds
applied (forked from a zygote that imported them once: `tests/zygote.py`), `emit(obj)` to hand JSON back, and a
clear failure carrying the child's stderr.

Inside the child, `from sglang_env import publish_args, tiny_model_config` give a published `ServerArgs`
and a real `ModelConfig` of the tiny Qwen3-MoE in `tests/sglang_cpu/tiny_qwen3moe`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the test process's side only: the children import this module without `tests/` on their path
    from zygote import Zygote


REPO = Path(__file__).resolve().parents[3]
TINY_MODEL = REPO / "tests" / "sglang_cpu" / "tiny_qwen3moe"
_RESULT = "R3-RESULT "

# The modules of the classes and functions the plugin's hooks patch (`engine_ext/sglang/hooks/table.py`; not
# AMD's aiter backend, which does not import here). The prelude imports them once, so a child does not import
# them again (about 1,400 modules, 2.5-3 CPU-s a child here). A server has them imported before its hooks apply
# too: its scheduler, engine and launcher call `load_plugins()` from modules that import them (`scheduler.py`,
# `entrypoints/engine.py`), and `HookRegistry` rebinds the copies `from x import f` made (it walks `sys.modules`).
HOOKED_MODULES = (
    "sglang.srt.beam_search.output",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.entrypoints.openai.serving_completions",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.scheduler_components.batch_result_processor",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.runtime_context",
    "sglang.srt.state_capturer.base",
    "sglang.srt.state_capturer.routed_experts",
)

# What every child's code can call: `emit(obj)` hands JSON back.
_EMIT = """\
import json as _json, sys as _sys
import sglang_env as _env
def emit(obj):
    print(_env._RESULT + _json.dumps(obj), flush=True)
"""
_PRELUDE = (
    _EMIT
    + """\
import importlib as _importlib
_env.cpu_workarounds()
for _module in _env.HOOKED_MODULES:
    _importlib.import_module(_module)
"""
)


def cpu_workarounds() -> None:
    """Host caches without `cudaHostRegister` (pinned memory needs CUDA); also for the `meta` device."""
    from sglang.srt.mem_cache.pool_host import common as host_common

    def unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        buffer = allocator.allocate(dims, dtype=dtype, device=device)
        # Not host-registered: marked as SGLang marks its own such buffers (`pool_host/common.py:325-326`), so
        # a destroy with CUDA present does not `cudaHostUnregister` it (rc 713, then a TypeError in the warning).
        setattr(buffer, host_common._CUDA_HOST_REGISTERED_RANGES_ATTR, [])
        return buffer

    host_common.ALLOC_MEMORY_FUNCS["cpu"] = unpinned
    host_common.ALLOC_MEMORY_FUNCS["meta"] = unpinned  # a capturer on "meta" keeps its host cache on the CPU


def publish_args(*, world_rank: int = 0, **fields: Any):
    """Publish a resolved `ServerArgs(model_path="dummy", device="cpu", **fields)` as this process's config.

    `model_path="dummy"` skips model-dependent resolution, so pass chunked_prefill_size / max_running_requests.
    DP attention is `tp_size=N, attn_dp_size=N`; `world_rank` then picks the DP rank. A `cuda_graph_config`
    dict (the `--cuda-graph-config` JSON) is parsed as resolution would.
    """
    from sglang.srt.layers.dp_attention import initialize_dp_attention_flags
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if isinstance(fields.get("cuda_graph_config"), dict):
        fields["cuda_graph_config"] = CudaGraphConfig.from_dict(fields["cuda_graph_config"])
    reset_context()
    server_args = ServerArgs(model_path="dummy", device="cpu", **fields)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=world_rank, dp_rank=None))
    initialize_dp_attention_flags(server_args)
    initialize_moe_config()  # the MoE flags (all-to-all backend, …) as the scheduler sets them
    return server_args


def tiny_model_config(context_length: int | None = None):
    """A real `ModelConfig` of the tiny Qwen3-MoE in `tests/sglang_cpu/tiny_qwen3moe` (2 layers, 8 experts, top-2)."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(TINY_MODEL), context_length=context_length)


def run_sglang(
    code: str, *, timeout: float = 240, env: dict[str, str] | None = None, read_late: dict[str, str] | None = None
) -> list[Any]:
    """Run `code` (dedented) in a new process that has run the prelude; return what it `emit`ted. The process is
    forked from this test process's zygote where the environment allows (`tests/zygote.py`), else a fresh
    interpreter (`R3_TEST_FRESH_CHILDREN=1`: always).

    `read_late`: variables that nothing reads on import, only when asked (SGLang's `envs.X.get()` reads
    `os.environ` at each call; `sglang/srt/environ.py`): set in the child's `os.environ` before `code` runs, as a
    process started with them has them, so the child can still be forked (`env` would make it a fresh one)."""
    child_env = _child_env({**os.environ, **(env or {})})
    late = f"import os as _os\n_os.environ.update({dict(read_late)!r})\n" if read_late else ""
    source = _PRELUDE + late + textwrap.dedent(code)
    zygote = _zygote()
    if zygote is not None and zygote.serves(child_env):
        returncode, stdout, stderr = zygote.run_captured(source, child_env, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=child_env
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    if returncode != 0:
        raise AssertionError(
            f"SGLang child exited {returncode}\n--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )
    return [json.loads(line[len(_RESULT) :]) for line in stdout.splitlines() if line.startswith(_RESULT)]


def fork_refusal(env: dict[str, str] | None = None) -> str | None:
    """Why `run_sglang(code, env=env)` would start a fresh interpreter rather than fork (None: it forks), for a
    test's failure message: a zygote test that finds a fresh child should say which of the causes it was."""
    if os.environ.get("R3_TEST_FRESH_CHILDREN") == "1":
        return "R3_TEST_FRESH_CHILDREN=1 asks for fresh children"
    zygote = _zygote()
    if zygote is None:
        return "this process's zygote died: every later child is a fresh interpreter"
    differ = zygote.unserved(_child_env({**os.environ, **(env or {})}))
    return f"variables differ from the zygote's: {', '.join(differ)}" if differ else None


def _child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this directory and the repository first on the child's path, and warnings off."""
    paths = [str(REPO), str(Path(__file__).resolve().parent)]
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join([*paths, out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.setdefault("PYTHONWARNINGS", "ignore")
    return out


_IMPORTED_WITH = dict(os.environ)  # this process's environment before any test changed it
_zygotes: list[Zygote] = []


def _zygote() -> Zygote | None:
    """This process's zygote, started on first use with the environment this module was imported with (less its
    `SERVED_PREFIXES` variables); None when fresh children are asked for, or the zygote died (then every later
    child is fresh too)."""
    if os.environ.get("R3_TEST_FRESH_CHILDREN") == "1":
        return None
    if not _zygotes:
        from zygote import SERVED_PREFIXES, Zygote

        base = {k: v for k, v in _child_env(_IMPORTED_WITH).items() if not k.startswith(SERVED_PREFIXES)}
        _zygotes.append(Zygote(_PRELUDE, base, REPO))
        atexit.register(_zygotes[0].close)
    return _zygotes[0] if _zygotes[0].alive() else None
