"""The vLLM plugin's plain-value parts: record rids, modes, refusals and the engine file, without vLLM.

The real-server suite (`tests/e2e/test_vllm_plugin.py`) proves the rows against vLLM itself; here each
decision is pinned where a real server cannot force it (a full spool, a dense layer, an unsupported vLLM).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import wait_sidecar_ready
from vllm_children import VLLM_PYTHON, run_vllm

from engine_ext.core.records import Finished, ModelShape
from engine_ext.core.settings import EngineSettings, Mode
from engine_ext.vllm.fit import plan
from engine_ext.vllm.spooler import Spooler, refusal_report, status_of
from engine_ext.vllm.versions import MATRIX, SUPPORTED_VLLM
from service.spool import Spool
from service.spool.engine_report import EngineReport
from service.spool.vllm_rids import record_rid, vllm_choice_rid

REPO = Path(__file__).resolve().parents[3]
SHAPE = ModelShape(num_experts=16, topk=4, num_hidden_layers=4, layers=(0, 1, 2, 3))


def _rows(n: int, layers: int = 4, seed: int = 0) -> np.ndarray:
    """Rows a router could make: 4 distinct ids of 16 per token and layer (the writer's row check passes them)."""
    return np.argsort(np.random.default_rng(seed).random((n, layers, 16)), axis=-1)[..., :4].astype(np.uint8)


def _spooler(tmp_path: Path, mode: Mode, shape: ModelShape = SHAPE, **settings: object) -> Spooler:
    env = EngineSettings(spool_dir=tmp_path, mode=mode, engine_id="t", telemetry_interval_s=0.05, **settings)
    return Spooler(env, shape, engine="t/api0", vllm="0.32.0")


def test_record_rids_are_the_choices_the_client_sees():
    """The plugin names a record from vLLM's external id and child; the client from the response alone."""
    # completion, two prompts, n=2: choice k = prompt k // 2, child k % 2
    engine = [record_rid(f"cmpl-B-{i}", j, 2) for i in range(2) for j in range(2)]
    assert engine == [vllm_choice_rid("cmpl-B", k, 4) for k in range(4)] == [f"cmpl-B-{k}" for k in range(4)]
    assert record_rid("cmpl-B-1") == vllm_choice_rid("cmpl-B", 1, 2) == "cmpl-B-1"  # n=1: vLLM's external id
    # chat: one prompt; its one choice is the response id, several are numbered
    assert record_rid("chatcmpl-B") == vllm_choice_rid("chatcmpl-B", 0, 1) == "chatcmpl-B"
    assert record_rid("chatcmpl-B", 2, 3) == vllm_choice_rid("chatcmpl-B", 2, 3) == "chatcmpl-B-2"
    assert record_rid("cmpl-x-y", 1, 2) == "cmpl-x-y-1"  # no prompt index: numbered like chat


def test_status_from_finish_reason():
    assert [status_of(r) for r in ("stop", "length", "repetition", "abort", "error")] == [
        "ok",
        "ok",
        "ok",
        "aborted",
        "error",
    ]


@pytest.mark.parametrize(("mode", "keeps"), [(Mode.SIDECAR, False), (Mode.MIRROR, True), (Mode.OFF, True)])
def test_modes(tmp_path, mode, keeps):
    spooler = _spooler(tmp_path, mode, sidecar_url="http://side:8000")
    rows = _rows(9)
    try:
        assert spooler.finish(Finished("cmpl-a-0", rows, start=2, prompt_len=6, status="ok")) is keeps
        assert spooler.writer.flush()
        meta = Spool(tmp_path).read_meta("cmpl-a-0")
        if mode is Mode.OFF:
            assert meta is None and spooler.pointer("cmpl-a-0") is None
            return
        assert meta.final and meta.rows == 9 and meta.start == 2 and meta.prompt_len == 6 and meta.engine == "t/api0"
        assert Spool(tmp_path).read_array(meta).tobytes() == rows.tobytes()
        assert spooler.pointer("cmpl-a-0") == "http://side:8000/routed_experts/cmpl-a-0"
        assert spooler.pointer("cmpl-a-0") is None  # taken once
    finally:
        spooler.close()


def test_aborted_before_any_forward_still_leaves_a_record(tmp_path):
    spooler = _spooler(tmp_path, Mode.SIDECAR)
    try:
        assert spooler.finish(Finished("cmpl-x-0", None, start=0, prompt_len=5, status="aborted")) is False
        assert spooler.writer.flush()
        meta = Spool(tmp_path).read_meta("cmpl-x-0")
        assert meta.status == "aborted" and meta.rows == 0 and meta.final
        assert spooler.pointer("cmpl-x-0") is None  # no R3_SIDECAR_URL: no pointer
    finally:
        spooler.close()


def test_dense_layers_are_not_stored(tmp_path):
    """vLLM's array has every layer's slot (dense ones zero); the record keeps the routing layers."""
    shape = ModelShape(num_experts=16, topk=4, num_hidden_layers=4, layers=(1, 3))
    spooler = _spooler(tmp_path, Mode.MIRROR, shape)
    rows = _rows(5)
    try:
        spooler.finish(Finished("cmpl-d-0", rows, start=0, prompt_len=3, status="ok"))
        assert spooler.writer.flush()
        meta = Spool(tmp_path).read_meta("cmpl-d-0")
        assert meta.layers == (1, 3) and meta.num_hidden_layers == 4
        assert np.array_equal(Spool(tmp_path).read_array(meta), rows[:, [1, 3]])
    finally:
        spooler.close()


def test_refused_reservation_keeps_the_inline_array_and_is_counted(tmp_path):
    """A full spool: vLLM keeps its inline rows in sidecar mode too, no pointer, and the engine file says so."""
    spooler = _spooler(tmp_path, Mode.SIDECAR, sidecar_url="http://side:8000", spool_max_bytes=1)
    try:
        assert spooler.finish(Finished("cmpl-f-0", _rows(3), start=0, prompt_len=2, status="ok")) is True
        assert spooler.pointer("cmpl-f-0") is None
        assert spooler.finish(Finished("cmpl-g-0", _rows(3, layers=3), 0, 2, "ok")) is True  # wrong width
        report = EngineReport.from_dict(spooler.telemetry.tick())
        assert report.writer.undelivered["spool_full"] == 1 and report.writer.undelivered["mirror_mismatch"] == 1
        assert report.writer.fallback_inline == 2 and report.vllm == "0.32.0" and report.sglang == ""
    finally:
        spooler.close()


NONE_FITS = "r3-sidecar: vLLM 0.28.1 fits none of the support matrix's rows (0.24.0 to 0.33.0: "


def test_a_build_is_planned_by_its_code_and_refused_only_where_no_row_fits(tmp_path):
    """Every proven release over its own files gets its own row (a `+cpu` label too); a build between rows gets the
    first row its code takes, unproven; one whose code takes none is refused with one message naming it, the range
    and the gap. (A release string over other files: `test_vllm_release_files.py`.)"""
    for version in (*MATRIX, "0.32.0+cpu", "0.27.1+cpu", "0.29.0+cpu"):
        decided = plan(version, files=lambda found, row: [])
        assert decided.proven and decided.row is MATRIX[version.split("+")[0]], version
    v2_only = plan("0.28.1", lambda row: [] if row.runner == "V2" else ["model_config.enable_return_routed_experts"])
    assert v2_only.row is MATRIX["0.31.0"] and not v2_only.proven  # 0.28.0 and below tried first, then above
    assert "vLLM 0.28.1: matrix row 0.31.0 applied (fits, but no test ran this build" in v2_only.describe()
    refused = plan("0.28.1", lambda row: [f"{row.version}-gap"])
    assert refused.row is None and refused.reason.startswith(NONE_FITS), refused.reason
    assert "the nearest, 0.28.0, lacks: 0.28.0-gap" in refused.reason and "no spool records" in refused.reason
    assert "not installed" in plan(None).reason
    settings = EngineSettings(spool_dir=tmp_path, mode=Mode.SIDECAR, engine_id="t")
    report = EngineReport.from_dict(refusal_report(settings, engine="t/vllm", vllm="0.28.1", reason=refused.reason))
    assert report.delivery.mode == "off" and report.delivery.configured_mode == "sidecar"
    assert report.delivery.inline_kept == refused.reason and report.vllm == "0.28.1"


def test_an_unproven_build_keeps_vllms_rows_and_says_so(tmp_path):
    """Sidecar mode acts as mirror on a build no test ran while its check is pending: the record is written and the
    inline array kept; the engine file names the build, the row applied, and why the rows stay inline. (Its check
    agreeing or not: `test_vllm_check_rows.py`.)"""
    settings = EngineSettings(spool_dir=tmp_path, mode=Mode.SIDECAR, engine_id="t")
    shape = ModelShape(num_experts=8, topk=2, layers=(0, 1), num_hidden_layers=2)
    spooler = Spooler(settings, shape, engine="t/api0", vllm="0.32.1", row="0.32.0", proven=False)
    try:
        rows = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=np.uint8)
        assert spooler.finish(Finished("r", rows, 0, 1, "ok")) is True  # True: keep the inline array
        report = EngineReport.from_dict(spooler.telemetry.tick())
    finally:
        spooler.close()
    assert report.delivery.mode == "mirror" and report.delivery.configured_mode == "sidecar"
    assert report.delivery.inline_kept == (
        "vLLM 0.32.1: no test ran this build (matrix row 0.32.0); until its first 3 records agree with vLLM's own "
        "(build.check)"
    )
    check = {"state": "pending", "agreed": 1, "needed": 3}
    assert report.build.to_dict() == {"found": "0.32.1", "layout": "0.32.0", "proven": False, "check": check}


def test_the_capture_flag_is_read_where_each_release_keeps_it():
    """V1 releases keep `--enable-return-routed-experts` on `model_config`, V2 on `aux_output_config`: the adapter
    reads the row's path, so a flag in the other place does not count."""
    from types import SimpleNamespace as NS

    from engine_ext.vllm.hooks import capture_enabled

    v1 = NS(model_config=NS(enable_return_routed_experts=True))
    v2 = NS(model_config=NS(), aux_output_config=NS(enable_return_routed_experts=True))
    for version, release in MATRIX.items():
        on, off = (v1, v2) if release.runner == "V1" else (v2, v1)
        assert capture_enabled(on, release.capture_flag) and not capture_enabled(off, release.capture_flag), version


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="`make env-vllm` builds the vLLM venv")
@pytest.mark.timeout(1000)  # two vLLM imports, each under its own 450 s hang guard
def test_in_real_vllm_a_build_between_rows_is_hooked_and_one_without_a_hook_target_is_refused(tmp_path):
    """In the vLLM venv: each row of the hook table resolves on the installed vLLM. Calling itself 0.28.1 (between
    the matrix's rows), its code takes 0.31.0's row (the nearest above it whose flag sits on `aux_output_config`,
    as 0.32's does): the hooks are wrapped, one WARNING says it is unproven. The same vLLM without a hooked
    attribute fits no row: `register()` wraps nothing, logs the one refusal naming the gap and writes it to the
    engine file."""

    def run(body: str, spool: Path) -> subprocess.CompletedProcess[str]:
        script = textwrap.dedent(
            f"""
            import importlib, logging, os, sys
            logging.basicConfig(level=logging.INFO)
            from engine_ext.vllm import hooks
            for hook in hooks.HOOKS:
                module, _, path = hook.target.partition(":")
                cls, attr = path.split(".")
                assert attr in vars(getattr(importlib.import_module(module), cls)), hook.target
            import vllm
            assert vllm.__version__ in {SUPPORTED_VLLM!r}, vllm.__version__
            vllm.__version__ = "0.28.1"
            os.environ.update(R3_SPOOL_DIR={str(spool)!r}, R3_ENGINE_ID="old")
            """
        ) + textwrap.dedent(body)
        # a hang guard: the import alone took 45 s quiet and ran past 180 s at load 10-17 (2026-11-29)
        return run_vllm(script, timeout=450)

    hooked = run(
        """
        import engine_ext.vllm
        engine_ext.vllm.register()
        from vllm.v1.engine.async_llm import AsyncLLM
        assert getattr(AsyncLLM.__init__, "_r3_hook", False)
        print("ok")
        """,
        tmp_path / "fits",
    )
    assert hooked.returncode == 0 and hooked.stdout.strip().endswith("ok"), hooked.stderr[-3000:]
    assert "vLLM 0.28.1: matrix row 0.31.0 applied (fits, but no test ran this build" in hooked.stderr
    lacking = run(
        """
        from vllm.v1.engine.output_processor import OutputProcessor
        del OutputProcessor.add_request
        import engine_ext.vllm
        engine_ext.vllm.register()
        from vllm.v1.engine.async_llm import AsyncLLM
        assert not getattr(AsyncLLM.__init__, "_r3_hook", False)
        print("ok")
        """,
        tmp_path,
    )
    assert lacking.returncode == 0 and lacking.stdout.strip().endswith("ok"), lacking.stderr[-3000:]
    (line,) = [text for text in lacking.stderr.splitlines() if NONE_FITS in text]
    assert "OutputProcessor.add_request" in line
    reason = line[line.index(NONE_FITS) :]
    (engine,) = (Spool(tmp_path).engines_dir).glob("*.json")
    report = EngineReport.from_dict(Spool(tmp_path).read_engine_file(engine))
    assert report.engine == "old/vllm" and report.delivery.mode == "off" and report.delivery.inline_kept == reason
    (served,) = _served_engines(tmp_path)  # the sidecar's `GET /v1/engines` says it too
    assert served["delivery"]["inline_kept"] == reason and served["vllm"] == "0.28.1"


def _served_engines(spool_dir: Path) -> list[dict]:
    """`GET /v1/engines` from a real `r3-sidecar serve` on `spool_dir` (loopback, a free port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "R3_SPOOL_DIR": str(spool_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_sidecar_ready(f"http://127.0.0.1:{port}", 90, proc)
        return httpx.get(f"http://127.0.0.1:{port}/v1/engines", timeout=10).json()["engines"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
