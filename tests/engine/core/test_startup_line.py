"""The start-up line is seen whether or not the engine configured logging before it loaded the plugin."""

from __future__ import annotations

import logging
import subprocess
import sys

from engine_ext.core.startup_line import announce

LINE = "r3-sidecar: sglang==0.5.23: layout 0.5.23 applied (proven by its real-server tests)"


def _in_a_fresh_process(setup: str, proven: bool, after: str = "") -> str:
    """stderr of a Python process that does `setup`, then announces LINE, then does `after`."""
    code = (
        "import logging\n"
        f"{setup}\n"
        "from engine_ext.core.startup_line import announce\n"
        f"announce(logging.getLogger('r3_sidecar'), {LINE!r}, proven={proven})\n"
        f"{after}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stderr


def test_a_proven_build_is_named_before_the_engine_configured_logging() -> None:
    """As in SGLang's processes, which load plugins before `configure_logger`: an INFO record would be dropped."""
    assert LINE in _in_a_fresh_process("", proven=True)


def test_a_proven_build_goes_through_the_engines_logging_once_configured() -> None:
    out = _in_a_fresh_process(
        "logging.basicConfig(level=logging.INFO, format='ENGINE %(levelname)s %(message)s')", True
    )
    assert f"ENGINE INFO {LINE}" in out and out.count(LINE) == 1


def test_a_level_above_info_the_user_chose_silences_a_proven_line_but_not_an_unproven_one() -> None:
    quiet = "logging.basicConfig(level=logging.WARNING)"
    assert LINE not in _in_a_fresh_process(quiet, proven=True)
    assert LINE in _in_a_fresh_process(quiet, proven=False)


def test_a_proven_line_kept_back_is_said_once_the_engine_configured_its_logging() -> None:
    """SGLang 0.5.21 and 0.5.22: a handler from an import, at Python's default WARNING, when plugins load; the
    engine's `--log-level info` comes later, then a hook says the line kept back."""
    imported = "logging.getLogger().addHandler(logging.StreamHandler())"
    configured = (
        "logging.getLogger().setLevel(logging.INFO)\n"
        "from engine_ext.core.startup_line import say_kept\nsay_kept()\nsay_kept()"
    )
    assert LINE not in _in_a_fresh_process(imported, proven=True)
    assert _in_a_fresh_process(imported, proven=True, after=configured).count(LINE) == 1


def test_an_unproven_build_is_a_warning(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="r3_sidecar"):
        announce(logging.getLogger("r3_sidecar"), LINE, proven=False)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, LINE)]
