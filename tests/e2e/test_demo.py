"""`r3-sidecar demo` end to end, as a user runs it: a subprocess on a free port, a temp spool, SIGINT to stop."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import bound_socket
from waiting import wait_until

from service.client import R3Error, RoutedExperts, RoutedExpertsClient
from service.client.errors import NotReady, RecordGone

REPO = Path(__file__).resolve().parents[2]


def r3_sidecar() -> list[str]:
    """The installed console script when there is one (what `make demo` runs), else the module."""
    script = Path(sys.executable).with_name("r3-sidecar")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.server.cli"]


@contextlib.contextmanager
def running_demo(tmp_path: Path, *flags: str):
    """`r3-sidecar demo` as a user runs it, on a free port; yields (process, URL, spool) once it is ready."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "R3_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*r3_sidecar(), "demo", "--host", "127.0.0.1", "--port", str(port), *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, proc.stdout.read().decode()
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200

    try:
        # a loaded CI machine: a deadline, not a pace
        wait_until(ready, 120, "the demo sidecar ready", interval=0.1, ignore=(httpx.HTTPError,))
        yield proc, url, tmp_path / "spool"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def demo(tmp_path: Path):
    with running_demo(tmp_path, "--step-ms", "20") as running:
        yield running


def first_finished(client: RoutedExpertsClient) -> RoutedExperts:
    for i in range(20):
        try:
            return client.get(f"demo-{i:06d}", wait=30)
        except RecordGone:
            continue  # an aborted demo request: the next one will do
    raise AssertionError("no finished demo record among the first 20")


def a_growing_record(client: RoutedExpertsClient, first: int) -> tuple[str, int, int]:
    """(rid, rows seen first, rows seen later) for a record that streams rows while it is open."""
    seen: dict[str, int] = {}  # the rows each open record had when first seen

    def grown() -> tuple[str, int, int] | None:
        for rid in (f"demo-{i:06d}" for i in range(first, first + 16)):
            rows = open_rows(client, rid)
            if not rows:
                continue  # not created yet, finished or aborted; or open, written whole at the end: not streamed
            if rows > seen.setdefault(rid, rows):
                return rid, seen[rid], rows
        return None

    return wait_until(grown, 40, "a demo record that grew while open", interval=0.1)


def open_rows(client: RoutedExpertsClient, rid: str) -> int:
    """The rows `rid` has while it is open; 0 once it is final or aborted, and before it exists."""
    try:
        client.get(rid)
    except NotReady as still_open:
        return still_open.rows
    except R3Error:
        return 0
    return 0


def test_demo_end_to_end(demo) -> None:
    proc, url, spool_dir = demo
    with RoutedExpertsClient(url) as client:
        r = first_finished(client)
        assert r.final and r.array.shape[1:] == (48, 8) and r.array.dtype == np.uint8
        assert r.rows >= r.prompt_len and int(r.array.max()) < 128
        assert r.layers == tuple(range(48))
        # Top-k order is real routing: the 8 experts of a token in a layer are distinct.
        assert all(len(set(row)) == 8 for row in r.array.reshape(-1, 8)[:500].tolist())
        rid, before, after = a_growing_record(client, first=int(r.rid[-6:]) + 1)
        assert after > before
        blocks = []
        with contextlib.suppress(RecordGone):  # a demo request may be aborted part way
            blocks.extend(client.stream(rid))
        assert sum(b.rows for b in blocks) >= after
        assert [b.start for b in blocks] == list(np.cumsum([0] + [b.rows for b in blocks[:-1]]))
        assert any(e["engine"] == "demo/dp0" for e in client.engines())
        # the dense+MoE model (DeepSeek-V3 shape): MoE layers 3-60 stored, SGLang's 61-slot layout served
        d = client.get("dsv3-000000", wait=30)
        assert d.layers == tuple(range(3, 61)) and d.num_hidden_layers == 61 and d.array.shape[1:] == (58, 8)
        b64 = client.fetch_bytes("dsv3-000000", fmt="sglang_b64")
        sglang = np.frombuffer(base64.b64decode(b64), dtype=np.int32).reshape(d.rows, 61, 8)
        assert not sglang[:, :3].any() and np.array_equal(sglang, d.to_sglang_layout())
        stage = client.get("dsv3-000000", layers="0-15")
        assert stage.layers == tuple(range(3, 16)) and np.array_equal(stage.array, d.array[:, :13])
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert 'r3_buffer_capacity{buffer="routed_experts_device_cache",engine="demo/dp0"}' in metrics
    assert "r3_records" in metrics
    assert (spool_dir / "v1" / "records").is_dir()

    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    text = out.decode()
    assert proc.returncode == 0, text
    assert f"{url}/routed_experts/demo-000000" in text and "RoutedExpertsClient" in text and "/metrics" in text
    assert "Traceback" not in text


@pytest.mark.timeout(900)  # a deadline for a loaded machine; the demo itself takes about a minute
def test_the_demo_keeps_producing_and_its_documented_rids_come_back(tmp_path: Path) -> None:
    """Records keep coming while the oldest expire (410 `expired`), and an acknowledged documented rid is back
    for the next run of README's block (the first run acknowledges `demo-000000`)."""
    demo = running_demo(tmp_path, "--step-ms", "5", "--ttl-s", "2", "--max-live", "10")
    with demo as (_proc, url, _spool), RoutedExpertsClient(url) as client:
        # 13 demo records and the 2 kept dsv3 ones: past --max-live 10, so the oldest expired to make room
        late = client.get("demo-000012", wait=600)
        assert late.rows > 0

        def gone() -> RecordGone | None:
            try:
                client.get("demo-000005")
            except RecordGone as answer:
                return answer
            return None

        assert "expired" in str(wait_until(gone, 60, "demo-000005 expired", interval=0.2))
        for _ in range(2):  # README's block, twice: read, then acknowledge
            # With a 2 s TTL the rid leaves the spool every few seconds; between the sidecar deleting it (410, its
            # tombstone) and indexing the demo's rewrite there are 0.1-0.3 s where it is gone: it must come back.
            back = wait_until(lambda: client.get("demo-000000", wait=30), 60, "demo-000000 back", ignore=(RecordGone,))
            assert back.rows > 0
            client.ack("demo-000000", missing_ok=True)  # may have expired (and come back) already
