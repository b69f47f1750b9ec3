"""The hooked capture path compiles under `torch.compile(fullgraph=True)` on every supported SGLang, and the
compiled forward captures the same rows as the eager one.

SGLang's piecewise CUDA graphs (default on GPUs) and `--enable-torch-compile` trace the model's forward with
Dynamo, and the plugin's per-layer hook on `BaseDeviceCache.capture` runs inside it. The hook used to call
`time.perf_counter_ns` (a builtin Dynamo skips: "Piecewise CUDA Graph failed", the scheduler exited) and to
keep a "proved once per forward" flag (state a compiled graph would freeze at trace time). Each version runs
`compiled_capture.py` over its own venv's SGLang (forked from a zygote that imported the torch all four venvs
share): the plugin installed by its real entry point through the real `HookRegistry`, hook timers on (the
default), Inductor, static and dynamic token counts. Checked: the compiled
rows equal eager's, the graph is op for op the one of SGLang's bare method, nothing Python-side moves while
compiled code runs, an overflow still names the setting. Before the fix this failed at the first trace:
"Attempted to call function marked as skipped ... perf_counter_ns".
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from zygote import Zygote

REPO = Path(__file__).resolve().parents[3]
VERSIONS = {"0.5.23": ".venv", "0.5.20": ".venv-sglang-0.5.20", "0.5.16": ".venv-sglang-0.5.16"}
VERSIONS["0.5.12"] = ".venv-sglang-0.5.12"

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


SCRIPT = REPO / "tests" / "engine" / "sglang" / "compiled_capture.py"
# A child forked from the torch zygote: a release's own site ahead of `.venv`'s, as its venv's interpreter has it
# (each release venv holds SGLang, and 0.5.16's and 0.5.12's their transformers, over `.venv`'s torch).
_CHILD = """
import runpy, site, sys
assert not {{"sglang", "transformers", "tokenizers"}} & set(sys.modules), "the zygote imported a release's package"
if {site!r} != site.getsitepackages()[0]:
    sys.path.insert(sys.path.index(site.getsitepackages()[0]), {site!r})
runpy.run_path({script!r}, run_name="__main__")
"""


def _env() -> dict[str, str]:
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), str(REPO / "tests" / "engine" / "sglang"), os.environ.get("PYTHONPATH")])
        ),
        "R3_TEST_SGLANG_CPU": "1",  # the CPU shims its servers run with (0.5.12's imports need sgl_kernel)
        "R3_MODE": "off",
        "R3_HOOK_TIMERS": "1",
        "PYTHONWARNINGS": "ignore",
        # Inductor builds its kernels in this process, not a pool of workers that each import torch again: the
        # same kernels, 5 CPU-s and 8 s less a version here (compile threads change where code is built, not what)
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }


@pytest.fixture(scope="module")
def torch_zygote() -> Iterator[Zygote | None]:
    """`.venv`'s torch and Dynamo imported once (`tests/zygote.py`), every release's run forked from it: all four
    venvs share that torch. None under `R3_TEST_FRESH_CHILDREN=1`: each run in its venv's own interpreter."""
    if os.environ.get("R3_TEST_FRESH_CHILDREN") == "1":
        yield None
        return
    zygote = Zygote("import torch, torch._dynamo", _env(), REPO)
    yield zygote
    zygote.close()


@pytest.fixture(scope="module", params=list(VERSIONS))  # every supported version, in CI too
def compiled(request: pytest.FixtureRequest, torch_zygote: Zygote | None) -> dict:
    venv = REPO / VERSIONS[request.param]
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"needs {VERSIONS[request.param]} (make env-sglang-{request.param})")
    if torch_zygote is None or not torch_zygote.serves(_env()):
        python = str(venv / "bin" / "python")
        done = subprocess.run([python, str(SCRIPT)], capture_output=True, text=True, timeout=800, env=_env(), cwd=REPO)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        (site,) = (venv / "lib").glob("python3*/site-packages")
        child = _CHILD.format(site=str(site), script=str(SCRIPT))
        returncode, stdout, stderr = torch_zygote.run_captured(child, _env(), 800)
    lines = [line for line in stdout.splitlines() if line.startswith("R3-RESULT ")]
    assert returncode == 0 and lines, stderr[-6000:]
    result = json.loads(lines[-1].removeprefix("R3-RESULT "))
    assert result["sglang"] == request.param, result
    return result


def test_the_plugin_hook_wraps_sglang_capture(compiled: dict) -> None:
    assert compiled["hooked"], compiled


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_compiled_rows_equal_eager_rows_and_no_python_state_moves(compiled: dict, shapes: str) -> None:
    run = compiled[shapes]
    assert run["equal"] == [True] * 4, run
    assert run["state_moved"] == [False] * 4, run  # no counter, clock or flag inside the compiled region


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_the_compiled_graph_is_upstreams_own(compiled: dict, shapes: str) -> None:
    """The FX graph Dynamo builds through the plugin's hook is op for op the one of SGLang's bare method: the
    hook adds nothing a replay runs (its shape test folds away or becomes a guard)."""
    run = compiled[shapes]
    assert run["graph"] == run["upstream_graph"], run


def test_an_eager_forward_learns_the_routed_layers(compiled: dict) -> None:
    assert compiled["learned_layers"] == [0, 1, 2, 3], compiled


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_an_overflow_under_compile_still_names_the_rows_and_the_setting(compiled: dict, shapes: str) -> None:
    message = compiled[shapes]["overflow"]
    assert "needs 17 rows but the buffer holds 16" in message, message
    assert "--chunked-prefill-size" in message, message


def test_0_5_23_real_capture_site_and_capturer_compile_to_the_same_rows(compiled: dict) -> None:
    if compiled["sglang"] != "0.5.23":
        pytest.skip("not applicable: the capture site and capturer are built through 0.5.23's published config only")
    site = compiled["capture_site"]
    assert site["equal"] == [True, True, True], site
