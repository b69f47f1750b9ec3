"""What a benchmark's numbers were taken on: load, cores, memory, tmpfs, versions, commit.

Its own module so that what reads it (`run`, `paired`, `hooks`, `real_server.runner`) imports no benchmark
shapes, and torch and SGLang only when it is called.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict:
    """What the numbers were taken on: load, cores, memory, tmpfs, versions."""
    import sglang
    import torch

    shm = shutil.disk_usage("/dev/shm")
    with open("/proc/meminfo") as f:
        mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "loadavg": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "mem_total": mem["MemTotal"],
        "mem_available": mem["MemAvailable"],
        "shm_total": shm.total,
        "shm_free": shm.free,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "sglang": sglang.__version__,
        "kernel": platform.release(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip(),
    }
