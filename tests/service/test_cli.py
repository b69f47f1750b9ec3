"""`r3-sidecar` commands in process: fetch against a real sidecar, settings flags, budget delegation, README."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import live_server, write_record

from engine_ext.core.settings import EngineSettings
from service.cli import _settings, build_parser, main
from service.settings import Settings
from service.spool import Spool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(spool: Spool):
    with live_server(Settings(spool_dir=spool.root)) as base:
        yield base


def test_fetch_out_writes_a_loadable_npy(spool: Spool, url: str, tmp_path: Path) -> None:
    rows = np.random.default_rng(5).integers(0, 128, (21, 6, 8)).astype(np.uint8)
    write_record(spool, "cli-rid", rows, layers=[0, 2, 4, 6, 8, 10], start=3, prompt_len=10)
    out = tmp_path / "cli.npy"
    assert main(["fetch", "cli-rid", "--url", url, "--out", str(out)]) == 0
    loaded = np.load(out)
    assert loaded.dtype == np.uint8
    np.testing.assert_array_equal(loaded, rows)

    part = tmp_path / "part.npy"
    assert main(["fetch", "cli-rid", "--url", url, "--out", str(part), "--start", "5", "--layers", "4,0"]) == 0
    np.testing.assert_array_equal(np.load(part), rows[2:, [2, 0], :])


def test_fetch_json_to_stdout_and_errors(spool: Spool, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = np.arange(2 * 2 * 2, dtype=np.uint8).reshape(2, 2, 2)
    write_record(spool, "cli-json", rows, num_experts=16)
    assert main(["fetch", "cli-json", "--url", url, "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["data"] == rows.tolist()
    assert main(["fetch", "cli-missing", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "RecordNotFound" in err and "404" in err and "cli-missing" in err


def test_settings_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("R3_TTL_S", "60")
    monkeypatch.setenv("R3_PORT", "9100")
    args = build_parser().parse_args(["serve", "--port", "9200", "--spool-dir", str(tmp_path), "--auth-token", "t"])
    s = _settings(args)
    assert (s.port, s.ttl_s, s.spool_dir, s.auth_token) == (9200, 60.0, tmp_path, "t")
    assert main(["serve", "--port", "not-a-port"]) == 2


def test_readme_opens_with_two_commands_and_documents_every_setting() -> None:
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```\w*\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    for cls in (Settings, EngineSettings):
        for name in cls.model_fields:
            assert f"`R3_{name.upper()}`" in readme, f"README lacks R3_{name.upper()} ({cls.__name__})"
