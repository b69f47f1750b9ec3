"""The plugin's start-up line (the build found, the layout applied, proven or only fitting), where a user sees it.

Engines load plugins before they configure logging in some of their processes (SGLang 0.5.23's main process in
`Engine.__init__`, before it parses its arguments; its detokenizer, before `configure_logger`), and Python drops
an INFO record that meets no handler. A proven build's INFO line then said nothing, so the one line that names the
build would be missing exactly where the build is fine. With no handler anywhere yet, the line goes to stderr in
the engine log's shape; otherwise through logging as configured. Where logging has a handler but does not pass
INFO yet, the line is kept back until the engine has configured its logging (`say_kept`, from a hook that runs
after that): SGLang 0.5.21 and 0.5.22 import a root handler at Python's default WARNING before their processes
load plugins, and load none after `configure_logger`, so no process of theirs showed the line. Then the level the
engine was given decides (a level above INFO silences it). An unproven build's line is a WARNING, which Python
always shows.
"""

from __future__ import annotations

import logging
import sys
import time

_kept: list[tuple[logging.Logger, str]] = []  # INFO lines waiting for the engine's logging (`say_kept`)


def announce(logger: logging.Logger, line: str, *, proven: bool) -> None:
    """Say `line` once in this process: INFO for a proven build, WARNING for one that only fits."""
    level = logging.INFO if proven else logging.WARNING
    if level >= logging.WARNING or (logger.hasHandlers() and logger.isEnabledFor(level)):
        logger.log(level, "%s", line)  # a WARNING meets Python's last-resort handler at worst
    elif logger.hasHandlers():
        _kept.append((logger, line))
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}] {line}", file=sys.stderr, flush=True)


def say_kept() -> None:
    """The lines `announce` kept back, through logging as the engine has configured it by now (once each)."""
    while _kept:
        logger, line = _kept.pop(0)
        logger.info("%s", line)
