"""`service.server.heap`: with glibc's thresholds raised, reading body chunks stops page-faulting (fresh processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.server.heap import thresholds

READER = """
import os, resource, sys
from service.server.heap import keep_freed_chunks
path, tune = sys.argv[1], sys.argv[2] == "1"
if tune:
    assert keep_freed_chunks(1 << 20)
fd = os.open(path, os.O_RDONLY)
for _ in range(5):
    os.pread(fd, 1 << 20, 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # a 4 MiB record sent as 1 MiB chunks, a few in flight at once, then all freed
    chunks = [os.pread(fd, 1 << 20, i << 20) for i in range(4)]
    del chunks
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(path: Path, tune: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", READER, str(path), "1" if tune else "0"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    return int(out.stdout.strip())


def test_thresholds_leave_room_for_chunks_in_flight() -> None:
    assert thresholds(1 << 20) == (4 << 20, 16 << 20)
    assert thresholds(8 << 20) == (16 << 20, 64 << 20)
    assert thresholds(1 << 30)[0] == 32 << 20  # glibc's cap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tuned_process_reads_chunks_without_faulting_them_in(tmp_path: Path) -> None:
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(range(256)) * (16 << 12))  # 16 MiB
    plain, tuned = faults(path, tune=False), faults(path, tune=True)
    print(f"minor faults for 50 records of 4 x 1 MiB chunks: default heap {plain}, tuned {tuned}")
    assert plain > 50 * 256, "expected the default heap to fault each chunk in (is this glibc?)"
    assert tuned < plain / 10
