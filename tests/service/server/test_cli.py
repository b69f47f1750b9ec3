"""`r3-sidecar` commands in process: fetch against a real sidecar, settings flags, budget delegation, README."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import live_server, write_record

from engine_ext.core.settings import EngineSettings
from service.server.cli import _settings, build_parser, main
from service.server.settings import Settings
from service.spool import Spool

REPO = Path(__file__).resolve().parents[3]


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


def test_fetch_clamp_cuts_the_range_to_the_rows(spool: Spool, url: str, tmp_path: Path) -> None:
    rows = np.random.default_rng(6).integers(0, 128, (9, 2, 4)).astype(np.uint8)
    write_record(spool, "cli-clamp", rows)
    out = tmp_path / "c.npy"
    assert main(["fetch", "cli-clamp", "--url", url, "--start", "4", "--end", "4096", "--out", str(out)]) == 1
    assert (
        main(["fetch", "cli-clamp", "--url", url, "--start", "4", "--end", "4096", "--clamp", "--out", str(out)]) == 0
    )
    np.testing.assert_array_equal(np.load(out), rows[4:])


def test_fetch_from_nowhere_prints_one_line_naming_the_url() -> None:
    """A refused connection, an unknown host: one line that names the URL and what to do, never a traceback."""
    cases = {
        f"http://127.0.0.1:{free_port()}": ("ConnectionRefused", "r3-sidecar serve"),
        "http://no-such-sidecar.invalid:8000": ("HostNotFound", "does not resolve"),
    }
    for url, (kind, hint) in cases.items():
        run = subprocess.run(
            [sys.executable, "-m", "service.server.cli", "fetch", "some-rid", "--url", url],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert run.returncode == 1 and run.stdout == ""
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert lines[0].startswith(f"r3-sidecar fetch: {kind}: ") and url in lines[0] and hint in lines[0], lines[0]


def test_every_flag_has_help_with_its_default() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest}: no help"
            if action.option_strings:
                text = command._get_formatter()._expand_help(action)
                assert "default" in text, f"r3-sidecar {name} {action.option_strings[0]}: no default in {text!r}"
    demo_help = build_parser().parse_known_args(["demo"])[0]
    assert demo_help.max_live >= 256, "the demo must not stop producing after its first minute"


def test_r3_budget_help_works_without_sglang() -> None:
    """Where SGLang is not importable (a trainer's env), `--help` explains what the command needs; a run says so."""
    code = (
        "import sys; sys.modules['sglang'] = None\n"
        "from engine_ext.sglang.budget.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    shown = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, cwd=REPO)
    assert shown.returncode == 0 and "usage: r3-budget" in shown.stdout and "Traceback" not in shown.stderr
    assert "needs SGLang" in shown.stdout and "engine's environment" in " ".join(shown.stdout.split())
    ran = subprocess.run([sys.executable, "-c", code, "--tp", "2"], capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr and "SGLang is not importable" in ran.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
