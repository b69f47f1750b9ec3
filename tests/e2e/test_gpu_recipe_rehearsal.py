"""The GPU server recipe's driver (`tests/engine/gpu/servers.py`), rehearsed on this machine's real CPU servers.

The recipe runs on a lent GPU rarely and within minutes of device time; a driver broken by a change in the tree
would spend them on its own bug. Here the same driver runs its whole sequence with `--cpu-rehearsal` on SGLang
0.5.23's CPU servers: three tiny servers (upstream, mirror, sidecar) with the same requests and checks as on the
GPU, the graph evidence found in their logs (saying no graph ran), then two rounds of the three-way A/B (routed
experts off, SGLang's inline path, sidecar mode). It must pass
every check and write what the GPU run writes. (0.5.12's and 0.5.16's rehearsals: docs/testing.md.)

It takes about 9 minutes here (passed on 2026-11-27, 02:26-02:35 UTC), a tenth of CI's time, so it is `slow`:
`make reliability` runs it, and so should any change to the recipe before a GPU session spends device time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "engine" / "gpu" / "servers.py"

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_the_gpu_recipe_passes_its_cpu_rehearsal(tmp_path, sglang_exclusive):
    sglang_exclusive()  # the pool's server stops: the driver starts its own, one at a time
    out = tmp_path / "out"
    cmd = [sys.executable, str(DRIVER), "--cpu-rehearsal", "--out", str(out), "--budget-s", "900"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([*cmd, "--start-timeout-s", "600"], env=env, capture_output=True, text=True, timeout=1700)
    results = json.loads((out / "results.json").read_text())
    failed = [check for check in results["checks"] if not check["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert {"tiny servers up", "compared", "A/B measured", "end"} <= set(results["phases"])
    names = {row["check"] for row in results["checks"]}
    for expected in ("mirror batch3-2: pointer fetch is the payload byte for byte", "mirror abort: aborted mid-decode"):
        assert expected in names
    assert results["ab"]["summary"]["tok_s"]["n"] == 2
    # three arms: routed experts off, SGLang's inline path, sidecar mode; `off` launched without the capture
    assert {"inline_vs_off", "sidecar_vs_off"} <= set(results["ab"]["summary"])
    assert all({"off", "upstream", "sidecar"} <= set(row) for row in results["ab"]["rounds"])
    assert "A/B off: enable_return_routed_experts=False" in names
    fragment = (out / "gpu_servers.md").read_text()
    assert "(CPU rehearsal)" in fragment and f"{len(names)} of {len(names)} checks passed" in fragment
    assert "upstream ÷ off" in fragment and "sidecar ÷ off" in fragment
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = set(tar.getnames())
    assert {"tiny-mirror/server.log", "tiny-sidecar/sidecar.log", "ab/ab-sidecar/server.log"} <= logs
    assert "ab/ab-off/server.log" in logs
