"""The data flows from the engine to the service: the service never imports the engine package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_service_modules_import_no_engine_ext() -> None:
    """`r3-sidecar` runs in a sidecar image without SGLang: the budget check is the engine side's `r3-budget`."""
    code = (
        "import sys\n"
        "import service.client, service.server.api, service.server.cli, service.server.demo\n"
        "import service.server.metrics, service.server.stream\n"
        "engine = sorted(m for m in sys.modules if m.split('.')[0] == 'engine_ext')\n"
        "assert not engine, engine\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
