"""Issue 40 on a real vLLM server: a capture that writes zeros for one layer leaves suspect records.

vLLM 0.27.1 (OpenRLHF's pin) in sidecar mode, with the CPU capture shim told to hand one layer's capture zeros
while a flag file exists (`tests/vllm_cpu/_vllm_cpu_capture_shim.py`, test-only; the shim's capture path exists
on 0.24-0.27 only, so not on 0.32): the record is kept and marked at its first row and that layer, the sidecar
answers 422 `record_suspect`, the trainer client raises unless asked, the engine file and /metrics count it, a real
Prometheus scraping the sidecar with the shipped rules fires `R3SuspectRecords` (quiet before), and a request
without the flag is `ok`. Its own server start, so `matrix` (CI's vLLM starts are spent on the
release suite, whose records are asserted not suspect in `test_vllm_plugin.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import vllm_server
from prometheus_live import watching
from vllm_server import VllmServer
from waiting import wait_until

from service.client.errors import SuspectRows
from service.client.refs import RoutedExpertsRef

pytestmark = [pytest.mark.vllm, pytest.mark.matrix, pytest.mark.timeout(900)]

VERSION = "0.27.1"
ZERO_LAYER = 1


@pytest.fixture(scope="module")
def zeroing(
    tmp_path_factory: pytest.TempPathFactory, sglang_exclusive: Callable[[], Path]
) -> Iterator[tuple[VllmServer, Path]]:
    if not vllm_server.available(VERSION):
        pytest.skip(vllm_server.missing(VERSION))
    sglang_exclusive()
    root = tmp_path_factory.mktemp("vllm-suspect")
    flag = root / "zero-layer"
    env = {"R3_MODE": "sidecar", "R3_ENGINE_ID": "zero", "R3_TEST_ZERO_LAYER": f"{ZERO_LAYER}:{flag}"}
    server = vllm_server.start(
        root / "server",
        vllm_server.write_model(root / "model"),
        name=f"zeroed layer {VERSION}",
        plugin=True,
        env=env,
        sidecar=True,
        version=VERSION,
    )
    try:
        yield server, flag
    finally:
        server.stop()


def test_a_zeroed_layer_leaves_a_suspect_record_and_a_true_one_does_not(zeroing, tmp_path: Path) -> None:
    server, flag = zeroing
    assert server.sidecar is not None
    fine = server.completion("All layers route", rid="fine")
    with watching(server.sidecar.url, tmp_path / "prometheus") as prom:
        wait_until(lambda: prom.query("r3_engine_suspect_records_total == 0"), 60, "a scrape counting 0 suspect")
        assert not prom.firing("R3SuspectRecords"), prom.active_alerts()
        flag.touch()
        try:
            zeroed = server.completion("Zero one layer", rid="zeroed")
        finally:
            flag.unlink()
        wait_until(lambda: prom.firing("R3SuspectRecords"), 60, "R3SuspectRecords firing in Prometheus")
        engines = {e["engine"] for e in server.engine_files()}
        assert {a["engine"] for a in prom.firing("R3SuspectRecords")} <= engines, prom.active_alerts()
    meta, rows = server.record("cmpl-zeroed-0")
    assert meta.status == "suspect" and (meta.suspect.row, meta.suspect.layer) == (0, ZERO_LAYER), meta
    assert not rows[:, meta.layers.index(ZERO_LAYER)].any()
    assert server.record("cmpl-fine-0")[0].status == "ok"
    url = zeroed["choices"][0]["routed_experts_url"]
    answer = httpx.get(url, timeout=30)
    assert answer.status_code == 422 and answer.json()["error"] == "record_suspect", answer.text
    (ref,) = RoutedExpertsRef.from_response(zeroed)
    with pytest.raises(SuspectRows, match=f"row 0, layer {ZERO_LAYER}: repeated"):
        ref.fetch()
    assert ref.fetch(allow_suspect=True).rows == meta.rows
    (fine_ref,) = RoutedExpertsRef.from_response(fine)
    assert fine_ref.fetch().status == "ok"
    wait_until(
        lambda: any(e["writer"].get("suspect_records") == 1 for e in server.engine_files()),
        30,
        "the engine file counting one suspect record",
    )
    text = httpx.get(f"{server.sidecar.url}/metrics", timeout=10).text
    assert 'r3_records{state="suspect"} 1.0' in text
    assert any(
        line.startswith("r3_engine_suspect_records_total{") and line.endswith(" 1.0") for line in text.splitlines()
    )
