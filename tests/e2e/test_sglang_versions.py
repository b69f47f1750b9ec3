"""A real SGLang server start that finds an SGLang the plugin does not support: one clear message, never half.

`importlib.metadata` reads the first `sglang-*.dist-info` on `sys.path`; the test puts the real 0.5.10.post1
wheel's dist-info (PyPI's own METADATA, AReaL 1.0.4's pin) ahead of the installed 0.5.23, so the plugin's
entry point sees `sglang==0.5.10.post1` through the real `load_plugins()` of a real `sglang.launch_server`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from child_process import free_port
from sglang_server import BASE_ARGS, REPO, Config, cli_args, server_env
from tiny_model import write_model

from engine_ext.sglang import compat
from engine_ext.sglang.versions import MATRIX

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

SHADOWED = "0.5.10.post1"  # AReaL 1.0.4's pin: no plugin mechanism, outside what the plugin supports


@pytest.fixture(scope="module")
def shadow_dist_info(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only `sglang-<SHADOWED>.dist-info`, taken from the wheel on PyPI."""
    wheels = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={SHADOWED}", "-d", str(wheels)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = wheels.glob("sglang-*.whl")
    out = tmp_path_factory.mktemp("shadow")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(out, [n for n in zf.namelist() if n.startswith(f"sglang-{SHADOWED}.dist-info/")])
    return out


def launch(shadow: Path, workdir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    model_dir = write_model(workdir / "model", weights=False)
    server = server_env(Config("versions"), workdir / "spool") | env
    server["PYTHONPATH"] = os.pathsep.join([str(shadow), server["PYTHONPATH"]])
    args = BASE_ARGS | {"model-path": str(model_dir), "load-format": "dummy", "port": free_port()}
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *cli_args(args)],
        env=server,
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,
    )


def test_enforce_refuses_to_start_on_an_unsupported_sglang_naming_it(shadow_dist_info, tmp_path):
    done = launch(shadow_dist_info, tmp_path, R3_BUDGET="enforce", R3_MODE="sidecar")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    lines = [line for line in output.splitlines() if "r3-sidecar: sglang==" in line]
    assert len(lines) == 1, output[-3000:]  # one message, not one per process
    assert f"sglang=={SHADOWED}" in lines[0] and "refusing to start (R3_BUDGET=enforce)" in lines[0]
    assert "Load weight begin" not in output  # stopped before any model work


VENVS = {"0.5.23": ".venv", **{v: f".venv-sglang-{v}" for v in ("0.5.20", "0.5.16", "0.5.12")}}


@pytest.mark.parametrize("venv", list(VENVS.values()))  # every supported version, in CI too
def test_the_matrix_row_is_what_the_installed_sglang_lacks(venv):
    """Each version's real modules, imported by its own python: the targets and names it lacks are its row,
    everything its `compat` layout names (retargeted hooks, settings' getters, helpers) imports there, and the
    attributes its hooks read off run-time objects are in its installed source (else the row names them), and
    where it writes its tokenizer workers' app path, that path goes to the call its layout retargets."""
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"needs {venv} (make env-{venv.removeprefix('.venv-')})")
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "R3_TEST_SGLANG_CPU": "1",  # the CPU shims, as its servers run (0.5.12's scheduler imports sgl_kernel)
    }
    done = subprocess.run(
        [str(python), str(REPO / "tests" / "e2e" / "resolve_targets.py")],
        capture_output=True,
        text=True,
        timeout=540,  # imports every hook target, then parses the sources the attribute check reads
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    row = MATRIX[found["sglang"]]
    # from its code alone, the build gets its own release's layout, and no layout tried before it fits
    assert found["fit"]["layout"] == found["sglang"], found["fit"]
    assert all(gaps for layout, gaps in found["fit"]["lacking"].items() if layout != found["sglang"]), found["fit"]
    assert sorted(found["targets"]) == sorted(row.missing_targets)
    assert sorted(found["names"]) == sorted(row.missing_names)
    if row.plugin_mechanism:  # a matrix version with plugins has its own layout, and all of it resolves here
        assert found["after_layout"] == []
        assert found["attributes"] == list(row.missing_attributes)  # what its run-time objects lack
        # where SGLang writes its workers' app path, the one call `worker_app` retargets is the one that gets it
        layout = compat.LAYOUTS[found["sglang"]]
        call = layout.worker_app_call
        assert found["literal_app_calls"] == ([call] if call else []), found["literal_app_calls"]
        # … and Granian's (`--enable-http2`) gets it too where the layout hooks Granian; where Granian is never
        # embedded, even one worker's responses are built in a process it spawns (`granian_spawns_one`)
        assert found["granian"]["literal"] == (layout.granian_app_call is not None), found["granian"]
        assert found["granian"]["embeds"] == (not layout.granian_spawns_one), found["granian"]
