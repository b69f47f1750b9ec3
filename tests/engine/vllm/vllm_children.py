"""Run a script in `.venv-vllm`'s interpreter (vLLM 0.32.0), forked from a zygote that imported torch and
transformers once (`tests/zygote.py`).

Why: each test child used to start a fresh interpreter, and `import vllm` took 14.4-15.0 CPU-s here, 7.5-8.4 of
them torch and transformers (measured 2026-11-30 in `.venv-vllm`). The zygote imports those two and no vLLM, so a
child may still put a patched vLLM first on its path (`path_first`) and import it as a fresh interpreter would. A
child gets a fresh interpreter instead when `R3_TEST_FRESH_CHILDREN=1`, or when its environment differs from the
zygote's in more than `R3_*` variables.
"""

from __future__ import annotations

import atexit
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zygote import Zygote

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# What every child's environment holds: the repository on the path, a bare PATH, no usage reports.
BASE_ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1"}
_PRELUDE = "import torch, transformers"

_zygotes: list[Zygote] = []


def run_vllm(
    script: str,
    *,
    env: dict[str, str] | None = None,
    path_first: list[Path] = (),
    venv: Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`script` run as `<venv>/bin/python -c script` with `BASE_ENV` and `env` (`R3_*` variables), and
    `path_first` ahead of the repository on its path (PYTHONPATH's place); its exit status and output.

    `venv`: another release's venv, laid over `.venv-vllm`'s site as the Makefile builds them (its own vLLM, its
    `.pth` files, then `.venv-vllm`'s packages); a forked child puts that site ahead of `.venv-vllm`'s and runs
    its `.pth` files, as the venv's own interpreter does at start."""
    python = (venv or VLLM_PYTHON.parent.parent) / "bin" / "python"
    child_env = BASE_ENV | (env or {})
    zygote = _zygote()
    if zygote is None or not zygote.serves(child_env):
        if path_first:
            child_env["PYTHONPATH"] = os.pathsep.join([*map(str, path_first), child_env["PYTHONPATH"]])
        return subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, env=child_env, timeout=timeout
        )
    source = _OVERLAY.format(site=str(_site(venv))) if venv else ""
    source += f"import sys\nsys.path[1:1] = {[str(p) for p in path_first]!r}\n" if path_first else ""
    returncode, stdout, stderr = zygote.run_captured(source + script, child_env, timeout)
    return subprocess.CompletedProcess([str(python), "-c", script], returncode, stdout, stderr)


# A release's site ahead of `.venv-vllm`'s, and its `.pth` files run (`site.addpackage`, as at start); the zygote's
# preload must not hold what a release brings.
_OVERLAY = """import os as _os, site as _site, sys as _sys
assert "vllm" not in _sys.modules, "the zygote imported vLLM"
_sys.path.insert(_sys.path.index(_site.getsitepackages()[0]), {site!r})
for _pth in sorted(n for n in _os.listdir({site!r}) if n.endswith(".pth")):
    _site.addpackage({site!r}, _pth, None)
"""


def _site(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


def _zygote() -> Zygote | None:
    """This process's vLLM zygote, started on first use; None when fresh children are asked for or it died."""
    if os.environ.get("R3_TEST_FRESH_CHILDREN") == "1":
        return None
    if not _zygotes:
        from zygote import Zygote

        _zygotes.append(Zygote(_PRELUDE, dict(BASE_ENV), REPO, python=VLLM_PYTHON))
        atexit.register(_zygotes[0].close)
    return _zygotes[0] if _zygotes[0].alive() else None
